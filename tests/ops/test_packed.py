"""``moe_compile.ops.packed``: the fused ops with their scalars packed into one string compute what the plain
ops compute, ``pack_calls`` swaps them into a graph (not where a scalar is symbolic), and compiled graphs call
them (unless ``pack_args=False``), on Inductor's CPU path and under ``aot_eager``."""
from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
import torch.fx as fx
from torch._inductor.utils import run_and_get_code

import moe_compile  # noqa: F401  (registers the backend)
from moe_compile import fused_moe
from moe_compile.ops import packed
from moe_compile.ops.packed import FUSED_EXPERTS_SCALARS, FUSED_MOE_SCALARS, pack_calls, unpack

E, TOP_K, H, I = 8, 2, 32, 16
MOE_SCALARS = dict(num_experts=E, top_k=TOP_K, routing_method="softmax", renormalize=True, routed_scaling_factor=1.0,
                   k_group=1, group_count=1, group_select_mode=0, normalize_sigmoid=True, scoring_after_topk=False,
                   activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0, gate_up_interleaved=False,
                   apply_router_weight_on_input=False, tp_group_name=None, ep_group_name=None, dispatcher_type=None,
                   tokens_full=True, reduce_results=True, lowering="auto")
EXPERTS_SCALARS = {k: MOE_SCALARS[k] for k in (
    "num_experts", "activation", "swiglu_alpha", "swiglu_limit", "gate_up_interleaved", "apply_router_weight_on_input",
    "tp_group_name", "ep_group_name", "dispatcher_type", "tokens_full", "reduce_results", "lowering")}


def _tensors(seed=0, tokens=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).transpose(1, 2)  # HF's [E, N, K] as [E, K, N]
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).transpose(1, 2)
    return x, logits, w13, w2


def test_unpack_names_the_argument_and_what_it_expects():
    assert unpack(json.dumps([1, "a", None, 1.5, True]), 5) == (1, "a", None, 1.5, True)
    with pytest.raises(ValueError, match=r"scalars='\[1, 2' is not the JSON list pack_calls writes"):
        unpack("[1, 2", 2)
    with pytest.raises(ValueError, match="must be a JSON list of 3 values"):
        unpack("[1, 2]", 3)
    with pytest.raises(ValueError, match="must be a JSON list of 1 values"):
        unpack('{"a": 1}', 1)
    assert FUSED_MOE_SCALARS == len(MOE_SCALARS) and FUSED_EXPERTS_SCALARS == len(EXPERTS_SCALARS)


def _plain_and_packed(name, scalars, seed):
    """Both ops' outputs on the same inputs: ``fused_moe`` on router logits, ``fused_experts`` on its top-k."""
    x, logits, w13, w2 = _tensors(seed)
    if name == "fused_moe":
        tensors = (x, logits, w13, w2, None, None, None)
    else:
        weights, ids = torch.topk(logits.softmax(-1), TOP_K)
        tensors = (x, weights, ids.to(torch.int32), w13, w2, None, None)
    plain = getattr(torch.ops.moe_compile, name).default(*tensors, **scalars)
    packed_op = getattr(torch.ops.moe_compile, name + "_packed").default
    return plain, packed_op(*tensors, json.dumps(list(scalars.values())))


@pytest.mark.parametrize("name,scalars", [
    ("fused_moe", MOE_SCALARS),
    ("fused_moe", {**MOE_SCALARS, "routing_method": "sigmoid", "renormalize": False, "routed_scaling_factor": 2.5,
                   "activation": "gelu"}),
    ("fused_experts", EXPERTS_SCALARS)])
def test_packed_op_equals_the_plain_op(name, scalars):
    plain, got = _plain_and_packed(name, scalars, seed=1)
    torch.testing.assert_close(got, plain, rtol=0, atol=0)


def test_packed_ops_pass_opcheck():
    x, logits, w13, w2 = _tensors(2)
    text = json.dumps(list(MOE_SCALARS.values()))
    torch.library.opcheck(torch.ops.moe_compile.fused_moe_packed.default, (x, logits, w13, w2, None, None, None, text),
                          test_utils=("test_schema", "test_faketensor"))


def test_packed_op_checks_its_scalars_like_the_plain_op():
    x, logits, w13, w2 = _tensors()
    bad = list({**MOE_SCALARS, "top_k": E + 1}.values())
    with pytest.raises(ValueError, match="top_k"):
        torch.ops.moe_compile.fused_moe_packed.default(x, logits, w13, w2, None, None, None, json.dumps(bad))


def _graph_with_plain_call(top_k):
    graph = fx.Graph()
    x, logits, w13, w2 = (graph.placeholder(n) for n in ("x", "logits", "w13", "w2"))
    node = graph.call_function(torch.ops.moe_compile.fused_moe.default, (x, logits, w13, w2, None, None, None),
                               {**MOE_SCALARS, "top_k": top_k})
    graph.output(node)
    return graph


def test_pack_calls_swaps_the_node_and_keeps_what_it_computes():
    graph = _graph_with_plain_call(TOP_K)
    before = fx.GraphModule({}, graph)(*_tensors())
    assert pack_calls(graph) == 1
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.moe_compile.fused_moe_packed.default]
    after = fx.GraphModule({}, graph)(*_tensors())
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert pack_calls(graph) == 0  # nothing left to pack


def test_pack_calls_leaves_a_symbolic_scalar_as_it_is_and_says_why(moe_log):
    graph = fx.Graph()
    k = graph.placeholder("k")
    node = graph.call_function(torch.ops.moe_compile.fused_moe.default, (k, k, k, k, None, None, None),
                               {**MOE_SCALARS, "top_k": k})  # a node where an int goes: a SymInt's shape
    graph.output(node)
    with moe_log.at_level(logging.DEBUG, logger="moe_compile"):
        assert pack_calls(graph) == 0
    assert node in graph.nodes
    assert "keeps its plain call: top_k=k is not a plain value to pack" in moe_log.text


def _layer(w13, w2):
    def layer(x, logits):
        return fused_moe(x, logits, E, TOP_K, w13, w2, renormalize=True) * 2.0
    return layer


def _compile_and_run(options, tokens=9):
    x, logits, w13, w2 = _tensors(3, tokens)
    fn = _layer(w13, w2)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="moe_npu", options=options, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a pass failure falls back with a RuntimeWarning
        with torch.no_grad():
            out, code = run_and_get_code(compiled, x, logits)
    torch.testing.assert_close(out, fn(x, logits), rtol=1e-5, atol=1e-5)
    return "\n".join(code)


def test_inductor_calls_the_packed_op():
    code = _compile_and_run({"cpu_decode": False})
    assert "torch.ops.moe_compile.fused_moe_packed.default(" in code
    assert "torch.ops.moe_compile.fused_moe.default(" not in code


def test_pack_args_false_keeps_the_plain_call():
    code = _compile_and_run({"cpu_decode": False, "pack_args": False})
    assert "torch.ops.moe_compile.fused_moe.default(" in code
    assert "fused_moe_packed" not in code
    with pytest.raises(TypeError, match=r"options\['pack_args'\] must be a bool"):
        moe_compile.options.parse_options({"pack_args": "yes"})


def test_aot_eager_runs_the_packed_op(monkeypatch):
    calls = []
    monkeypatch.setattr(packed, "unpack", lambda text, count: (calls.append(text), unpack(text, count))[1])
    x, logits, w13, w2 = _tensors(4)
    fn = _layer(w13, w2)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    with torch.no_grad():
        out = compiled(x, logits)
    torch.testing.assert_close(out, fn(x, logits), rtol=1e-6, atol=1e-6)
    assert calls and json.loads(calls[-1])[1] == TOP_K
