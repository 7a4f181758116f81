"""One MoE layer on the CPU: our op (CPU lowering) vs the HF block eager vs the HF block under
torch.compile (inductor), side by side in one run.

    OMP_NUM_THREADS=2 python benchmarks/bench_cpu_layer.py [--ms 1 32 256] [--out benchmarks/results]

The HF block is transformers' Qwen3-MoE block (``experts_implementation="grouped_mm"``) at a
scaled-down Qwen3-30B-A3B shape (E=64, top-8, H=1024, I=384, fp32), random weights. *Ours* is the
router linear + ``moe_compile.fused_moe`` on transposed views of the block's own weights (what the
rewritten graph runs). Times are wall-clock medians; outputs are compared with the eager block.
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


def build_block():
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
    return block


def ours(block):
    from moe_compile import fused_moe

    w13, w2 = block.experts.gate_up_proj.transpose(1, 2), block.experts.down_proj.transpose(1, 2)

    def layer(x):
        logits = F.linear(x, block.gate.weight)
        return fused_moe(x, logits, EXPERTS, TOP_K, w13, w2, renormalize=True, lowering="cpu")
    return layer


def median_ms(fn, x, reps: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", nargs="+", type=int, default=[1, 32, 256])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    block = build_block()

    def hf(x):
        out = block(x.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).squeeze(0)
    compiled = torch.compile(hf, dynamic=True)
    mine = ours(block)
    rows = []
    print(f"{'M':>6}{'ours ms':>10}{'HF eager ms':>13}{'HF inductor ms':>16}{'eager/ours':>12}{'ind./ours':>11}"
          f"{'err':>10}")
    with torch.no_grad():
        for m in args.ms:
            x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(m))
            ref = hf(x)
            err = ((mine(x) - ref).norm() / ref.norm()).item()
            row = dict(M=m, ours_ms=median_ms(mine, x, args.reps), hf_eager_ms=median_ms(hf, x, args.reps),
                       hf_inductor_ms=median_ms(compiled, x, args.reps), rel_err=err)
            rows.append(row)
            print(f"{m:>6}{row['ours_ms']:>10.3f}{row['hf_eager_ms']:>13.3f}{row['hf_inductor_ms']:>16.3f}"
                  f"{row['hf_eager_ms'] / row['ours_ms']:>12.2f}{row['hf_inductor_ms'] / row['ours_ms']:>11.2f}"
                  f"{err:>10.1e}", flush=True)
    if args.out:
        meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), shape=dict(
            hidden=HIDDEN, inter=INTER, experts=EXPERTS, top_k=TOP_K), argv=sys.argv)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu_layer.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
