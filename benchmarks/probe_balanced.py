"""One expert GEMM, a few configs, timed in turn for several rounds on the benchmark's routing and
on a balanced one, with the registers and spills triton gave each compiled kernel (CUDA).

    python benchmarks/probe_balanced.py --point mixtral:2048 --gemm 1 \\
        --configs '{"merge_m": 64}' '{"merge_m": 0}' --rounds 2

The first config is the point's tuned one; each of ``--configs`` overrides some of its fields.
Every config runs once per round on each routing (A B C A B C ...), so a clock that drifts over a
run weighs on all of them alike. Each output is checked against the tuned config's on the same
routing. Twelfth session: the merge sweep timed the tuned Mixtral M = 2048 GEMM1 at 1514 µs on the
balanced routing and a variant that runs the very same blocks there at 1277 µs; this says whether
that is the code triton generated for the variant, or noise.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import (  # noqa: E402
    BF16_FLOP_PER_S, HBM_BYTES_PER_S, ALL_SHAPES,
    cuda_or_say, graph_time_us, point, write_json,
)
from gemm_split import stage_inputs  # noqa: E402
from tune_triton import MAX_REL_ERR, hf_layout_weights, problem  # noqa: E402

from moe_compile.kernels.triton.experts import plan_for  # noqa: E402
from moe_compile.kernels.triton.gemm import _moe_gemm_kernel, moe_gemm  # noqa: E402
from moe_compile.ops.config import ExpertsConfig  # noqa: E402


def compiled_kernels() -> dict:
    """Every compiled ``_moe_gemm_kernel`` in triton's in-process cache, by cache key."""
    found = {}
    for cache in getattr(_moe_gemm_kernel, "device_caches", {}).values():
        table = cache[0] if isinstance(cache, tuple) else cache
        if isinstance(table, dict):
            found.update(table)
    return found


def resources(kernel) -> str:
    regs, spills = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
    return f"{regs} regs, {spills} spilled, {kernel.metadata.shared} B shared"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--point", type=point, required=True)
    parser.add_argument("--gemm", type=int, choices=(1, 2), required=True)
    parser.add_argument("--configs", nargs="*", default=[], help="JSON field overrides of the tuned config")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not cuda_or_say("probe_balanced"):
        return 2
    name, m = args.point
    shape = ALL_SHAPES[name]
    weights = hf_layout_weights(shape)
    calls = problem(shape, m, weights)
    plan = plan_for(calls[0][0], shape.top_k, weights)
    tuned = plan.gemm1 if args.gemm == 1 else plan.gemm2
    configs = [tuned] + [replace(tuned, **json.loads(c)) for c in args.configs]
    pre = plan.pre_gather and plan.path.value == "sorted"
    x0, w0, ids0 = calls[0]
    ids_bal = (torch.arange(ids0.numel(), device=ids0.device) % shape.num_experts).view_as(ids0).to(ids0.dtype)
    routings = {"routed": stage_inputs(shape, m, calls), "balanced": stage_inputs(shape, m, [(x0, w0, ids_bal)])}
    if args.gemm == 2:  # GEMM2 reads GEMM1's output: give it the same values on every config
        for st in routings.values():
            for s in st:
                s["act"].normal_(0, 1)
    k = shape.top_k
    n_w = (2 if args.gemm == 1 else 1) * shape.hidden * shape.inter
    hits = sum(torch.unique(ids).numel() for _, _, ids in calls) / len(calls)
    bound = max(hits * n_w * 2 / HBM_BYTES_PER_S, 2 * m * k * n_w / BF16_FLOP_PER_S) * 1e6

    def run(cfg, s):
        al = s["al"]
        if args.gemm == 1:
            moe_gemm(al.x_sorted if pre else s["x"], weights.w13, s["act"], topk_ids=s["ids"], top_k=k,
                     counts=al.counts, sorted_pair=al.sorted_pair, experts=ExpertsConfig(), gather_a=not pre,
                     config=cfg)
            return s["act"]
        moe_gemm(s["act"], weights.w2, s["y"], topk_ids=s["ids"], top_k=k, counts=al.counts,
                 sorted_pair=al.sorted_pair, gather_a=False, config=cfg)
        return s["y"]

    print(f"{name} M={m} GEMM{args.gemm}, bound {bound:.1f} us", flush=True)
    refs = {r: run(tuned, st[0]).float().clone() for r, st in routings.items()}
    rows = []
    for i, cfg in enumerate(configs):
        before = set(compiled_kernels())
        errs = {}
        for r, st in routings.items():
            out = run(cfg, st[0]).float()
            errs[r] = ((out - refs[r]).norm() / refs[r].norm()).item()
        new = [v for key, v in compiled_kernels().items() if key not in before]
        regs = "; ".join(resources(kern) for kern in new) or "compiled before (same kernel as an earlier config)"
        ok = all(e <= MAX_REL_ERR for e in errs.values())
        print(f"  config {i}: {cfg}\n    {regs}; rel err {errs}{'' if ok else '  WRONG'}", flush=True)
        rows.append({"config": cfg.__dict__, "rel_err": errs, "resources": regs, "us": {r: [] for r in routings}})
    for rnd in range(args.rounds):
        for i, cfg in enumerate(configs):
            for r, st in routings.items():
                us = graph_time_us(lambda s, c=cfg: run(c, s), st, args.reps)
                rows[i]["us"][r].append(us)
            print(f"  round {rnd} config {i}: " + ", ".join(
                f"{r} {rows[i]['us'][r][-1]:8.1f} us ({rows[i]['us'][r][-1] / bound:4.2f}x)" for r in routings),
                flush=True)
    write_json(args.out, f"probe_balanced_{name}_{m}_gemm{args.gemm}.json", {"bound_us": bound, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
