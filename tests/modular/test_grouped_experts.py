"""GroupedExperts leaves the rows of other ranks' pairs undefined through both grouped GEMMs and
masks them once in the combine: even NaN there must not reach the output."""
import torch

from moe_compile.kernels import grouped_mm as gmm
from moe_compile.modular import ExpertWeights, GroupedExperts, ModularKernel, ReferenceExperts
from moe_compile.modular.prepare_finalize import StandardPrepareAndFinalize
from moe_compile.ops.config import ExpertsConfig


def test_rows_past_the_last_group_are_masked_even_when_nan(monkeypatch):
    real = gmm.grouped_mm

    def nan_tail(x, w, offsets, *, zero_rest=True):
        out = real(x, w, offsets, zero_rest=zero_rest)
        if not zero_rest:
            out = out.clone()
            out[int(offsets[-1]):] = float("nan")  # what an unwritten row may hold
        return out

    monkeypatch.setattr("moe_compile.modular.experts.grouped_mm", nan_tail)
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, num_global, num_local, top_k = 12, 32, 16, 8, 4, 2
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = torch.randn(tokens, num_global, generator=gen).softmax(-1).topk(top_k)
    ids = ids.int()
    w = ExpertWeights(torch.randn(num_local, hidden, 2 * inter, generator=gen) * 0.2,
                      torch.randn(num_local, inter, hidden, generator=gen) * 0.2,
                      torch.randn(num_local, 2 * inter, generator=gen) * 0.1,
                      torch.randn(num_local, hidden, generator=gen) * 0.1)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)  # half the experts elsewhere
    assert bool((expert_map[ids.long()] < 0).any()), "the case needs pairs of other ranks"
    got = ModularKernel(StandardPrepareAndFinalize(), GroupedExperts(ExpertsConfig()))(
        x, weights, ids, w, global_num_experts=num_global, expert_map=expert_map)
    want = ModularKernel(StandardPrepareAndFinalize(), ReferenceExperts(ExpertsConfig()))(
        x, weights, ids, w, global_num_experts=num_global, expert_map=expert_map)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
