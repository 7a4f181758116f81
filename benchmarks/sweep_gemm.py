"""Each expert GEMM alone, the tuned config against variants: K-depths and tiles, or tile order (CUDA).

    python benchmarks/sweep_gemm.py [--variants group|blockk|expert|occupancy|merge|splitk|bigm] [--points qwen3:2048 ...] [--out DIR] [--budget-s 420]

``tune_triton.py`` searched 64-deep K-steps only for the large tiles. A memory-bound GEMM reads
each weight row in ``block_k * 2``-byte pieces, and longer pieces may stream better from HBM, so
this times, per ``shape:M`` point (routing and CUDA-graph timing as ``gemm_split.py``), the tuned
plan's first and second GEMM against the same GEMM with each variant of ``VARIANTS`` (block
sizes, warps, stages; TMA, tails, persistence and grouping kept from the tuned config). Each
variant's output is compared with the tuned one's (``MAX_REL_ERR``); a variant that fails to
compile, to fit in shared memory or to match is reported and skipped. Prints each GEMM's time and
its ratio to its own bound; writes ``sweep_gemm_{variants}.json``. ``--apply`` (or, later and on
any machine, ``--apply-from`` that JSON) writes each GEMM's fastest variant into the tuned plans
where it beats the tuned config by ``MIN_GAIN``.

Sixth session: ``--variants blockk`` found no gain (128-deep K-steps were slower everywhere);
``--variants group`` did (DeepSeek-V3 M=2048's first GEMM ran with all M-blocks of one N-block in
turn, so each expert's gathered rows left L2 before its next N-block read them).
Seventh session: ``--variants expert`` orders the tiles expert by expert (a group of M-blocks
never mixes experts, whose weight tiles would compete for L2).
Tenth session: ``--variants occupancy`` times tiles small enough for two or three CTAs per SM.
Eleventh session: ``--variants merge`` lets an expert's last block take up to ``merge_m`` rows
past a full block, computed transposed on the same weight tiles (``GemmConfig.merge_m``), and also
times the tuned config on a balanced routing (every expert the same number of rows, whole blocks at
four of the six points): what the GEMM would cost with no partial blocks at all, the most any
handling of the last blocks can gain.
Thirteenth session: ``--variants bigm`` times 256-row blocks (the partial last block per expert
is the cost ``merge`` measured; 256-row blocks leave none at ~256 or ~512 rows per expert).
They were slower at every GEMM tried (12-46 %, ``results/README.md``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import (  # noqa: E402
    BF16_FLOP_PER_S, HBM_BYTES_PER_S, ALL_SHAPES,
    cuda_or_say, graph_time_us, point, write_json,
)
from gemm_split import stage_inputs  # noqa: E402
from tune_triton import MAX_REL_ERR, hf_layout_weights, problem, write_table  # noqa: E402

from moe_compile.kernels.triton.configs import CONFIG_DIR, config_file_name  # noqa: E402

from moe_compile.kernels.triton.experts import plan_for  # noqa: E402
from moe_compile.kernels.triton.gemm import GemmConfig, moe_gemm  # noqa: E402
from moe_compile.ops.config import ExpertsConfig  # noqa: E402

# each variant overrides some of the tuned config's fields; GEMM1's tile is block_m x 2*block_n
# (gate + up). "blockk": deeper K-steps and other tiles; "group": the order of the tiles (how many
# M-blocks share each N-block in turn, so how long an expert's rows stay in L2)
VARIANTS = {
    "blockk": {
        1: [(128, 128, 128, 8, 2), (128, 64, 128, 8, 3), (64, 64, 128, 4, 4), (64, 128, 128, 4, 2),
            (64, 128, 128, 8, 2), (128, 64, 64, 8, 5), (64, 128, 64, 4, 4), (64, 128, 64, 8, 4)],
        2: [(128, 256, 128, 8, 2), (128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (64, 256, 128, 8, 2),
            (64, 256, 64, 8, 4), (128, 128, 64, 8, 5), (64, 128, 64, 4, 5)],
    },
    "group": {1: [1, 2, 4, 8, 16, 32, 1024], 2: [1, 2, 4, 8, 16, 32, 1024]},
    # the tiles expert by expert (GemmConfig.expert_order), group_m M-blocks of one expert at a time
    "expert": {g: [dict(expert_order=1, group_m=m) for m in (1, 4, 8, 16, 1024)] for g in (1, 2)},
    # two or three CTAs per SM (shared memory <= ~110 KB, registers <= 32 K per CTA), so one CTA's
    # pipeline fill and epilogue overlap another's K-loop (the tuned tiles run one CTA per SM)
    "occupancy": {
        1: [(128, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 2), (64, 64, 64, 4, 4)],
        2: [(128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 4, 2), (64, 128, 64, 4, 3), (64, 256, 64, 8, 2),
            (128, 128, 64, 8, 2)],
    },
    # an expert's last block takes up to merge_m more rows (transposed, on the same weight tiles)
    # (merge_launch=1: the merged blocks in a second launch, so the first keeps the plain tile's code)
    "merge": {
        # merge_m=0 is the plain tile, so a plan that already merges is timed against it too
        1: [dict(merge_m=m) for m in (0, 16, 32, 64)] + [dict(merge_m=m, tail_m=0) for m in (16, 32)]
        + [dict(merge_m=m, merge_launch=1) for m in (16, 32)],
        2: [dict(merge_m=m) for m in (0, 16, 32, 64)] + [dict(merge_m=m, tail_m=0) for m in (16, 32)]
        + [dict(merge_m=m, persistent=0) for m in (32, 64)] + [dict(merge_m=m, merge_launch=1) for m in (16, 32)],
    },
    # the second GEMM over K slices (GemmConfig.split_k): its tiles fill the SMs' last wave; the
    # time here leaves out the combine's extra reads of the slices (the layer benchmark has them)
    "splitk": {1: [], 2: [dict(split_k=s) for s in (2, 3, 4)] + [dict(split_k=s, persistent=0) for s in (2, 3)]
               + [dict(split_k=s, persistent=2) for s in (2, 3)]},
    # 256-row blocks: an expert of ~512 rows (Mixtral M=2048, Qwen3 M=8192) or ~256 (DeepSeek-V3
    # M=8192) fills whole blocks plus at most a merged remainder, where 128-row blocks leave a
    # partial block per expert; each weight tile is also read by half as many programs
    "bigm": {
        1: [dict(block_m=256, block_n=64, num_warps=8, num_stages=s) for s in (3, 4)]
        + [dict(block_m=256, block_n=64, num_warps=8, num_stages=3, merge_m=0),
           dict(block_m=256, block_n=128, num_warps=16, num_stages=3)],
        2: [dict(block_m=256, block_n=128, num_warps=8, num_stages=s) for s in (3, 4)]
        + [dict(block_m=256, block_n=128, num_warps=8, num_stages=3, split_k=1),
           dict(block_m=256, block_n=256, num_warps=16, num_stages=3)],
    },
}
FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")


def variant(cfg, v):
    if isinstance(v, int):
        return replace(cfg, group_m=v)
    if isinstance(v, dict):
        if v.get("tail_m", 0) >= cfg.block_m or v.get("merge_m", 0) >= cfg.block_m:
            return cfg  # no tail tile as large as a block, no more rows merged than a block
        return replace(cfg, **v)
    fields = dict(zip(FIELDS, v))
    tail = cfg.tail_m if 0 < cfg.tail_m < fields["block_m"] else 0
    return replace(cfg, tail_m=tail, **fields)


def sweep(name: str, m: int, reps: int, deadline: float, kind: str) -> dict:
    shape = ALL_SHAPES[name]
    weights = hf_layout_weights(shape)
    calls = problem(shape, m, weights)
    plan = plan_for(calls[0][0], shape.top_k, weights)
    st = stage_inputs(shape, m, calls)
    cfg_x = ExpertsConfig()
    k, h, i = shape.top_k, shape.hidden, shape.inter
    pairs = m * k
    hits = sum(torch.unique(ids).numel() for _, _, ids in calls) / len(calls)
    pre = plan.pre_gather and plan.path.value == "sorted"

    def run(gemm, cfg, s):
        al = s["al"]
        if gemm == 1:
            a1 = al.x_sorted if pre else s["x"]
            moe_gemm(a1, weights.w13, s["act"], topk_ids=s["ids"], top_k=k, counts=al.counts,
                     sorted_pair=al.sorted_pair, experts=cfg_x, gather_a=not pre, config=cfg)
            return s["act"]
        y = s["y"]
        if cfg.split_k > 1:  # one [pairs, H] slice per K slice
            y = s.setdefault(f"y{cfg.split_k}", torch.empty(cfg.split_k, *y.shape, dtype=y.dtype, device=y.device))
        moe_gemm(s["act"], weights.w2, y, topk_ids=s["ids"], top_k=k, counts=al.counts,
                 sorted_pair=al.sorted_pair, gather_a=False, config=cfg)
        return y

    def value(t):  # what a config computed, in fp32: split-K slices summed
        return t.float().sum(0) if t.dim() == 3 else t.float()

    row = {"shape": name, "M": m, "plan": plan.to_dict(), "experts_hit": hits, "gemm1": [], "gemm2": []}
    balanced = None
    if kind in ("merge", "bigm"):  # pair p -> expert p % E: every expert the same rows (a token's k experts distinct)
        x0, w0, ids0 = calls[0]
        ids_bal = (torch.arange(ids0.numel(), device=ids0.device) % shape.num_experts).view_as(ids0).to(ids0.dtype)
        balanced = stage_inputs(shape, m, [(x0, w0, ids_bal)])
    print(f"\n{name} M={m} plan {plan.path.value} pre_gather={pre}", flush=True)
    for gemm, n_w, tuned in ((1, 2 * h * i, plan.gemm1), (2, h * i, plan.gemm2)):
        bound = max(hits * n_w * 2 / HBM_BYTES_PER_S, 2 * pairs * n_w / BF16_FLOP_PER_S) * 1e6
        row[f"gemm{gemm} bound"] = bound
        ref = value(run(gemm, tuned, st[0])).clone()
        variants = [variant(tuned, v) for v in VARIANTS[kind][gemm]]
        # the tuned config is timed first and again last: the first timing of a point can run on a
        # GPU that is not yet at its steady clocks, which would favour every variant after it
        for cfg in [tuned] + [c for c in dict.fromkeys(variants) if c != tuned] + [tuned]:
            if time.time() > deadline:
                print("  budget spent; stopping", flush=True)
                return row
            tag = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} tail{cfg.tail_m}"
                   f"{f' merge{cfg.merge_m}' if cfg.merge_m else ''}{' 2nd-launch' if cfg.merge_launch else ''}{f' split{cfg.split_k}' if cfg.split_k > 1 else ''} p{cfg.persistent} g{cfg.group_m}"
                   f"{' by-expert' if cfg.expert_order else ''}")
            try:
                out = value(run(gemm, cfg, st[0]))
                err = ((out - ref).norm() / ref.norm()).item()
                if not err <= MAX_REL_ERR:
                    print(f"  gemm{gemm} {tag}: wrong (rel err {err:.2e})", flush=True)
                    continue
                us = graph_time_us(lambda s, c=cfg, g=gemm: run(g, c, s), st, reps)
            except Exception as exc:  # no fit in shared memory, no compile: skipped, said
                print(f"  gemm{gemm} {tag}: failed {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            row[f"gemm{gemm}"].append({"config": asdict(cfg), "us": us, "tuned": cfg == tuned})
            print(f"  gemm{gemm} {tag}{' (tuned)' if cfg == tuned else ''}: {us:9.1f} us "
                  f"{us / bound:5.2f}x its bound", flush=True)
        if kind in ("merge", "bigm") and time.time() < deadline:
            # the tuned config and the fastest variant, each on the balanced routing too: a variant
            # faster there than the tuned config gains from its code, not from the partial blocks
            timed = row[f"gemm{gemm}"]
            best = GemmConfig.from_dict(min(timed, key=lambda t: t["us"])["config"]) if timed else tuned
            counts = balanced[0]["al"].counts
            for label, cfg in (("tuned", tuned), ("fastest variant", best))[: 1 if best == tuned else 2]:
                us = graph_time_us(lambda s, g=gemm, c=cfg: run(g, c, s), balanced, reps)
                row[f"gemm{gemm} balanced" + ("" if cfg == tuned else " fastest")] = us
                print(f"  gemm{gemm} {label} on a balanced routing ({int(counts.min())}-{int(counts.max())} rows "
                      f"per expert): {us:9.1f} us {us / bound:5.2f}x its bound", flush=True)
    del weights, calls, st
    torch.cuda.empty_cache()
    return row


MIN_GAIN = 0.015  # a variant replaces the tuned config only when this much faster (run-to-run noise ~1 %)


def apply_best(rows: list[dict], config_dir: Path = CONFIG_DIR) -> list[str]:
    """Write each GEMM's fastest variant into the tuned-plans file where it beats the tuned config
    by ``MIN_GAIN``; returns what changed."""
    changed = []
    for row in rows:
        shape = ALL_SHAPES[row["shape"]]
        path = config_dir / config_file_name(shape.num_experts, shape.hidden, shape.inter, torch.bfloat16,
                                             "NVIDIA_H200")
        table = json.loads(path.read_text())
        entry = table.get(str(row["M"]))
        for gemm in ("gemm1", "gemm2"):
            timed = row.get(gemm) or []
            tuned_runs = [t for t in timed if t["tuned"]]
            tuned = min(tuned_runs, key=lambda t: t["us"]) if tuned_runs else None  # first and last timing
            if tuned is None or entry is None or GemmConfig.from_dict(entry[gemm]) != GemmConfig.from_dict(tuned["config"]):
                continue  # the file moved on since this sweep, or the sweep never timed the tuned config
            best = min(timed, key=lambda t: t["us"])
            if best["us"] < tuned["us"] * (1 - MIN_GAIN):
                entry[gemm] = best["config"]
                changed.append(f"{row['shape']} M={row['M']} {gemm}: {tuned['us']:.1f} -> {best['us']:.1f} us "
                               f"{ {k: v for k, v in best['config'].items() if tuned['config'][k] != v} }")
        if entry is not None and any(c.startswith(f"{row['shape']} M={row['M']} ") for c in changed):
            entry["_from"] = "benchmarks/sweep_gemm.py (GEMM alone, CUDA graph)"
            write_table(path, table)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=point, default=[
        ("qwen3", 256), ("qwen3", 2048), ("deepseek_v3", 2048), ("mixtral", 2048), ("qwen3", 8192), ("deepseek_v3", 8192)])
    parser.add_argument("--variants", choices=list(VARIANTS), default="group")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no variant after this")
    parser.add_argument("--out", default=None, help="directory for sweep_gemm.json")
    parser.add_argument("--apply", action="store_true",
                        help="write each GEMM's fastest variant into the tuned plans (see MIN_GAIN)")
    parser.add_argument("--apply-from", default=None, help="apply a saved sweep_gemm_*.json (no GPU needed)")
    args = parser.parse_args(argv)
    if args.apply_from:
        print("\n".join(apply_best(json.loads(Path(args.apply_from).read_text())["rows"])) or "nothing to change")
        return 0
    if not cuda_or_say("sweep_gemm"):
        return 2
    deadline = time.time() + args.budget_s
    rows = []
    for name, m in args.points:
        rows.append(sweep(name, m, args.reps, deadline, args.variants))
        # after every point, so a cut run keeps what it measured
        write_json(args.out, f"sweep_gemm_{args.variants}.json", {"rows": rows})
    if args.apply:
        print("\n".join(apply_best(rows)) or "nothing to change")
    return 0


if __name__ == "__main__":
    sys.exit(main())
