"""``benchmarks/bench_eager_call.py`` on the CPU at a small scale: the direct call and the
``torch.ops`` call agree bit for bit (the script raises otherwise), and it prints one row per point."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_eager_call  # noqa: E402


def test_runs_on_the_cpu_and_checks_both_calls_agree(capsys):
    assert bench_eager_call.main(["--device", "cpu", "--scale", "16", "--reps", "2", "--ms", "1", "3",
                                  "--shapes", "qwen3", "deepseek_v3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    assert [r.split()[:2] for r in rows] == [["qwen3", "1"], ["qwen3", "3"], ["deepseek_v3", "1"], ["deepseek_v3", "3"]]
