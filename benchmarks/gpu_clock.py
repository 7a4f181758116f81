"""The SM clock, power draw and clock-limit reasons of a timed window, sampled by ``nvidia-smi``.

At its compute-bound points the H200 reaches its 700 W limit within a second of load and lowers its
SM clock (``benchmarks/probe_power.py``), so a timing means more with the clock it ran at::

    with ClockSampler(torch.cuda.current_device()) as clock:
        t0 = time.time(); ...timed work...; t1 = time.time()
        clock.window(t0, t1)   # {"mhz": ..., "watts": ..., "reasons": "0x4", "samples": ...} or None

Without ``nvidia-smi`` the sampler records nothing and ``window`` returns ``None``. Limit reasons
(``clocks_event_reasons``): ``0x1`` idle, ``0x4`` software power cap, ``0x20``/``0x40`` thermal.
"""
from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def parse_smi(text: str) -> list[tuple[float, float, float, int]]:
    """``(unix time, SM MHz, watts, limit reasons)`` per ``nvidia-smi --format=csv,noheader,nounits`` line."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((when, float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except ValueError:
            continue
    return out


def window_stats(samples, replays, start: float, end: float) -> dict:
    """Mean SM clock, power and the OR of the limit reasons of ``samples`` in ``[start, end)``, and
    the median time per replay of ``replays`` (``(unix time at its end, us)``) in it."""
    s = [x for x in samples if start <= x[0] < end]
    r = [us for when, us in replays if start <= when < end]
    reasons = 0
    for x in s:
        reasons |= x[3]
    return {"mhz": statistics.mean(x[1] for x in s) if s else float("nan"),
            "watts": statistics.mean(x[2] for x in s) if s else float("nan"),
            "reasons": hex(reasons), "samples": len(s), "replays": len(r),
            "replay_us": statistics.median(r) if r else float("nan")}


class ClockSampler:
    """``nvidia-smi`` sampling GPU ``index`` every ``period_ms`` in the background, while in ``with``."""

    def __init__(self, index: int, period_ms: int = 50):
        self.index, self.period_ms = index, period_ms
        self.path = Path(tempfile.mkdtemp()) / "smi.csv"
        self._proc = self._file = None

    @property
    def available(self) -> bool:
        """Whether ``nvidia-smi`` is sampling (inside ``with``; without it every window is ``None``)."""
        return self._proc is not None

    def __enter__(self) -> "ClockSampler":
        if shutil.which("nvidia-smi"):
            self._file = open(self.path, "w")
            self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                                           "-lms", str(self.period_ms), "-i", str(self.index)], stdout=self._file,
                                          stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._file.close()

    def samples(self) -> list[tuple[float, float, float, int]]:
        if self._proc is None:
            return []
        time.sleep(2 * self.period_ms / 1e3)  # the samples of the window's last moments
        self._file.flush()
        return parse_smi(self.path.read_text())

    def window(self, start: float, end: float, replays=()) -> dict | None:
        """``window_stats`` of ``[start, end)``; ``None`` without samples there (no ``nvidia-smi``)."""
        stats = window_stats(self.samples(), replays, start, end)
        return stats if stats["samples"] else None
