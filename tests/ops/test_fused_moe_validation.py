"""Bad inputs to ``fused_moe``: each raises ValueError/TypeError whose message names the parameter.

Covers every rule of npu_ops.md §1.9 that applies to the unquantized API (1, 6-23), plus dtypes,
devices (the ``meta`` device stands in for a second device), shapes of every tensor, the keyword
extensions and what a custom routing function returns.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe_compile import fused_moe
from moe_inputs import make_inputs


def _base(**spec):
    kwargs = make_inputs(tokens=4, hidden=16, inter=8, experts=8, **spec)
    kwargs["top_k"] = 2
    return kwargs


def _set(**changes):
    return lambda kw: kw.update(changes)


def _routing(weights_ids):
    """A custom routing function returning ``weights_ids(gating_output, topk)``."""
    def fn(hidden_states, gating_output, topk, renormalize):
        return weights_ids(gating_output, topk)
    return fn


def _good_routing(logits, k):
    return torch.softmax(logits, -1).topk(k, -1)


def _w(kw, name, fn):
    kw[name] = fn(kw[name])


# (id, mutate(kwargs), exception type, regex the message must match: it names the parameter)
CASES = [
    # rule 1: tensors
    ("hidden_states_list", _set(hidden_states=[[1.0] * 16] * 4), TypeError, r"hidden_states must be a torch\.Tensor"),
    ("router_logits_none", _set(router_logits=None), TypeError, r"router_logits must be a torch\.Tensor"),
    ("w13_numpy", lambda kw: _w(kw, "w13_weight", lambda t: t.numpy()), TypeError, r"w13_weight must be a torch\.Tensor"),
    ("w2_list", _set(w2_weight=[0.0]), TypeError, r"w2_weight must be a torch\.Tensor"),
    ("w13_bias_float", _set(w13_bias=0.5), TypeError, r"w13_bias must be a torch\.Tensor or None"),
    ("w2_bias_numpy", _set(w2_bias=np.zeros((8, 16), dtype=np.float32)), TypeError, r"w2_bias must be a torch\.Tensor or None"),
    ("e_score_bias_list", _set(e_score_correction_bias=[0.0] * 8), TypeError, r"e_score_correction_bias must be a torch\.Tensor"),
    # rule 6: ints, not bools
    ("num_experts_float", _set(num_experts=8.0), TypeError, r"num_experts must be an int.*float"),
    ("num_experts_bool", _set(num_experts=True), TypeError, r"num_experts must be an int.*bool"),
    ("top_k_bool", _set(top_k=True), TypeError, r"top_k must be an int.*bool"),
    ("top_k_str", _set(top_k="2"), TypeError, r"top_k must be an int"),
    ("k_group_float", _set(k_group=1.0), TypeError, r"k_group must be an int"),
    ("group_count_bool", _set(group_count=False), TypeError, r"group_count must be an int.*bool"),
    ("group_select_mode_str", _set(group_select_mode="0"), TypeError, r"group_select_mode must be an int"),
    # rule 7: routed_scaling_factor is a float (an int 1 is rejected)
    ("routed_scaling_factor_int", _set(routed_scaling_factor=1), TypeError, r"routed_scaling_factor must be a float.*int"),
    ("routed_scaling_factor_tensor", _set(routed_scaling_factor=torch.tensor(1.0)), TypeError, r"routed_scaling_factor must be a float"),
    # rule 8: bools
    ("renormalize_int", _set(renormalize=1), TypeError, r"renormalize must be a bool"),
    ("tokens_full_str", _set(tokens_full="yes"), TypeError, r"tokens_full must be a bool"),
    ("reduce_results_none", _set(reduce_results=None), TypeError, r"reduce_results must be a bool"),
    ("use_fused_op_int", _set(use_fused_op=1), TypeError, r"use_fused_op must be a bool"),
    ("gate_up_interleaved_int", _set(gate_up_interleaved=0), TypeError, r"gate_up_interleaved must be a bool"),
    ("normalize_sigmoid_str", _set(normalize_sigmoid="false"), TypeError, r"normalize_sigmoid must be a bool"),
    ("scoring_after_topk_int", _set(scoring_after_topk=1), TypeError, r"scoring_after_topk must be a bool"),
    ("swiglu_alpha_int", _set(swiglu_alpha=2), TypeError, r"swiglu_alpha must be a float"),
    ("swiglu_limit_str", _set(swiglu_limit="7"), TypeError, r"swiglu_limit must be a float"),
    # rules 9-12: enumerations and the callable
    ("dispatcher_type_unknown", _set(dispatcher_type="auto"), ValueError, r"dispatcher_type must be one of.*'auto'"),
    ("dispatcher_type_int", _set(dispatcher_type=1), ValueError, r"dispatcher_type must be one of"),
    ("group_select_mode_2", _set(group_select_mode=2), ValueError, r"group_select_mode must be 0 or 1.*2"),
    ("routing_method_unknown", _set(routing_method="softplus"), ValueError, r"routing_method must be one of.*softplus"),
    ("routing_method_upper", _set(routing_method="SOFTMAX"), ValueError, r"routing_method must be one of"),
    ("activation_unknown", _set(activation="swish"), ValueError, r"activation must be one of.*swish"),
    ("lowering_unknown", _set(lowering="tpu"), ValueError, r"lowering must be one of.*tpu"),
    ("custom_routing_not_callable", _set(custom_routing_function="softmax"), TypeError, r"custom_routing_function must be callable"),
    # rule 13: ranges
    ("top_k_zero", _set(top_k=0), ValueError, r"top_k must be in \[1, num_experts=8\].*0"),
    ("top_k_above_num_experts", _set(top_k=9), ValueError, r"top_k must be in \[1, num_experts=8\].*9"),
    ("num_experts_zero", _set(num_experts=0), ValueError, r"num_experts must be >= 1"),
    ("k_group_zero", _set(k_group=0), ValueError, r"k_group must be >= 1"),
    ("group_count_zero", _set(group_count=0), ValueError, r"group_count must be >= 1"),
    ("k_group_above_group_count", _set(k_group=3, group_count=2), ValueError, r"k_group=3 exceeds group_count=2"),
    # rule 14: process groups
    ("tp_group_str", _set(tp_group="tp"), TypeError, r"tp_group must be a torch\.distributed\.ProcessGroup or None"),
    ("ep_group_int", _set(ep_group=2), TypeError, r"ep_group must be a torch\.distributed\.ProcessGroup or None"),
    # rule 15: ranks
    ("hidden_states_1d", lambda kw: _w(kw, "hidden_states", lambda t: t[0]), ValueError, r"hidden_states must have >= 2 dims"),
    ("router_logits_1d", lambda kw: _w(kw, "router_logits", lambda t: t[0]), ValueError, r"router_logits must have >= 2 dims"),
    ("w13_2d", lambda kw: _w(kw, "w13_weight", lambda t: t[0]), ValueError, r"w13_weight must be 3-D"),
    ("w2_4d", lambda kw: _w(kw, "w2_weight", lambda t: t[None]), ValueError, r"w2_weight must be 3-D \[local_experts, intermediate_size, hidden_size\]"),
    # rule 16
    ("router_logits_wrong_num_experts", lambda kw: _w(kw, "router_logits", lambda t: t[:, :6]), ValueError, r"router_logits\.shape\[-1\] must equal num_experts=8"),
    ("leading_dims_mismatch", lambda kw: _w(kw, "router_logits", lambda t: t[:3]), ValueError, r"router_logits leading dims \(3,\) must match hidden_states"),
    ("leading_dims_3d_vs_2d", lambda kw: _w(kw, "hidden_states", lambda t: t.view(2, 2, 16)), ValueError, r"router_logits leading dims"),
    # rule 17
    ("w13_no_experts", lambda kw: kw.update(w13_weight=kw["w13_weight"][:0], w2_weight=kw["w2_weight"][:0]), ValueError, r"w13_weight must hold >= 1 expert"),
    ("w2_expert_count", lambda kw: _w(kw, "w2_weight", lambda t: t[:7]), ValueError, r"w2_weight\.shape\[0\]=7 must equal w13_weight\.shape\[0\]=8"),
    ("local_experts_without_ep", lambda kw: kw.update(w13_weight=kw["w13_weight"][:4], w2_weight=kw["w2_weight"][:4]), ValueError, r"w13_weight\.shape\[0\]=4 must equal num_experts=8"),
    # rule 18
    ("w13_hidden", lambda kw: _w(kw, "w13_weight", lambda t: t[:, :12]), ValueError, r"w13_weight\.shape\[1\]=12 must equal hidden_size=16"),
    ("w2_hidden", lambda kw: _w(kw, "w2_weight", lambda t: t[:, :, :12]), ValueError, r"w2_weight\.shape\[2\]=12 must equal hidden_size=16"),
    ("w13_not_2I", lambda kw: _w(kw, "w13_weight", lambda t: t[:, :, :15]), ValueError, r"w13_weight\.shape\[2\]=15 must equal 2 \* intermediate_size=16"),
    ("non_gated_with_gated_w13", _set(activation="relu_no_mul"), ValueError, r"w13_weight\.shape\[2\]=16 must equal intermediate_size \(non-gated"),
    # rule 19: bias shapes
    ("w13_bias_shape", _set(w13_bias=torch.zeros(8, 8)), ValueError, r"w13_bias must have shape \(8, 16\), but got \(8, 8\)"),
    ("w2_bias_shape", _set(w2_bias=torch.zeros(16)), ValueError, r"w2_bias must have shape \(8, 16\), but got \(16,\)"),
    ("e_score_bias_shape", _set(e_score_correction_bias=torch.zeros(4)), ValueError, r"e_score_correction_bias must have shape \(8,\)"),
    # zero sizes (used to fail deep inside with a RuntimeError)
    ("intermediate_size_zero", _set(w13_weight=torch.randn(8, 16, 0), w2_weight=torch.randn(8, 0, 16)), ValueError,
     r"intermediate_size \(w2_weight\.shape\[1\]\) must be >= 1, but got w2_weight shape \(8, 0, 16\)"),
    ("hidden_size_zero", _set(hidden_states=torch.randn(4, 0), w13_weight=torch.randn(8, 0, 16),
                              w2_weight=torch.randn(8, 8, 0)), ValueError,
     r"hidden_size \(hidden_states\.shape\[-1\]\) must be >= 1, but got shape \(4, 0\)"),
    # non-finite floats (used to give a NaN output)
    ("routed_scaling_factor_nan", _set(routed_scaling_factor=float("nan")), ValueError,
     r"routed_scaling_factor must be a finite float, but got nan"),
    ("routed_scaling_factor_inf", _set(routed_scaling_factor=float("inf")), ValueError,
     r"routed_scaling_factor must be a finite float, but got inf"),
    ("swiglu_alpha_nan", _set(activation="swigluoai", swiglu_alpha=float("nan")), ValueError,
     r"swiglu_alpha must be a finite float, but got nan"),
    ("swiglu_alpha_minus_inf", _set(activation="swigluoai", swiglu_alpha=-float("inf")), ValueError,
     r"swiglu_alpha must be a finite float, but got -inf"),
    ("swiglu_limit_nan", _set(activation="swigluoai", swiglu_limit=float("nan")), ValueError,
     r"swiglu_limit must be > 0 \(inf: no clamping\), but got nan"),
    ("swiglu_limit_zero", _set(activation="swigluoai", swiglu_limit=0.0), ValueError,
     r"swiglu_limit must be > 0 \(inf: no clamping\), but got 0\.0"),
    # rules 21-23: grouped routing
    ("num_experts_not_divisible_by_group_count", _set(group_count=3), ValueError, r"num_experts=8 must be divisible by group_count=3"),
    ("mode1_needs_two_per_group", _set(group_count=8, k_group=2, group_select_mode=1), ValueError, r"group_select_mode=1.*>= 2 experts"),
    ("top_k_above_selected_groups", _set(group_count=4, k_group=1, top_k=3), ValueError, r"top_k=3 exceeds the experts in the selected groups"),
    # dtypes
    ("hidden_states_int", lambda kw: _w(kw, "hidden_states", lambda t: t.to(torch.int32)), TypeError, r"hidden_states\.dtype must be one of"),
    ("hidden_states_fp64", lambda kw: _w(kw, "hidden_states", lambda t: t.double()), TypeError, r"hidden_states\.dtype must be one of.*float64"),
    ("router_logits_int", lambda kw: _w(kw, "router_logits", lambda t: t.to(torch.int64)), TypeError, r"router_logits\.dtype must be a floating dtype"),
    ("w13_dtype_mismatch", lambda kw: _w(kw, "w13_weight", lambda t: t.half()), TypeError, r"w13_weight\.dtype must equal hidden_states\.dtype"),
    ("w2_dtype_mismatch", lambda kw: _w(kw, "w2_weight", lambda t: t.bfloat16()), TypeError, r"w2_weight\.dtype must equal hidden_states\.dtype"),
    ("w13_bias_dtype", _set(w13_bias=torch.zeros(8, 16, dtype=torch.float16)), TypeError, r"w13_bias\.dtype must equal"),
    ("e_score_bias_int", _set(e_score_correction_bias=torch.zeros(8, dtype=torch.int32)), TypeError, r"e_score_correction_bias\.dtype must be a floating"),
    # devices (meta = "another device")
    ("w2_other_device", lambda kw: _w(kw, "w2_weight", lambda t: t.to("meta")), ValueError, r"w2_weight is on meta but hidden_states is on cpu"),
    ("router_logits_other_device", lambda kw: _w(kw, "router_logits", lambda t: t.to("meta")), ValueError, r"router_logits is on meta"),
    ("w2_bias_other_device", _set(w2_bias=torch.zeros(8, 16, device="meta")), ValueError, r"w2_bias is on meta"),
    ("e_score_bias_other_device", _set(e_score_correction_bias=torch.zeros(8, device="meta")), ValueError, r"e_score_correction_bias is on meta"),
    # extensions and combinations
    ("dynamic_without_ep_group", _set(dispatcher_type="dynamic"), ValueError, r"dispatcher_type='dynamic' needs an ep_group"),
    ("apply_weight_on_input_top2", _set(apply_router_weight_on_input=True), ValueError, r"apply_router_weight_on_input=True needs top_k == 1"),
    ("scoring_after_topk_grouped", _set(scoring_after_topk=True, group_count=2), ValueError, r"scoring_after_topk=True .*group_count"),
    ("scoring_after_topk_with_bias", _set(scoring_after_topk=True, e_score_correction_bias=torch.zeros(8)), ValueError, r"scoring_after_topk=True .*e_score_correction_bias"),
    ("custom_routing_with_bias", _set(custom_routing_function=_routing(_good_routing), e_score_correction_bias=torch.zeros(8)), ValueError, r"e_score_correction_bias .*custom_routing_function"),
    # what a custom routing function returns
    ("custom_returns_one_tensor", _set(custom_routing_function=_routing(lambda g, k: g[:, :k])), TypeError, r"custom_routing_function must return a \(topk_weights, topk_ids\) pair"),
    ("custom_returns_triple", _set(custom_routing_function=_routing(lambda g, k: (g, g, g))), TypeError, r"custom_routing_function must return a \(topk_weights, topk_ids\) pair"),
    ("custom_returns_list_ids", _set(custom_routing_function=_routing(lambda g, k: (g[:, :k], [[0, 1]] * 4))), TypeError, r"custom_routing_function .*topk_ids is list"),
    ("custom_wrong_k", _set(custom_routing_function=_routing(lambda g, k: _good_routing(g, k + 1))), ValueError, r"custom_routing_function must return tensors of shape \(4, 2\)"),
    ("custom_wrong_tokens", _set(custom_routing_function=_routing(lambda g, k: _good_routing(g[:3], k))), ValueError, r"custom_routing_function must return tensors of shape \(4, 2\)"),
    ("custom_float_ids", _set(custom_routing_function=_routing(lambda g, k: (g[:, :k], g[:, :k]))), TypeError, r"custom_routing_function's topk_ids must be an integer tensor"),
    ("custom_int_weights", _set(custom_routing_function=_routing(lambda g, k: (torch.ones(4, k, dtype=torch.int64), _good_routing(g, k)[1]))), TypeError, r"custom_routing_function's topk_weights must be floating"),
    ("custom_ids_out_of_range", _set(custom_routing_function=_routing(lambda g, k: (_good_routing(g, k)[0], _good_routing(g, k)[1] + 7))), ValueError, r"custom_routing_function's topk_ids must lie in \[0, num_experts=8\)"),
    ("custom_negative_ids", _set(custom_routing_function=_routing(lambda g, k: (_good_routing(g, k)[0], -_good_routing(g, k)[1] - 1))), ValueError, r"topk_ids must lie in \[0, num_experts=8\)"),
    ("custom_ids_other_device", _set(custom_routing_function=_routing(lambda g, k: (_good_routing(g, k)[0], _good_routing(g, k)[1].to("meta")))), ValueError, r"custom_routing_function's topk_ids is on meta"),
]


@pytest.mark.parametrize("mutate, exc, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(mutate, exc, pattern):
    kwargs = _base()
    mutate(kwargs)
    with pytest.raises(exc, match=pattern):
        fused_moe(**kwargs)


def test_enough_bad_input_cases():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


def test_the_base_call_is_valid():
    """Every bad case above differs from this valid call in the one way it names."""
    out = fused_moe(**_base())
    assert out.shape == (4, 16)


def test_an_infinite_swiglu_limit_means_no_clamping():
    kwargs = _base()
    out = fused_moe(**kwargs, activation="swigluoai", swiglu_limit=float("inf"))
    ref = fused_moe(**kwargs, activation="swigluoai", swiglu_limit=1e30)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_message_names_the_value_and_expectation():
    with pytest.raises(ValueError) as err:
        fused_moe(**{**_base(), "top_k": 11})
    msg = str(err.value)
    assert "top_k" in msg and "11" in msg and "[1, num_experts=8]" in msg


def test_bad_positional_order_is_caught():
    """Swapping num_experts and top_k positionally (8, 2 -> 2, 8) is reported, not silently run."""
    kw = _base()
    with pytest.raises(ValueError, match=r"router_logits\.shape\[-1\] must equal num_experts=2|top_k must be in"):
        fused_moe(kw["hidden_states"], kw["router_logits"], 2, 8, kw["w13_weight"], kw["w2_weight"])


@pytest.fixture
def world_of_four():
    """A fake 4-rank default group (no other processes): enough for the EP-size rules."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_ep_num_experts_not_divisible(world_of_four):
    # rule 20: num_experts % ep_size
    kwargs = make_inputs(experts=6)
    with pytest.raises(ValueError, match=r"num_experts=6 must be divisible by the ep_group size 4"):
        fused_moe(**kwargs, top_k=2, ep_group=world_of_four)


def test_ep_local_expert_count(world_of_four):
    kwargs = make_inputs(experts=8)  # all 8 experts, but each of 4 EP ranks holds 2
    with pytest.raises(ValueError, match=r"w13_weight\.shape\[0\]=8 must equal num_experts / ep_size"):
        fused_moe(**kwargs, top_k=2, ep_group=world_of_four)
