"""Smoke test of benchmarks/bench_distributed.py (issue 7's benchmark) on 2 gloo ranks."""
import importlib.util
import pathlib

import pytest


@pytest.mark.distributed
def test_bench_distributed_runs_and_matches_single_device(capsys):
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_distributed.py"
    spec = importlib.util.spec_from_file_location("bench_distributed", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--tiny", "--sizes", "3", "--models", "deepseek_v3", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    for mode in ("single", "ep_static", "ep_dynamic", "tp"):
        assert mode in out
    worst = float(out.rsplit("any rank: ", 1)[1].split()[0])
    assert worst <= 1e-5
