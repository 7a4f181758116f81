"""``benchmarks/probe_floor.py``'s stream kernel (under Triton's interpreter without CUDA, on the GPU
with it) sums exactly the bytes of each pair's expert, and ``kernel_breakdown.idle_gaps`` measures
the time no kernel runs."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernel_breakdown  # noqa: E402
import probe_floor  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_stream_reads_each_pairs_expert_whole():
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 8, 32, generator=gen).bfloat16()   # 256 elements per expert
    down = torch.randn(5, 32, 4, generator=gen).bfloat16()      # 128
    ids = torch.tensor([[4, 0], [2, 4]], dtype=torch.int32)
    got = probe_floor.stream_experts(ids.to(DEV), gate_up.to(DEV), down.to(DEV), launch=(64, 16, 1)).cpu()
    assert got.shape == (4, 256 // 64 + 128 // 64)
    flat = ids.long().reshape(-1)
    want = torch.cat([gate_up[flat].float().reshape(4, -1, 64).sum(-1), down[flat].float().reshape(4, -1, 64).sum(-1)], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_stream_rejects_a_chunk_that_does_not_divide():
    w = torch.zeros(2, 96)
    with pytest.raises(ValueError, match="chunk must divide 96"):
        probe_floor.stream_experts(torch.zeros(1, 1, dtype=torch.int32), w, w, launch=(64, 16, 1))


def test_idle_gaps_merges_overlaps_and_ranks_the_gaps():
    span, covered, gaps = kernel_breakdown.idle_gaps([(0, 10, "a"), (5, 12, "b"), (20, 30, "c"), (31, 32, "d")])
    assert (span, covered) == (32, 12 + 10 + 1)
    assert gaps == [(8, "b", "c"), (1, "c", "d")]
    assert kernel_breakdown.idle_gaps([]) == (0.0, 0.0, [])
