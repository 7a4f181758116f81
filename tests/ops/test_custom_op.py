"""The custom ops ``moe_compile::fused_moe`` / ``moe_compile::fused_experts``: ``torch.library.opcheck``
and torch.compile(fullgraph=True) tracing ``fused_moe`` as one opaque node with no graph break.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import make_boxed_func

from moe_compile import fused_moe
from moe_inputs import make_inputs, seed_custom_routing_function

FUSED_MOE = torch.ops.moe_compile.fused_moe.default
FUSED_EXPERTS = torch.ops.moe_compile.fused_experts.default

COMMON = dict(activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0, gate_up_interleaved=False,
              apply_router_weight_on_input=False, tp_group_name=None, ep_group_name=None, dispatcher_type=None,
              tokens_full=True, reduce_results=True, lowering="auto")
ROUTING = dict(num_experts=8, top_k=2, routing_method="softmax", renormalize=False, routed_scaling_factor=1.0,
               k_group=1, group_count=1, group_select_mode=0, normalize_sigmoid=True, scoring_after_topk=False)


def _fused_moe_args(name):
    spec, routing, common, bias = dict(seed=1), dict(ROUTING), dict(COMMON), None
    if name == "bias_3d_bf16":
        spec.update(lead=(2, 3), dtype=torch.bfloat16, bias=True)
    elif name == "grouped_sigmoid_correction_bias":
        routing.update(routing_method="sigmoid", group_count=4, k_group=2, group_select_mode=1, top_k=3,
                       routed_scaling_factor=2.5)
        bias = torch.linspace(-0.2, 0.2, 8)
    elif name == "swigluoai_hf_layout":
        spec.update(hf_layout=True, bias=True)
        common.update(activation="swigluoai", gate_up_interleaved=True, swiglu_limit=0.5)
    elif name == "noncontiguous_hidden_fp16":
        spec.update(dtype=torch.float16)
    elif name == "zero_tokens":
        spec.update(lead=(0,))
    t = make_inputs(**spec)
    hs = t["hidden_states"]
    if name == "noncontiguous_hidden_fp16":
        hs = hs.t().contiguous().t()
    args = (hs, t["router_logits"], t["w13_weight"], t["w2_weight"], t.get("w13_bias"), t.get("w2_bias"), bias)
    return args, {**routing, **common}


@pytest.mark.parametrize("name", ["plain", "bias_3d_bf16", "grouped_sigmoid_correction_bias", "swigluoai_hf_layout",
                                  "noncontiguous_hidden_fp16", "zero_tokens"])
def test_opcheck_fused_moe(name):
    args, kwargs = _fused_moe_args(name)
    torch.library.opcheck(FUSED_MOE, args, kwargs)


def _fused_experts_args(name):
    spec, common, top_k = dict(seed=2), dict(COMMON), 2
    if name == "bf16_bias":
        spec.update(dtype=torch.bfloat16, bias=True)
    elif name == "top1_weight_on_input":
        common.update(apply_router_weight_on_input=True)
        top_k = 1
    elif name == "non_gated_3d":
        spec.update(gated=False, lead=(2, 2))
        common.update(activation="relu2_no_mul")
    t = make_inputs(**spec)
    weights, ids = seed_custom_routing_function(None, t["router_logits"].reshape(-1, 8), top_k, True)
    args = (t["hidden_states"], weights.float(), ids.to(torch.int32), t["w13_weight"], t["w2_weight"],
            t.get("w13_bias"), t.get("w2_bias"))
    return args, dict(num_experts=8, **common)


@pytest.mark.parametrize("name", ["plain", "bf16_bias", "top1_weight_on_input", "non_gated_3d"])
def test_opcheck_fused_experts(name):
    args, kwargs = _fused_experts_args(name)
    torch.library.opcheck(FUSED_EXPERTS, args, kwargs)


def _capturing_backend():
    """A backend that records the Dynamo graphs and the post-dispatch (aten) forward graphs."""
    dynamo_graphs, aten_graphs = [], []

    def forward_compiler(gm, example_inputs):
        aten_graphs.append(gm)
        return make_boxed_func(gm.forward)

    inner = aot_autograd(fw_compiler=forward_compiler)

    def backend(gm, example_inputs):
        dynamo_graphs.append(gm)
        return inner(gm, example_inputs)

    return backend, dynamo_graphs, aten_graphs


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.mark.parametrize("custom", [False, True], ids=["builtin_routing", "custom_routing_function"])
def test_compile_traces_one_opaque_node(custom):
    t = make_inputs(lead=(2, 3), bias=True, seed=3)
    extra = dict(custom_routing_function=seed_custom_routing_function) if custom else {}

    def f(hs, logits):
        return fused_moe(hs, logits, 8, 2, t["w13_weight"], t["w2_weight"], t["w13_bias"], t["w2_bias"],
                         renormalize=True, routed_scaling_factor=0.5, **extra)

    backend, dynamo_graphs, aten_graphs = _capturing_backend()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    out = compiled(t["hidden_states"], t["router_logits"])
    torch.testing.assert_close(out, f(t["hidden_states"], t["router_logits"]), atol=1e-6, rtol=1e-6)
    assert len(dynamo_graphs) == 1 and len(aten_graphs) == 1  # one graph: no break
    want, other = (FUSED_EXPERTS, FUSED_MOE) if custom else (FUSED_MOE, FUSED_EXPERTS)
    assert _count(aten_graphs[0], want) == 1
    assert _count(aten_graphs[0], other) == 0
    # the op stays opaque: none of its internals (GEMMs, sorting) leak into the graph
    leaked = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.sort.stable,
              torch.ops.aten.index_add.default}
    assert not [n for n in aten_graphs[0].graph.nodes if n.target in leaked]


def test_compile_aot_eager_with_dynamic_tokens():
    t = make_inputs(seed=4)
    counter = CompileCounterWithBackend("aot_eager")

    def f(hs, logits):
        return fused_moe(hs, logits, 8, 2, t["w13_weight"], t["w2_weight"], group_count=4, k_group=2,
                         routing_method="sigmoid")

    compiled = torch.compile(f, fullgraph=True, backend=counter, dynamic=True)
    frames = None
    for tokens in (4, 7, 9):  # (1 would be specialised by Dynamo's 0/1 rule, whatever the op does)
        x = make_inputs(tokens=tokens, seed=tokens)
        out = compiled(x["hidden_states"], x["router_logits"])
        torch.testing.assert_close(out, f(x["hidden_states"], x["router_logits"]), atol=1e-6, rtol=1e-6)
        frames = counter.frame_count if frames is None else frames
    # no recompile for new token counts (the first compile may count twice: Dynamo restarts its
    # analysis once to specialise the float defaults)
    assert counter.frame_count == frames
    assert _count(counter.graphs[-1], torch.ops.moe_compile.fused_moe) == 1


def test_compile_inductor():
    t = make_inputs(lead=(2, 3), dtype=torch.bfloat16, bias=True, seed=5)
    counter = CompileCounterWithBackend("inductor")

    def f(hs, logits):
        return fused_moe(hs, logits, 8, 2, t["w13_weight"], t["w2_weight"], t["w13_bias"], t["w2_bias"],
                         renormalize=True)

    compiled = torch.compile(f, fullgraph=True, backend=counter)
    out = compiled(t["hidden_states"], t["router_logits"])
    torch.testing.assert_close(out, f(t["hidden_states"], t["router_logits"]), atol=0, rtol=0)
    assert counter.frame_count == 1
    assert _count(counter.graphs[0], torch.ops.moe_compile.fused_moe) == 1
