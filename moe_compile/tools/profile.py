"""Write a torch.profiler trace (Chrome JSON) of one ModularKernel forward.

    python -m moe_compile.tools.profile --pf-type StandardPrepareAndFinalize \
        --experts-type GroupedExperts --trace-dir /tmp/mk_traces -m 64 --topk 4

Takes the problem flags of ``moe_compile.tools.check`` (the first ``-m`` and ``--topk`` value are
used), runs ``--warmup`` forwards, then profiles one (CPU activity, plus CUDA on a GPU, with
shapes and stacks) inside a ``ModularKernel.forward`` range and writes
``DIR/m{M}_topk{K}_{pf}_{experts}_trace.json``. Exit status 2 for unknown or incompatible types, a
``--device`` this machine does not have, or a ``--trace-dir`` that cannot be created or written.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from moe_compile.tools.check import validate_pair
from moe_compile.tools.harness import (
    add_problem_args,
    build_kernel,
    cases_from_args,
    check_problem_args,
    forward,
    make_problem,
)


def profile_case(case, trace_dir: str, warmup: int) -> str:
    problem = make_problem(case)
    kernel = build_kernel(case, problem)
    for _ in range(warmup):
        forward(kernel, case, problem)
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_cuda = torch.device(case.device).type == "cuda"
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        with torch.profiler.record_function("ModularKernel.forward"):
            forward(kernel, case, problem)
        if on_cuda:
            torch.cuda.synchronize()
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"m{case.m}_topk{case.topk}_{case.pf_type}_{case.experts_type}_trace.json")
    prof.export_chrome_trace(path)
    return path


def trace_dir_problem(trace_dir: str) -> str | None:
    """Why no trace can be written to ``trace_dir``, or None; creates it if missing.

    Asked before profiling (as the main CLI does for ``--dump-dir``) so that a bad path is a usage
    error at once, not a raw OSError after the warmup and the profiled forward have run.
    """
    try:
        os.makedirs(trace_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=trace_dir):
            pass
    except OSError as exc:
        return (f"cannot write the trace to --trace-dir {trace_dir!r} ({type(exc).__name__}: {exc}); "
                "expected a directory that exists or can be created, and is writable")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_compile.tools.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_args(parser)
    parser.add_argument("--trace-dir", required=True, help="directory for the Chrome trace JSON")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.m, args.topk = args.m[:1], args.topk[:1]
    check_problem_args(parser, args)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    validate_pair(parser, args)
    problem = trace_dir_problem(args.trace_dir)  # after the pair checks: a rejected pair creates no directory
    if problem:
        parser.error(problem)
    path = profile_case(cases_from_args(args)[0], args.trace_dir, args.warmup)
    print(f"trace written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
