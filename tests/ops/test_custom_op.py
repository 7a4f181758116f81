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


def _raw_args(**changes):
    """``torch.ops.moe_compile.fused_moe`` arguments (8 experts, H=16, I=8), with ``changes``: a tensor by
    name or a scalar option."""
    t = make_inputs(seed=6)
    tensors = dict(hidden_states=t["hidden_states"], router_logits=t["router_logits"], w13_weight=t["w13_weight"],
                   w2_weight=t["w2_weight"], w13_bias=None, w2_bias=None, e_score_correction_bias=None)
    kwargs = {**ROUTING, **COMMON}
    for name, value in changes.items():
        (tensors if name in tensors else kwargs)[name] = value
    return tuple(tensors.values()), kwargs


RAW_CASES = [  # (id, changes, message): the raw op used to run most of these silently or fail deep inside
    ("top_k_above_num_experts", dict(top_k=9), r"top_k must be in \[1, num_experts=8\], but got 9"),
    ("top_k_zero", dict(top_k=0), r"top_k must be in \[1, num_experts=8\], but got 0"),
    ("num_experts_vs_logits", dict(num_experts=16), r"router_logits\.shape\[-1\] must equal num_experts=16"),
    ("hidden_states_1d", dict(hidden_states=torch.randn(16), router_logits=torch.randn(8)),
     r"hidden_states must have >= 2 dims .*\(16,\)"),
    ("router_logits_1d", dict(router_logits=torch.randn(8)), r"router_logits must have >= 2 dims"),
    ("group_count_3", dict(group_count=3), r"num_experts=8 must be divisible by group_count=3"),
    ("w2_wrong_intermediate", dict(w2_weight=torch.randn(8, 7, 16)),
     r"w13_weight\.shape\[2\]=16 must equal 2 \* intermediate_size=14"),
    ("w2_wrong_hidden", dict(w2_weight=torch.randn(8, 8, 12)), r"w2_weight\.shape\[2\]=12 must equal hidden_size=16"),
    ("w13_2d", dict(w13_weight=torch.randn(16, 16)), r"w13_weight must be 3-D"),
    ("local_experts_without_ep", dict(w13_weight=torch.randn(4, 16, 16), w2_weight=torch.randn(4, 8, 16)),
     r"w13_weight\.shape\[0\]=4 must equal num_experts=8"),
    ("intermediate_zero", dict(w13_weight=torch.randn(8, 16, 0), w2_weight=torch.randn(8, 0, 16)),
     r"intermediate_size \(w2_weight\.shape\[1\]\) must be >= 1"),
    ("routing_method_relu", dict(routing_method="relu"),
     r"routing_method must be one of \['softmax', 'sigmoid', 'sqrtsoftplus'\], but got 'relu'"),
    ("scaling_nan", dict(routed_scaling_factor=float("nan")), r"routed_scaling_factor must be a finite float.*nan"),
    ("activation_unknown", dict(activation="tanh"), r"activation must be one of .*'tanh'"),
]


@pytest.mark.parametrize("changes, pattern", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_raw_fused_moe_op_checks_its_arguments(changes, pattern):
    """Called through ``torch.ops`` (not the ``fused_moe`` wrapper), the op still refuses bad arguments."""
    args, kwargs = _raw_args(**changes)
    with pytest.raises(ValueError, match=pattern):
        torch.ops.moe_compile.fused_moe(*args, **kwargs)


def _raw_experts_args(**changes):
    t = make_inputs(seed=7)
    weights, ids = seed_custom_routing_function(None, t["router_logits"], 2, True)
    tensors = dict(hidden_states=t["hidden_states"], topk_weights=weights, topk_ids=ids.to(torch.int32),
                   w13_weight=t["w13_weight"], w2_weight=t["w2_weight"], w13_bias=None, w2_bias=None)
    kwargs = dict(num_experts=8, **COMMON)
    for name, value in changes.items():
        (tensors if name in tensors else kwargs)[name] = value
    return tuple(tensors.values()), kwargs


RAW_EXPERTS_CASES = [
    ("top_k_above_num_experts", dict(topk_weights=torch.rand(5, 9), topk_ids=torch.zeros(5, 9, dtype=torch.int32)),
     r"topk_ids\.shape\[1\] \(top_k\) must be in \[1, num_experts=8\], but got 9"),
    ("topk_shapes_differ", dict(topk_weights=torch.rand(5, 3)), r"topk_weights and topk_ids must both be"),
    ("topk_tokens", dict(topk_weights=torch.rand(4, 2), topk_ids=torch.zeros(4, 2, dtype=torch.int32)),
     r"topk_ids\.shape\[0\]=4 must equal the number of tokens of hidden_states \(shape \(5, 16\)\)"),
    ("w13_wrong_hidden", dict(w13_weight=torch.randn(8, 12, 16)), r"w13_weight\.shape\[1\]=12 must equal hidden_size"),
    ("swiglu_alpha_inf", dict(swiglu_alpha=float("inf")), r"swiglu_alpha must be a finite float"),
]


@pytest.mark.parametrize("changes, pattern", [c[1:] for c in RAW_EXPERTS_CASES],
                         ids=[c[0] for c in RAW_EXPERTS_CASES])
def test_raw_fused_experts_op_checks_its_arguments(changes, pattern):
    args, kwargs = _raw_experts_args(**changes)
    with pytest.raises(ValueError, match=pattern):
        torch.ops.moe_compile.fused_experts(*args, **kwargs)


def _compile_raw_op(monkeypatch, op, args, kwargs):
    """Compile a function calling the raw op; the op must never run (the error comes at compile time)."""
    from moe_compile.ops import custom_op

    for name in ("fused_moe_impl", "fused_experts_impl"):
        monkeypatch.setattr(custom_op, name, lambda *a: pytest.fail("the op ran: not refused at compile time"))
    hidden, rest = args[0], args[1:]
    torch._dynamo.reset()  # a fresh compile: no sizes or options made dynamic by an earlier test's
    compiled = torch.compile(lambda hs: op(hs, *rest, **kwargs), backend="aot_eager", fullgraph=True)
    return compiled(hidden)


@pytest.mark.parametrize("changes, pattern", [
    (dict(top_k=9), r"top_k must be in \[1, num_experts=8\], but got 9"),
    (dict(routing_method="relu"), r"routing_method must be one of"),
    (dict(group_count=3), r"num_experts=8 must be divisible by group_count=3"),
    # caught by the fake's full tensor checks only (not among the cheap per-call ones)
    (dict(router_logits=torch.randn(3, 8)), r"router_logits leading dims \(3,\) must match"),
    (dict(w13_weight=torch.randn(8, 16, 16, dtype=torch.bfloat16)), r"w13_weight\.dtype must equal"),
], ids=["top_k", "routing_method", "group_count", "leading_dims", "w13_dtype"])
def test_compiled_raw_op_refuses_bad_arguments_at_compile_time(changes, pattern, monkeypatch):
    args, kwargs = _raw_args(**changes)
    with pytest.raises(Exception, match=pattern):
        _compile_raw_op(monkeypatch, torch.ops.moe_compile.fused_moe, args, kwargs)


def test_compiled_raw_experts_op_refuses_integer_weights_at_compile_time(monkeypatch):
    args, kwargs = _raw_experts_args(topk_weights=torch.ones(5, 2, dtype=torch.int64))
    with pytest.raises(Exception, match=r"topk_weights\.dtype must be a floating dtype"):
        _compile_raw_op(monkeypatch, torch.ops.moe_compile.fused_experts, args, kwargs)


def test_compiled_raw_op_resolves_the_ep_group_by_name(monkeypatch):
    """The trace-time check knows the EP size from ``ep_group_name``: 8 local experts on a 4-rank group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        args, kwargs = _raw_args(ep_group_name=dist.group.WORLD.group_name)
        with pytest.raises(Exception, match=r"w13_weight\.shape\[0\]=8 must equal num_experts / ep_size"):
            _compile_raw_op(monkeypatch, torch.ops.moe_compile.fused_moe, args, kwargs)
    finally:
        dist.destroy_process_group()


def test_wrapper_eager_path_skips_the_ops_checks(monkeypatch):
    """``fused_moe()`` validated its arguments already: in eager it calls the implementation directly,
    without the op's per-call shape checks."""
    from moe_compile.ops import custom_op

    monkeypatch.setattr(custom_op, "check_op_shapes", lambda *a, **k: pytest.fail("checked twice"))
    t = make_inputs(seed=8)
    with torch.no_grad():
        out = fused_moe(t["hidden_states"], t["router_logits"], 8, 2, t["w13_weight"], t["w2_weight"])
    assert out.shape == t["hidden_states"].shape


def test_compiled_raw_op_with_int_options_made_dynamic():
    """Recompiling one function for other ``top_k`` values makes Dynamo pass ``top_k`` as a SymInt to the
    fake: its checks must take it (a cached ``make_config`` would fail: a SymInt does not hash)."""
    t = make_inputs(seed=9)
    torch._dynamo.reset()
    for top_k in (2, 3, 4):
        kwargs = {**ROUTING, **COMMON, "top_k": top_k}

        def f(hs):
            return torch.ops.moe_compile.fused_moe(hs, t["router_logits"], t["w13_weight"], t["w2_weight"], None,
                                                   None, None, **kwargs)

        out = torch.compile(f, backend="aot_eager", fullgraph=True)(t["hidden_states"])
        torch.testing.assert_close(out, f(t["hidden_states"]), atol=0, rtol=0)
