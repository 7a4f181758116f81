"""No new graph breaks, and at most one recompile when the token count changes."""
from __future__ import annotations

import pytest
import torch

import moe_compile  # noqa: F401  (registers the backend)
from moe_compile.testing import zoo

from .helpers import TOL, GraphCounter, first_tensor, max_rel_diff


def _count_backend_calls(model, inputs_list, backend, options=None):
    calls = []

    def counting(gm, example_inputs, **kw):
        calls.append(len(gm.graph.nodes))
        from moe_compile.backend import moe_npu_backend

        return moe_npu_backend(gm, example_inputs, options=options) if backend == "moe_npu" else backend(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting)
    outs = []
    with torch.no_grad():
        for kwargs in inputs_list:
            outs.append(first_tensor(compiled(**kwargs)))
    return calls, outs


def test_token_count_change_recompiles_at_most_once_and_adds_no_graph_breaks():
    model, _ = zoo.build_model("qwen3_moe")
    inputs = [zoo.build_inputs("qwen3_moe", num_tokens=t) for t in (5, 9, 13)]
    baseline = GraphCounter()
    base_calls, _ = _count_backend_calls(model, inputs, baseline)
    calls, outs = _count_backend_calls(model, inputs, "moe_npu", {"inner_compiler": "aot_eager"})
    assert len(calls) <= 2, calls  # the first compile, then one dynamic-shape recompile
    assert len(calls) <= len(base_calls)
    with torch.no_grad():
        for kwargs, out in zip(inputs, outs):
            ref = first_tensor(model(**kwargs))
            assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] >= 2


def test_dynamic_true_rewrites_and_compiles_once(monkeypatch):
    """``torch.compile(..., dynamic=True)``: AOTAutograd asks Dynamo to trace the frame again with
    some scalars specialised (``TensorifyScalarRestartAnalysis``). That request is passed on, not
    taken for a failure of the pass (it was, until the eighteenth session: the original graph was
    compiled instead, with a warning), and the retrace is rewritten and counted once."""
    model, _ = zoo.build_model("qwen3_moe")
    inputs = [zoo.build_inputs("qwen3_moe", num_tokens=t) for t in (5, 9)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="moe_npu", dynamic=True, options={"inner_compiler": "inductor"})
    with torch.no_grad():
        for kwargs in inputs:
            out, ref = first_tensor(compiled(**kwargs)), first_tensor(model(**kwargs))
            assert max_rel_diff(out, ref) <= TOL[torch.float32]
    counters = torch._dynamo.utils.counters
    assert counters["moe_compile"]["pass_failed"] == 0, dict(counters["moe_compile"])
    assert counters["moe_compile"]["rewritten"] == zoo.expected_moe_layers("qwen3_moe")
    assert counters["moe_compile"]["skipped"] == 0


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2", "lfm2_moe"])
def test_dynamic_true_finds_scales_that_became_graph_inputs(name):
    """Under ``dynamic=True`` Dynamo turns a Python float such as ``routed_scaling_factor`` into a
    graph input, and AOTAutograd multiplies the weights by it as a 0-d tensor in a node with no
    module metadata. Those routers were left alone under dynamic=True (11 families, among them
    every DeepSeek-style one); the scale is now read from the input and the node counts as part of
    its block."""
    available, why = zoo.is_available(name, None)
    if not available:
        pytest.skip(why)
    model, _ = zoo.build_model(name)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="moe_npu", dynamic=True, options={"inner_compiler": "aot_eager"})
    with torch.no_grad():
        for tokens in (5, 11):
            kwargs = zoo.build_inputs(name, num_tokens=tokens, seed=tokens)
            out, ref = first_tensor(compiled(**kwargs)), first_tensor(model(**kwargs))
            assert max_rel_diff(out, ref) <= TOL[torch.float32]
    counters = torch._dynamo.utils.counters["moe_compile"]
    assert counters["rewritten"] >= zoo.expected_moe_layers(name) and counters["skipped"] == 0, dict(counters)


def test_forget_takes_an_attempts_decisions_out_of_counters_and_reports():
    from moe_compile.report import BlockDecision, collecting, forget, record, tracking

    torch._dynamo.utils.counters.clear()
    with collecting() as report:
        record(BlockDecision(path="a", reason="kept"))
        with tracking() as attempt:
            record(BlockDecision(path="b", num_experts=8, top_k=2, rewritten=True))
            record(BlockDecision(path="c", reason="no"))
        forget(attempt)
    assert [b.path for b in report.blocks] == ["a"]
    assert dict(torch._dynamo.utils.counters["moe_compile"]) == {"rewritten": 0, "skipped": 1}


def test_generate_with_the_compiled_forward_picks_the_same_tokens():
    """``model.forward = torch.compile(model.forward, backend="moe_npu")`` under ``generate``: the
    prefill and the one-token decode steps (with the KV cache) are both rewritten, and greedy
    decoding picks the same tokens as eager (fp32)."""
    model, _ = zoo.build_model("qwen3_moe")
    ids = zoo.build_inputs("qwen3_moe", num_tokens=6, batch=2)["input_ids"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        model.forward = torch.compile(model.forward, backend="moe_npu", options={"inner_compiler": "aot_eager"})
        try:
            got = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        finally:
            del model.forward
    assert torch.equal(ref, got), (ref, got)
    counters = torch._dynamo.utils.counters["moe_compile"]
    # prefill and decode graphs, each with every MoE layer
    assert counters["rewritten"] == 2 * zoo.expected_moe_layers("qwen3_moe"), dict(counters)
    assert counters["skipped"] == 0, dict(counters)


def test_a_scale_held_in_a_parameter_is_not_baked_into_the_rewrite():
    """A router whose weights are multiplied by a 0-d ``nn.Parameter`` is left alone: a constant
    copied into the rewrite would not follow the parameter when it changes after compiling."""
    from moe_compile.testing.zoo_blocks import build_block_model

    import dataclasses

    model, kwargs = build_block_model("titan_sigmoid_gmm", num_layers=1, dtype=torch.bfloat16)
    scale = torch.nn.Parameter(torch.tensor(2.0))
    for module in [m for m in model.modules() if hasattr(getattr(m, "cfg", None), "route_scale")]:
        module.cfg = dataclasses.replace(module.cfg, route_scale=scale)
        if hasattr(module, "gate"):  # the router module, which multiplies by it, holds the parameter
            module.scale = scale
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    with torch.no_grad():
        first = first_tensor(compiled(**kwargs))
        scale.fill_(3.0)
        again = first_tensor(compiled(**kwargs))
        ref = first_tensor(model(**kwargs))
    assert not torch.allclose(first, again)
    assert max_rel_diff(again, ref) <= TOL[torch.bfloat16]
    assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 0
