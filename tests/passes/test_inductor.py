"""The default inner compiler: the pass runs as Inductor's post-grad custom pass and Inductor
compiles the rewritten graph (one small model; Inductor's CPU compile is the slow part)."""
from __future__ import annotations

import torch

import moe_compile
from moe_compile.testing import zoo

from .helpers import first_tensor, max_rel_diff


def test_inductor_compiles_the_rewritten_graph():
    model, kwargs = zoo.build_model("qwen3_moe", num_layers=1)
    torch._dynamo.utils.counters.clear()
    report = moe_compile.explain(model, **kwargs, options={"inner_compiler": "inductor", "verify": True})
    with torch.no_grad():
        ref = first_tensor(model(**kwargs))
    assert report.rewritten == ["model.layers.0.mlp"], str(report)
    assert max_rel_diff(first_tensor(report.output), ref) <= 1e-4
    assert any("moe_compile.fused_moe" in g for g in report.graphs_after)
    assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 1
