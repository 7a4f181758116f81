"""One expert GEMM per kernel, run once each, for ``ncu`` to read (a probe, not a benchmark).

    ncu --kernel-name regex:"moe_wgmma_gemm|_moe_gemm_kernel" --metrics ... \\
        python benchmarks/profile_gemm.py [--points mixtral:2048 ...] [--gemm 1|2]

Builds the point's routing as ``sweep_wgmma.py`` does, then launches the tuned Triton GEMM and the
CUDA kernel (persistent=2, tail, group_m=8) once each after a warm-up call of both.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import ALL_SHAPES, point  # noqa: E402
from gemm_split import stage_inputs  # noqa: E402
from tune_triton import hf_layout_weights, problem  # noqa: E402

from moe_compile.kernels.cuda import wgmma  # noqa: E402
from moe_compile.kernels.triton.experts import plan_for  # noqa: E402
from moe_compile.kernels.triton.gemm import moe_gemm  # noqa: E402
from moe_compile.ops.config import ExpertsConfig  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", type=point, default=[("mixtral", 2048)])
    parser.add_argument("--gemm", type=int, default=1, choices=(1, 2))
    args = parser.parse_args(argv)
    for name, m in args.points:
        shape = ALL_SHAPES[name]
        weights = hf_layout_weights(shape)
        calls = problem(shape, m, weights)
        plan = plan_for(calls[0][0], shape.top_k, weights)
        s = stage_inputs(shape, m, calls[:1])[0]
        pairs = m * shape.top_k
        table = wgmma.block_table(s["al"].counts, pairs)
        common = dict(topk_ids=s["ids"], top_k=shape.top_k, counts=s["al"].counts, sorted_pair=s["al"].sorted_pair)

        def triton_gemm():
            if args.gemm == 1:
                moe_gemm(s["al"].x_sorted, weights.w13, s["act"], experts=ExpertsConfig(), gather_a=False,
                         config=plan.gemm1, **common)
            else:
                moe_gemm(s["act"], weights.w2, s["y"], gather_a=False, config=plan.gemm2, **common)

        def cuda_gemm():
            if args.gemm == 1:
                wgmma.wgmma_gemm(s["al"].x_sorted, weights.w13, s["act"], *table, gated=True)
            else:
                wgmma.wgmma_gemm(s["act"], weights.w2, s["y"], *table, gated=False)

        for fn in (triton_gemm, cuda_gemm, triton_gemm, cuda_gemm):
            fn()
        torch.cuda.synchronize()
        print(f"{name}:{m} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
