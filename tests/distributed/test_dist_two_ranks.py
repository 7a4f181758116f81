"""Two gloo ranks, one spawn: every mode against the single-process reference, the error cases,
and the compiled checks (one op node per block under ``fullgraph=True``, a tiny Mixtral run
expert-parallel), the distributed PFs built through the modular registry, and which modes wait for the host. Spawning is the slow part (seconds per rank), so one worker runs everything
and a failure lists each failing case with its rank and traceback.
"""
from __future__ import annotations

import traceback
import warnings

import pytest

from dist_cases import CASES, REGISTRY_CASES, Case, host_syncs, registry_report, run_case, triton_batched_case
from dist_harness import failures, run_cases, run_workers

from moe_compile.kernels.triton import interpreter_problem

# batched and static never wait for the host (graph-capturable); dynamic waits once, for its splits
SYNC_CASES = [(Case("batched", "ep", "batched"), []), (Case("batched-sharded", "ep", "batched", tokens_full=False), []),
              (Case("static", "ep", "static"), []), (Case("static-sharded", "ep", "static", tokens_full=False), []),
              (Case("dynamic", "ep", "dynamic"), ["tolist"])]


def _worker(rank: int, world_size: int) -> dict:
    from dist_compiled import compile_report
    from dist_errors import error_report

    report = run_cases(CASES, run_case)
    report.update(registry_report(REGISTRY_CASES))
    if not interpreter_problem():  # (the test warns when it cannot run)
        try:  # the batched Triton experts behind the EP batched all-to-all (Triton's interpreter on CPU)
            triton_batched_case()
            report["triton-batched-experts"] = None
        except Exception:  # noqa: BLE001
            report["triton-batched-experts"] = traceback.format_exc(limit=6)
    for case, expected in SYNC_CASES:
        try:
            seen = host_syncs(case)
            report[f"host-syncs-{case.id}"] = None if seen == expected else f"host syncs {seen}, expected {expected}"
        except Exception:  # noqa: BLE001
            report[f"host-syncs-{case.id}"] = traceback.format_exc(limit=6)
    report.update(compile_report(rank))
    report.update(error_report(rank))  # last: its timeout case leaves a subgroup unusable
    return report


@pytest.mark.distributed
def test_two_ranks(monkeypatch):
    pytest.importorskip("transformers")
    from dist_compiled import BACKEND_CASE

    # the gloo ranks hold CPU tensors, so their Triton kernels run under the interpreter even
    # where a GPU is present (the spawned workers read the flag before they import triton)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    problem = interpreter_problem()
    if problem:
        warnings.warn(f"the batched Triton experts case is not run: {problem}", stacklevel=1)
    reports = run_workers(_worker, 2)
    backend = [rep.pop(BACKEND_CASE, "not run") for rep in reports]
    bad = failures(reports)
    assert not bad, f"{len(bad)} failing (rank, case):\n" + "\n".join(bad)
    assert all(len(rep) >= len(CASES) + 20 for rep in reports), [sorted(rep) for rep in reports]
    if any(b is not None for b in backend):
        raise AssertionError("backend='moe_npu' ep_group run failed:\n" + "\n".join(map(str, backend)))
