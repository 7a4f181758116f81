"""Smoke test of benchmarks/bench_distributed.py (issue 7's benchmark) on 2 gloo ranks."""
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.distributed
def test_bench_distributed_runs_and_matches_single_device():
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_distributed.py"
    args = ["--device", "cpu", "--tiny", "--sizes", "3", "--models", "deepseek_v3", "--reps", "1"]
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for mode in ("single", "ep_static", "ep_dynamic", "tp"):
        assert mode in run.stdout
    worst = float(run.stdout.rsplit("any rank: ", 1)[1].split()[0])
    assert worst <= 1e-5
