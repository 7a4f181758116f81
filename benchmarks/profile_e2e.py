"""One whole model (``bench_e2e.py``'s builder) under two compile modes, timed interleaved and profiled.

    python benchmarks/profile_e2e.py --model gemma4 --tokens 1 [--modes inductor-cg moe_npu-cg] [--rounds 20]

Both compiled models live in one process; each round times ``--reps`` calls of every mode in turn
(CUDA events, median per round), so clock and power drift hits all modes alike. Then a few calls of each
mode run under ``torch.profiler``: the GPU time per kernel name (top ``--top``) and in all, which says
where a mode spends what the other does not. CUDA only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def compiled(model, mode: str):
    graphs = "reduce-overhead" if mode.endswith("-cg") else None
    if mode == "eager":
        return model
    fn = torch.compile(model, mode=graphs) if mode.startswith("inductor") else \
        torch.compile(model, backend="moe_npu", mode=graphs)
    if not graphs:
        return fn

    def step(**kw):
        torch.compiler.cudagraph_mark_step_begin()
        return fn(**kw)
    return step


def kernel_times(fn, ids, calls: int) -> dict[str, float]:
    """GPU microseconds per call for each kernel name, over ``calls`` profiled calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / calls
    return dict(totals)


def main(argv=None) -> int:
    from bench_e2e import DIMS, build, timed

    import moe_compile  # noqa: F401  (registers backend="moe_npu")

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma4", choices=list(DIMS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["inductor-cg", "moe_npu-cg"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_e2e needs a CUDA device", file=sys.stderr)
        return 2
    model = build(args.model, args.layers, False, "cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    fns = {mode: compiled(model, mode) for mode in args.modes}
    with torch.no_grad():
        for fn in fns.values():  # compile, then a warm call
            fn(input_ids=ids, use_cache=False)
            fn(input_ids=ids, use_cache=False)
        rounds = {mode: [] for mode in fns}
        for _ in range(args.rounds):
            for mode, fn in fns.items():
                rounds[mode].append(timed(lambda: fn(input_ids=ids, use_cache=False), args.reps, "cuda"))
        print(f"{args.model}, {args.layers} layers, {args.tokens} token(s), {args.rounds} interleaved rounds of "
              f"{args.reps} calls (median ms per round):")
        for mode, ms in rounds.items():
            print(f"  {mode:<12} median {statistics.median(ms):.3f}  min {min(ms):.3f}  max {max(ms):.3f}")
        for mode, fn in fns.items():
            kernels = kernel_times(fn, ids, 5)
            total = sum(kernels.values())
            print(f"{mode}: GPU kernel time {total:.1f} us per call, {len(kernels)} kernel names; top {args.top}:")
            for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"  {us:9.1f} us  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
