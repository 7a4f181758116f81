"""Two GPUs, NCCL, one process per GPU: the two-rank suite with the CUDA lowering (issue 7).

Every case of ``test_dist_two_ranks`` (TP, EP static/dynamic/batched, tokens_full True/False,
dtypes, activations, routing modes, the registry-built kernels, the host-sync audit, the compiled
and ``backend="moe_npu"`` runs, the error cases) runs with its tensors on the rank's GPU, against
the single-GPU reference computed on that GPU; on top, the modes that allow it are captured in
a CUDA graph with their collectives and replayed on new tokens, and the Triton experts are built
through the registry under the static and all-to-all dispatchers. The collective-timeout case is
left out: NCCL's watchdog aborts the process on a timeout instead of raising.

Skipped without two CUDA devices (CI has none); run on the 2-GPU machine with
``NCCL_NVLS_ENABLE=0 python3 -m pytest -q tests/distributed/test_dist_nccl.py``.
"""
from __future__ import annotations

import pytest
import torch

from dist_cases import CUDA_REGISTRY_CASES, GRAPH_CASES, graph_case, registry_report
from dist_harness import failures, run_cases, run_workers

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")


def _worker(rank: int, world_size: int) -> dict:
    from test_dist_two_ranks import _worker as two_rank_cases

    from moe_compile.lowering.cuda import FALLBACKS

    report = two_rank_cases(rank, world_size)
    report.update(run_cases(GRAPH_CASES, graph_case))
    report.update(registry_report(CUDA_REGISTRY_CASES))
    report["<cuda fallbacks>"] = dict(FALLBACKS)
    return report


@pytest.mark.distributed
def test_two_gpus_nccl():
    pytest.importorskip("transformers")
    reports = run_workers(_worker, 2, backend="nccl", deadline_s=540.0)
    fallbacks = [rep.pop("<cuda fallbacks>", None) for rep in reports]
    print("CUDA-lowering fallbacks by rank:", fallbacks)
    ran = [sorted(rep) for rep in reports]
    bad = failures(reports)
    assert not bad, f"{len(bad)} failing (rank, case):\n" + "\n".join(bad)
    assert all(len(rep) >= len(GRAPH_CASES) + 60 for rep in reports), ran
    print(f"{len(reports[0])} cases passed on each of 2 ranks")
