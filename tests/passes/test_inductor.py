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


def test_inductor_compiles_stacked_weight_copies():
    """ModuleList experts are stacked into weights the graph owns (get_attr constants): Inductor
    must lower the op on them (a bare constant used to fail its fake-tensor propagation, and the
    compile fell back to the original graph)."""
    from moe_compile.report import collecting

    from moe_compile.testing.zoo_blocks import build_block_model

    model, kwargs = build_block_model("v4_mixtral", num_layers=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad(), collecting() as report:
        ref = model(**kwargs)
        out = torch.compile(model, backend="moe_npu", options={"inner_compiler": "inductor"})(**kwargs)
    counters = torch._dynamo.utils.counters["moe_compile"]
    assert counters["pass_failed"] == 0 and counters["rewritten"] == 1, (dict(counters), str(report))
    assert max_rel_diff(first_tensor(out), first_tensor(ref)) <= 1e-4
