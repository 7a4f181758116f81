"""Tune the CUDA experts' plans for a shape on this GPU, and write them where the backend reads them.

The plan per token count: the path (pairs / decode / sorted / grouped_mm) and the Triton block sizes.

    python -m moe_compile tune --shape E,top_k,H,I [--ms 1 32 256 2048 8192] [--out DIR] [--refine]

``E,top_k,H,I``: experts, top-k, hidden size, expert intermediate size (routing: softmax top-k,
renormalised, over random logits). For each token count M it times the whole ``fused_experts`` call
(a CUDA graph over ``ROTATE`` different routings, so weights come from HBM) for: the sorted path
with each candidate GEMM1 config (GEMM2 at its default), then each GEMM2 candidate with the best
GEMM1; the pairs path (where eligible) likewise, then a few plans of the one-kernel ``decode``
path; and the ``torch._grouped_mm`` path. Every plan's output is checked against the default plan's
before it is timed, so a fast wrong plan is never kept. Each point's best plan is then refined:
timed side by side with its variants (persistent launches, the pre-gathered first GEMM,
neighbouring tiles, short tails as smaller tiles, merged last blocks, split-K, tile orders),
keeping the fastest. ``--refine`` does only that, from the plan already in the file (in ``--out``,
else the one the backend reads: ``$MOE_COMPILE_CONFIG_DIR``'s merged over the shipped file).

The fastest plan per M goes to ``E{E}_H{H}_I{I}_bf16_{device}.json`` in ``--out`` (default:
``$MOE_COMPILE_CONFIG_DIR`` if set, else the shipped configs directory), written after each point;
the backend merges ``$MOE_COMPILE_CONFIG_DIR``'s file over the shipped one of the same name, entry
by entry, so tuning a few batch sizes keeps the shipped plans at the others. ``benchmarks/tune_triton.py``
runs the same tuner over the issue's named shapes.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from moe_compile.kernels.triton.configs import (
    ExpertsPath, Plan, config_dirs, config_file_name, decode_plan, default_plan, device_key, merged_raw,
    pairs_eligible, parse_shape,
)
from moe_compile.kernels.triton.experts import fused_experts
from moe_compile.kernels.triton.gemm import GemmConfig
from moe_compile.modular import ExpertWeights
from moe_compile.tools.cuda_timing import ROTATE, graph_time_us

MS = (1, 32, 256, 2048, 8192)


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    routing: dict = field(default_factory=dict)  # fused_moe keyword arguments


def routing_config(shape: Shape):
    """The shape's routing as ``select_experts`` takes it."""
    from moe_compile.ops.config import RoutingConfig, RoutingMethod

    r = shape.routing
    return RoutingConfig(num_experts=shape.num_experts, top_k=shape.top_k, method=RoutingMethod(r["routing_method"]),
                         renormalize=r["renormalize"], routed_scaling_factor=r.get("routed_scaling_factor", 1.0),
                         k_group=r.get("k_group", 1), group_count=r.get("group_count", 1),
                         group_select_mode=r.get("group_select_mode", 0))


G = GemmConfig
# group_m >= the number of M-blocks runs all M-blocks of one N-block together, so an expert whose rows
# span two blocks reads each weight tile from HBM once (L2 serves the second block)
ALL_M = 1024
SMALL = [G(16, 32, 128, 1, 4, 4), G(16, 64, 128, 1, 4, 4), G(16, 64, 256, 1, 4, 3), G(16, 128, 128, 1, 4, 4),
         G(16, 32, 256, 1, 4, 4), G(16, 64, 64, 1, 4, 5)]
MID = [G(64, 64, 64, ALL_M, 4, 4), G(64, 128, 64, ALL_M, 4, 4), G(128, 64, 64, ALL_M, 4, 4),
       G(128, 128, 64, ALL_M, 8, 3), G(64, 64, 128, ALL_M, 4, 3), G(64, 128, 64, 1, 4, 4), G(32, 128, 64, ALL_M, 4, 4)]
LARGE1 = [G(128, 128, 64, 8, 8, 3), G(128, 128, 64, 8, 8, 4), G(128, 128, 64, 16, 8, 3), G(128, 64, 64, 8, 8, 3),
          G(64, 128, 64, 8, 4, 4), G(128, 128, 64, ALL_M, 8, 3)]
LARGE2 = [G(128, 256, 64, 8, 8, 3), G(128, 256, 64, 8, 8, 4), G(128, 256, 64, 16, 8, 3), G(128, 128, 64, 8, 8, 3),
          G(128, 128, 64, 8, 4, 4), G(128, 256, 64, ALL_M, 8, 3)]


# the one-kernel decode path (kernels/triton/decode.py): (intermediate columns per program, K step,
# output columns per step, warps, stages, TMA), probe_decode.py's best on the H200 at Qwen3 M = 1 / 4
DECODE = [(32, 256, 256, 8, 3, 0), (32, 256, 256, 4, 3, 0), (64, 128, 256, 8, 3, 1), (64, 256, 256, 4, 4, 0)]
GROUPS = (1, 2, 4, 8, 16, ALL_M)
MID_EXTRA = [G(64, 128, 64, ALL_M, 8, 4), G(128, 128, 64, ALL_M, 8, 4)]
LARGE_EXTRA = [G(64, 128, 64, ALL_M, 4, 4), G(128, 128, 64, ALL_M, 8, 4), G(64, 256, 64, 8, 8, 3)]


def with_tma(configs: list[GemmConfig]) -> list[GemmConfig]:
    """Each config, then its TMA twin (weights by descriptor; see kernels/triton/gemm.py)."""
    return [c for g in configs for c in (g, replace(g, tma=1))]


def decode_candidates() -> list[Plan]:
    """The ``decode`` path's plans worth timing for a decode batch (see ``DECODE``)."""
    return [decode_plan(*choice) for choice in DECODE]


def candidates(per_expert: float, gemm: int, tma: bool = True) -> list[GemmConfig]:
    if per_expert <= 8:
        base = SMALL
    elif per_expert <= 96:
        base = MID + MID_EXTRA
    else:
        base = (LARGE1 if gemm == 1 else LARGE2) + LARGE_EXTRA
    return with_tma(base) if tma else list(base)


def problem(shape: Shape, m: int, weights: ExpertWeights):
    from moe_compile.kernels.triton.routing import route

    cfg = routing_config(shape)
    gen = torch.Generator(device="cuda").manual_seed(m)
    calls = []
    for _ in range(ROTATE):
        x = torch.randn(m, shape.hidden, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(m, shape.num_experts, device="cuda", generator=gen)
        bias = torch.randn(shape.num_experts, device="cuda", generator=gen) * 0.05
        w, ids = route(logits, cfg, bias if shape.name == "deepseek_v3" else None)
        calls.append((x, w, ids))
    return calls


def reference_output(calls, weights: ExpertWeights, shape: Shape, m: int) -> torch.Tensor:
    """The first call's output on the default plan (pointer loads, no TMA, no persistence)."""
    x, w, ids = calls[0]
    plan = default_plan(m, shape.top_k, shape.num_experts, shape.hidden, shape.inter)
    return fused_experts(x, w, ids, weights, plan=plan).float()


def plan_error(plan: Plan, calls, weights: ExpertWeights, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` of ``plan`` on the first call (NaN counts as wrong)."""
    x, w, ids = calls[0]
    out = fused_experts(x, w, ids, weights, plan=plan).float()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if err == err else float("inf")


MAX_REL_ERR = 1e-2  # bf16 outputs, fp32 accumulation in another order: ~3e-3 seen


def time_plan(plan: Plan, calls, weights: ExpertWeights, reps: int, ref: torch.Tensor | None = None) -> float:
    """Graph-replay time of ``plan`` (inf if it fails to compile or run, or, given ``ref``, if its
    output is further than ``MAX_REL_ERR`` from it: a fast wrong plan is never kept)."""
    def fn(call):
        x, w, ids = call
        return fused_experts(x, w, ids, weights, plan=plan)
    try:
        if ref is not None:
            err = plan_error(plan, calls, weights, ref)
            if not err <= MAX_REL_ERR:
                print(f"    {plan.path.value} {plan.gemm1} {plan.gemm2}: wrong output (rel err {err:.2e}), skipped")
                return float("inf")
        return graph_time_us(fn, calls, reps)
    except Exception as exc:  # a config that does not compile or fit (shared memory) is skipped
        print(f"    {plan.path.value} {plan.gemm1} {plan.gemm2}: failed: {type(exc).__name__}: {str(exc)[:120]}")
        return float("inf")


def tune_point(shape: Shape, m: int, weights: ExpertWeights, reps: int, log: list) -> Plan:
    calls = problem(shape, m, weights)
    ref = reference_output(calls, weights, shape, m)
    pairs = m * shape.top_k
    per_expert = pairs / shape.num_experts
    base = default_plan(m, shape.top_k, shape.num_experts, shape.hidden, shape.inter)
    paths = [ExpertsPath.SORTED] + ([ExpertsPath.PAIRS] if pairs_eligible(pairs, shape.num_experts) else [])
    best = (float("inf"), base)
    for path in paths:
        g2 = base.gemm2 if base.path is path else candidates(per_expert, 2)[0]
        plan = Plan(path, candidates(per_expert, 1)[0], g2)
        t1 = {}
        for g1 in candidates(per_expert, 1):
            t1[g1] = time_plan(replace(plan, gemm1=g1), calls, weights, reps, ref)
            log.append({"shape": shape.name, "M": m, "path": path.value, "gemm1": asdict(g1), "gemm2": asdict(g2),
                        "us": t1[g1]})
        plan = replace(plan, gemm1=min(t1, key=t1.get))
        for g2 in candidates(per_expert, 2):
            us = time_plan(replace(plan, gemm2=g2), calls, weights, reps, ref)
            log.append({"shape": shape.name, "M": m, "path": path.value, "gemm1": asdict(plan.gemm1),
                        "gemm2": asdict(g2), "us": us})
            if us < best[0]:
                best = (us, replace(plan, gemm2=g2))
    if pairs_eligible(pairs, shape.num_experts):  # the one-kernel decode path
        for plan in decode_candidates():
            us = time_plan(plan, calls, weights, reps, ref)
            log.append(dict(plan.to_dict(), shape=shape.name, M=m, us=us))
            if us < best[0]:
                best = (us, plan)
    grouped = Plan(ExpertsPath.GROUPED_MM, best[1].gemm1, best[1].gemm2)
    us = time_plan(grouped, calls, weights, reps, ref)
    log.append({"shape": shape.name, "M": m, "path": "grouped_mm", "us": us})
    if us < best[0]:
        best = (us, grouped)
    print(f"  {shape.name} M={m}: best {best[1].path.value} {best[0]:.1f} us "
          f"(grouped_mm {us:.1f} us) g1={best[1].gemm1} g2={best[1].gemm2}", flush=True)
    return best


def refine_variants(plan: Plan, per_expert: float) -> list[Plan]:
    """Plans near a tuned one: the persistent launch (plain and with a flattened tile loop), the
    pre-gathered first GEMM, TMA twins, and a few neighbouring tiles; the pairs path gets its
    small-tile TMA twins; the decode path its other block choices (GEMM1's first, then the second
    product's output columns)."""
    if plan.path is ExpertsPath.DECODE:
        firsts = [replace(plan, gemm1=c.gemm1) for c in decode_candidates()]
        return list(dict.fromkeys([plan] + firsts + [replace(plan, gemm2=replace(plan.gemm2, block_n=n))
                                                      for n in (64, 128, 256) if n != plan.gemm2.block_n]))
    if plan.path is ExpertsPath.PAIRS:
        return [replace(plan, gemm1=g) for g in with_tma(SMALL)] + [replace(plan, gemm2=g) for g in with_tma(SMALL)]
    g1, g2 = plan.gemm1, plan.gemm2
    if plan.path is ExpertsPath.GROUPED_MM:  # start the Triton variants from the large tiles
        g1, g2 = G(128, 128, 64, 8, 8, 4, tma=1), G(128, 256, 64, 8, 8, 4, tma=1)
    base = Plan(ExpertsPath.SORTED, g1, g2)
    out = [base]
    for pre in (False, True):
        for pers in (0, 1, 2):
            out.append(replace(base, pre_gather=pre, gemm1=replace(g1, persistent=pers, tma=1)))
    if per_expert > 32:  # two neighbouring tiles, pre-gathered and persistent with a flat tile loop
        for t in (G(128, 128, 64, 8, 8, 3, 1, 2), G(64, 128, 64, ALL_M, 8, 4, 1, 2)):
            out.append(replace(base, pre_gather=True, gemm1=t))
    for pers in (1, 2):
        out.append(replace(base, gemm2=replace(g2, persistent=pers)))
    if per_expert > 32:
        for t in (G(128, 256, 64, 8, 8, 3, 1), G(128, 128, 64, 8, 8, 4, 1)):
            for pers in (0, 2):
                out.append(replace(base, gemm2=replace(t, persistent=pers)))
    # short tails as smaller tiles, on the tuned plan's own GEMMs (pre-gather and persistence kept)
    tails = sorted({max(16, g1.block_m // 4), g1.block_m // 2} - {g1.block_m})
    for tail in tails:
        out.append(replace(plan, path=ExpertsPath.SORTED, gemm1=replace(g1, tail_m=tail)))
        out.append(replace(plan, path=ExpertsPath.SORTED, gemm1=replace(g1, tail_m=tail, persistent=1),
                           pre_gather=True))
    for tail in sorted({max(16, g2.block_m // 4), g2.block_m // 2} - {g2.block_m}):
        for pers in (0, 2):
            out.append(replace(plan, path=ExpertsPath.SORTED, gemm2=replace(g2, tail_m=tail, persistent=pers)))
    sorted_plan = replace(plan, path=ExpertsPath.SORTED, gemm1=g1, gemm2=g2)
    for tail in tails:  # tails on a one-program-per-tile GEMM1 (the persistent one lost with tails)
        out.append(replace(sorted_plan, gemm1=replace(g1, tail_m=tail, persistent=0)))
    if 16 < per_expert <= 160:  # 64-row blocks with 16/32-row tails: little padding at ~1-2 blocks per expert
        for tail in (16, 32):
            out.append(replace(sorted_plan, gemm1=G(64, 128, 64, ALL_M, 4, 4, 1, tail_m=tail)))
            out.append(replace(sorted_plan, gemm2=G(64, 128, 64, ALL_M, 4, 4, 1, tail_m=tail)))
            out.append(replace(sorted_plan, gemm2=G(64, 256, 64, ALL_M, 8, 3, 1, tail_m=tail)))
    if per_expert > 32 and g1.block_m >= 64 and g2.block_m >= 64:
        # an expert's few rows past its last full block merged into it, transposed, in place or in a
        # second launch (sweep_gemm.py --variants merge, eleventh session: 4-5 % faster GEMMs at
        # Qwen3 M = 2048)
        for merge in (16, 32):
            for second in (0, 1):
                out.append(replace(sorted_plan, gemm1=replace(g1, merge_m=merge, merge_launch=second, tail_m=0)))
                out.append(replace(sorted_plan, gemm2=replace(g2, merge_m=merge, merge_launch=second)))
    # the second GEMM over K slices, so a GEMM of few long-K tiles fills its last wave of SMs
    # (sweep_gemm.py --variants splitk, twelfth session); the combine adds the slices
    for split in (2, 3):
        out.append(replace(sorted_plan, gemm2=replace(g2, split_k=split)))
    if 8 < per_expert <= 48:  # 32-row blocks with 16-row tails (~1-2 blocks per expert)
        for t in (G(32, 128, 64, ALL_M, 4, 4, 1, tail_m=16), G(32, 64, 128, ALL_M, 4, 4, 1, tail_m=16)):
            out.append(replace(sorted_plan, gemm1=t))
            out.append(replace(sorted_plan, gemm2=t))
    # the tile order of the tuned GEMMs: how many M-blocks share each N-block in turn (one expert's
    # rows stay in L2 while all its N-blocks read them: sweep_gemm.py --variants group, sixth session)
    if plan.path is not ExpertsPath.GROUPED_MM:
        for group in GROUPS:
            out.append(replace(plan, gemm1=replace(plan.gemm1, group_m=group)))
            out.append(replace(plan, gemm2=replace(plan.gemm2, group_m=group)))
        # the tiles expert by expert, so a group never mixes experts (thirteenth session: both GEMMs
        # so ordered took DeepSeek-V3 M = 8192's layer 1.5-3.3 % faster, ab_layer.py with a control)
        if per_expert > 32:
            eo1 = replace(plan.gemm1, expert_order=1, group_m=ALL_M)
            eo2 = replace(plan.gemm2, expert_order=1, group_m=ALL_M)
            out += [replace(plan, gemm1=eo1), replace(plan, gemm2=eo2), replace(plan, gemm1=eo1, gemm2=eo2)]
    return list(dict.fromkeys(out))


def refine_point(shape: Shape, m: int, weights: ExpertWeights, reps: int, log: list, current: Plan,
                 session: int) -> tuple[float, Plan]:
    """Time the current plan and its variants in one run; GEMM1 variants first (GEMM2 fixed),
    then GEMM2 variants with the best GEMM1 (and its pre-gather choice)."""
    calls = problem(shape, m, weights)
    ref = reference_output(calls, weights, shape, m)
    per_expert = m * shape.top_k / shape.num_experts
    timed = {current: time_plan(current, calls, weights, reps, ref)}
    if current.path is ExpertsPath.PAIRS:  # a decode batch: the one-kernel path's plans too
        for plan in decode_candidates():
            timed[plan] = time_plan(plan, calls, weights, reps, ref)
    variants = refine_variants(current, per_expert)
    first = [v for v in variants if v.gemm2 == variants[0].gemm2]
    for plan in first:
        if plan not in timed:
            timed[plan] = time_plan(plan, calls, weights, reps, ref)
    # GEMM1 of the current plan's kind (a decode plan's blocks mean other things than a GEMM's)
    kind = current.path is ExpertsPath.DECODE
    best1 = min((p for p in timed if p.path is not ExpertsPath.GROUPED_MM and (p.path is ExpertsPath.DECODE) == kind),
                key=timed.get)
    for plan in variants:
        if plan.gemm2 != variants[0].gemm2:
            plan = replace(plan, gemm1=best1.gemm1, pre_gather=best1.pre_gather, path=best1.path)
            if plan not in timed:
                timed[plan] = time_plan(plan, calls, weights, reps, ref)
    for plan, us in timed.items():
        log.append(dict(plan.to_dict(), shape=shape.name, M=m, us=us, session=session, current=plan == current))
    best = min(timed, key=timed.get)
    print(f"  {shape.name} M={m}: current {timed[current]:.1f} us -> best {timed[best]:.1f} us "
          f"{best.path.value} pre_gather={best.pre_gather} g1={best.gemm1} g2={best.gemm2}", flush=True)
    return timed[best], best


def custom_shape(spec: str) -> Shape:
    """``"E,top_k,H,I"`` -> a shape with softmax top-k routing (renormalised), named by its sizes."""
    try:
        e, k, h, i = parse_shape(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--{exc}") from None
    return Shape(f"E{e}_k{k}_H{h}_I{i}", e, k, h, i, dict(routing_method="softmax", renormalize=True))


def hf_layout_weights(shape: Shape) -> ExpertWeights:
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=torch.bfloat16) * h ** -0.5).transpose(1, 2)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen, dtype=torch.bfloat16) * i ** -0.5).transpose(1, 2)
    return ExpertWeights(w13, w2)


def write_table(path: Path, table: dict) -> None:
    """A tuned-plans file: token counts in order, notes last."""
    path.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: (
        kv[0].startswith("_"), int(kv[0]) if kv[0].isdigit() else 0))), indent=1))


def tune_shapes(shapes, ms, out: Path, *, reps: int = 10, budget_s: float = 1e9, refine: bool = False,
                session: int = 0, log_path: str | None = None, writer: str = "python -m moe_compile tune") -> list:
    """Tune (or, with ``refine``, refine) every shape at every token count; write each shape's
    tuned file in ``out`` after each point. Returns the timing log."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log: list = []
    for shape in shapes:
        weights = hf_layout_weights(shape)
        path = out / config_file_name(shape.num_experts, shape.hidden, shape.inter, torch.bfloat16,
                                      device_key(torch.device("cuda")))
        table = json.loads(path.read_text()) if path.exists() else {}
        read = (merged_raw(path.name) or ({}, {}))[0]  # what the backend reads for this shape now
        for m in ms:
            if time.perf_counter() - start > budget_s:
                print(f"  budget spent: {shape.name} M={m} not tuned", flush=True)
                continue
            current = table.get(str(m)) or read.get(str(m))
            if refine and current:
                us, plan = refine_point(shape, m, weights, reps, log, Plan.from_dict(current), session)
            else:  # a full search, then its best plan's variants (persistent, pre-gather, tails)
                _, plan = tune_point(shape, m, weights, reps, log)
                us, plan = refine_point(shape, m, weights, reps, log, plan, session)
            table[str(m)] = dict(plan.to_dict(), us=round(us, 1))
            table["_note"] = f"written by {writer} on {torch.cuda.get_device_name()}, torch {torch.__version__}"
            table["_top_k"] = shape.top_k  # rows per expert, for shapes that borrow these plans
            write_table(path, table)  # after each point, so a run cut short keeps what it measured
            if log_path:
                Path(log_path).write_text(json.dumps(log, indent=0))
        print("wrote", path, flush=True)
        del weights
        torch.cuda.empty_cache()
    print(f"tuning took {time.perf_counter() - start:.0f} s")
    return log


def out_dir_problem(out: Path) -> str | None:
    """Why the tuned files could not be written to ``out`` (``None`` when they can), found before any
    GPU time is spent rather than after the first point."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as exc:
        return (f"cannot write tuned files to --out {str(out)!r} ({type(exc).__name__}: {exc}); pass --out DIR, "
                f"and set MOE_COMPILE_CONFIG_DIR=DIR so the backend reads it first")
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The tuner's options other than which shapes (``--shape`` here; the benchmark adds ``--shapes``)."""
    parser.add_argument("--shape", action="append", type=custom_shape, default=[],
                        help="a shape, E,top_k,H,I (experts, top-k, hidden, expert intermediate size; softmax "
                             "top-k routing); repeatable")
    parser.add_argument("--ms", nargs="+", type=int, default=list(MS), help="token counts to tune")
    parser.add_argument("--out", default=str(config_dirs()[0]),
                        help="where the tuned files go (default: $MOE_COMPILE_CONFIG_DIR if set, else the shipped "
                             "configs directory)")
    parser.add_argument("--log", default=None, help="where to write every timing (JSON)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting new points after this")
    parser.add_argument("--refine", action="store_true",
                        help="start from each point's tuned plan (in --out, else the one the backend reads) and "
                             "time its variants (persistent, pre-gathered, neighbouring tiles) side by side with it; "
                             "keep the fastest")
    parser.add_argument("--session", type=int, default=0, help="(refine) a tag for the log rows")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_compile tune", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.shape:
        parser.error("give at least one --shape E,top_k,H,I")
    if bad := [m for m in args.ms if m < 1]:
        parser.error(f"--ms must be token counts >= 1, got {bad}")
    why = out_dir_problem(Path(args.out))
    if why:
        print(f"python -m moe_compile tune: {why}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("python -m moe_compile tune needs a CUDA device: it times the CUDA experts on it", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if Path(args.out).resolve() not in [d.resolve() for d in config_dirs()]:
        print(f"note: the backend reads tuned files from {', '.join(str(d) for d in config_dirs())}; set "
              f"MOE_COMPILE_CONFIG_DIR={args.out} for it to use these", flush=True)
    tune_shapes(args.shape, args.ms, Path(args.out), reps=args.reps, budget_s=args.budget_s, refine=args.refine,
                session=args.session, log_path=args.log)
    return 0
