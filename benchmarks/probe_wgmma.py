"""Where does the CUDA expert GEMM lose to the tuned Triton one? (a probe, not a product)

    python benchmarks/probe_wgmma.py

Mixtral's first GEMM (K = 4096, gated, I = 14336) over 4096 rows, three ways of splitting the rows
among experts: one expert holding all of them, 8 experts of 512 rows (whole 128-row blocks), and
8 experts of random sizes (Mixtral M = 2048 routing). For each, the Triton GEMM with the tuned
plan's config and the CUDA kernel's variants (``NO_TAIL``: compiled without the 64-row tail
tiles), ``do_bench`` medians, useful TFLOP/s. (Run 10/11 of the seventh session also timed a
``SPLIT_N`` build, two m64n128 MMAs per k-step instead of one m64n256: no gain, removed.)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent.parent))

from moe_compile.kernels.cuda import wgmma  # noqa: E402
from moe_compile.kernels.triton.gemm import GemmConfig, moe_gemm  # noqa: E402
from moe_compile.ops.config import ExpertsConfig  # noqa: E402

K, INTER, ROWS = 4096, 14336, 4096
TRITON_CFG = GemmConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, tma=1, tail_m=32)
CUDA_VARIANTS = [dict(persistent=2, group_m=8), dict(persistent=0, group_m=8),
                 dict(persistent=2, group_m=8, tail=False, defines=("NO_TAIL",)),
                 dict(persistent=0, group_m=8, cluster=2), dict(persistent=1, group_m=8, cluster=2),
                 dict(persistent=0, group_m=8, cluster=4)]


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    splits = {"1 expert": [ROWS], "8 x 512": [512] * 8,
              "8 random": torch.bincount(torch.randint(0, 8, (ROWS,), generator=gen), minlength=8).tolist()}
    w_all = (torch.randn(8, 2 * INTER, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5).transpose(1, 2)
    a = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(ROWS, INTER, device="cuda", dtype=torch.bfloat16)
    ref = torch.empty_like(out)
    flop = 2 * ROWS * K * 2 * INTER
    for name, counts in splits.items():
        w = w_all[:len(counts)]
        c = torch.tensor(counts, dtype=torch.int32, device="cuda")
        ids = torch.zeros(ROWS, 1, dtype=torch.int32, device="cuda")
        blocks, live = wgmma.block_table(c, ROWS)

        def tri():
            moe_gemm(a, w, ref, topk_ids=ids, top_k=1, counts=c, sorted_pair=None, experts=ExpertsConfig(),
                     gather_a=False, config=TRITON_CFG)
        tri()
        t = triton.testing.do_bench(tri, warmup=25, rep=200, return_mode="median")
        print(f"{name} {counts}: triton {t * 1e3:.1f} us ({flop / t / 1e9:.0f} TFLOP/s)", flush=True)
        for var in CUDA_VARIANTS:
            def cud(var=var):
                wgmma.wgmma_gemm(a, w, out, blocks, live, gated=True, **var)
            cud()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t = triton.testing.do_bench(cud, warmup=25, rep=200, return_mode="median")
            print(f"   cuda {var}: {t * 1e3:.1f} us ({flop / t / 1e9:.0f} TFLOP/s) err {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
