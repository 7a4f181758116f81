"""``fused_moe`` against the plain per-token float64 reference (``moe_compile.testing.moe_reference``).

Tolerances: fp32 atol = rtol = 1e-4; bf16/fp16 atol = rtol = 2e-2 (atol times max(1, max|ref|)).
"""
from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_compile import fused_moe
from moe_compile.testing.moe_reference import reference_fused_moe
from moe_inputs import check_against_reference, make_inputs, seed_custom_routing_function

# (``moe_compile.ops.fused_moe`` the attribute is the function; the module holds the log-once flag)
fused_moe_module = importlib.import_module("moe_compile.ops.fused_moe")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def _bias8():
    # a selection-only bias that reorders experts (DeepSeek-V3 e_score_correction_bias); fp32 like HF's
    return torch.tensor([0.3, -0.2, 0.1, 0.0, -0.3, 0.25, -0.1, 0.05])


ROUTING_MODES = {
    "softmax": dict(top_k=2),
    "softmax_top1": dict(top_k=1),
    "softmax_renormalize": dict(top_k=3, renormalize=True),
    "sigmoid": dict(top_k=2, routing_method="sigmoid"),
    "sigmoid_renormalize_flag_is_moot": dict(top_k=2, routing_method="sigmoid", renormalize=True),
    "sigmoid_unnormalized": dict(top_k=2, routing_method="sigmoid", normalize_sigmoid=False),
    "grouped_max_mode0": dict(top_k=3, group_count=4, k_group=2, group_select_mode=0),
    "grouped_top2sum_mode1": dict(top_k=3, group_count=4, k_group=2, group_select_mode=1, renormalize=True),
    "scaled": dict(top_k=2, renormalize=True, routed_scaling_factor=0.5),
    "softmax_bias": dict(top_k=2, e_score_correction_bias=_bias8),
    "deepseek_v3_grouped_sigmoid_bias_scaled": dict(
        top_k=4, routing_method="sigmoid", group_count=4, k_group=2, group_select_mode=1,
        e_score_correction_bias=_bias8, routed_scaling_factor=2.5),
    "deepseek_v4_sqrtsoftplus_bias_scaled": dict(top_k=3, routing_method="sqrtsoftplus",
                                                 e_score_correction_bias=_bias8, routed_scaling_factor=1.5),
    "sqrtsoftplus_unnormalized_grouped": dict(top_k=2, routing_method="sqrtsoftplus", normalize_sigmoid=False,
                                              group_count=4, k_group=2, group_select_mode=1),
    "scoring_after_topk_softmax": dict(top_k=2, scoring_after_topk=True),
    "llama4_top1_sigmoid_on_input": dict(top_k=1, routing_method="sigmoid", scoring_after_topk=True,
                                         normalize_sigmoid=False, apply_router_weight_on_input=True),
    "custom_routing_function": dict(top_k=2, custom_routing_function=seed_custom_routing_function,
                                    renormalize=True, routed_scaling_factor=0.5),
}


def _resolve(kwargs):
    return {k: (v() if k == "e_score_correction_bias" else v) for k, v in kwargs.items()}


@pytest.mark.parametrize("lead", [(5,), (2, 3)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", sorted(ROUTING_MODES))
def test_routing_modes_match_reference(mode, dtype, lead):
    tensors = make_inputs(dtype=dtype, lead=lead, seed=len(mode), bias=True)
    kwargs = _resolve(ROUTING_MODES[mode])
    out = fused_moe(**tensors, **kwargs)
    check_against_reference(out, tensors, dtype, **kwargs)


ACTIVATIONS = {
    "silu": dict(activation="silu"),
    "gelu": dict(activation="gelu"),
    "gelu_tanh": dict(activation="gelu_tanh"),
    # gpt-oss: interleaved gate/up, biases, and a limit small enough that the clamps bite
    "swigluoai_interleaved": dict(activation="swigluoai", gate_up_interleaved=True, swiglu_alpha=1.702,
                                  swiglu_limit=0.5),
    "swigluoai_halves": dict(activation="swigluoai", swiglu_alpha=1.2, swiglu_limit=7.0),
    "silu_interleaved": dict(activation="silu", gate_up_interleaved=True),
    # DeepSeek-V4 style clamped SwiGLU (hy_v4, glm5_next), a limit small enough that both clamps bite
    "silu_clamped": dict(activation="silu_clamped", swiglu_limit=0.5),
    "silu_clamped_interleaved": dict(activation="silu_clamped", gate_up_interleaved=True, swiglu_limit=0.5),
    "silu_no_mul": dict(activation="silu_no_mul"),
    "gelu_no_mul": dict(activation="gelu_no_mul"),
    "relu_no_mul": dict(activation="relu_no_mul"),
    "relu2_no_mul": dict(activation="relu2_no_mul"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_activations_match_reference(act, dtype):
    kwargs = ACTIVATIONS[act]
    gated = not kwargs["activation"].endswith("_no_mul")
    tensors = make_inputs(dtype=dtype, gated=gated, bias=True, seed=3, tokens=6)
    out = fused_moe(**tensors, top_k=3, **kwargs)
    check_against_reference(out, tensors, dtype, top_k=3, **kwargs)


@pytest.mark.parametrize("act", ["swigluoai", "silu_clamped"])
def test_swiglu_clamp_changes_the_result(act):
    """The small limit above must actually clamp (otherwise that test would not test the clamp)."""
    tensors = make_inputs(bias=True, seed=3, tokens=6)
    clamped = fused_moe(**tensors, top_k=3, activation=act, swiglu_limit=0.5)
    loose = fused_moe(**tensors, top_k=3, activation=act, swiglu_limit=100.0)
    assert (clamped - loose).abs().max() > 1e-2
    if act == "silu_clamped":  # with a limit no value reaches, it is the plain SiLU-gated MLP
        torch.testing.assert_close(loose, fused_moe(**tensors, top_k=3, activation="silu"))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_hf_layout_weight_views(dtype):
    """Transposed views of HF ``[E, 2I, H]`` weights are read through their strides."""
    tensors = make_inputs(dtype=dtype, hf_layout=True, bias=True, tokens=7)
    assert not tensors["w13_weight"].is_contiguous()
    out = fused_moe(**tensors, top_k=2, renormalize=True)
    check_against_reference(out, tensors, dtype, top_k=2, renormalize=True)


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)], ids=["0", "2x0", "0x3"])
@pytest.mark.parametrize("custom", [False, True], ids=["builtin", "custom"])
def test_zero_tokens(lead, custom):
    tensors = make_inputs(lead=lead, bias=True)
    extra = dict(custom_routing_function=seed_custom_routing_function) if custom else {}
    out = fused_moe(**tensors, top_k=2, **extra)
    assert out.shape == tensors["hidden_states"].shape and out.dtype == torch.float32


def test_noncontiguous_hidden_states():
    tensors = make_inputs(tokens=6)
    tensors["hidden_states"] = tensors["hidden_states"].t().contiguous().t()
    assert not tensors["hidden_states"].is_contiguous()
    out = fused_moe(**tensors, top_k=2)
    check_against_reference(out, tensors, torch.float32, top_k=2)


def test_seed_example_single_card_scaled_down():
    """Seed 003 'single card': bf16, biases, top_k=2 of 8, renormalize=True (8 tokens, H=64, I=32)."""
    tensors = make_inputs(tokens=8, hidden=64, inter=32, experts=8, dtype=torch.bfloat16, bias=True, seed=11)
    out = fused_moe(**tensors, top_k=2, renormalize=True)
    check_against_reference(out, tensors, torch.bfloat16, top_k=2, renormalize=True)


def test_seed_example_grouped_sigmoid_scaled_down():
    """Seed 003 'grouped routing': 16 experts, top_k=2, k_group=1, group_count=4, mode 1, sigmoid, x0.5."""
    tensors = make_inputs(tokens=8, hidden=64, inter=32, experts=16, dtype=torch.bfloat16, seed=12)
    kwargs = dict(top_k=2, k_group=1, group_count=4, group_select_mode=1, routing_method="sigmoid",
                  routed_scaling_factor=0.5)
    out = fused_moe(**tensors, **kwargs)
    check_against_reference(out, tensors, torch.bfloat16, **kwargs)
    # with k_group=1 both experts of every token come from one group of 4
    from moe_compile.ops.config import RoutingConfig, RoutingMethod
    from moe_compile.ops.routing import select_experts

    cfg = RoutingConfig(num_experts=16, top_k=2, method=RoutingMethod.SIGMOID, k_group=1, group_count=4,
                        group_select_mode=1, routed_scaling_factor=0.5)
    weights, ids = select_experts(tensors["router_logits"], cfg)
    assert torch.equal(ids[:, 0] // 4, ids[:, 1] // 4)
    torch.testing.assert_close(weights.sum(-1), torch.full((8,), 0.5))


def test_seed_example_custom_routing_function_scaled_down():
    tensors = make_inputs(tokens=8, hidden=64, inter=32, experts=8, dtype=torch.bfloat16, seed=13)
    kwargs = dict(top_k=2, custom_routing_function=seed_custom_routing_function, renormalize=True)
    out = fused_moe(**tensors, **kwargs)
    check_against_reference(out, tensors, torch.bfloat16, **kwargs)


def test_custom_routing_function_gets_the_seed_arguments():
    seen = {}

    def spy(hidden_states, gating_output, topk, renormalize):
        seen.update(hidden=hidden_states.shape, gating=gating_output.shape, topk=topk, renormalize=renormalize)
        return seed_custom_routing_function(hidden_states, gating_output, topk, renormalize)

    tensors = make_inputs(lead=(2, 3))
    fused_moe(**tensors, top_k=3, custom_routing_function=spy, renormalize=True)
    assert seen == dict(hidden=(6, 16), gating=(6, 8), topk=3, renormalize=True)


def test_use_fused_op_falls_back_and_logs_once(moe_log, monkeypatch):
    monkeypatch.setattr(fused_moe_module, "_warned_fused_op", False)
    tensors = make_inputs(tokens=4)
    first = fused_moe(**tensors, top_k=2, use_fused_op=True)
    second = fused_moe(**tensors, top_k=2, use_fused_op=True)
    staged = fused_moe(**tensors, top_k=2, use_fused_op=False)
    assert torch.equal(first, staged) and torch.equal(second, staged)
    notes = [r for r in moe_log.records if "use_fused_op" in r.getMessage()]
    assert len(notes) == 1 and notes[0].name == "moe_compile"
    assert "staged" in notes[0].getMessage()


def test_routing_weight_scaling_is_linear():
    """routed_scaling_factor scales the routed output linearly (without w2 bias)."""
    tensors = make_inputs(tokens=5)
    base = fused_moe(**tensors, top_k=2)
    scaled = fused_moe(**tensors, top_k=2, routed_scaling_factor=2.5)
    torch.testing.assert_close(scaled, base * 2.5, atol=1e-5, rtol=1e-5)


# -- hypothesis: random configurations ----------------------------------------------------------
@st.composite
def configs(draw):
    experts = draw(st.sampled_from([2, 4, 6, 8, 12]))
    group_count = draw(st.sampled_from([g for g in (1, 2, 3, 4) if experts % g == 0]))
    per_group = experts // group_count
    k_group = draw(st.integers(1, group_count))
    top_k = draw(st.integers(1, k_group * per_group))
    method = draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]))
    custom = draw(st.integers(0, 9)) == 0
    scoring_after_topk = not custom and group_count == 1 and draw(st.booleans())
    kwargs = dict(
        top_k=top_k, group_count=group_count, k_group=k_group, routing_method=method,
        group_select_mode=draw(st.sampled_from([0, 1] if per_group >= 2 else [0])),
        renormalize=draw(st.booleans()), normalize_sigmoid=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 0.5, 2.5])), scoring_after_topk=scoring_after_topk,
        activation=draw(st.sampled_from(["silu", "gelu", "gelu_tanh", "swigluoai", "silu_clamped", "silu_no_mul",
                                         "relu2_no_mul"])),
        gate_up_interleaved=draw(st.booleans()),
        apply_router_weight_on_input=top_k == 1 and draw(st.booleans()),
    )
    if custom:
        kwargs["custom_routing_function"] = seed_custom_routing_function
    elif not scoring_after_topk and draw(st.booleans()):
        # multiples of 1/8: no accidental near-ties between the fp32 op and the fp64 oracle
        kwargs["e_score_correction_bias"] = torch.tensor(
            draw(st.lists(st.integers(-3, 3), min_size=experts, max_size=experts)), dtype=torch.float32) / 8
    lead = draw(st.sampled_from([(0,), (1,), (3,), (6,), (2, 3), (1, 1)]))
    tensors = dict(experts=experts, lead=lead, hidden=draw(st.sampled_from([8, 16])),
                   inter=draw(st.sampled_from([4, 8])), dtype=draw(st.sampled_from(DTYPES)),
                   gated=not kwargs["activation"].endswith("_no_mul"), bias=draw(st.booleans()),
                   hf_layout=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))
    return tensors, kwargs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_random_configurations_match_reference(config):
    spec, kwargs = config
    dtype = spec["dtype"]
    tensors = make_inputs(**spec)
    out = fused_moe(**tensors, **kwargs)
    check_against_reference(out, tensors, dtype, **kwargs)


def test_reference_is_not_trivially_equal():
    """Sanity of the oracle: a different routing gives a different reference (the tests can fail)."""
    tensors = make_inputs(tokens=6)
    a = reference_fused_moe(**tensors, top_k=2)
    b = reference_fused_moe(**tensors, top_k=2, renormalize=True)
    assert (a - b).abs().max() > 1e-3


def test_signature_is_the_seeds():
    """Seed 003's public parameters: same names, order and defaults; extensions keyword-only after."""
    import inspect

    seed = [("hidden_states", None), ("router_logits", None), ("num_experts", None), ("top_k", None),
            ("w13_weight", None), ("w2_weight", None), ("w13_bias", None), ("w2_bias", None), ("tp_group", None),
            ("ep_group", None), ("dispatcher_type", None), ("tokens_full", True), ("k_group", 1),
            ("group_count", 1), ("group_select_mode", 0), ("routing_method", "softmax"), ("renormalize", False),
            ("routed_scaling_factor", 1.0), ("custom_routing_function", None), ("reduce_results", True),
            ("use_fused_op", False)]
    params = list(inspect.signature(fused_moe).parameters.values())
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == [name for name, _ in seed]
    for p, (_, default) in zip(positional[6:], seed[6:]):
        assert p.default == default and type(p.default) is type(default), p
    for p in positional[:6]:  # hidden_states .. w2_weight are required
        assert p.default is inspect.Parameter.empty
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(seed):])
