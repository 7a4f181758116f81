"""The small kernels around the expert GEMMs, timed side by side (CUDA graphs, one run).

    python benchmarks/bench_align_combine.py [--out benchmarks/results]

- **align**: the launch methods (``sort``, ``blocks``, ``two_launch``: see
  ``kernels/triton/align.py``), for the pair counts ``P`` of the issue's shapes (Mixtral top-2 /
  E=8, Qwen3 top-8 / E=128, DeepSeek-V3 top-8 / E=256), each where it can take them. Sets
  ``align.SORT_MAX_PAIRS`` and which sizes take ``blocks``.
- **combine**: every ``(BLOCK_T, BLOCK_H, num_warps)`` candidate for each ``(T, H, k)`` of the
  issue's points, against the current ``combine_blocks`` rule and the bytes it must move
  (``T*k*H`` reads + ``T*H`` writes, bf16) at 4.8 TB/s. Sets ``combine.combine_blocks``.

Each timing is the median of ``--reps`` replays of a graph over ``ROTATE`` inputs (so no input
sits in L2 from the call before). Writes ``align_combine.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import HBM_BYTES_PER_S, MS, ROTATE, SHAPES, graph_time_us, write_json  # noqa: E402

from moe_compile.kernels.triton.align import METHODS, align, align_method  # noqa: E402
from moe_compile.kernels.triton.combine import combine, combine_blocks  # noqa: E402

COMBINE_CANDIDATES = [(bt, bh, w) for bt in (1, 2, 4, 8) for bh in (256, 512, 1024, 2048) for w in (4, 8)
                      if bt * bh <= 8192]


def _ids(m: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(m, num_experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.int()


def bench_align(reps: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in SHAPES.values():
        for m in MS:
            pairs = m * shape.top_k
            if pairs > 4 * 4096:
                continue
            ids = [_ids(m, shape.num_experts, shape.top_k, gen) for _ in range(ROTATE)]
            row = {"shape": shape.name, "M": m, "pairs": pairs}
            for method in METHODS:
                if method == "sort" and pairs > 4096:
                    continue
                if method == "blocks" and align_method(pairs, False, shape.num_experts) == "two_launch":
                    continue  # its count table would not fit (align.BLOCKS_MAX_TABLE)
                row[f"{method}_us"] = graph_time_us(lambda i: align(i, shape.num_experts, method=method), ids, reps)
            print(f"  align {shape.name:12s} M={m:5d} P={pairs:6d}: " + ", ".join(
                f"{k[:-3]} {v:6.1f} us" for k, v in row.items() if k.endswith("_us")), flush=True)
            rows.append(row)
    return rows


def bench_combine(reps: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for shape in SHAPES.values():
        for m in MS:
            k, h = shape.top_k, shape.hidden
            calls = []
            for _ in range(ROTATE):
                y = torch.randn(m * k, h, device="cuda", generator=gen).bfloat16()
                w = torch.rand(m, k, device="cuda", generator=gen)
                pos = torch.randperm(m * k, device="cuda", generator=gen).int()
                calls.append((y, w, pos, torch.empty(m, h, dtype=torch.bfloat16, device="cuda")))
            bytes_moved = (m * k + m) * h * 2
            row = {"shape": shape.name, "M": m, "T": m, "H": h, "k": k,
                   "bound_us": bytes_moved / HBM_BYTES_PER_S * 1e6, "rule": list(combine_blocks(h))}
            times = {}
            for cand in dict.fromkeys([combine_blocks(h)] + COMBINE_CANDIDATES):
                def fn(c, cand=cand):
                    combine(c[0], c[1], c[3], pos=c[2], blocks=cand)
                times[cand] = graph_time_us(fn, calls, reps)
            best = min(times, key=times.get)
            row.update(rule_us=times[combine_blocks(h)], best=list(best), best_us=times[best],
                       all={f"{bt}x{bh}x{w}": t for (bt, bh, w), t in times.items()})
            print(f"  combine {shape.name:12s} T={m:5d} H={h} k={k}: rule {row['rule']} {row['rule_us']:7.1f} us, "
                  f"best {row['best']} {row['best_us']:7.1f} us, bytes/4.8TB/s {row['bound_us']:7.1f} us", flush=True)
            rows.append(row)
            del calls
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None, help="directory for align_combine.json")
    parser.add_argument("--only", choices=["align", "combine"], default=None)
    args = parser.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.only in (None, "align"):
        result["align"] = bench_align(args.reps)
    if args.only in (None, "combine"):
        result["combine"] = bench_combine(args.reps)
    write_json(args.out, "align_combine.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
