"""Batch-1 decode of a whole model under CUDA graphs: where the time goes, per kernel, per mode.

    python benchmarks/probe_decode1.py [--models qwen3] [--layers 2] [--reps 20]
    python benchmarks/probe_decode1.py --ab [--rounds 4]   # inductor-cg vs moe_npu-cg, alternately
    python benchmarks/probe_decode1.py --ab --models gemma4 --tokens 32   # any bench_e2e model, any batch

``bench_e2e.py --sizes decode1`` gives one number per mode; this script profiles the same forward
(one sequence of one token, ``bench_e2e.build``'s model) under ``inductor-cg``, ``moe_npu-cg``
and ``moe_npu-cg`` with the router GEMM left to the graph (``router-off``: the pass's
``_router_op`` patched to decline), and prints each mode's median time and its kernels (total
microseconds per forward, launches per forward), so the modes can be compared kernel by kernel.

``--tokens`` makes the sequence longer (one sequence of that many tokens, no KV cache, as in
``bench_e2e.py``). ``--ab``: ``inductor-cg`` and ``moe_npu-cg`` compiled on two copies of the model, then timed in
alternation (``--rounds``, the first mode swapped every round), so the host's drift between modes
does not decide the comparison; also the CUDA-graph launches and CUDA runtime calls per forward
(from the profiler's host side), which say whether a mode replays one graph or several pieces.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_e2e import DIMS, build, timed  # noqa: E402
from bench_moe_layer import cuda_or_say  # noqa: E402


def kernels_per_call(fn, calls: int = 5) -> dict[str, tuple[float, float]]:
    """``{kernel name: (us per call, launches per call)}`` from the profiler over ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total, count = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            count[ev.name] += 1
    return {k: (total[k] / calls, count[k] / calls) for k in total}


def host_calls_per_call(fn, calls: int = 5) -> dict[str, float]:
    """CUDA runtime/driver calls per call of ``fn`` (``cudaGraphLaunch`` and the rest), from the
    profiler's host side."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    count = collections.Counter(ev.name for ev in prof.events() if ev.name.startswith(("cuda", "cu")))
    return {k: v / calls for k, v in count.items()}


def _ids(model, tokens: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(1))


def run_ab(name: str, layers: int, reps: int, rounds: int, tokens: int = 1) -> None:
    import copy

    import moe_compile  # noqa: F401  (registers backend="moe_npu")

    model = build(name, layers, False, "cuda")
    ids = _ids(model, tokens)
    fns = {}
    for mode, m in (("inductor-cg", model), ("moe_npu-cg", copy.deepcopy(model))):
        compiled = torch.compile(m, backend="inductor" if mode == "inductor-cg" else "moe_npu", mode="reduce-overhead")

        def fn(compiled=compiled):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(input_ids=ids, use_cache=False).logits
        with torch.no_grad():
            for _ in range(3):
                fn()
        fns[mode] = fn
    times = {mode: [] for mode in fns}
    with torch.no_grad():
        for r in range(rounds):
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for mode in order:
                times[mode].append(timed(fns[mode], reps, "cuda") * 1e3)
        for mode, fn in fns.items():
            ks = kernels_per_call(fn)
            host = host_calls_per_call(fn)
            print(f"\n{name} {mode}: us per forward by round {' '.join(f'{t:.1f}' for t in times[mode])}; "
                  f"{sum(c for _, c in ks.values()):.0f} kernels, {sum(t for t, _ in ks.values()):.1f} us of kernel time",
                  flush=True)
            print("  host calls per forward: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(host.items(), key=lambda kv: -kv[1])))
    a, b = times["inductor-cg"], times["moe_npu-cg"]
    print(f"\n{name}: moe_npu-cg / inductor-cg per round {' '.join(f'{y / x:.3f}' for x, y in zip(a, b))}", flush=True)


def run(name: str, layers: int, reps: int, tokens: int = 1) -> None:
    import moe_compile  # noqa: F401  (registers backend="moe_npu")
    from moe_compile.passes import rewrite

    model = build(name, layers, False, "cuda")
    ids = _ids(model, tokens)
    original = rewrite._router_op
    for mode in ("inductor-cg", "moe_npu-cg", "router-off"):
        torch._dynamo.reset()
        rewrite._router_op = (lambda *a: None) if mode == "router-off" else original
        backend = "inductor" if mode == "inductor-cg" else "moe_npu"
        compiled = torch.compile(model, backend=backend, mode="reduce-overhead")

        def fn():
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(input_ids=ids, use_cache=False).logits

        with torch.no_grad():
            for _ in range(3):
                fn()
            ms = timed(fn, reps, "cuda")
            ks = kernels_per_call(fn)
        rewrite._router_op = original
        launches = sum(c for _, c in ks.values())
        busy = sum(t for t, _ in ks.values())
        print(f"\n{name} {mode}: {ms * 1e3:.1f} us per forward, {launches:.0f} kernels, {busy:.1f} us of kernel time",
              flush=True)
        for k, (t, c) in sorted(ks.items(), key=lambda kv: -kv[1][0])[:18]:
            print(f"  {t:8.1f} us {c:4.0f}x  {k[:110]}")
    del model
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3"], choices=list(DIMS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--ab", action="store_true", help="inductor-cg vs moe_npu-cg, timed alternately")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1, help="tokens in the one sequence (default 1)")
    args = parser.parse_args(argv)
    if not cuda_or_say("probe_decode1"):
        return 2
    for name in args.models:
        if args.ab:
            run_ab(name, args.layers, args.reps, args.rounds, args.tokens)
        else:
            run(name, args.layers, args.reps, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
