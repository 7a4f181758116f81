"""``benchmarks/gpu_clock.py``: reading ``nvidia-smi`` samples and a window's figures (no GPU)."""
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_clock  # noqa: E402


def test_parse_smi_reads_samples_and_skips_junk():
    text = ("2026/11/30 17:55:04.059, 1980, 310.5, 0x0000000000000000\n"
            "garbage line\n"
            "2026/11/30 17:55:04.109, 1410, 695.2, 0x0000000000000004\n"
            "2026/11/30 17:55:04.159, [N/A], 695.2, 0x0\n")
    got = gpu_clock.parse_smi(text)
    t0 = datetime.datetime(2026, 11, 30, 17, 55, 4, 59000).timestamp()
    assert [(round(t - t0, 3), mhz, w, r) for t, mhz, w, r in got] == [(0.0, 1980.0, 310.5, 0), (0.05, 1410.0, 695.2, 4)]


def test_window_stats_takes_only_the_window():
    samples = [(0.0, 1980.0, 300.0, 0), (1.0, 1400.0, 700.0, 4), (2.0, 1500.0, 690.0, 4)]
    replays = [(0.5, 10.0), (1.5, 30.0), (1.6, 20.0), (2.5, 99.0)]
    w = gpu_clock.window_stats(samples, replays, 1.0, 2.1)
    assert (w["mhz"], w["watts"], w["reasons"], w["samples"]) == (1450.0, 695.0, "0x4", 2)
    assert (w["replays"], w["replay_us"]) == (2, 25.0)
    empty = gpu_clock.window_stats(samples, replays, 5.0, 6.0)
    assert empty["samples"] == 0 and empty["replays"] == 0


def test_sampler_without_nvidia_smi_gives_no_window(monkeypatch):
    monkeypatch.setattr(gpu_clock.shutil, "which", lambda name: None)
    with gpu_clock.ClockSampler(0) as clock:
        assert not clock.available
        assert clock.samples() == []
        assert clock.window(0.0, 1e12) is None


def test_sampler_reads_what_nvidia_smi_writes(monkeypatch, tmp_path):
    """A stand-in ``nvidia-smi`` that prints two samples: the window between them sees the first."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '2026/11/30 17:55:04.059, 1410, 695.2, 0x0000000000000004'\n"
                    "echo '2026/11/30 17:55:05.059, 1980, 300.0, 0x0000000000000000'\nsleep 5\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    t0 = datetime.datetime(2026, 11, 30, 17, 55, 4).timestamp()
    with gpu_clock.ClockSampler(0) as clock:
        assert clock.available
        for _ in range(50):
            if len(clock.samples()) == 2:
                break
        w = clock.window(t0, t0 + 1.0)
    assert (w["mhz"], w["watts"], w["reasons"], w["samples"]) == (1410.0, 695.2, "0x4", 1)
