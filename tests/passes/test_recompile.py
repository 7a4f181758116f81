"""No new graph breaks, and at most one recompile when the token count changes."""
from __future__ import annotations

import torch

import moe_compile  # noqa: F401  (registers the backend)
from moe_compile.testing import zoo

from .helpers import GraphCounter, first_tensor


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
