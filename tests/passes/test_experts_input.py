"""Blocks whose experts read another tensor than the router, with a per-expert output scale
(Gemma-4's form, ``passes/experts_input.py``): the op gets the experts' input, the router's logits,
and ``down_proj`` with the scale folded in, kept in step with the scale when it changes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .helpers import TOL, explain_and_compare, max_rel_diff

H, I, E, K = 64, 32, 8, 2


class TwoNormBlock(nn.Module):
    """Router on its own scaled RMSNorm of ``x``, experts (``w[ids]`` gathers + einsum) on another norm
    of ``x``; routing weights times ``per_expert_scale[ids]`` after (or, ``scale="before"``, before)
    the renormalisation; ``modulelist``: the down projections are one ``Linear`` per expert."""

    def __init__(self, scale: str | None = "after", down_bias: bool = False, modulelist: bool = False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.scale, self.modulelist = scale, modulelist
        self.router_norm = nn.RMSNorm(H, elementwise_affine=False)
        self.router_scale = nn.Parameter(torch.rand(H) + 0.5)
        self.router = nn.Linear(H, E, bias=False)
        self.experts_norm = nn.RMSNorm(H)
        with torch.no_grad():
            self.experts_norm.weight.uniform_(0.5, 1.5)
        self.per_expert_scale = nn.Parameter(torch.rand(E) + 0.5)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        if modulelist:
            self.down = nn.ModuleList(nn.Linear(I, H, bias=down_bias) for _ in range(E))
        else:
            self.down = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
            self.down_bias = nn.Parameter(torch.randn(E, H) * 0.1) if down_bias else None

    def forward(self, x):
        flat = x.reshape(-1, H)
        probs = F.softmax(self.router(self.router_norm(flat) * self.router_scale * H ** -0.5), dim=-1,
                          dtype=torch.float32)
        weights, ids = torch.topk(probs, K, dim=-1)
        if self.scale == "before":
            weights = weights * self.per_expert_scale[ids]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale == "after":
            weights = weights * self.per_expert_scale[ids]
        xe = self.experts_norm(flat)
        gate, up = torch.einsum("th,tknh->tkn", xe, self.gate_up[ids]).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
        if self.modulelist:
            down = torch.stack([m.weight for m in self.down])[ids]
            y = torch.einsum("tki,tkhi->tkh", act, down)
            if self.down[0].bias is not None:
                y = y + torch.stack([m.bias for m in self.down])[ids]
        else:
            y = torch.einsum("tki,tkhi->tkh", act, self.down[ids])
            if self.down_bias is not None:
                y = y + self.down_bias[ids]
        out = torch.einsum("tkh,tk->th", y, weights.to(y.dtype))
        return out.reshape(x.shape)


def _x(seed=1, tokens=7, dtype=torch.float32):
    return torch.randn(1, tokens, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("down_bias,modulelist", [(False, False), (True, False), (True, True)])
def test_experts_on_their_own_input_with_a_per_expert_scale(down_bias, modulelist):
    block = TwoNormBlock(down_bias=down_bias, modulelist=modulelist).eval()
    report, diff = explain_and_compare(block, {"x": _x()})
    assert len(report.rewritten) == 1 and not report.skipped, str(report)
    assert diff <= TOL[torch.float32], diff
    assert "per-expert scale folded into down_proj" in str(report), str(report)


def test_experts_on_their_own_input_without_a_scale():
    block = TwoNormBlock(scale=None).eval()
    report, diff = explain_and_compare(block, {"x": _x()})
    assert len(report.rewritten) == 1 and diff <= TOL[torch.float32], (str(report), diff)
    assert "per-expert scale" not in str(report)


def test_a_scale_before_the_renormalisation_is_left_alone():
    """``w * s[id] / sum(w * s[id])`` is no per-expert output scale: folding it would be wrong."""
    block = TwoNormBlock(scale="before").eval()
    report, diff = explain_and_compare(block, {"x": _x()})
    assert not report.rewritten and len(report.skipped) == 1, str(report)
    assert diff <= TOL[torch.float32], diff


@pytest.mark.parametrize("modulelist", [False, True])
def test_the_folded_scale_follows_the_model(modulelist):
    """The folded copy is re-made when the scale (or the down projection) is written in place or
    loaded, as the uncompiled model would compute."""
    block = TwoNormBlock(modulelist=modulelist).eval()
    x = _x(tokens=5)
    fast = torch.compile(block, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]
        assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 1
        block.per_expert_scale.mul_(torch.linspace(0.2, 3.0, E))
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]
        block.load_state_dict(TwoNormBlock(modulelist=modulelist, seed=5).state_dict())
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]


def test_bf16_experts_input_and_inductor():
    block = TwoNormBlock(down_bias=True).eval().to(torch.bfloat16)
    x = _x(tokens=9, dtype=torch.bfloat16)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        fast = torch.compile(block, backend="moe_npu", options={"inner_compiler": "inductor"})
        diff = max_rel_diff(fast(x), block(x))
    assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 1
    assert diff <= TOL[torch.bfloat16], diff


def test_a_scale_of_ones_is_folded_and_followed():
    """Gemma-4 initialises ``per_expert_scale`` to ones: the reading without the scale reproduces the
    block too, and is refused by the stress probe (the op would not follow the scale); the folded
    reading is taken and follows a later write."""
    block = TwoNormBlock().eval()
    with torch.no_grad():
        block.per_expert_scale.fill_(1.0)
    x = _x(tokens=5)
    report, diff = explain_and_compare(block, {"x": x})
    assert len(report.rewritten) == 1 and "per-expert scale folded" in str(report), str(report)
    fast = torch.compile(block, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    with torch.no_grad():
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]
        block.per_expert_scale.copy_(torch.linspace(0.2, 3.0, E))
        assert max_rel_diff(fast(x), block(x)) <= TOL[torch.float32]
