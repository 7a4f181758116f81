"""Decode experts: the tuned ``pairs`` GEMM1 followed by the GEMV down kernel (the combine fused in)
against the tuned plan (``pairs`` GEMM1 + ``pairs`` GEMM2 + combine), side by side.

    python benchmarks/probe_mixed.py [--points qwen3:1 mixtral:1 deepseek_v3:1] [--reps 20] [--out DIR]

The same weights and routings as ``probe_gemv.py`` (HF layout, ``ROTATE`` routings in one CUDA
graph). Times the tuned plan, its GEMM1 alone, then GEMM1 + ``gemv_down`` over a sweep of the down
kernel's ``(BLOCK_N, BLOCK_K, warps)``; each candidate's output is checked against the tuned plan's
(relative Frobenius error). The best candidate and the tuned plan are then timed alternately, four
rounds. Writes ``mixed.json``.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import cuda_or_say, graph_time_us, point, write_json  # noqa: E402
from probe_gemv import decode_problem  # noqa: E402

from moe_compile.kernels.triton.experts import fused_experts  # noqa: E402
from moe_compile.kernels.triton.gemm import moe_gemm  # noqa: E402
from moe_compile.kernels.triton.gemv import gemv_down  # noqa: E402
from moe_compile.ops.activation import intermediate_size  # noqa: E402

DOWN = list(itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (2, 4, 8)))


def run_point(name: str, m: int, reps: int) -> dict:
    shape, weights, calls, experts, tuned = decode_problem(name, m)
    inter = intermediate_size(weights.w13.shape[2], experts.activation)

    def tuned_fn(c):
        return fused_experts(*c, weights, experts, plan=tuned)

    def gemm1(c):
        x, _, ids = c
        act = torch.empty(ids.numel(), inter, dtype=x.dtype, device=x.device)
        return moe_gemm(x, weights.w13, act, topk_ids=ids, top_k=shape.top_k, counts=None, sorted_pair=None,
                        experts=experts, gather_a=True, config=tuned.gemm1)

    def mixed(down):
        def fn(c):
            x, w, ids = c
            out = torch.empty(m, shape.hidden, dtype=x.dtype, device=x.device)
            return gemv_down(gemm1(c), w, ids, weights.w2, out, down=down)
        return fn

    ref = tuned_fn(calls[0]).float()
    row = {"shape": name, "M": m, "tuned_plan": tuned.to_dict()}
    row["tuned_us"] = graph_time_us(tuned_fn, calls, reps)
    row["gemm1_us"] = graph_time_us(gemm1, calls, reps)
    sweep = {}
    for down in DOWN:
        try:
            err = ((mixed(down)(calls[0]).float() - ref).norm() / ref.norm()).item()
            sweep["x".join(map(str, down))] = (graph_time_us(mixed(down), calls, reps), err)
        except Exception as exc:  # a block shape this triton cannot build: say so and go on
            print(f"   down {down}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    best_key = min(sweep, key=lambda k: sweep[k][0])
    best = tuple(int(v) for v in best_key.split("x"))
    a, b = [], []
    for _ in range(4):
        a.append(graph_time_us(tuned_fn, calls, reps))
        b.append(graph_time_us(mixed(best), calls, reps))
    row.update(down_sweep=sweep, best_down=best, tuned_us_ab=a, mixed_us_ab=b, mixed_err=sweep[best_key][1])
    print(f"{name:<12}{m:>5}  tuned ({tuned.path.value}) {min(a):7.1f} us (GEMM1 alone {row['gemm1_us']:.1f})  "
          f"GEMM1 + gemv_down {best_key} {min(b):7.1f} us  ratio per round "
          f"{' '.join(f'{y / x:.3f}' for x, y in zip(a, b))}  err {row['mixed_err']:.1e}", flush=True)
    print("   down: " + "  ".join(f"{k} {v[0]:.1f}" for k, v in sorted(sweep.items(), key=lambda kv: kv[1][0])[:12]),
          flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=point, default=[("qwen3", 1), ("mixtral", 1), ("deepseek_v3", 1)])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None, help="write mixed.json here")
    args = parser.parse_args(argv)
    if not cuda_or_say("probe_mixed"):
        return 0
    rows = []
    for name, m in args.points:
        rows.append(run_point(name, m, args.reps))
        torch.cuda.empty_cache()
        write_json(args.out, "mixed.json", {"device": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
