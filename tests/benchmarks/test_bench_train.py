"""``benchmarks/bench_train.py`` end to end at a tiny size (moe_npu through aot_eager, to stay quick): every mode's row
is written, moe_npu's loss and gradients match eager's, it saves less for the backward than eager, and
``--host-profile`` and ``--compile-profile`` print cProfile tables per mode."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_train  # noqa: E402


def test_bench_train_runs_and_matches_eager(tmp_path, capsys):
    argv = ["--hidden", "64", "--inter", "32", "--experts", "8", "--top-k", "2", "--batch", "2", "--seq", "16",
            "--reps", "2", "--modes", "eager", "moe_npu", "moe_npu_graphs", "moe_npu_dynamic", "--inner", "aot_eager",
            "--host-profile", "5", "--compile-profile", "5", "--out", str(tmp_path)]
    assert bench_train.main(argv) == 0
    rows = {r["mode"]: r for r in json.loads((tmp_path / "train.json").read_text())["rows"]}
    assert set(rows) == {"eager", "moe_npu", "moe_npu_graphs", "moe_npu_dynamic"}
    for mode in ("moe_npu", "moe_npu_graphs", "moe_npu_dynamic"):  # graphs: none on the CPU
        moe = rows[mode]
        assert moe["loss_diff"] <= 1e-4 and moe["grad_rel_diff"] <= 1e-4 and moe["ms"] > 0, mode
    moe = rows["moe_npu"]
    assert 0 < moe["saved_mb"] < rows["eager"]["saved_mb"]
    assert rows["moe_npu_dynamic"]["saved_mb"] == moe["saved_mb"]  # rewritten with symbolic shapes too
    out = capsys.readouterr().out
    assert "moe_npu" in out
    assert "moe_npu: the 5 Python functions of most own time over 3 steps" in out and "tottime" in out
    assert "moe_npu: the 5 functions of most cumulative time in the first step" in out
