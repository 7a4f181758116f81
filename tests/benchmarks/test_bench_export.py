"""``benchmarks/bench_export.py`` end to end at a tiny size (no AOTInductor, to stay quick): every mode's row is
written, the rewritten program has its blocks rewritten and matches eager."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_export  # noqa: E402


def test_bench_export_runs_and_matches_eager(tmp_path, capsys):
    argv = ["--hidden", "64", "--inter", "32", "--experts", "8", "--top-k", "2", "--reps", "2",
            "--sizes", "decode", "--modes", "eager", "export", "export+moe", "--out", str(tmp_path)]
    assert bench_export.main(argv) == 0
    rows = json.loads((tmp_path / "export.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["eager", "export", "export+moe"]
    moe = rows[-1]
    assert moe["rewritten"] == 2 and moe["rel_diff"] <= 1e-4 and moe["ms"] > 0
    assert "export+moe" in capsys.readouterr().out


def test_ranged_dims_refused_falls_back_to_auto(tmp_path, capsys, monkeypatch):
    """Where torch refuses the ranged dims of the plain model (torch 2.11 on Qwen3-MoE), the program is exported with
    ``Dim.AUTO`` instead, says so, and still matches eager."""
    import torch
    from torch._dynamo.exc import UserError, UserErrorType

    real, calls = torch.export.export, []

    def refusing(model, args, kwargs, dynamic_shapes=None, **rest):
        dims = list(dynamic_shapes["input_ids"].values())
        calls.append(dims)
        if any(d is not torch.export.Dim.AUTO for d in dims):
            raise UserError(UserErrorType.CONSTRAINT_VIOLATION, "Constraints violated (seq)!\n  - a guard")
        return real(model, args, kwargs, dynamic_shapes=dynamic_shapes, **rest)

    monkeypatch.setattr(torch.export, "export", refusing)
    argv = ["--hidden", "64", "--inter", "32", "--experts", "8", "--top-k", "2", "--reps", "1",
            "--sizes", "decode", "--modes", "eager", "export+moe", "--out", str(tmp_path)]
    assert bench_export.main(argv) == 0
    moe = json.loads((tmp_path / "export.json").read_text())["rows"][-1]
    assert moe["rewritten"] == 2 and moe["rel_diff"] <= 1e-4
    assert len(calls) == 2 and "ranged dims refused (Constraints violated (seq)!" in capsys.readouterr().out
