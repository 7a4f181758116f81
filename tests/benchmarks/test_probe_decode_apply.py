"""``benchmarks/probe_decode.py``: ``--apply`` writes a decode plan only where it was faster in
every side-by-side round and matched the tuned plan; ``choose_plan`` then picks it and
``fused_experts`` runs it; bad arguments are refused by name."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_decode  # noqa: E402

from moe_compile.kernels.triton import configs  # noqa: E402
from tuned_files import TUNED, chosen_plans, tuned_file  # noqa: E402


def _row(m, tuned_us, decode_us, err=3e-3):
    best = configs.decode_plan(32, 256, 256, 8, 3, 1).to_dict()
    return dict(shape="qwen3", M=m, best_plan=best, tuned_plan={"path": "pairs"}, tuned_us_ab=tuned_us,
                decode_us_ab=decode_us, max_err_vs_tuned=err,
                faster_every_round=all(b < a for a, b in zip(tuned_us, decode_us)))


def test_apply_writes_only_decode_plans_that_won_every_round(tmp_path, monkeypatch):
    path = tuned_file(tmp_path, monkeypatch, (1, 4, 8))
    rows = [_row(1, [26.0, 26.2, 26.1], [25.0, 25.5, 25.1]),   # faster in every round: written
            _row(4, [76.0, 76.5, 76.1], [75.0, 77.0, 75.1]),   # slower in one round: kept
            _row(8, [90.0, 90.0, 90.0], [80.0, 80.0, 80.0], err=0.2)]  # off: kept
    probe_decode.apply(rows)
    table = json.loads(path.read_text())
    assert table["1"]["path"] == "decode" and table["1"]["us"] == 25.1 and "26.1" in table["1"]["_from"]
    assert table["4"] == TUNED and table["8"] == TUNED
    chosen = chosen_plans(monkeypatch, (1, 4))
    assert [p.path for p in chosen] == [configs.ExpertsPath.DECODE, configs.ExpertsPath.PAIRS]
    g1 = chosen[0].gemm1
    assert (g1.block_n, g1.block_k, g1.num_warps, g1.tma, chosen[0].gemm2.block_n) == (32, 256, 8, 1, 256)


@pytest.mark.parametrize("argv,says", [(["--rounds", "0"], "--rounds (0)"), (["--reps", "0"], "--reps (0)"),
                                       (["--points", "qwen3:x"], "is not shape:M")])
def test_bad_arguments_are_named(argv, says, capsys):
    with pytest.raises(SystemExit):
        probe_decode.main(argv)
    assert says in capsys.readouterr().err
