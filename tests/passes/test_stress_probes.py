"""Blocks that match the fused op on the random probes but not beyond them: one expert unlike the
others seen only at decode sizes, a clamp that fires only on large inputs, capacity drops that only
skewed routing shows, and parameters that are a no-op only at compile time. Each must be left as it
was, with a reason that says what was found; a plain block must still be rewritten."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from moe_compile.passes.probes import coverage_logits, num_coverage_probes

from .helpers import explain_and_compare, first_tensor, max_rel_diff

H, I, E, K = 32, 16, 8, 2


class Expert(nn.Module):
    def __init__(self, kind: str = "plain"):
        super().__init__()
        self.kind = kind
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        if kind == "lora":  # peft's initialisation: B = 0
            self.lora_a, self.lora_b = nn.Linear(H, 4, bias=False), nn.Linear(4, I, bias=False)
            nn.init.zeros_(self.lora_b.weight)
        if kind == "scale":  # a learned output scale, initialised to one
            self.scale = nn.Parameter(torch.ones(H))

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.kind == "lora":
            gate = gate + self.lora_b(self.lora_a(x))
        if self.kind == "clamp":
            gate, up = gate.clamp(-7, 7), up.clamp(-7, 7)
        act = F.relu(gate) if self.kind == "relu" else F.silu(gate)
        out = self.down_proj(act * up)
        if self.kind == "residual":
            out = out + x
        return out * self.scale if self.kind == "scale" else out


class LoopMoE(nn.Module):
    """The 4.x loop over ``ModuleList`` experts; ``odd`` experts are of kind ``kind``; ``capacity``
    drops the tokens past ``capacity`` per expert (Switch style); ``temperature`` divides the logits
    by a buffer."""

    def __init__(self, kind="plain", odd=(), capacity=None, temperature=False):
        super().__init__()
        self.capacity = capacity
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([Expert(kind if (e in odd or not odd) else "plain") for e in range(E)])
        if temperature:
            self.register_buffer("temperature", torch.ones(()))
        self.temperature_on = temperature

    def forward(self, x):
        logits = self.gate(x)
        if self.temperature_on:
            logits = logits / self.temperature
        weights, ids = torch.topk(logits.softmax(-1), K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            if self.capacity is not None:
                tok, slot = tok[:self.capacity], slot[:self.capacity]
            out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, slot, None])
        return out


def _skipped_reason(model, tokens):
    torch.manual_seed(1)
    report, diff = explain_and_compare(model.eval(), {"x": torch.randn(tokens, H)}, {"verify": False})
    assert not report.rewritten and diff == 0.0, str(report)
    ((_, reason),) = report.skipped
    return reason


def test_plain_block_is_still_rewritten_at_one_token():
    torch.manual_seed(0)
    report, diff = explain_and_compare(LoopMoE().eval(), {"x": torch.randn(1, H)})
    assert report.rewritten == [""] and diff <= 1e-5, (diff, str(report))


@pytest.mark.parametrize("kind", ["residual", "lora_live", "relu"])
def test_one_odd_expert_is_found_at_one_token(kind):
    """At T = 1 a random probe reaches 2 of 8 experts; expert 2 alone differs."""
    torch.manual_seed(0)
    model = LoopMoE("lora" if kind == "lora_live" else kind, odd=(2,))
    if kind == "lora_live":
        nn.init.normal_(model.experts[2].lora_b.weight, std=0.3)
    reason = _skipped_reason(model, 1)
    # one token, two experts per probe: a second pass pairs them differently, so expert 2 is singled out
    assert "not all the same MLP" in reason and "experts [2]" in reason, reason


def test_clamp_that_fires_only_on_large_inputs_is_found():
    torch.manual_seed(0)
    reason = _skipped_reason(LoopMoE("clamp"), 7)
    assert "large hidden states" in reason and "silu" in reason, reason


def test_capacity_drops_are_found():
    torch.manual_seed(0)
    reason = _skipped_reason(LoopMoE(capacity=4), 7)
    assert "capacity" in reason, reason


@pytest.mark.parametrize("kind", ["lora", "scale"])
def test_parameters_that_are_a_no_op_at_compile_time_are_found(kind):
    """The op would match now and ignore their later updates: left as it was, and the compiled
    model follows a ``load_state_dict`` that changes them."""
    torch.manual_seed(0)
    # a zero-initialised LoRA on one expert (on every expert the extra [E, 4, H] families leave no layout)
    model = LoopMoE(kind, odd=(3,) if kind == "lora" else ())
    reason = _skipped_reason(model, 7)
    assert "also reads" in reason and "which the fused op does not take" in reason, reason
    assert {"lora": "lora_b", "scale": "scale"}[kind] in reason, reason

    torch._dynamo.reset()
    x = torch.randn(7, H)
    with torch.no_grad():
        fast = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
        fast(x)
        state = {k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        assert max_rel_diff(fast(x), model(x)) <= 1e-6


def test_a_temperature_of_one_stays_in_the_graph():
    """A router temperature buffer of 1 divides the logits: the op is handed the divided logits (until
    the twenty-second session it was left alone, as a no-op input the op would not follow), so the
    compiled model follows a ``load_state_dict`` that changes it."""
    torch.manual_seed(0)
    model = LoopMoE("plain", temperature=True).eval()
    x = torch.randn(7, H)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        fast = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
        assert max_rel_diff(fast(x), model(x)) <= 1e-5
        assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 1
        state = {k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        assert model.temperature.item() != 1.0
        assert max_rel_diff(fast(x), model(x)) <= 1e-5


def test_coverage_probes_route_to_every_expert():
    num_tokens, num_experts, top_k = 1, 16, 4
    n = num_coverage_probes(num_tokens, num_experts, top_k)
    assert n == 4
    seen = set()
    for i in range(n):
        logits = coverage_logits((num_tokens, num_experts), top_k, i * num_tokens * top_k, torch.float32, "cpu",
                                 torch.Generator().manual_seed(i))
        assert logits.unique().numel() == num_experts  # no ties
        seen |= set(logits.topk(top_k, dim=-1).indices.reshape(-1).tolist())
    assert seen == set(range(num_experts))
    assert num_coverage_probes(64, 8, 2) == 1 and num_coverage_probes(1, 4096, 1) == 64


def test_zoo_model_at_one_token_is_rewritten():
    """Coverage at decode size does not refuse a real model (all experts alike)."""
    from moe_compile.testing import zoo

    model, _ = zoo.build_model("qwen3_moe")
    kwargs = zoo.build_inputs("qwen3_moe", num_tokens=1)
    report = moe_compile.explain(model, **kwargs, options={"inner_compiler": "aot_eager"})
    assert len(report.rewritten) == zoo.expected_moe_layers("qwen3_moe") and not report.skipped, str(report)


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_bias_on_the_logits_is_not_taken_for_a_bias_on_the_scores_at_one_token(seed):
    """kolibri1 adds its selection bias to the logits before the sigmoid, which the op cannot express.
    At one token its small compile-time bias reordered nothing on six one-token probes, so the block
    was rewritten as "sigmoid+bias" and went 0.5-0.8 off eager once the bias was trained. The routing
    probes now cover at least 48 tokens and use a bias that reorders experts."""
    from moe_compile.testing import zoo

    torch._dynamo.reset()
    model, inputs = zoo.build_model("kolibri1", num_tokens=1, seed=seed)
    options = {"inner_compiler": "aot_eager", "experts_only": False}
    report = moe_compile.explain(model, **inputs, options=options)
    assert not report.rewritten, str(report)
    # with experts-only rewrites (the default) the router stays as written, so a trained bias is followed
    torch._dynamo.reset()
    report = moe_compile.explain(model, **inputs, options={"inner_compiler": "aot_eager"})
    assert report.rewritten and all(b.router.startswith("kept as written (top-k") for b in report.blocks), str(report)
    fast = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fast(**inputs)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                bias = module.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.5)
        assert max_rel_diff(first_tensor(fast(**inputs)), first_tensor(model(**inputs))) <= 1e-4
