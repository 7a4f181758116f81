"""Batch-1 decode of a whole model under CUDA graphs: where the time goes, per kernel, per mode.

    python benchmarks/probe_decode1.py [--models qwen3] [--layers 2] [--reps 20]

``bench_e2e.py --sizes decode1`` gives one number per mode; this script profiles the same forward
(one sequence of one token, ``bench_e2e.build``'s model) under ``inductor-cg``, ``moe_npu-cg``
and ``moe_npu-cg`` with the router GEMM left to the graph (``router-off``: the pass's
``_router_op`` patched to decline), and prints each mode's median time and its kernels (total
microseconds per forward, launches per forward), so the modes can be compared kernel by kernel.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_e2e import build, timed  # noqa: E402
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


def run(name: str, layers: int, reps: int) -> None:
    import moe_compile  # noqa: F401  (registers backend="moe_npu")
    from moe_compile.passes import rewrite

    model = build(name, layers, False, "cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, 1), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
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
    parser.add_argument("--models", nargs="+", default=["qwen3"], choices=["mixtral", "qwen3", "deepseek_v3"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    if not cuda_or_say("probe_decode1"):
        return 2
    for name in args.models:
        run(name, args.layers, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
