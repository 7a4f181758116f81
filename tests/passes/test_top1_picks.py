"""Top-1 routers written as a pick, not a top-k: ``probs.max(-1)`` (values and indices) or ``probs.argmax(-1)``
with the weight gathered, as Switch-style user code writes them. The ids are 1-D ``[T]``; the experts-only rewrite
takes them as ``[T, 1]`` pairs, keeps the router as written and fuses the experts.

Tolerances: fp32 1e-4 and bf16 2e-2 of the output's magnitude (``helpers.TOL``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .helpers import TOL, explain_and_compare, max_rel_diff, rewrites_under_dynamic

H, I, E = 32, 48, 6


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Top1MoE(nn.Module):
    """``pick``: "max" (values, indices = probs.max(-1)) or "argmax" (ids = probs.argmax(-1), weight gathered).
    ``capacity``: each expert keeps its first ``capacity`` tokens; the others get no output (Switch's drop)."""

    def __init__(self, pick: str = "max", capacity: int | None = None):
        super().__init__()
        self.pick, self.capacity = pick, capacity
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, H)
        probs_TE = F.softmax(self.gate(x_TD), dim=-1, dtype=torch.float32)
        if self.pick == "max":
            weight_T, ids_T = probs_TE.max(dim=-1)
        else:
            ids_T = probs_TE.argmax(dim=-1)
            weight_T = probs_TE.gather(1, ids_T[:, None]).squeeze(1)
        out_TD = torch.zeros_like(x_TD)
        if self.capacity is not None:
            position_T = F.one_hot(ids_T, E).cumsum(dim=0).gather(1, ids_T[:, None]).squeeze(1)
            weight_T = weight_T * (position_T <= self.capacity)
        for i, expert in enumerate(self.experts):
            tokens = torch.where(ids_T == i)[0]
            y = expert(x_TD[tokens]) * weight_T[tokens, None].to(x_TD.dtype)
            out_TD.index_add_(0, tokens, y)
        return out_TD.view_as(x_BSD)


def _model(dtype=torch.float32, **kwargs) -> Top1MoE:
    model = Top1MoE(**kwargs)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.to(dtype).eval()


def _x(tokens: int = 10, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, tokens // 2, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pick,source", [("max", "ids from a max"), ("argmax", "ids from an argmax")])
def test_a_top1_pick_router_stays_and_its_experts_are_fused(pick, source, dtype):
    report, diff = explain_and_compare(_model(dtype, pick=pick), {"x_BSD": _x(dtype=dtype)})
    assert diff <= TOL[dtype], (diff, str(report))
    (block,) = report.blocks
    assert block.rewritten and block.router == "kept as written (%s) -> fused_experts" % source, str(report)
    assert (block.num_experts, block.top_k, block.activation) == (E, 1, "silu")
    graph = report.graphs_after[0]
    assert "moe_compile.fused_experts" in graph and "index_add" not in graph, graph


def test_a_top1_pick_with_capacity_drops_stays_in_the_router():
    """Drops by a zero weight are part of the router, which stays: the rewrite drops the same tokens. Checked
    with every token on one expert, where 7 of the 10 are dropped."""
    model = _model(capacity=3)
    with torch.no_grad():
        model.gate.weight.zero_()
        model.gate.weight[2] = 1.0
    x = _x().abs()  # expert 2's logit is the largest for every token
    report, diff = explain_and_compare(model, {"x_BSD": x})
    assert report.rewritten == [""] and diff <= TOL[torch.float32], (diff, str(report))
    with torch.no_grad():
        assert (model(x).reshape(-1, H).abs().amax(dim=-1) == 0).sum() == 7  # the drops happened


def test_dynamic_token_counts():
    inputs = [{"x_BSD": _x(tokens, seed=tokens)} for tokens in (12, 4, 6)]  # first [2, 6, H]: no duck-sized dims
    assert rewrites_under_dynamic(_model(pick="argmax"), inputs) == 1


class _ArgmaxOverTokens(nn.Module):
    """An argmax that is not a per-token pick (over the tokens of each score column): nothing is reported."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, E, bias=False)
        self.table = nn.Parameter(torch.randn(16, H))

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, H)
        best_E = self.proj(x_TD).argmax(dim=0)
        return (x_TD + self.table[best_E].sum(dim=0)).view_as(x_BSD)


class _ClassifierPick(nn.Module):
    """A per-token argmax over a linear's classes that picks embeddings, not experts: nothing is reported."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, E, bias=False)
        self.embed = nn.Embedding(E, H)

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, H)
        return (x_TD + self.embed(self.proj(x_TD).argmax(dim=-1))).view_as(x_BSD)


@pytest.mark.parametrize("make", [_ArgmaxOverTokens, _ClassifierPick])
def test_an_argmax_without_experts_is_not_reported(make):
    torch.manual_seed(0)
    report, diff = explain_and_compare(make().eval(), {"x_BSD": _x()})
    assert diff <= TOL[torch.float32] and not report.blocks, str(report)


def test_a_top1_pick_block_on_the_emulated_npu():
    """The experts-only rewrite of a top-1 pick lowers to the NPU ops (k=1), inside emulated_npu(poison=True)."""
    from moe_compile.testing import emulated_npu

    model, x = _model(pick="max"), _x()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = model(x)
            with emulated_npu(poison=True) as npu:
                compiled = torch.compile(model, backend="moe_npu",
                                         options={"lowering": "npu", "inner_compiler": "aot_eager"})
                out = compiled(x)
    finally:
        torch._dynamo.reset()
    assert dict(npu.calls) == {"npu_moe_init_routing_v2": 1, "npu_grouped_matmul": 2, "npu_swiglu": 1}
    assert max_rel_diff(out, eager) <= TOL[torch.float32]
