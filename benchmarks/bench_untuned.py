"""Shapes without tuned plans of their own: the borrowed plan against the default heuristic (CUDA).

    python benchmarks/bench_untuned.py [--out DIR] [--ms 1 32 256 2048 8192] [--budget-s 480]

``kernels/triton/configs.py`` gives a shape without a tuned file the plan another shape's file on
this device tuned for the nearest rows per expert. This measures what that is worth, timing the
experts alone (``fused_experts``, CUDA-graph replay over ``ROTATE`` routings, as
``tune_triton.py`` does; each plan's output checked against the default plan's first) with:

- ``default``: ``default_plan``, the fixed heuristic used before borrowing existed;
- ``borrowed``: the plan ``choose_plan`` now picks. For the three tuned shapes it is borrowed with
  the shape's own file left out (leave-one-out: what a new model of that kind would get);
- ``tuned``: the shape's own tuned plan, where it has one.

Shapes: the three tuned ones and three that have no file (Qwen3-235B-A22B's 128 x 4096 x 1536 top-8,
Mixtral-8x22B's 8 x 6144 x 16384 top-2, OLMoE's 64 x 2048 x 1024 top-8). Prints each time and
its ratio to the experts' bound (``bench_moe_layer.py``'s); writes ``untuned_plans.json``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import BF16_FLOP_PER_S, HBM_BYTES_PER_S, MS, SHAPES, Shape, cuda_or_say, write_json  # noqa: E402
from tune_triton import hf_layout_weights, problem, reference_output, time_plan  # noqa: E402

from moe_compile.kernels.triton import configs  # noqa: E402

UNTUNED = {
    "qwen3_235b": Shape("qwen3_235b", 128, 8, 4096, 1536, dict(routing_method="softmax", renormalize=True)),
    "mixtral_8x22b": Shape("mixtral_8x22b", 8, 2, 6144, 16384, dict(routing_method="softmax", renormalize=True)),
    "olmoe": Shape("olmoe", 64, 8, 2048, 1024, dict(routing_method="softmax", renormalize=False)),
}


def plans_for(shape: Shape, m: int) -> dict:
    """``{label: (plan, where it came from)}`` for one point."""
    key = configs.device_key(torch.device("cuda"))
    own = configs.config_file_name(shape.num_experts, shape.hidden, shape.inter, torch.bfloat16, key)
    out = {"default": (configs.default_plan(m, shape.top_k, shape.num_experts, shape.hidden, shape.inter),
                       "default_plan")}
    found = configs.borrowed_plan(num_tokens=m, top_k=shape.top_k, num_local=shape.num_experts, hidden=shape.hidden,
                                  dtype=torch.bfloat16, device=key, exclude=own)
    if found:
        out["borrowed"] = found
    if any((d / own).exists() for d in configs.config_dirs()):
        out["tuned"] = (configs.choose_plan(num_tokens=m, top_k=shape.top_k, num_local=shape.num_experts,
                                            hidden=shape.hidden, inter=shape.inter, dtype=torch.bfloat16,
                                            device=torch.device("cuda")), own)
    return out


def bound_us(shape: Shape, m: int, calls) -> float:
    hits = sum(torch.unique(ids).numel() for _, _, ids in calls) / len(calls)
    per_expert_bytes = 3 * shape.hidden * shape.inter * 2
    flops = 6 * m * shape.top_k * shape.hidden * shape.inter
    return max(hits * per_expert_bytes / HBM_BYTES_PER_S, flops / BF16_FLOP_PER_S) * 1e6


def run(shape: Shape, ms, reps: int, deadline: float) -> list[dict]:
    weights = hf_layout_weights(shape)
    rows = []
    for m in ms:
        if time.time() > deadline:
            print(f"  budget spent: {shape.name} M={m} not timed", flush=True)
            continue
        calls = problem(shape, m, weights)
        ref = reference_output(calls, weights, shape, m)
        bound = bound_us(shape, m, calls)
        row = {"shape": shape.name, "M": m, "rows_per_expert": m * shape.top_k / shape.num_experts, "bound_us": bound}
        for label, (plan, source) in plans_for(shape, m).items():
            us = time_plan(plan, calls, weights, reps, ref)
            row[label] = {"us": us, "ratio": us / bound, "plan": plan.to_dict(), "from": source}
        rows.append(row)
        cells = "  ".join(f"{k} {row[k]['us']:9.1f} us {row[k]['ratio']:5.2f}x" for k in ("default", "borrowed", "tuned")
                          if k in row)
        src = row.get("borrowed", {}).get("from", "-")
        print(f"{shape.name:14s} M={m:5d} rows/expert {row['rows_per_expert']:8.2f} bound {bound:9.1f} us  {cells}"
              f"  (borrowed from {src})", flush=True)
    del weights
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES) + list(UNTUNED),
                        default=["qwen3", "mixtral", "olmoe", "qwen3_235b", "mixtral_8x22b", "deepseek_v3"])
    parser.add_argument("--ms", nargs="+", type=int, default=list(MS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no point after this")
    parser.add_argument("--out", default=None, help="directory for untuned_plans.json")
    args = parser.parse_args(argv)
    if not cuda_or_say("bench_untuned"):
        return 2
    deadline = time.time() + args.budget_s
    rows = []
    for name in args.shapes:
        rows += run(SHAPES.get(name) or UNTUNED[name], args.ms, args.reps, deadline)
        write_json(args.out, "untuned_plans.json", {"rows": rows})  # after each shape: a cut run keeps its rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
