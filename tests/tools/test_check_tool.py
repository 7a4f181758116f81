"""``python -m moe_compile.tools.check``: PASS/FAIL per case, clear failures for bad pairs and names."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe_compile.modular import ActivationFormat, registry
from moe_compile.modular.experts import GroupedExperts
from moe_compile.tools.check import main

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
