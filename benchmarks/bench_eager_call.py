"""One eager ``fused_moe()`` call (no CUDA graph): the direct call plain eager inference takes
against the same call through ``torch.ops.moe_compile.fused_moe`` (what it was before the
sixteenth session, and what a compiled graph calls), alternated in one process.

    python benchmarks/bench_eager_call.py [--shapes qwen3 mixtral] [--ms 1 32] [--reps 200] [--device cuda]

Each call is timed on the host from its start until the device has finished it (a synchronize
after every call), so the figure is what one eager layer costs a decode step. The weights are
HF's transposed views in bf16 on CUDA (fp32 on the CPU); random routing logits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import SHAPES, Shape  # noqa: E402

from moe_compile import fused_moe  # noqa: E402


def op_kwargs(shape: Shape) -> dict:
    """Every argument of ``torch.ops.moe_compile.fused_moe`` after the tensors, for this shape."""
    kw = dict(routing_method="softmax", renormalize=False, routed_scaling_factor=1.0, k_group=1, group_count=1,
              group_select_mode=0)
    kw.update(shape.routing)
    kw.update(num_experts=shape.num_experts, top_k=shape.top_k, normalize_sigmoid=True, scoring_after_topk=False,
              activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0, gate_up_interleaved=False,
              apply_router_weight_on_input=False, tp_group_name=None, ep_group_name=None, dispatcher_type=None,
              tokens_full=True, reduce_results=True, lowering="auto")
    return kw


def op_call(x, logits, w13, w2, shape: Shape):
    return torch.ops.moe_compile.fused_moe(x, logits, w13, w2, None, None, None, **op_kwargs(shape))


def time_pair(direct, via_op, reps: int, sync) -> tuple[float, float]:
    """Median µs of each, alternating which goes first."""
    times = ([], [])
    for fn in (direct, via_op):
        for _ in range(5):
            fn()
    sync()
    for rep in range(reps):
        for side in ((0, 1) if rep % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            (direct, via_op)[side]()
            sync()
            times[side].append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times[0]), statistics.median(times[1])


def time_shape(shape: Shape, ms, reps: int, dev, dtype, sync):
    """``(M, direct µs, torch.ops µs)`` for each token count, after checking both calls agree."""
    e, k, h, i = shape.num_experts, shape.top_k, shape.hidden, shape.inter
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=dev, generator=gen) * h ** -0.5).to(dtype).transpose(1, 2)
    w2 = (torch.randn(e, h, i, device=dev, generator=gen) * i ** -0.5).to(dtype).transpose(1, 2)
    rows = []
    for m in ms:
        x = torch.randn(m, h, device=dev, generator=gen).to(dtype)
        logits = torch.randn(m, e, device=dev, generator=gen).to(dtype)
        direct = lambda: fused_moe(x, logits, e, k, w13, w2, **shape.routing)  # noqa: E731
        via_op = lambda: op_call(x, logits, w13, w2, shape)  # noqa: E731
        if not torch.equal(direct(), via_op()):
            raise AssertionError(f"{shape.name} M={m}: the direct call and torch.ops disagree")
        rows.append((m, *time_pair(direct, via_op, reps, sync)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3"], choices=list(SHAPES))
    parser.add_argument("--ms", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", type=int, default=1, help="divide H and I by this (a small CPU run)")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"{'shape':<12}{'M':>6}{'direct us':>11}{'torch.ops us':>14}{'direct/op':>11}")
    with torch.no_grad():
        for name in args.shapes:
            s = SHAPES[name]
            shape = Shape(s.name, s.num_experts, s.top_k, s.hidden // args.scale, s.inter // args.scale, s.routing)
            for m, d, o in time_shape(shape, args.ms, args.reps, dev, dtype, sync):
                print(f"{name:<12}{m:>6}{d:>11.1f}{o:>14.1f}{d / o:>11.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
