"""Four gloo ranks, one spawn: every mode against the single-process reference, and EP on two
independent size-2 subgroups (EP x DP) whose ranks hold different tokens."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from dist_cases import CASES, SUB_CASES, run_case
from dist_harness import failures, run_cases, run_workers


def _worker(rank: int, world_size: int) -> dict:
    report = run_cases(CASES, run_case)
    subgroup, _ = dist.new_subgroups(2)
    report.update(run_cases(SUB_CASES, lambda c: run_case(c, subgroup, subgroup_index=rank // 2)))
    return report


@pytest.mark.distributed
def test_four_ranks():
    reports = run_workers(_worker, 4)
    bad = failures(reports)
    assert not bad, f"{len(bad)} failing (rank, case):\n" + "\n".join(bad)
    expected = {c.id for c in CASES} | {c.id for c in SUB_CASES}
    assert all(set(rep) == expected for rep in reports), [sorted(rep) for rep in reports]
