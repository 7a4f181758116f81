"""``benchmarks/check_zoo.py``: a family under ``dynamic=True`` is rewritten and matches eager; a
pass that fails is flagged with exit code 1; bad options are refused."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import check_zoo  # noqa: E402


def test_a_family_under_dynamic_true_is_rewritten(capsys):
    assert check_zoo.main(["--dynamic", "--families", "qwen3_moe", "--tokens", "5", "7"]) == 0
    out = capsys.readouterr().out
    assert "'rewritten': 2" in out and "none flagged" in out


def test_export_mode_rewrites_the_program_and_lists_unexportable_models_apart(capsys):
    assert check_zoo.main(["--export", "--families", "qwen3_moe", "dbrx", "--tokens", "5", "7", "--tol", "1e-4"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_moe            {'rewritten': 2, 'skipped': 0, 'exports': 1}" in out and "none flagged" in out, out
    assert "dbrx                 torch.export failed (before the pass): " in out, out


@pytest.mark.expects_fallback
def test_a_failing_pass_is_flagged(capsys, monkeypatch):
    from moe_compile.passes.moe_pass import MoEFusionPass

    def broken(self, graph):
        raise RuntimeError("broken on purpose")
    monkeypatch.setattr(MoEFusionPass, "__call__", broken)
    assert check_zoo.main(["--families", "qwen3_moe", "--tokens", "5"]) == 1
    assert "1 flagged: ['qwen3_moe']" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [(["--tokens", "0"], "--tokens must be positive"),
                                        (["--families", "nope"], "unknown ['nope']"),
                                        (["--device", "tpu"], "--device must be cpu or cuda"),
                                        (["--mode", "reduce-overhead"], "needs --inner inductor")])
def test_bad_options_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit):
        check_zoo.main(argv)
    assert words in capsys.readouterr().err


@pytest.mark.skipif(check_zoo.torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_without_cuda_is_refused(capsys):
    with pytest.raises(SystemExit):
        check_zoo.main(["--device", "cuda", "--families", "qwen3_moe"])
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


@pytest.mark.expects_fallback
def test_a_wrong_rewrite_is_flagged_by_tol(capsys, monkeypatch):
    """A fused op off by 1 % is flagged with --tol 1e-3 (and not without --tol)."""
    from moe_compile.ops import custom_op
    right = custom_op._run

    def off(cfg, inputs):
        return right(cfg, inputs) * 1.01
    monkeypatch.setattr(custom_op, "_run", off)
    assert check_zoo.main(["--families", "qwen3_moe", "--tokens", "5"]) == 0
    assert check_zoo.main(["--families", "qwen3_moe", "--tokens", "5", "--tol", "1e-3"]) == 1
    assert "1 flagged: ['qwen3_moe']" in capsys.readouterr().out


def test_a_crashing_family_is_flagged_and_the_scan_goes_on(capsys, monkeypatch):
    real = check_zoo.check

    def check(name, args):
        if name == "mixtral":
            raise RuntimeError("crashed on purpose")
        return real(name, args)
    monkeypatch.setattr(check_zoo, "check", check)
    assert check_zoo.main(["--families", "mixtral", "qwen3_moe", "--tokens", "5"]) == 1
    out = capsys.readouterr().out
    assert "mixtral              FAILED: RuntimeError: crashed on purpose" in out
    assert "qwen3_moe" in out and "1 flagged: ['mixtral']" in out


def test_training_mode_compares_every_gradient(capsys):
    assert check_zoo.main(["--training", "--families", "qwen3_moe", "--tokens", "5", "--tol", "1e-4"]) == 0
    out = capsys.readouterr().out
    assert "'rewritten': 2" in out and " grads " in out and "none flagged" in out, out


def test_training_with_dynamic_compiles_once_for_every_count(capsys):
    """``--training --dynamic``: ``dynamic=True``, so the two token counts share one symbolic graph (two layers
    rewritten once, not per count) and its gradients still match eager."""
    assert check_zoo.main(["--training", "--dynamic", "--families", "qwen3_moe", "--tokens", "5", "9",
                           "--tol", "1e-4"]) == 0
    out = capsys.readouterr().out
    assert "'rewritten': 2}" in out and "none flagged" in out, out
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompile at the second count


def test_a_wrong_gradient_is_flagged_by_tol(capsys, monkeypatch):
    from moe_compile.ops import autograd

    right = autograd.experts_backward
    monkeypatch.setattr(autograd, "experts_backward", lambda *a: [None if g is None else g * 1.01 for g in right(*a)])
    assert check_zoo.main(["--training", "--families", "qwen3_moe", "--tokens", "5", "--tol", "1e-3"]) == 1
    assert "1 flagged: ['qwen3_moe']" in capsys.readouterr().out
