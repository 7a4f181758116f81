"""One MoE layer on the CPU: our op (CPU lowering) and the block under ``backend="moe_npu"`` vs
the HF block eager and under torch.compile (inductor), side by side in one run; each compiled column
with ``dynamic=True`` (one graph for all token counts) and ``dynamic=False`` (a graph per count).

    OMP_NUM_THREADS=2 python benchmarks/bench_cpu_layer.py [--ms 1 4 32 256] [--dtype bfloat16] [--out DIR]

The HF block is transformers' Qwen3-MoE block (``experts_implementation="grouped_mm"``) at a
scaled-down Qwen3-30B-A3B shape (E=64, top-8, H=1024, I=384, fp32 or ``--dtype``), random weights. *Ours* is the
router linear + ``moe_compile.fused_moe`` called eagerly on transposed views of the block's own
weights; *moe_npu* is ``torch.compile(block, backend="moe_npu")``, what a user runs: with a fixed
token count of at most 2 top-k pairs per expert its experts compile into gather-GEMVs
(``moe_compile/lowering/cpu_decode.py``; ``cpu_decode_graphs`` counts the graphs that took it, so
far). Each rep calls the columns in turn, first one then the next, each on a new input (so the experts hit
change, as from one decode step to the next, and no call finds the one before it's experts in the
cache); times are wall-clock medians. Outputs are compared with the eager block.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 384, 64, 8


def build_block(dtype: torch.dtype = torch.float32):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return block.to(dtype)


def ours(block):
    from moe_compile import fused_moe

    w13, w2 = block.experts.gate_up_proj.transpose(1, 2), block.experts.down_proj.transpose(1, 2)

    def layer(x):
        logits = F.linear(x, block.gate.weight)
        return fused_moe(x, logits, EXPERTS, TOP_K, w13, w2, renormalize=True, lowering="cpu")
    return layer


def interleaved_ms(fns: dict, inputs: list, reps: int) -> dict:
    """Median ms of each function; every rep calls them all in turn on the rep's input."""
    for fn in fns.values():
        for x in inputs[:3]:
            fn(x)
    names = list(fns)
    times = {name: [] for name in names}
    calls = 0
    for rep in range(reps):
        # rotate who goes first: a call right after another one on the same input finds that
        # input's experts in the cache, so each column gets a fresh input and every position
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            x = inputs[calls % len(inputs)]
            calls += 1
            t0 = time.perf_counter()
            fns[name](x)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", nargs="+", type=int, default=[1, 4, 32, 256])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    block = build_block(dtype)

    def hf(x):
        out = block(x.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).squeeze(0)
    import moe_compile  # noqa: F401  (registers the backend)

    torch._dynamo.utils.counters.clear()
    # dynamic=True: one graph for every token count (the op's own CPU path); dynamic=False: a graph per
    # token count, where a fixed count of few tokens takes the gather-GEMV path (lowering/cpu_decode.py)
    fns = dict(ours=ours(block), moe_npu=torch.compile(hf, backend="moe_npu", dynamic=True),
               moe_npu_static=torch.compile(hf, backend="moe_npu", dynamic=False),
               hf_eager=hf, hf_inductor=torch.compile(hf, dynamic=True),
               hf_inductor_static=torch.compile(hf, dynamic=False))
    # the four compiled columns share hf's code object, so Dynamo counts all their graphs against one limit
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 8 * len(args.ms) + 8))
    rows = []
    names = list(fns)
    print(f"{'M':>5}" + "".join(f"{n + ' ms':>23}" for n in names) + f"{'eager/moe_npu_static':>22}"
          f"{'ind_static/moe_npu_static':>27}{'err':>9}")
    with torch.no_grad():
        for m in args.ms:
            gen = torch.Generator().manual_seed(m)
            inputs = [torch.randn(m, HIDDEN, generator=gen).to(dtype) for _ in range(17)]
            ref = hf(inputs[0])
            err = max(((fns[name](inputs[0]).float() - ref.float()).norm() / ref.float().norm()).item()
                      for name in ("ours", "moe_npu", "moe_npu_static"))
            ms = interleaved_ms(fns, inputs, args.reps)
            row = dict(M=m, **{f"{n}_ms": ms[n] for n in names}, rel_err=err,
                       cpu_decode_graphs=torch._dynamo.utils.counters["moe_compile"]["cpu_decode"])
            rows.append(row)
            print(f"{m:>5}" + "".join(f"{ms[n]:>23.3f}" for n in names)
                  + f"{ms['hf_eager'] / ms['moe_npu_static']:>22.2f}"
                  + f"{ms['hf_inductor_static'] / ms['moe_npu_static']:>27.2f}{err:>9.1e}", flush=True)
    if args.out:
        meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), dtype=args.dtype, shape=dict(
            hidden=HIDDEN, inter=INTER, experts=EXPERTS, top_k=TOP_K), argv=sys.argv)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "cpu_layer.json" if dtype == torch.float32 else f"cpu_layer_{args.dtype}.json"
        (Path(args.out) / name).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
