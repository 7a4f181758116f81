"""Decode experts: the one-kernel ``decode`` path (``kernels/triton/decode.py``) against the tuned plan.

    python benchmarks/probe_decode.py [--points qwen3:1 mixtral:1 deepseek_v3:1 qwen3:4] [--apply]
        [--out benchmarks/results]

For each ``shape:M`` point: the experts (``fused_experts``, after routing) on random bf16 weights
in HF's layout (transposed views), over ``ROTATE`` routings of random tokens in one CUDA graph, so
the experts hit change from call to call and the weights come from HBM. Sweeps the decode
kernel's blocks in three steps (intermediate columns per program x K step x TMA loads; then the second
product's columns x pipeline stages; then 8 warps), each candidate checked against the tuned
plan's output (relative Frobenius error), then times the tuned plan and the best candidate
alternately for ``--rounds`` rounds. Writes ``decode.json``; ``--apply`` writes the decode plan
into the tuned config file where it was faster in every round.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import cuda_or_say, point, write_json  # noqa: E402
from probe_gemv import point_timer, write_entry  # noqa: E402

from moe_compile.kernels.triton.configs import Plan, decode_plan  # noqa: E402

BLOCK_I = (16, 32, 64)
BLOCK_K = (128, 256)
BLOCK_N = (64, 128, 256)
STAGES = (2, 3, 4)


def key(plan: Plan) -> str:
    g1 = plan.gemm1
    return f"i{g1.block_n}k{g1.block_k}n{plan.gemm2.block_n}w{g1.num_warps}s{g1.num_stages}" + ("tma" if g1.tma else "")


def run_point(name: str, m: int, reps: int, rounds: int) -> dict:
    tuned, time = point_timer(name, m, reps)
    sweep = {}

    def best_of(plans):
        for p in plans:
            sweep[key(p)] = time(p)
        return min(plans, key=lambda p: sweep[key(p)][0])

    best = best_of([decode_plan(i, k, 128, tma=t) for i, k, t in itertools.product(BLOCK_I, BLOCK_K, (0, 1))])
    g1 = best.gemm1
    best = best_of([best] + [decode_plan(g1.block_n, g1.block_k, n, 4, s, g1.tma)
                             for n, s in itertools.product(BLOCK_N, STAGES) if (n, s) != (128, 3)])
    g1 = best.gemm1
    best = best_of([best, decode_plan(g1.block_n, g1.block_k, best.gemm2.block_n, 8, g1.num_stages, g1.tma)])
    worst_err = max(err for _, err in sweep.values())
    a, b = [], []
    for _ in range(rounds):  # side by side, alternating, so the comparison is not across the sweep's minutes
        a.append(time(tuned)[0])
        b.append(time(best)[0])
    row = {"shape": name, "M": m, "tuned_plan": tuned.to_dict(), "best_plan": best.to_dict(),
           "sweep": {k: {"us": round(v[0], 2), "err": v[1]} for k, v in sweep.items()},
           "tuned_us_ab": a, "decode_us_ab": b, "max_err_vs_tuned": worst_err,
           "faster_every_round": all(y < x for x, y in zip(a, b))}
    print(f"{name:<12}{m:>5}  tuned ({tuned.path.value}) {statistics.median(a):8.1f} us  decode {key(best)} "
          f"{statistics.median(b):8.1f} us  ratio {statistics.median(b) / statistics.median(a):.3f}  "
          f"(rounds {' '.join(f'{y / x:.3f}' for x, y in zip(a, b))})  max err {worst_err:.1e}", flush=True)
    print("   sweep: " + "  ".join(f"{k} {v[0]:.1f}" for k, v in sweep.items()), flush=True)
    return row


def apply(rows: list[dict]) -> None:
    for row in rows:
        if not row["faster_every_round"] or row["max_err_vs_tuned"] > 1e-2:
            print(f"kept: {row['shape']} M={row['M']} (decode not faster in every round, or off by more than 1e-2)")
            continue
        entry = dict(row["best_plan"], us=round(statistics.median(row["decode_us_ab"]), 1),
                     _from=f"benchmarks/probe_decode.py (experts alone, CUDA graph; {row['tuned_plan']['path']} "
                           f"path {statistics.median(row['tuned_us_ab']):.1f} us in the same run)")
        write_entry(row["shape"], row["M"], entry, "decode")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=point,
                        default=[("qwen3", 1), ("mixtral", 1), ("deepseek_v3", 1), ("qwen3", 4)])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--apply", action="store_true", help="write the winning decode plans into the tuned configs")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error(f"--rounds ({args.rounds}) and --reps ({args.reps}) must be >= 1")
    if not cuda_or_say("probe_decode"):
        return 2
    rows = []
    for name, m in args.points:
        rows.append(run_point(name, m, args.reps, args.rounds))
        torch.cuda.empty_cache()  # the point's weights went with its timer
        write_json(args.out, "decode.json", {"device": torch.cuda.get_device_name(), "rows": rows})
    if args.apply:
        apply(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
