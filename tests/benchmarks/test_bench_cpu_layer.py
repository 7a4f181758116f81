"""``benchmarks/bench_cpu_layer.py``'s timing loop: every column is called equally often, each
position in the rotation comes first equally often, and no call reuses the input of the call just
before it (which would find that input's experts in the cache)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_cpu_layer  # noqa: E402


def test_interleaved_calls_rotate_and_take_fresh_inputs():
    log = []

    def column(name):
        return lambda x: log.append((name, x))

    names = ["a", "b", "c", "d"]
    inputs = list(range(17))
    ms = bench_cpu_layer.interleaved_ms({n: column(n) for n in names}, inputs, reps=8)
    assert set(ms) == set(names) and all(v >= 0 for v in ms.values())
    timed = log[4 * 3:]  # after 3 warm-up calls per column
    assert len(timed) == 32 and all(sum(1 for n, _ in timed if n == name) == 8 for name in names)
    firsts = [timed[4 * rep][0] for rep in range(8)]
    assert firsts == ["a", "b", "c", "d", "a", "b", "c", "d"]
    assert all(timed[i][1] != timed[i + 1][1] for i in range(len(timed) - 1))
