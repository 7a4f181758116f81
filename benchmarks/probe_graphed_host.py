"""Where the host time of a call replayed from the op's own CUDA graph goes, and what the router op costs.

    python benchmarks/probe_graphed_host.py [--shapes qwen3 mixtral] [--ms 1 32] [--calls 400] [--json F]

All on the host clock, ``--calls`` calls back to back with no synchronisation between them ("issue µs":
until the last returns), best of ``--rounds`` rounds alternated in one process:

1. *the op*: ``torch.ops.moe_compile.fused_moe`` with op graphs on (the packet, keywords built per call), called
   as Inductor's wrapper calls it (``.default``, the 21 scalars by keyword) and packed (``fused_moe_packed``,
   what a graph compiled with ``pack_args`` calls, ``moe_compile/ops/packed.py``), registered
   as ``moe_compile`` registers it (``ops/registration.py``), the same with ``registration.DIRECT`` off
   (every call re-dispatched below autograd, as ``custom_op`` does), and the same body registered through
   ``torch.library.custom_op`` (how the ops were registered before); the body called directly;
   ``CudaLowering.run``; ``op_graphs.replay_hit``; the replay alone (copies in, ``graph.replay()``, the
   output copy); ``graph.replay()`` alone; one input copy; one output copy; the graph key, the current stream
   and the capture query alone.
2. *the router*: ``torch.ops.moe_compile.router_logits`` (bf16 out) the same three ways, its body
   (``kernels/triton/router.router_logits``), and ``F.linear`` (cuBLAS) on the same tensors.
3. *a breakdown* of the graphed op call with timers around each of our stages (inclusive µs per call).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_eager_call import op_call, op_kwargs  # noqa: E402
from bench_op_graphs import loop_us  # noqa: E402
from bench_moe_layer import SHAPES  # noqa: E402
from probe_launch import Timers, make_inputs  # noqa: E402

import moe_compile.ops.custom_op as co  # noqa: E402
from moe_compile.lowering import MoEInputs, op_graphs  # noqa: E402
from moe_compile.lowering.cuda import CudaLowering  # noqa: E402
from moe_compile.ops import registration  # noqa: E402
from moe_compile.modular import ExpertWeights  # noqa: E402

_COPIES = []


def custom_op_copies():
    """The two ops' bodies registered again, as ``moe_probe::*``, through ``torch.library.custom_op`` (how
    ``moe_compile`` registered them before ``ops/registration.py``), with the same fakes."""
    if not _COPIES:
        for name, op in (("fused_moe", co.fused_moe_op), ("router_logits", co.router_logits_op)):
            _COPIES.append(torch.library.custom_op(f"moe_probe::{name}", op._init_fn, mutates_args=()))
    return torch.ops.moe_probe


def issue_us(fn, calls: int) -> float:
    return loop_us(fn, calls)[0]


def _direct(flag: bool, fn):
    """``fn`` with the ops' direct dispatch on or off (``registration.DIRECT``) for its calls."""
    return lambda: (setattr(registration, "DIRECT", flag), fn())[1]


def op_variants(shape, m: int) -> tuple[dict, torch.Tensor]:
    x, logits, w13, w2 = make_inputs(shape, m)
    probe = custom_op_copies()
    kw = op_kwargs(shape)
    args = (x, logits, w13, w2, None, None, None)
    cfg = co.make_config(**kw, has_bias=False)
    inputs = MoEInputs(x, logits, ExpertWeights(w13, w2, None, None), None)
    lowering = CudaLowering()
    for _ in range(4):
        ref = op_call(x, logits, w13, w2, shape)
    key = op_graphs.call_key(inputs, cfg, x.device.index, torch._C._cuda_getCurrentRawStream(x.device.index))
    entry = op_graphs._GRAPHS[key]
    static_x, out = entry.static_in[0], entry.static_out
    plain, packed_op = torch.ops.moe_compile.fused_moe.default, torch.ops.moe_compile.fused_moe_packed.default
    text = json.dumps([kw[a.name] for a in plain._schema.arguments[7:]])
    variants = {
        "torch.ops, custom_op (before)": lambda: probe.fused_moe(*args, **kw),
        "torch.ops, ours": _direct(True, lambda: op_call(x, logits, w13, w2, shape)),
        ".default, scalars by keyword (Inductor's call)": lambda: plain(*args, **kw),
        "packed op (Inductor's call, pack_args)": lambda: packed_op(*args, text),
        "torch.ops, ours, DIRECT off": _direct(False, lambda: op_call(x, logits, w13, w2, shape)),
        "op body (fused_moe_op._init_fn)": lambda: co.fused_moe_op._init_fn(*args, **kw),
        "CudaLowering.run": lambda: lowering.run(inputs, cfg),
        "op_graphs.replay_hit": lambda: op_graphs.replay_hit(inputs, cfg),
        "op_graphs._replay": lambda: op_graphs._replay(entry, inputs),
        "graph.replay() alone": entry.graph.replay,
        "static_x.copy_(x) alone": lambda: static_x.copy_(x),
        "static_out.clone() alone": out.clone,
        "call_key alone": lambda: op_graphs.call_key(inputs, cfg, 0, 0),
        "current raw stream alone": lambda: op_graphs._stream(x.device.index),
        "is_current_stream_capturing alone": torch.cuda.is_current_stream_capturing,
    }
    return variants, ref


def router_variants(shape, m: int) -> dict:
    from moe_compile.kernels.triton.router import router_logits

    x, _, _, _ = make_inputs(shape, m)
    w = (torch.randn(shape.num_experts, shape.hidden, device="cuda") * shape.hidden ** -0.5).bfloat16()
    probe = custom_op_copies()
    return {
        "router torch.ops, custom_op (before)": lambda: probe.router_logits(x, w, None, torch.bfloat16),
        "router torch.ops, ours": _direct(
            True, lambda: torch.ops.moe_compile.router_logits(x, w, None, torch.bfloat16)),
        "router torch.ops, ours, DIRECT off": _direct(
            False, lambda: torch.ops.moe_compile.router_logits(x, w, None, torch.bfloat16)),
        "router body": lambda: router_logits(x, w, None, torch.bfloat16),
        "F.linear (cuBLAS)": lambda: F.linear(x, w),
    }


def breakdown(fn, calls: int) -> dict:
    import moe_compile.lowering.cuda as cuda_lowering

    timers = Timers()
    timers.wrap(co, "check_op_shapes", "check_op_shapes")
    timers.wrap(co, "fused_moe_impl", "fused_moe_impl")
    timers.wrap(co, "make_config", "  make_config (cached)")
    timers.wrap(co, "_run", "  _run")
    timers.wrap(cuda_lowering.CudaLowering, "run", "    CudaLowering.run")
    timers.wrap(cuda_lowering.CudaLowering, "experts_unsupported", "      experts_unsupported")
    timers.wrap(op_graphs, "replay_hit", "      op_graphs.replay_hit")
    timers.wrap(op_graphs, "run", "      op_graphs.run")
    timers.wrap(op_graphs, "skip_reason", "        skip_reason")
    timers.wrap(op_graphs, "call_key", "        call_key")
    timers.wrap(op_graphs, "_replay", "        _replay (under replay_hit or run)")
    timers.wrap(torch.cuda.CUDAGraph, "replay", "          graph.replay")
    try:
        wall = issue_us(fn, calls)
    finally:
        timers.restore()
    return dict(wall_us=wall, rows={n: timers.total[n] / calls * 1e6 for n in timers.total})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3", "mixtral"], choices=list(SHAPES))
    parser.add_argument("--ms", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_graphed_host.py needs CUDA")
        return 1
    op_graphs.configure(max_tokens=max(args.ms), max_expert_bytes=1 << 60)
    result = []
    for name in args.shapes:
        for m in args.ms:
            shape = SHAPES[name]
            variants, ref = op_variants(shape, m)
            variants.update(router_variants(shape, m))
            for label, fn in variants.items():
                if "alone" not in label and "router" not in label and "linear" not in label and "_replay" not in label:
                    got = fn()
                    if not torch.equal(got, ref):
                        raise AssertionError(f"{name} M={m}: {label} differs from the op's output")
            best = {label: float("inf") for label in variants}
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for label in order:
                    best[label] = min(best[label], issue_us(variants[label], args.calls))
            registration.DIRECT = True
            split = breakdown(variants["torch.ops, ours"], args.calls)
            row = dict(shape=name, m=m, issue_us=best, breakdown=split)
            result.append(row)
            print(f"\n{name} M={m}: host µs per call (issue, best of {args.rounds})")
            for label, us in best.items():
                print(f"  {label:36s} {us:8.1f}")
            print(f"  breakdown of torch.ops, ours (instrumented wall {split['wall_us']:.1f} µs):")
            for label, us in split["rows"].items():
                print(f"    {label:40s} {us:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
