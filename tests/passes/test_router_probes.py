"""Routing probes that a model's own weights would not exercise (``passes/match.py``):

* a zero selection bias (transformers' initial value): the probe logits' grid was symmetric about 0,
  so ``sigmoid(a) + sigmoid(-a) = 1`` made two groups' top-2 sums tie exactly, and the block and the op
  kept different groups: DeepSeek-V3-like blocks were left alone from 5 tokens up;
* a grouped router that masks the dropped groups with 0.0, not -inf (AXK2): the same as -inf while
  every selection score is positive, a different choice when a trained bias makes them negative.
  It used to be rewritten as DeepSeek-V3 routing.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_compile.testing import blocks, zoo
from moe_compile.testing.zoo_blocks import build_block_model

from .helpers import TOL, explain_and_compare, first_tensor, max_rel_diff


@pytest.mark.parametrize("tokens", [5, 17])
def test_a_zero_selection_bias_is_rewritten(tokens):
    model, kwargs = zoo.build_model("deepseek_v3", num_tokens=tokens)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
                module.e_score_correction_bias.zero_()
    report, diff = explain_and_compare(model, kwargs)
    assert len(report.rewritten) == 2, str(report)
    assert diff <= TOL[torch.float32], diff


@pytest.mark.parametrize("fill", [float("-inf"), 0.0], ids=["-inf", "0.0"])
def test_groups_masked_with_zero_are_left_alone(fill):
    model, kwargs = build_block_model("v4_grouped_sigmoid", num_layers=1)
    gate = next(m for m in model.modules() if isinstance(m, blocks.GroupedSigmoidGate))
    gate.cfg = dataclasses.replace(gate.cfg, group_mask_fill=fill)
    torch._dynamo.reset()
    report, diff = explain_and_compare(model, kwargs)
    assert diff <= TOL[torch.float32], diff
    assert len(report.rewritten) == 1, str(report)
    kept = report.blocks[0].router.startswith("kept as written (top-k; expert choice or weights match no")
    assert kept == (fill == 0.0), str(report)  # the 0.0 fill is no routing of the op: its router stays
    # a trained bias below every score: the 0.0 fill then outranks every kept expert
    fast = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    with torch.no_grad():
        gate.weight.copy_(-gate.weight.abs())
        gate.e_score_correction_bias.fill_(-0.05)
        x = kwargs["hidden_states"].abs() + 1.0
        assert max_rel_diff(first_tensor(fast(hidden_states=x)), first_tensor(model(hidden_states=x))) <= 1e-4


class _BlockThenDataDependentTopk(torch.nn.Module):
    """An MoE block, then a top-k over a data-dependent number of scores (as glm5_next's attention
    indexer does): reading that top-k raised, the whole pass failed and the block was left as it was."""

    def __init__(self):
        super().__init__()
        self.moe = blocks.GatherEinsumMoE(blocks.MoEBlockConfig())

    def forward(self, x):
        y = self.moe(x)
        picked = y[0][(y[0, :, 0] > 0).nonzero().squeeze(-1)]  # [u0, H]
        scores = torch.cat([picked, y[0]]).t()                # top-k over u0 + T scores
        return y, scores.topk(2, dim=-1).values


def test_a_top_k_over_a_data_dependent_width_does_not_stop_the_pass():
    torch.manual_seed(0)
    model = _BlockThenDataDependentTopk().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    x = torch.randn(1, 5, blocks.MoEBlockConfig().hidden_size)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        report, diff = explain_and_compare(model, {"x": x})
    assert torch._dynamo.utils.counters["moe_compile"]["pass_failed"] == 0
    assert report.rewritten == ["moe"], str(report)
    assert not report.skipped, str(report)  # no MoE block: listed apart
    assert any("data-dependent number of scores" in reason for _, reason in report.other_topk), str(report)
    assert "1 other top-k op(s), not MoE routers" in str(report)
    assert torch._dynamo.utils.counters["moe_compile"]["other_topk"] == 1
    assert diff <= TOL[torch.float32], diff


def _deepseek_v3_scaled(scale: float):
    model, kwargs = zoo.build_model("deepseek_v3", num_layers=1)
    for module in model.modules():
        if isinstance(getattr(module, "routed_scaling_factor", None), float):
            module.routed_scaling_factor = scale
    return model, kwargs


def test_a_routing_scale_passed_in_per_call_is_read_per_call():
    """Under ``dynamic=True`` Dynamo passes ``routed_scaling_factor`` (a Python float) in as a graph input
    and does not recompile when it changes: a second model of the same class with another scale runs
    the first one's graph. The rewrite had baked the first model's scale in (0.49 off eager)."""
    first, kwargs = _deepseek_v3_scaled(2.5)
    second, _ = _deepseek_v3_scaled(1.0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options = {"inner_compiler": "aot_eager"}
    with torch.no_grad():
        for model in (first, second):
            out = torch.compile(model, backend="moe_npu", dynamic=True, options=options)(**kwargs)
            assert max_rel_diff(first_tensor(out), first_tensor(model(**kwargs))) <= TOL[torch.float32]
    assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 1  # one graph served both


class _TemperatureMoE(blocks.GatherEinsumMoE):
    """gpt-fast's block with its router logits divided by a temperature (a number, or a learned 0-d
    parameter) or, ``per_expert``, scaled by an ``[E]`` vector (not one number: left alone)."""

    def __init__(self, temperature, per_expert: bool = False):
        super().__init__(blocks.MoEBlockConfig())
        self.per_expert = per_expert
        self.temperature = torch.nn.Parameter(temperature) if isinstance(temperature, torch.Tensor) else temperature
        if per_expert:
            self.logit_scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, self.cfg.num_experts))
        with torch.no_grad():
            for p in [*self.gate.parameters(), *self.cond_ffn.parameters()]:
                p.normal_(0.0, 0.1)

    def forward(self, x_BSD):
        x_TD = x_BSD.view(-1, self.cfg.hidden_size)
        logits = self.gate(x_TD) * self.logit_scale if self.per_expert else self.gate(x_TD) / self.temperature
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), self.cfg.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return torch.einsum("tkd,tk -> td", self.cond_ffn(x_TD, ids), weights).view_as(x_BSD)


@pytest.mark.parametrize("temperature", [0.3, "parameter"])
def test_router_logits_scaled_by_one_number_are_rewritten(temperature):
    """The op is handed the scaled logits (MuseSpark's ``output_multiplier`` form): the number stays in
    the graph, so a learned temperature written after compiling is followed."""
    torch.manual_seed(0)
    model = _TemperatureMoE(torch.tensor(0.3) if temperature == "parameter" else temperature).eval()
    x = torch.randn(1, 9, blocks.MoEBlockConfig().hidden_size)
    report, diff = explain_and_compare(model, {"x_BSD": x})
    assert len(report.rewritten) == 1 and diff <= TOL[torch.float32], (str(report), diff)
    if temperature == "parameter":
        fast = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
        with torch.no_grad():
            assert max_rel_diff(fast(x), model(x)) <= TOL[torch.float32]
            model.temperature.fill_(3.0)  # flatter routing: other picks and weights
            assert max_rel_diff(fast(x), model(x)) <= TOL[torch.float32]


def test_router_logits_scaled_per_expert_keep_their_router():
    """No routing of the op scales each expert's logit: the router stays as written (experts-only rewrite),
    so a scale changed after compiling is followed; with ``experts_only=False`` the block stays whole."""
    torch.manual_seed(0)
    model = _TemperatureMoE(1.0, per_expert=True).eval()
    x = torch.randn(1, 9, blocks.MoEBlockConfig().hidden_size)
    report, diff = explain_and_compare(model, {"x_BSD": x}, {"experts_only": False})
    assert not report.rewritten and diff <= TOL[torch.float32], (str(report), diff)
    report, diff = explain_and_compare(model, {"x_BSD": x})
    assert report.rewritten == [""] and diff <= TOL[torch.float32], (str(report), diff)
    assert report.blocks[0].router.startswith("kept as written (top-k"), str(report)
    fast = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    with torch.no_grad():
        fast(x)
        model.logit_scale.mul_(torch.linspace(0.2, 3.0, model.logit_scale.numel()).reshape(model.logit_scale.shape))
        assert max_rel_diff(fast(x), model(x)) <= TOL[torch.float32]
