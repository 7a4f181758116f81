"""``python -m moe_compile {demo, inspect, selfcheck}``."""
from __future__ import annotations

from moe_compile.__main__ import main


def test_inspect_prints_the_report_table(capsys):
    assert main(["inspect", "qwen3_moe"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp" in out and "rewritten" in out and "softmax→topk" in out


def test_inspect_unknown_type_lists_the_known_ones(capsys):
    assert main(["inspect", "no_such_model"]) == 2
    assert "mixtral" in capsys.readouterr().err


def test_demo_reports_rewrite_difference_and_times(capsys):
    assert main(["demo", "--tokens", "4", "--batch", "1", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 MoE block(s) rewritten" in out
    assert "max |compiled - eager| =" in out and "eager" in out and "compiled" in out
    diff = float(out.split("max |compiled - eager| = ")[1].split()[0])
    assert diff <= 1e-4


def test_selfcheck_without_an_npu_says_why(capsys):
    assert main(["selfcheck", "--device", "npu"]) == 2
    captured = capsys.readouterr()
    assert "npu" in (captured.out + captured.err).lower()
