"""``python -m moe_compile.tools.check``: PASS/FAIL per case, clear failures for bad pairs and names."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moe_compile.modular import ActivationFormat, registry
from moe_compile.modular.experts import GroupedExperts
from moe_compile.tools.check import main
from moe_compile.tools.harness import Case, make_problem, runnable_here

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("pf, ex", [("StandardPrepareAndFinalize", "GroupedExperts"),
                                    ("StandardPrepareAndFinalize", "ReferenceExperts"),
                                    ("BatchedPrepareAndFinalize", "BatchedExperts")])
def test_compatible_pair_passes(pf, ex, capsys):
    code = main(["--pf-type", pf, "--experts-type", ex, "-m", "1", "9", "--topk", "1", "3", "--num-experts", "6",
                 "--hidden", "32", "--intermediate", "16", "--dtype", "fp32", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [l for l in out.splitlines() if l.startswith(("PASS", "FAIL"))]
    # m in {1, 9} x (topk 1 with and without weight-on-input, topk 3)
    assert len(lines) == 6 and all(l.startswith("PASS") for l in lines)
    assert all("max_error=" in l for l in lines)


def test_expert_map_and_chunking_options(capsys):
    code = main(["--pf-type", "StandardPrepareAndFinalize", "--experts-type", "GroupedExperts", "-m", "40",
                 "--topk", "4", "--expert-map", "--chunk-size", "16", "--dtype", "bf16", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out and "expert_map=True" in out


def test_incompatible_pair_fails_with_the_reason(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--pf-type", "StandardPrepareAndFinalize", "--experts-type", "BatchedExperts"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "incompatible pair" in err and "standard-format" in err and "batched-format" in err


@pytest.mark.parametrize("flag, name, listed", [("--pf-type", "NoSuchPF", "StandardPrepareAndFinalize"),
                                                ("--experts-type", "NoSuchExperts", "GroupedExperts")])
def test_unknown_name_lists_the_valid_ones(flag, name, listed, capsys):
    argv = {"--pf-type": "StandardPrepareAndFinalize", "--experts-type": "GroupedExperts"}
    argv[flag] = name
    with pytest.raises(SystemExit) as exit_info:
        main([a for kv in argv.items() for a in kv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert name in err and listed in err and "valid" in err


def test_bad_problem_sizes_fail_clearly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--pf-type", "StandardPrepareAndFinalize", "--experts-type", "GroupedExperts", "--topk", "9",
              "--num-experts", "8"])
    assert exit_info.value.code == 2 and "--topk" in capsys.readouterr().err


def test_a_broken_experts_type_fails(capsys):
    class DropsBias(GroupedExperts):
        def apply(self, *, weights, **kwargs):
            return super().apply(weights=type(weights)(weights.w13, weights.w2), **kwargs)

    registry.register_experts("DropsBiasExperts", factory=lambda ctx: DropsBias(ctx.experts_config),
                              activation_format=ActivationFormat.STANDARD, replace=True)
    try:
        code = main(["--pf-type", "StandardPrepareAndFinalize", "--experts-type", "DropsBiasExperts", "-m", "5",
                     "--topk", "2", "--dtype", "fp32", "--device", "cpu"])
    finally:
        registry.unregister_experts("DropsBiasExperts")
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out and "FAILED: 1 failed" in out


def test_list_prints_the_registered_types(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "StandardPrepareAndFinalize" in out and "BatchedExperts" in out


def test_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "moe_compile.tools.check", "--pf-type", "BatchedPrepareAndFinalize",
         "--experts-type", "GroupedExperts"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "incompatible pair: BatchedPrepareAndFinalize emits batched-format" in proc.stderr


PAIR = ["--pf-type", "StandardPrepareAndFinalize", "--experts-type", "GroupedExperts", "-m", "1", "--topk", "1"]


def _usage_error(argv, capsys) -> str:
    """Run the check tool expecting a usage error (exit 2); returns stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("device", ["foo", "cuda:x", ""])
def test_not_a_device_is_a_usage_error(device, capsys):
    err = _usage_error(PAIR + ["--device", device], capsys)
    assert f"--device {device!r}" in err and "expected auto, cpu" in err


def test_cuda_without_a_gpu_is_a_usage_error(monkeypatch, capsys):
    """Before: registry.runnable said yes and make_problem died on 'Torch not compiled with CUDA'."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _usage_error(PAIR + ["--device", "cuda"], capsys)
    assert "--device 'cuda'" in err and "torch.cuda.is_available() is False" in err


def test_npu_without_torch_npu_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    err = _usage_error(PAIR + ["--device", "npu"], capsys)
    assert "--device 'npu'" in err and "torch_npu cannot be imported" in err


def test_runnable_here_is_false_for_an_absent_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, reason = runnable_here("StandardPrepareAndFinalize", "GroupedExperts", "cuda")
    assert not ok and "'cuda'" in reason and "is_available() is False" in reason
    ok, reason = runnable_here("StandardPrepareAndFinalize", "GroupedExperts", "foo")
    assert not ok and "'foo'" in reason
    assert runnable_here("StandardPrepareAndFinalize", "GroupedExperts", "cpu") == (True, "")


def test_device_module_entry_point_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "moe_compile.tools.check", *PAIR, "--device", "foo"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--device 'foo'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("num_experts", [1, 2, 3])
def test_expert_map_with_few_experts_holds_at_least_one(num_experts, capsys):
    """Before: E=1 gave an empty float index list and an IndexError in make_problem."""
    code = main(["--pf-type", "StandardPrepareAndFinalize", "--experts-type", "GroupedExperts",
                 "--num-experts", str(num_experts), "--topk", "1", "--expert-map", "-m", "0", "2",
                 "--dtype", "fp32", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and "OK: 0 failed" in out, out
    problem = make_problem(Case("StandardPrepareAndFinalize", "GroupedExperts", m=2, topk=1,
                                num_experts=num_experts, expert_map=True))
    assert len(problem.owned_experts) == max(1, num_experts // 2)
    assert problem.local_weights.w13.shape[0] == len(problem.owned_experts)
