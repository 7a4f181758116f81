"""fp32 router logits from bf16 activations: our tensor-core kernel vs cast + cuBLAS fp32, per token count.

    python benchmarks/bench_router.py [--tokens 17 32 ...] [--out benchmarks/results]

DeepSeek-V3's router shape (E = 256, H = 7168), fp32 and bf16 stored weights. For each token count
T: the CUDA-graph time of ``F.linear(x.float(), w.float())`` (what the model computes: a cast and
cuBLAS's fp32 GEMM) and of ``router._gemm`` (the tensor-core kernel, H split into ranges at small
T, see ``router.h_splits``), each over ``ROTATE`` inputs, and both errors against fp64 (largest
error / largest logit). Its first run set the kernel to run from 17 tokens; writes ``router.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import ROTATE, graph_time_us  # noqa: E402

from moe_compile.kernels.triton import router  # noqa: E402
from moe_compile.kernels.triton.gemm import num_programs  # noqa: E402


def rel_err(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = F.linear(x.double(), w.double())
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[17, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'w':<6}{'T':>6}{'splits':>8}{'cuBLAS us':>11}{'ours us':>9}{'ratio':>7}{'cuBLAS err':>12}{'ours err':>10}")
    for wdtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(args.experts, args.hidden, device="cuda", generator=gen) * args.hidden ** -0.5).to(wdtype)
        for t in args.tokens:
            xs = [torch.randn(t, args.hidden, device="cuda", generator=gen).bfloat16() for _ in range(ROTATE)]
            outs = [torch.empty(t, args.experts, device="cuda") for _ in range(ROTATE)]
            inputs = list(range(ROTATE))
            cublas_us = graph_time_us(lambda i: F.linear(xs[i].float(), w.float()), inputs, args.reps)
            ours_us = graph_time_us(lambda i: router._gemm(xs[i], w, None, outs[i]), inputs, args.reps)
            got = router._gemm(xs[0], w, None, torch.empty(t, args.experts, device="cuda"))
            splits = router.h_splits(t, args.experts, args.hidden, num_programs(xs[0].device))[2]
            row = dict(wdtype=str(wdtype).split(".")[-1], tokens=t, splits=splits, cublas_us=cublas_us, ours_us=ours_us,
                       cublas_err=rel_err(F.linear(xs[0].float(), w.float()), xs[0], w), ours_err=rel_err(got, xs[0], w))
            rows.append(row)
            print(f"{row['wdtype']:<6}{t:>6}{splits:>8}{cublas_us:>11.1f}{ours_us:>9.1f}{ours_us / cublas_us:>7.2f}"
                  f"{row['cublas_err']:>12.1e}{row['ours_err']:>10.1e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "router.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                     rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
