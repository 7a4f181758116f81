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
