"""Run one PrepareAndFinalize x experts combination against the per-token reference.

    python -m moe_compile.tools.check --pf-type StandardPrepareAndFinalize --experts-type GroupedExperts \
        -m 1 33 --topk 1 4 --dtype bf16

Prints one PASS/FAIL line per (M, topk[, apply_router_weight_on_input]) with the max error. Exit
status: 0 all passed, 1 a case failed, 2 bad usage (unknown type, incompatible pair, a ``--device``
this machine does not have, or a pair that cannot run on this machine; the reason is printed).
``--list`` prints the registered types.
"""
from __future__ import annotations

import argparse
import sys

from moe_compile.modular import registry
from moe_compile.tools.harness import (
    DTYPES,
    add_problem_args,
    cases_from_args,
    check_problem_args,
    run_case,
    runnable_here,
)


def validate_pair(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Unknown names, incompatible or unrunnable pairs end the program through ``parser.error``."""
    try:
        registry.get_prepare_finalize(args.pf_type)
        registry.get_experts(args.experts_type)
    except ValueError as err:
        parser.error(str(err))
    ok, reason = registry.compatibility(args.pf_type, args.experts_type, dtype=DTYPES[args.dtype],
                                        expert_map=args.expert_map)
    if not ok:
        parser.error(f"incompatible pair: {reason}")
    ok, reason = runnable_here(args.pf_type, args.experts_type, args.device)
    if not ok:
        parser.error(f"cannot run here: {reason}")


def list_types() -> str:
    return ("PrepareAndFinalize types: " + ", ".join(registry.prepare_finalize_names()) + "\n"
            "experts types: " + ", ".join(registry.experts_names()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--list" in argv:
        print(list_types())
        return 0
    parser = argparse.ArgumentParser(prog="python -m moe_compile.tools.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_args(parser)
    parser.add_argument("--list", action="store_true", help="list the registered types and exit")
    args = parser.parse_args(argv)
    check_problem_args(parser, args)
    validate_pair(parser, args)
    failed = 0
    for case in cases_from_args(args):
        result = run_case(case)
        failed += not result.ok
        print(f"{'PASS' if result.ok else 'FAIL'} {case.pf_type} x {case.experts_type} m={case.m} "
              f"topk={case.topk} apply_router_weight_on_input={case.apply_router_weight_on_input} "
              f"dtype={args.dtype} device={case.device} expert_map={case.expert_map} "
              f"max_error={result.max_error:.3g} (tolerance {result.tolerance:.3g})")
    print(f"{'FAILED' if failed else 'OK'}: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
