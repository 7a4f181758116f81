"""Tune the CUDA experts per shape: path (pairs / decode / sorted / grouped_mm) and Triton block sizes.

    python benchmarks/tune_triton.py [--shapes mixtral qwen3 deepseek_v3] [--ms 1 32 256 2048 8192]
        [--out moe_compile/kernels/triton/configs] [--budget-s 400] [--log tune_log.json]
    python benchmarks/tune_triton.py --refine --session 4 --reps 5 --shapes qwen3 --ms 256 2048
    python benchmarks/tune_triton.py --shape 128,8,4096,1536      # your model: E,top_k,H,I

The tuner is ``moe_compile.tools.tune`` (``python -m moe_compile tune --shape E,top_k,H,I`` from an
installed package; its module doc says what it times and keeps). This script adds the issue's named
shapes (``--shapes``, with their own routings: DeepSeek-V3's grouped sigmoid with a bias) and is
what wrote the shipped tuned files. The benchmarks import the tuner's pieces from here.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from bench_moe_layer import SHAPES, cuda_or_say  # noqa: E402

from moe_compile.tools.tune import (  # noqa: E402,F401  (re-exported for the benchmarks)
    ALL_M, MAX_REL_ERR, MS, Shape, add_arguments, candidates, custom_shape, decode_candidates, hf_layout_weights,
    problem, reference_output, refine_point, refine_variants, routing_config, time_plan, tune_point, tune_shapes,
    with_tma, write_table,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES))
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not cuda_or_say("tune_triton"):
        return 2
    shapes = [SHAPES[name] for name in (args.shapes if args.shapes is not None else ([] if args.shape else SHAPES))]
    tune_shapes(shapes + args.shape, args.ms, Path(args.out), reps=args.reps, budget_s=args.budget_s,
                refine=args.refine, session=args.session, log_path=args.log, writer="benchmarks/tune_triton.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
