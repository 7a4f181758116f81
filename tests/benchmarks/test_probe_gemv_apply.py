"""``benchmarks/probe_gemv.py --apply``: a GEMV plan that beat the tuned plan in its side-by-side
timings is written into the tuned config file for that shape and token count, and ``choose_plan``
then picks it; a plan that lost is not written."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_gemv  # noqa: E402

from moe_compile.kernels.triton import configs  # noqa: E402
from tuned_files import TUNED, chosen_plans, tuned_file  # noqa: E402


def test_apply_writes_only_winning_gemv_plans(tmp_path, monkeypatch):
    path = tuned_file(tmp_path, monkeypatch, (1, 4))
    best = configs.Plan(configs.ExpertsPath.GEMV, probe_gemv.cfg(8, 128, 8), probe_gemv.cfg(16, 256, 4)).to_dict()
    rows = [dict(shape="qwen3", M=1, best_plan=best, tuned_us_ab=[26.0, 26.2], gemv_us_ab=[25.0, 25.5]),
            dict(shape="qwen3", M=4, best_plan=best, tuned_us_ab=[76.0, 76.5], gemv_us_ab=[78.0, 79.0])]
    probe_gemv.apply(rows)
    table = json.loads(path.read_text())
    assert table["1"]["path"] == "gemv" and table["1"]["us"] == 25.0 and "26.0" in table["1"]["_from"]
    assert table["4"] == TUNED
    chosen = chosen_plans(monkeypatch, (1, 4))
    assert [p.path for p in chosen] == [configs.ExpertsPath.GEMV, configs.ExpertsPath.PAIRS]
    assert (chosen[0].gemm1.block_n, chosen[0].gemm1.block_k, chosen[0].gemm1.num_warps) == (8, 128, 8)
