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


def _biased_loop_block():
    """A 4.x Mixtral-style block whose expert Linears carry biases (gate, up and down)."""
    from moe_compile.testing.blocks import MoEBlockConfig, V4MoEBlock

    torch.manual_seed(0)
    cfg = MoEBlockConfig()
    block = V4MoEBlock(cfg)
    for expert in block.experts:
        for name in ("w1", "w2", "w3"):
            old = getattr(expert, name)
            new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.normal_(0.0, 0.1)
            setattr(expert, name, new)
    return block.eval(), torch.randn(2, 5, cfg.hidden_size)


def test_biased_modulelist_experts_through_both_compilers():
    """Separate gate/up biases are concatenated like their weights (b13 = [b_gate | b_up]); the
    stacked weights and biases the graph owns reach the op under aot_eager and Inductor."""
    from moe_compile.report import collecting

    block, x = _biased_loop_block()
    with torch.no_grad():
        ref = block(x)
        for inner in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            with collecting() as report:
                out = torch.compile(block, backend="moe_npu", options={"inner_compiler": inner})(x)
            assert report.rewritten == [""], (inner, str(report))
            assert torch._dynamo.utils.counters["moe_compile"]["pass_failed"] == 0, inner
            assert max_rel_diff(out, ref) <= 1e-5, inner
            graph = report.graphs_after[-1]
            assert "moe_compile.fused_moe" in graph and "aten.squeeze.dim" in graph, graph
