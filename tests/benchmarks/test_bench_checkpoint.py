"""``benchmarks/bench_checkpoint.py`` end to end at a tiny size: four rows, the blocks rewritten in the ``moe_npu``
rows (also under activation checkpointing), every gradient within fp32 1e-4 of eager, and the rewritten checkpointed
model holding less for the backward than either the checkpointed model without us or the rewritten one without
checkpointing."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_checkpoint  # noqa: E402


def test_bench_checkpoint_rows(tmp_path, capsys):
    assert bench_checkpoint.main(["--layers", "2", "--batch", "2", "--tokens", "16", "--reps", "1",
                                  "--out", str(tmp_path)]) == 0
    rows = {r["row"]: r for r in json.loads((tmp_path / "checkpoint.json").read_text())["rows"]}
    assert set(rows) == {"aot_eager", "moe_npu", "aot_eager + checkpoint", "moe_npu + checkpoint"}
    assert rows["moe_npu"]["rewritten"] == rows["moe_npu + checkpoint"]["rewritten"] == 2
    assert all(r["grad_rel_diff"] <= 1e-4 and r["ms"] > 0 for r in rows.values()), rows
    ours = rows["moe_npu + checkpoint"]["held_kib"]
    assert ours < rows["aot_eager + checkpoint"]["held_kib"] and ours < rows["moe_npu"]["held_kib"], rows
    assert "moe_npu + checkpoint" in capsys.readouterr().out


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(SystemExit):
        bench_checkpoint.main(["--tokens", "0"])
