"""``repr()`` of the ``explain()`` report is one short line (a REPL echoes it); ``str()``/``print`` is the table."""
from __future__ import annotations

import moe_compile
from moe_compile.report import BlockDecision, Report
from moe_compile.testing.zoo import build_model


def test_repr_of_an_explain_report_is_short():
    model, inputs = build_model("qwen3_moe")
    report = moe_compile.explain(model, **inputs, options={"inner_compiler": "aot_eager"})
    assert report.graphs_before and sum(len(g) for g in report.graphs_before) > 5000  # what the repr used to hold
    text = repr(report)
    assert len(text) < 120 and "\n" not in text
    assert text == "<Report: 2 rewritten, 0 skipped, %d graph(s); print() for the table>" % report.graph_count
    table = str(report)
    assert "model.layers.0.mlp" in table and table.endswith("2 MoE block(s) rewritten, 0 skipped")


def test_repr_counts_skips_and_str_keeps_the_table():
    report = Report(graphs_before=["x" * 100_000], graphs_after=["y" * 100_000], graph_count=1)
    report.add(BlockDecision(path="a.mlp", rewritten=True))
    report.add(BlockDecision(path="b.mlp", reason="no router"))
    assert repr(report) == "<Report: 1 rewritten, 1 skipped, 1 graph(s); print() for the table>"
    assert "b.mlp" in str(report) and "skipped: no router" in str(report) and "x" * 10 not in str(report)
