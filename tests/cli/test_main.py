"""``python -m moe_compile {demo, inspect, selfcheck, plan}``."""
from __future__ import annotations

import pytest

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


def test_plan_shows_tuned_borrowed_and_default_plans(capsys):
    """``plan``: for each token count the plan the CUDA experts would run and where it comes from."""
    pytest.importorskip("triton")
    from moe_compile.__main__ import main as cli

    assert cli(["plan", "--shape", "128,8,2048,768", "--device-key", "NVIDIA_H200", "--sm90", "--tokens", "1",
                "2048"]) == 0
    out = capsys.readouterr().out
    assert "M=1 " in out and "pairs |" in out and "from tuned: E128_H2048_I768_bf16_NVIDIA_H200.json M=1" in out
    assert "from tuned: E128_H2048_I768_bf16_NVIDIA_H200.json M=2048" in out
    # another model's sizes on an H100 read the H200's files and borrow by rows per expert
    assert cli(["plan", "--shape", "64,8,2048,1024", "--device-key", "NVIDIA_H100_80GB_HBM3", "--sm90",
                "--tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "from borrowed: E128_H2048_I768_bf16_NVIDIA_H200.json M=2048" in out  # 128 rows per expert
    assert "no tuned plans E64_H2048_I1024_bf16_NVIDIA_H100_80GB_HBM3.json" in out
    assert cli(["plan", "--shape", "128,8,2048,768", "--device-key", "NVIDIA_H100_80GB_HBM3", "--sm90",
                "--tokens", "2048"]) == 0
    assert "from tuned: E128_H2048_I768_bf16_NVIDIA_H200.json M=2048" in capsys.readouterr().out
    # a device without any files: the default heuristic, said
    assert cli(["plan", "--shape", "64,8,2048,1024", "--device-key", "SOME_GPU", "--tokens", "1024"]) == 0
    assert "from default heuristic (no tuned plans" in capsys.readouterr().out
    for bad in ("64,8,2048", "8,16,2048,1024"):
        assert cli(["plan", "--shape", bad]) == 2
        assert "--shape" in capsys.readouterr().err
