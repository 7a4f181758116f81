"""The CPU decode path: fused-op nodes of a graph with a fixed, small token count become gather-GEMVs
that Inductor compiles with the graph (``moe_compile/lowering/cpu_decode.py``).

Every case is checked against the float64 reference (fp32 1e-4, bf16 2e-2, as for the op) and, in
fp32, against the same graph compiled with the op (``cpu_decode=False``) within 1e-5; the counter
says whether the path was taken, so a node that silently kept the op fails the test.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from moe_compile import fused_moe
from moe_compile.lowering.cpu_decode import PAIRS_PER_EXPERT, pair_experts, skip_reason
from moe_compile.modular import ExpertWeights
from moe_compile.ops.config import Activation, ExpertsConfig
from moe_compile.testing.moe_reference import assert_close_to_reference, reference_experts, reference_fused_moe

E, H, I = 8, 32, 16


def _weights(dtype=torch.float32, *, gated=True, biases=False, seed=0):
    """K-major expert weights as HF stores them: ``[E, 2I, H]`` / ``[E, H, I]`` storage, op views."""
    gen = torch.Generator().manual_seed(seed)
    n13 = 2 * I if gated else I
    w13 = (torch.randn(E, n13, H, generator=gen) / H ** 0.5).to(dtype).transpose(1, 2)
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dtype).transpose(1, 2)
    b13 = torch.randn(E, n13, generator=gen).to(dtype) if biases else None
    b2 = torch.randn(E, H, generator=gen).to(dtype) if biases else None
    return w13, w2, b13, b2


def _compiled(fn, **options):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(fn, backend="moe_npu", options={"inner_compiler": "inductor", **options})


def _taken() -> int:
    return torch._dynamo.utils.counters["moe_compile"]["cpu_decode"]


CASES = {
    "softmax-silu": dict(top_k=2, renormalize=True),
    "grouped-sigmoid-bias-scale": dict(top_k=2, routing_method="sigmoid", k_group=2, group_count=4,
                                       routed_scaling_factor=2.5, bias=True),
    "swigluoai-interleaved-biases": dict(top_k=2, activation="swigluoai", gate_up_interleaved=True, biases=True,
                                         swiglu_limit=1.5),
    "relu2-weight-on-input-after-topk": dict(top_k=1, activation="relu2_no_mul", routing_method="sigmoid",
                                             scoring_after_topk=True, normalize_sigmoid=False,
                                             apply_router_weight_on_input=True),
}


def _case(name: str, dtype, tokens: int):
    spec = dict(CASES[name])
    biases, bias = spec.pop("biases", False), spec.pop("bias", False)
    gated = not spec.get("activation", "silu").endswith("no_mul")
    w13, w2, b13, b2 = _weights(dtype, gated=gated, biases=biases)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    logits = torch.randn(tokens, E, generator=gen).to(dtype)
    if bias:
        spec["e_score_correction_bias"] = torch.randn(E, generator=gen)
    return x, logits, w13, w2, b13, b2, spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_op_takes_the_path_and_matches(name, dtype):
    x, logits, w13, w2, b13, b2, spec = _case(name, dtype, tokens=3)

    def layer(x, logits):
        return fused_moe(x, logits, E, spec["top_k"], w13, w2, b13, b2,
                         **{k: v for k, v in spec.items() if k != "top_k"})

    ref = reference_fused_moe(x, logits, E, spec["top_k"], w13, w2, b13, b2,
                              **{k: v for k, v in spec.items() if k != "top_k"})
    with torch.no_grad():
        out = _compiled(layer)(x, logits)
        assert _taken() == 1
        assert_close_to_reference(out, ref, dtype, name)
        if dtype == torch.float32:
            with_op = _compiled(layer, cpu_decode=False)(x, logits)
            assert _taken() == 0
            torch.testing.assert_close(out, with_op, rtol=1e-5, atol=1e-6)


def test_fused_experts_node_drops_ids_outside_the_experts():
    """The experts-only op (routing done outside): ids outside [0, E) contribute nothing, as in the op."""
    w13, w2, _, _ = _weights()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, H, generator=gen)
    ids = torch.tensor([[1, 5], [-1, 2], [7, E]], dtype=torch.int32)
    weights = torch.rand(3, 2, generator=gen)

    def experts(x, weights, ids):
        return torch.ops.moe_compile.fused_experts(x, weights, ids, w13, w2, None, None, E, "silu", 1.702, 7.0,
                                                   False, False, None, None, None, True, True, "auto")

    keep = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    ref = reference_experts(x, weights * keep, ids.clamp(0, E - 1), w13, w2)
    with torch.no_grad():
        out = _compiled(experts)(x, weights, ids)
    assert _taken() == 1
    assert_close_to_reference(out, ref, torch.float32)


def test_hf_blocks_at_one_token_take_the_path():
    from moe_compile.testing import zoo

    model, kwargs = zoo.build_model("qwen3_moe", experts_implementation="grouped_mm")
    kwargs = zoo.build_inputs("qwen3_moe", num_tokens=1)
    layers = zoo.expected_moe_layers("qwen3_moe")
    with torch.no_grad():
        ref = zoo.first_tensor(model(**kwargs))
        out = zoo.first_tensor(_compiled(model)(**kwargs))
        assert _taken() == layers
        with_op = zoo.first_tensor(_compiled(model, cpu_decode=False)(**kwargs))
        assert _taken() == 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, with_op, rtol=1e-5, atol=1e-6)


def _softmax_layer(w13, w2):
    def layer(x, logits):
        return fused_moe(x, logits, E, 2, w13, w2, renormalize=True)
    return layer


def test_many_tokens_and_symbolic_token_counts_keep_the_op():
    w13, w2, _, _ = _weights()
    layer = _softmax_layer(w13, w2)
    tokens = PAIRS_PER_EXPERT * E // 2 + 1  # one token past the limit
    x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
    ref = reference_fused_moe(x, logits, E, 2, w13, w2, renormalize=True)
    with torch.no_grad():
        assert_close_to_reference(_compiled(layer)(x, logits), ref, torch.float32)
        assert _taken() == 0
        assert_close_to_reference(_compiled(layer, cpu_decode=True)(x[:2], logits[:2]), ref[:2], torch.float32)
        assert _taken() == 1
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        dynamic = torch.compile(layer, backend="moe_npu", dynamic=True)
        assert_close_to_reference(dynamic(x[:3], logits[:3]), ref[:3], torch.float32)
        assert _taken() == 0


def test_n_major_weights_keep_the_op():
    w13, w2, _, _ = _weights()
    layer = _softmax_layer(w13.contiguous(), w2.contiguous())
    x, logits = torch.randn(2, H), torch.randn(2, E)
    with torch.no_grad():
        out = _compiled(layer)(x, logits)
    assert _taken() == 0
    assert_close_to_reference(out, reference_fused_moe(x, logits, E, 2, w13, w2, renormalize=True), torch.float32)


def _bound(**overrides) -> dict:
    """A fused_moe node's bound arguments, with tensor inputs as graph nodes that carry values."""
    graph = fx.Graph()
    w13, w2, _, _ = _weights()
    tensors = dict(hidden_states=torch.randn(2, H), router_logits=torch.randn(2, E), w13_weight=w13, w2_weight=w2)
    tensors.update({k: v for k, v in overrides.items() if isinstance(v, torch.Tensor)})
    bound = {}
    for name, value in tensors.items():
        node = graph.placeholder(name)
        node.meta["val"] = value
        bound[name] = node
    bound.update(w13_bias=None, w2_bias=None, e_score_correction_bias=None, top_k=2, lowering="auto",
                 tp_group_name=None, ep_group_name=None, dispatcher_type=None)
    bound.update({k: v for k, v in overrides.items() if not isinstance(v, torch.Tensor)})
    return bound


def test_skip_reasons_name_what_keeps_the_op():
    assert skip_reason(_bound()) is None
    assert "lowering='npu'" in skip_reason(_bound(lowering="npu"))
    assert "parallel" in skip_reason(_bound(ep_group_name="ep0"))
    assert "dtype" in skip_reason(_bound(hidden_states=torch.randn(2, H, dtype=torch.float64)))
    assert "K-major" in skip_reason(_bound(w2_weight=torch.randn(E, I, H)))
    assert "pairs" in skip_reason(_bound(hidden_states=torch.randn(PAIRS_PER_EXPERT * E, H), top_k=2))


def test_pair_experts_eager_matches_the_reference_for_every_activation():
    """The formulation itself (eager), over the activations the op takes."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, H, generator=gen)
    ids = torch.randint(0, E, (4, 2), generator=gen, dtype=torch.int32)
    weights = torch.rand(4, 2, generator=gen)
    for act in Activation:
        w13, w2, b13, b2 = _weights(gated=act.is_gated, biases=True)
        cfg = ExpertsConfig(activation=act, swiglu_alpha=1.5, swiglu_limit=2.0)
        out = pair_experts(x, weights, ids, ExpertWeights(w13, w2, b13, b2), cfg)
        ref = reference_experts(x, weights, ids, w13, w2, b13, b2, activation=act.value, alpha=1.5, limit=2.0)
        assert_close_to_reference(out, ref, torch.float32, act.value)


def test_option_is_a_bool():
    from moe_compile.options import parse_options

    assert parse_options({"cpu_decode": False}).cpu_decode is False
    with pytest.raises(TypeError, match="cpu_decode"):
        parse_options({"cpu_decode": "no"})
