"""Each stage of the sorted experts path timed on its own, with the alternatives per GEMM (CUDA).

    python benchmarks/gemm_split.py [--points mixtral:2048 qwen3:8192 ...] [--out DIR]

For each ``shape:M`` point (routing of random logits, as ``tune_triton.py`` does; CUDA graph over
``ROTATE`` routings, so weights come from HBM), the per-call GPU time of:

- ``align``: count + scatter (+ the row gather when the tuned plan pre-gathers);
- ``gemm1 triton``: the tuned plan's first GEMM (activation fused), ``gemm1 grouped_mm``:
  ``torch._grouped_mm`` on the gathered rows followed by the activation pass (``gemm1 act``
  is that pass alone);
- ``gemm2 triton`` / ``gemm2 grouped_mm``: the second GEMM on the expert-ordered activations;
- ``combine``;
- ``gemm1 wgmma`` / ``gemm2 wgmma``: the hand-written Hopper kernel (``moe_compile/kernels/cuda``),
  the first one with its block-table launch;
- ``dense``: cuBLAS doing each GEMM's size as one dense GEMM (``[P, H] @ [H, 2I]``, ``[P, I] @ [I, H]``);
- each GEMM's bound: max(its weight bytes / 4.8 TB/s, its FLOPs / 790 TFLOP/s);
- first, what HBM bandwidth the GPU reaches at all: a 1.2 GB bf16 copy and a 1.2 GB sum
  (``hbm_probe``), the floor under every memory-bound point.

This says which GEMM is where against the bound, and whether CUTLASS's grouped GEMM beats ours
for one of the two GEMMs (the ``grouped_gemm2`` plan option runs the second GEMM there).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import BF16_FLOP_PER_S, HBM_BYTES_PER_S, ALL_SHAPES, graph_time_us, point, write_json  # noqa: E402
from tune_triton import hf_layout_weights, problem  # noqa: E402

from moe_compile.kernels.cuda import wgmma  # noqa: E402
from moe_compile.kernels.triton.activation import activation  # noqa: E402
from moe_compile.kernels.triton.align import align  # noqa: E402
from moe_compile.kernels.triton.combine import combine  # noqa: E402
from moe_compile.kernels.triton.experts import plan_for  # noqa: E402
from moe_compile.kernels.triton.gemm import moe_gemm  # noqa: E402
from moe_compile.ops.config import ExpertsConfig  # noqa: E402


LARGE_POINTS = [(s, m) for s in ("mixtral", "qwen3", "deepseek_v3") for m in (2048, 8192)]


def hbm_probe(nbytes: float = 1.2e9, reps: int = 20) -> dict:
    """TB/s of a ``nbytes`` bf16 copy (read + write counted) and sum (read): CUDA events, the mean
    of ``reps`` calls after three warm-up calls."""
    x = torch.empty(int(nbytes) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    out = {}
    for name, fn, moved in (("copy", lambda: y.copy_(x), 2 * nbytes), ("sum", lambda: x.sum(), nbytes)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        sec = start.elapsed_time(end) / reps * 1e-3
        out[name] = {"us": sec * 1e6, "tb_per_s": moved / sec / 1e12}
        print(f"  HBM {name}: {sec * 1e6:.1f} us, {moved / sec / 1e12:.2f} TB/s", flush=True)
    del x, y
    torch.cuda.empty_cache()
    return out


def stage_inputs(shape, m: int, calls) -> list[dict]:
    """Per routing: its alignment (with gathered rows) and the buffers each stage reads and writes."""
    pairs = m * shape.top_k
    st = []
    for x, w, ids in calls:
        al = align(ids, shape.num_experts, x=x)
        st.append(dict(x=x, w=w, ids=ids, al=al, act=torch.empty(pairs, shape.inter, dtype=x.dtype, device="cuda"),
                       y=torch.empty(pairs, shape.hidden, dtype=x.dtype, device="cuda"),
                       out=torch.empty(m, shape.hidden, dtype=x.dtype, device="cuda")))
    return st


def split(name: str, m: int, reps: int) -> dict:
    shape = ALL_SHAPES[name]
    weights = hf_layout_weights(shape)
    calls = problem(shape, m, weights)
    plan = plan_for(calls[0][0], shape.top_k, weights)
    cfg = ExpertsConfig()
    k, h, i = shape.top_k, shape.hidden, shape.inter
    pairs = m * k
    st = stage_inputs(shape, m, calls)
    common = dict(top_k=k, expert_map=None)

    def gemm1_triton(s):
        a1 = s["al"].x_sorted if plan.pre_gather else s["x"]
        moe_gemm(a1, weights.w13, s["act"], topk_ids=s["ids"], counts=s["al"].counts,
                 sorted_pair=s["al"].sorted_pair, experts=cfg, gather_a=not plan.pre_gather, config=plan.gemm1,
                 **common)

    def gemm1_grouped(s):
        hh = torch._grouped_mm(s["al"].x_sorted, weights.w13, offs=s["al"].offsets)
        activation(hh, cfg)

    h_full = torch.empty(pairs, 2 * i, dtype=torch.bfloat16, device="cuda")

    def gemm1_act(s):
        activation(h_full, cfg)

    def gemm2_triton(s):
        moe_gemm(s["act"], weights.w2, s["y"], topk_ids=s["ids"], counts=s["al"].counts,
                 sorted_pair=s["al"].sorted_pair, gather_a=False, config=plan.gemm2, **common)

    def gemm1_wgmma(s):  # the block table is built here, once per layer call
        s["table"] = wgmma.block_table(s["al"].counts, pairs)
        wgmma.wgmma_gemm(s["al"].x_sorted, weights.w13, s["act"], *s["table"], gated=True)

    def gemm2_wgmma(s):
        if "table" not in s:
            s["table"] = wgmma.block_table(s["al"].counts, pairs)
        wgmma.wgmma_gemm(s["act"], weights.w2, s["y"], *s["table"], gated=False)

    def gemm2_grouped(s):
        torch._grouped_mm(s["act"], weights.w2, offs=s["al"].offsets)

    def align_only(s):
        align(s["ids"], shape.num_experts, x=s["x"] if plan.pre_gather else None)

    def combine_only(s):
        combine(s["y"], s["w"], s["out"], pos=s["al"].pos)

    a_dense = torch.randn(pairs, h, device="cuda").bfloat16()
    w1_dense = weights.w13[0].new_empty(h, 2 * i).normal_()
    act_dense = torch.randn(pairs, i, device="cuda").bfloat16()
    w2_dense = weights.w2[0].new_empty(i, h).normal_()
    stages = {
        "align": align_only, "gemm1 triton": gemm1_triton, "gemm1 grouped_mm": gemm1_grouped,
        "gemm1 act": gemm1_act, "gemm2 triton": gemm2_triton, "gemm2 grouped_mm": gemm2_grouped,
        "combine": combine_only,
        **({"gemm1 wgmma": gemm1_wgmma, "gemm2 wgmma": gemm2_wgmma} if wgmma.available(weights.w13.device) else {}),
        "gemm1 dense": lambda s: torch.mm(a_dense, w1_dense), "gemm2 dense": lambda s: torch.mm(act_dense, w2_dense),
    }
    hits = sum(torch.unique(ids).numel() for _, _, ids in calls) / len(calls)
    row = {"shape": name, "M": m, "plan": plan.to_dict(), "experts_hit": hits}
    for gemm, n_w in (("gemm1", 2 * h * i), ("gemm2", h * i)):
        row[f"{gemm} bound"] = max(hits * n_w * 2 / HBM_BYTES_PER_S, 2 * pairs * n_w / BF16_FLOP_PER_S) * 1e6
    for key, fn in stages.items():
        try:
            row[key] = graph_time_us(fn, st, reps)
        except Exception as exc:  # e.g. no _grouped_mm in this torch
            row[key] = None
            print(f"  {key}: {type(exc).__name__}: {str(exc)[:100]}")
    print(f"\n{name} M={m} plan {plan.to_dict()}")
    for key in stages:
        v = row[key]
        bound = row.get(f"{key.split()[0]} bound")
        ratio = f"  {v / bound:5.2f}x its bound" if v and bound and "act" not in key else ""
        print(f"  {key:18s} {v if v is None else round(v, 1)!s:>9} us{ratio}")
    del weights, calls, st
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=point, default=LARGE_POINTS)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None, help="directory for gemm_split.json")
    args = parser.parse_args(argv)
    result = {"hbm_probe": hbm_probe(),
              "rows": [split(name, m, args.reps) for name, m in args.points]}
    write_json(args.out, "gemm_split.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
