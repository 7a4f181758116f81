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


def test_probe_power_batched_gemms_run_every_expert_on_its_own_rows():
    """``probe_power.batched_gemms``: each expert's rows through that expert's weights (HF layout,
    read through the transposed views), M * top_k / E rows each; a shape whose pairs do not divide
    evenly is refused."""
    import types

    import pytest
    import torch

    import probe_power
    from moe_compile.tools.tune import Shape

    shape = Shape("tiny", num_experts=4, top_k=2, hidden=8, inter=6)
    gen = torch.Generator().manual_seed(0)
    experts = types.SimpleNamespace(gate_up_proj=torch.randn(4, 12, 8, generator=gen),
                                    down_proj=torch.randn(4, 8, 6, generator=gen))
    block = types.SimpleNamespace(experts=experts)
    h, y = probe_power.batched_gemms(block, shape, 6, torch.Generator().manual_seed(1))(None)
    assert h.shape == (4, 3, 12) and y.shape == (4, 3, 8)
    ref = torch.Generator().manual_seed(1)
    a1 = torch.randn(4, 3, 8, generator=ref)
    a2 = torch.randn(4, 3, 6, generator=ref)
    for e in range(4):
        torch.testing.assert_close(h[e], a1[e] @ experts.gate_up_proj[e].T)
        torch.testing.assert_close(y[e], a2[e] @ experts.down_proj[e].T)
    with pytest.raises(ValueError, match="multiple of E = 4"):
        probe_power.batched_gemms(block, shape, 3, gen)
