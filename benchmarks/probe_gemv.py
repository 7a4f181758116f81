"""Decode experts: the GEMV path (``kernels/triton/gemv.py``) against the tuned plan, side by side.

    python benchmarks/probe_gemv.py [--points qwen3:1 mixtral:1 deepseek_v3:1] [--out benchmarks/results]

For each ``shape:M`` point: the experts (``fused_experts``, after routing) on random bf16 weights
in HF's layout (transposed views), over ``ROTATE`` routings of random tokens in one CUDA graph, so
the experts hit change from call to call and the weights come from HBM. Times the tuned plan
(``plan_for``: the ``pairs`` path at these points) and the ``gemv`` path: first the up kernel's
``(BLOCK_N, BLOCK_K, warps)`` candidates with the down kernel at its default, then the down
kernel's with the best up. Every candidate's output is checked against the tuned plan's first
(relative Frobenius error). Writes ``gemv.json``; ``--apply`` writes the best GEMV plan into the
tuned config files where it beat the tuned plan.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import ROTATE, ALL_SHAPES, cuda_or_say, graph_time_us, point, write_json  # noqa: E402

from moe_compile.kernels.triton.configs import CONFIG_DIR, ExpertsPath, Plan, config_file_name, device_key  # noqa: E402
from moe_compile.kernels.triton.experts import fused_experts, plan_for  # noqa: E402
from moe_compile.kernels.triton.gemm import GemmConfig  # noqa: E402
from moe_compile.modular import ExpertWeights  # noqa: E402
from moe_compile.ops.config import ExpertsConfig  # noqa: E402

BLOCK_N = (8, 16, 32)
BLOCK_K = (128, 256, 512)
WARPS = (4, 8)
DEFAULT = (16, 256, 4)


def cfg(block_n: int, block_k: int, warps: int) -> GemmConfig:
    return GemmConfig(block_m=1, block_n=block_n, block_k=block_k, group_m=1, num_warps=warps, num_stages=1)


def hf_weights(shape, gen) -> ExpertWeights:
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=torch.bfloat16) * h ** -0.5).transpose(1, 2)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen, dtype=torch.bfloat16) * i ** -0.5).transpose(1, 2)
    return ExpertWeights(w13, w2, None, None)


def routings(shape, m: int, gen):
    calls = []
    for _ in range(ROTATE):
        x = torch.randn(m, shape.hidden, device="cuda", generator=gen).bfloat16()
        w, ids = torch.randn(m, shape.num_experts, device="cuda", generator=gen).softmax(-1).topk(shape.top_k)
        calls.append((x, (w / w.sum(-1, keepdim=True)).float().contiguous(), ids.int().contiguous()))
    return calls


def decode_problem(name: str, m: int):
    """``(shape, weights, calls, experts config, tuned plan)`` of the decode point ``name:M``:
    random HF-layout weights and ``ROTATE`` routings, drawn from a generator seeded with ``M``."""
    shape = ALL_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(m)
    weights = hf_weights(shape, gen)
    calls = routings(shape, m, gen)
    return shape, weights, calls, ExpertsConfig(), plan_for(calls[0][0], shape.top_k, weights)


def point_timer(name: str, m: int, reps: int):
    """``(tuned plan, time)`` for the decode point ``name:M``: random HF-layout weights and
    ``ROTATE`` routings; ``time(plan)`` -> (µs per call of the experts in a CUDA graph, relative
    Frobenius error against the tuned plan's output). The weights live as long as ``time``."""
    _, weights, calls, experts, tuned = decode_problem(name, m)
    ref = fused_experts(*calls[0], weights, experts, plan=tuned).float()

    def time(plan: Plan) -> tuple[float, float]:
        err = ((fused_experts(*calls[0], weights, experts, plan=plan).float() - ref).norm() / ref.norm()).item()
        us = graph_time_us(lambda c: fused_experts(*c, weights, experts, plan=plan), calls, reps)
        return us, err

    return tuned, time


def run_point(name: str, m: int, reps: int) -> dict:
    tuned, time = point_timer(name, m, reps)
    row = {"shape": name, "M": m, "tuned_plan": tuned.to_dict()}
    row["tuned_us"], _ = time(tuned)
    up_rows, down_rows = {}, {}
    for combo in itertools.product(BLOCK_N, BLOCK_K, WARPS):
        up_rows["x".join(map(str, combo))] = time(Plan(ExpertsPath.GEMV, cfg(*combo), cfg(*DEFAULT)))
    best_up = min(up_rows, key=lambda k: up_rows[k][0])
    up = tuple(int(v) for v in best_up.split("x"))
    for combo in itertools.product(BLOCK_N, BLOCK_K, WARPS):
        down_rows["x".join(map(str, combo))] = time(Plan(ExpertsPath.GEMV, cfg(*up), cfg(*combo)))
    best_down = min(down_rows, key=lambda k: down_rows[k][0])
    down = tuple(int(v) for v in best_down.split("x"))
    best = Plan(ExpertsPath.GEMV, cfg(*up), cfg(*down))
    row.update(up_sweep=up_rows, down_sweep=down_rows, best_plan=best.to_dict())
    # the two side by side once more, alternating, so the comparison is not across the sweep's minutes
    a, b = [], []
    for _ in range(2):
        a.append(time(tuned)[0])
        b.append(time(best)[0])
    row["tuned_us_ab"], row["gemv_us_ab"] = a, b
    row["gemv_err_vs_tuned"] = time(best)[1]
    print(f"{name:<12}{m:>5}  tuned ({tuned.path.value}) {min(a):8.1f} us  gemv up {best_up} down {best_down} "
          f"{min(b):8.1f} us  ratio {min(b) / min(a):.3f}  err {row['gemv_err_vs_tuned']:.1e}", flush=True)
    print("   up:   " + "  ".join(f"{k} {v[0]:.1f}" for k, v in up_rows.items()), flush=True)
    print("   down: " + "  ".join(f"{k} {v[0]:.1f}" for k, v in down_rows.items()), flush=True)
    return row


def apply(rows: list[dict]) -> None:
    for row in rows:
        if min(row["gemv_us_ab"]) >= min(row["tuned_us_ab"]):
            continue
        entry = dict(row["best_plan"], us=round(min(row["gemv_us_ab"]), 1),
                     _from="benchmarks/probe_gemv.py (experts alone, CUDA graph; pairs path "
                           f"{min(row['tuned_us_ab']):.1f} us in the same run)")
        write_entry(row["shape"], row["M"], entry, "gemv")


def write_entry(name: str, m: int, entry: dict, label: str) -> None:
    """``entry`` (a plan's dict with ``us`` and ``_from``) at ``M`` in shape ``name``'s tuned file
    for this GPU (the file must exist: the probes change tuned shapes only)."""
    shape = ALL_SHAPES[name]
    path = CONFIG_DIR / config_file_name(shape.num_experts, shape.hidden, shape.inter, torch.bfloat16,
                                         device_key(torch.device("cuda")))
    table = json.loads(path.read_text())
    table[str(m)] = entry
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"applied: {path.name} M={m} -> {label}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=point,
                        default=[("qwen3", 1), ("mixtral", 1), ("deepseek_v3", 1), ("qwen3", 4)])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--apply", action="store_true", help="write the winning GEMV plans into the tuned configs")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if not cuda_or_say("probe_gemv"):
        return 2
    rows = []
    for name, m in args.points:
        rows.append(run_point(name, m, args.reps))
        torch.cuda.empty_cache()  # the point's weights went with its timer
        write_json(args.out, "gemv.json", {"device": torch.cuda.get_device_name(), "rows": rows})
    if args.apply:
        apply(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
