"""fused_moe(..., lowering="npu") under the emulation matches the reference lowering ("cpu").

Every routing mode, activation and dtype, with poison=True (any read of an undefined row would turn
the output NaN) and the expected torch_npu ops counted. Tolerances: fp32 1e-5, bf16 2e-2.
"""
import pytest
import torch

from moe_compile import fused_moe
from moe_compile.lowering import get_lowering
from moe_compile.ops.config import Lowering
from moe_compile.testing import emulated_npu

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
GATE_SOFTMAX, GATE_TOPK = "npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k"


def _weights(num_experts, hidden, inter, dtype, gated=True, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 2 * inter if gated else inter
    # HF layout [E, 2I, H] handed over as a transposed view, as the pass does
    w13 = (torch.randn(num_experts, width, hidden, generator=g) / hidden**0.5).to(dtype).transpose(1, 2)
    w2 = (torch.randn(num_experts, inter, hidden, generator=g) / inter**0.5).to(dtype)
    b13 = (torch.randn(num_experts, width, generator=g) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(num_experts, hidden, generator=g) * 0.1).to(dtype) if bias else None
    return w13, w2, b13, b2


def _inputs(num_tokens, hidden, num_experts, dtype, seed=1, shape=None):
    g = torch.Generator().manual_seed(seed)
    lead = shape or (num_tokens,)
    x = torch.randn(*lead, hidden, generator=g).to(dtype)
    logits = torch.randn(*lead, num_experts, generator=g).to(dtype)
    return x, logits


def _compare(kwargs, *, dtype=torch.float32, num_experts=8, top_k=2, hidden=16, inter=8, gated=True,
             bias=False, shape=None, poison=True):
    w13, w2, b13, b2 = _weights(num_experts, hidden, inter, dtype, gated, bias)
    x, logits = _inputs(7, hidden, num_experts, dtype, shape=shape)
    args = (x, logits, num_experts, top_k, w13, w2, b13, b2)
    ref = fused_moe(*args, lowering="cpu", **kwargs)
    with emulated_npu(poison=poison) as npu:
        out = fused_moe(*args, lowering="npu", **kwargs)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, **TOL[dtype])
    return npu.calls


ROUTING = {
    "softmax": (dict(), GATE_SOFTMAX),
    "softmax_renorm": (dict(renormalize=True), GATE_SOFTMAX),
    "softmax_groups_mode0": (dict(group_count=4, k_group=2, num_experts=16, renormalize=True), GATE_TOPK),
    "softmax_groups_mode1": (dict(group_count=4, k_group=2, group_select_mode=1, num_experts=16), GATE_TOPK),
    "softmax_bias": (dict(bias_E=True, renormalize=True), GATE_TOPK),
    "sigmoid": (dict(routing_method="sigmoid"), GATE_TOPK),
    "sigmoid_deepseek": (dict(routing_method="sigmoid", bias_E=True, group_count=4, k_group=2, num_experts=16,
                              routed_scaling_factor=2.5, top_k=3), GATE_TOPK),
    "softmax_scaling": (dict(routed_scaling_factor=0.5, renormalize=True), GATE_SOFTMAX),
    # the NPU gating ops cannot express these: plain torch routing, no gating op
    "scoring_after_topk": (dict(scoring_after_topk=True), None),
    "sigmoid_unnormalised": (dict(routing_method="sigmoid", normalize_sigmoid=False), None),
    "groups_too_small": (dict(group_count=4, k_group=2), None),  # 2 experts per group: 2.14 needs > 2
}


@pytest.mark.parametrize("name", sorted(ROUTING))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_modes_match_reference(name, dtype):
    spec, gate_op = ROUTING[name]
    spec = dict(spec)
    num_experts = spec.pop("num_experts", 8)
    top_k = spec.pop("top_k", 2)
    if spec.pop("bias_E", False):
        spec["e_score_correction_bias"] = (torch.randn(num_experts, generator=torch.Generator().manual_seed(9)) * 0.1)
    calls = _compare(spec, dtype=dtype, num_experts=num_experts, top_k=top_k)
    gating = {op: calls[op] for op in (GATE_SOFTMAX, GATE_TOPK) if calls[op]}
    assert gating == ({} if gate_op is None else {gate_op: 1})
    assert calls["npu_moe_init_routing_v2"] == 1 and calls["npu_grouped_matmul"] == 2
    assert calls["npu_swiglu"] == 1


ACTIVATIONS = {
    "silu": (dict(activation="silu"), True, False, 1),
    "silu_bias": (dict(activation="silu"), True, True, 1),
    "gelu": (dict(activation="gelu"), True, False, 0),
    "gelu_tanh": (dict(activation="gelu_tanh"), True, False, 0),
    "swigluoai_interleaved_bias": (dict(activation="swigluoai", gate_up_interleaved=True), True, True, 0),
    "silu_clamped_bias": (dict(activation="silu_clamped", swiglu_limit=0.5), True, True, 0),
    "silu_interleaved": (dict(activation="silu", gate_up_interleaved=True), True, False, 0),
    "silu_no_mul": (dict(activation="silu_no_mul"), False, False, 0),
    "relu2_no_mul_bias": (dict(activation="relu2_no_mul"), False, True, 0),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_match_reference(name, dtype):
    kwargs, gated, bias, swiglu_calls = ACTIVATIONS[name]
    calls = _compare(kwargs, dtype=dtype, gated=gated, bias=bias)
    assert calls["npu_swiglu"] == swiglu_calls and calls["npu_grouped_matmul"] == 2


def test_custom_routing_function_skips_the_gating_ops():
    def route(hidden_states, gating_output, topk, renormalize):
        w, ids = torch.topk(torch.sigmoid(gating_output.float()), topk, dim=-1)
        return w, ids.to(torch.int32)

    calls = _compare(dict(custom_routing_function=route, routed_scaling_factor=1.5))
    assert calls[GATE_SOFTMAX] == calls[GATE_TOPK] == 0 and calls["npu_moe_init_routing_v2"] == 1


def test_router_weight_on_input_top1():
    calls = _compare(dict(routing_method="sigmoid", scoring_after_topk=True, normalize_sigmoid=False,
                          apply_router_weight_on_input=True), top_k=1)
    assert calls["npu_grouped_matmul"] == 2


@pytest.mark.parametrize("poison", [False, True])
def test_3d_hidden_states_and_top1(poison):
    _compare(dict(renormalize=True), shape=(2, 3), top_k=1, poison=poison)


def test_experts_no_token_picks_and_top_k_equals_num_experts():
    _compare(dict(), num_experts=4, top_k=4)  # every expert busy
    _compare(dict(), num_experts=12, top_k=1)  # 7 tokens: several experts get no rows


def test_bf16_bias_is_cast_once_not_per_call():
    w13, w2, b13, b2 = _weights(8, 16, 8, torch.bfloat16, bias=True)
    x, logits = _inputs(5, 16, 8, torch.bfloat16)
    lowering = get_lowering(Lowering.NPU)
    with emulated_npu():
        before = lowering.layouts.misses
        first = fused_moe(x, logits, 8, 2, w13, w2, b13, b2, lowering="npu")
        second = fused_moe(x, logits, 8, 2, w13, w2, b13, b2, lowering="npu")
        assert lowering.layouts.misses - before == 2  # one fp32 copy per bias, reused
        b13.mul_(2.0)  # an in-place update bumps the version: the copy is rebuilt
        third = fused_moe(x, logits, 8, 2, w13, w2, b13, b2, lowering="npu")
        assert lowering.layouts.misses - before == 3
    assert torch.equal(first, second) and not torch.equal(first, third)
    torch.testing.assert_close(third, fused_moe(x, logits, 8, 2, w13, w2, b13, b2, lowering="cpu"),
                               **TOL[torch.bfloat16])


# -- static EP stages in one process: each "rank" runs its expert range; the partials sum to the reference
def _ep_partials(x, ids, weights, w13, w2, ep_size, combine=None):
    from moe_compile.lowering.npu_comm import Comm, CommMode
    from moe_compile.modular import ExpertWeights
    from moe_compile.ops.config import ExpertsConfig

    lowering = get_lowering(Lowering.NPU)
    num_experts, num_local = w13.shape[0], w13.shape[0] // ep_size
    partials = []
    for rank in range(ep_size):
        local = slice(rank * num_local, (rank + 1) * num_local)
        comm = Comm(CommMode.EP, "unused", ep_size, rank)
        disp = lowering.dispatch(x, ids, num_experts, num_local, comm)
        y = lowering.mlp(disp.x_RH, disp.group_list, ExpertWeights(w13[local], w2[local]), ExpertsConfig())
        partials.append((combine or lowering.combine)(y, disp.row_idx_P, weights, *ids.shape))
    return partials


def _ep_case(seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    w13, w2, _, _ = _weights(8, 16, 8, torch.float32, seed=seed)
    x = torch.randn(6, 16, generator=g)
    logits = torch.randn(6, 8, generator=g)
    if skew:
        logits[:, 4:] -= 100.0  # every token picks experts 0-3: rank 1 receives no rows at all
    weights, ids = torch.topk(torch.softmax(logits, -1), 2)
    return x, logits, weights, ids.to(torch.int32), w13, w2


@pytest.mark.parametrize("skew", [False, True])
def test_static_ep_partials_sum_to_reference_under_poison(skew):
    x, logits, weights, ids, w13, w2 = _ep_case(skew=skew)
    ref = fused_moe(x, logits, 8, 2, w13, w2, lowering="cpu")
    with emulated_npu(poison=True) as npu:
        partials = _ep_partials(x, ids, weights, w13, w2, ep_size=2)
    assert npu.calls["npu_moe_init_routing_v2"] == 2
    for part in partials:
        assert not torch.isnan(part).any()
    if skew:
        assert torch.equal(partials[1], torch.zeros_like(partials[1]))
    torch.testing.assert_close(partials[0] + partials[1], ref, **TOL[torch.float32])


def test_poison_catches_the_abs_row_idx_trap():
    """MindIE-SD's combine (abs(row_idx) into token_unpermute, non-local weights zeroed) reads an
    undefined row: under poison it turns NaN, which is why the lowering's combine selects instead."""
    x, logits, weights, ids, w13, w2 = _ep_case(skew=True)

    def mindie_combine(y, row_idx, w, num_tokens, top_k):
        import torch_npu

        local_w = w * (row_idx.view(num_tokens, top_k) >= 0)
        return torch_npu.npu_moe_token_unpermute(y, row_idx.abs(), probs=local_w.to(y.dtype))

    with emulated_npu(poison=True):
        trapped = _ep_partials(x, ids, weights, w13, w2, ep_size=2, combine=mindie_combine)
    assert torch.isnan(trapped[1]).all()
    with emulated_npu(poison=False):
        quiet = _ep_partials(x, ids, weights, w13, w2, ep_size=2, combine=mindie_combine)
    assert not torch.isnan(quiet[1]).any()  # without poison the trap stays invisible


@pytest.mark.parametrize("kwargs", [dict(), dict(routing_method="sigmoid", group_count=2, k_group=1),
                                    dict(scoring_after_topk=True)])
def test_zero_tokens(kwargs):
    w13, w2, _, _ = _weights(8, 16, 8, torch.float32)
    x, logits = torch.randn(0, 16), torch.randn(0, 8)
    with emulated_npu(poison=True):
        out = fused_moe(x, logits, 8, 2, w13, w2, lowering="npu", **kwargs)
    assert out.shape == (0, 16)
