"""The hand-written Hopper expert GEMM (``moe_compile/kernels/cuda``) against the tuned Triton GEMMs.

    python benchmarks/sweep_wgmma.py [--points mixtral:2048 ...] [--out DIR]

For each ``shape:M`` point (routing of random logits, CUDA graph over ``ROTATE`` routings, as
``gemm_split.py``), the per-call GPU time of the tuned plan's Triton GEMM1 and GEMM2 and of the
CUDA kernel's variants: ``persistent`` 0 (a CTA per tile), 1 (a CTA per SM, tiles round-robin),
2 (a CTA per SM, tiles claimed from a device counter) x ``tail`` (blocks of at most 64 rows as
64-row tiles) x ``group_m``, the kernel compiled without the tail tiles (``NO_TAIL``), and 2- and
4-CTA clusters sharing the A tile by TMA multicast (``cluster``; skipped where it does not divide
the GEMM's N-tiles). Every variant's output is checked against the Triton GEMM's first
(relative error <= 1e-2) before it is timed. Writes ``sweep_wgmma.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import BF16_FLOP_PER_S, HBM_BYTES_PER_S, ALL_SHAPES, graph_time_us, point, write_json  # noqa: E402
from gemm_split import LARGE_POINTS, stage_inputs  # noqa: E402
from tune_triton import hf_layout_weights, problem  # noqa: E402

from moe_compile.kernels.cuda import wgmma  # noqa: E402
from moe_compile.kernels.triton.experts import plan_for  # noqa: E402
from moe_compile.kernels.triton.gemm import moe_gemm  # noqa: E402
from moe_compile.ops.config import ExpertsConfig  # noqa: E402

VARIANTS = [dict(persistent=p, tail=True, group_m=g) for p, g in ((2, 8), (0, 8), (1, 8), (2, 4))]
VARIANTS += [dict(persistent=p, tail=False, group_m=8, defines=("NO_TAIL",)) for p in (2, 0)]
CLUSTER_VARIANTS = [dict(persistent=p, tail=True, group_m=8, cluster=c) for c in (2, 4) for p in (0, 1)]
VARIANTS += CLUSTER_VARIANTS


def sweep(name: str, m: int, reps: int, variants=VARIANTS) -> dict:
    shape = ALL_SHAPES[name]
    weights = hf_layout_weights(shape)
    calls = problem(shape, m, weights)
    plan = plan_for(calls[0][0], shape.top_k, weights)
    cfg = ExpertsConfig()
    k, h, i = shape.top_k, shape.hidden, shape.inter
    pairs = m * k
    st = stage_inputs(shape, m, calls)
    for s in st:
        s["table"] = wgmma.block_table(s["al"].counts, pairs)
        if plan.gemm2.split_k > 1:
            s["y_split"] = torch.empty(plan.gemm2.split_k, pairs, h, dtype=s["y"].dtype, device="cuda")
    common = dict(top_k=k, expert_map=None)

    def gemm1_triton(s, out=None):
        a1 = s["al"].x_sorted if plan.pre_gather else s["x"]
        moe_gemm(a1, weights.w13, s["act"] if out is None else out, topk_ids=s["ids"], counts=s["al"].counts,
                 sorted_pair=s["al"].sorted_pair, experts=cfg, gather_a=not plan.pre_gather, config=plan.gemm1,
                 **common)

    def gemm2_triton(s, out=None):
        split = plan.gemm2.split_k  # a split-K plan writes one partial per K slice, summed by the combine
        y = s["y_split"] if split > 1 else (s["y"] if out is None else out)
        moe_gemm(s["act"], weights.w2, y, topk_ids=s["ids"], counts=s["al"].counts,
                 sorted_pair=s["al"].sorted_pair, gather_a=False, config=plan.gemm2, **common)
        if split > 1 and out is not None:  # the reference: outside the timing
            torch.sum(y, dim=0, out=out)

    def gemm1_cuda(var):
        def run(s, out=None):
            table = wgmma.block_table(s["al"].counts, pairs)  # once per layer call
            wgmma.wgmma_gemm(s["al"].x_sorted, weights.w13, s["act"] if out is None else out, *table,
                             gated=True, **var)
        return run

    def gemm2_cuda(var):
        def run(s, out=None):
            wgmma.wgmma_gemm(s["act"], weights.w2, s["y"] if out is None else out, *s["table"], gated=False, **var)
        return run

    hits = sum(torch.unique(ids).numel() for _, _, ids in calls) / len(calls)
    row = {"shape": name, "M": m, "plan": plan.to_dict(), "experts_hit": hits}
    print(f"\n{name} M={m} (Triton plan {plan.to_dict()})", flush=True)
    for gemm, n_w, triton_fn, cuda_fn, width in (("gemm1", 2 * h * i, gemm1_triton, gemm1_cuda, i),
                                                 ("gemm2", h * i, gemm2_triton, gemm2_cuda, h)):
        bound = max(hits * n_w * 2 / HBM_BYTES_PER_S, 2 * pairs * n_w / BF16_FLOP_PER_S) * 1e6
        ref = torch.empty(pairs, width, dtype=torch.bfloat16, device="cuda")
        triton_fn(st[0], ref)
        t_triton = graph_time_us(triton_fn, st, reps)
        res = {"bound": bound, "triton": t_triton, "cuda": []}
        print(f"  {gemm}: bound {bound:.1f} us, triton {t_triton:.1f} us ({t_triton / bound:.2f}x)", flush=True)
        for var in variants:
            fn = cuda_fn(var)
            got = torch.empty_like(ref)
            try:
                fn(st[0], got)
            except ValueError as exc:  # a cluster size that does not divide this GEMM's N-tiles
                res["cuda"].append({**var, "us": None, "skipped": str(exc)})
                print(f"    {var}: skipped ({exc})", flush=True)
                continue
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            t = graph_time_us(fn, st, reps) if err <= 1e-2 else None
            res["cuda"].append({**var, "us": t, "rel_err_vs_triton": err})
            shown = "WRONG" if t is None else f"{t:.1f} us ({t / bound:.2f}x, {t_triton / t:.3f} of triton's time)"
            print(f"    {var}: {shown}  err {err:.1e}", flush=True)
        row[gemm] = res
    del weights, calls, st
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=point, default=LARGE_POINTS)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--clusters-only", action="store_true",
                        help="only the cluster variants and the default (persistent=2) one")
    parser.add_argument("--out", default=None, help="directory for sweep_wgmma.json")
    args = parser.parse_args(argv)
    if not wgmma.available(torch.device("cuda")):
        print(f"the CUDA kernel cannot run here: {wgmma.unavailable_reason(0)}")
        return 1
    variants = VARIANTS[:1] + CLUSTER_VARIANTS if args.clusters_only else VARIANTS
    rows = [sweep(name, m, args.reps, variants) for name, m in args.points]
    write_json(args.out, "sweep_wgmma.json", {"variants": variants, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
