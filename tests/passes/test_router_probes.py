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
    if fill == 0.0:
        assert not report.rewritten and "routing" in report.skipped[0][1], str(report)
    else:
        assert len(report.rewritten) == 1, str(report)
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
    assert any("data-dependent number of scores" in reason for _, reason in report.skipped), str(report)
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
