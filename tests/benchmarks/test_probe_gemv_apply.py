"""``benchmarks/probe_gemv.py --apply``: a GEMV plan that beat the tuned plan in its side-by-side
timings is written into the tuned config file for that shape and token count, and ``choose_plan``
then picks it; a plan that lost is not written."""
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import probe_gemv  # noqa: E402

from moe_compile.kernels.triton import configs  # noqa: E402


def test_apply_writes_only_winning_gemv_plans(tmp_path, monkeypatch):
    name = configs.config_file_name(128, 2048, 768, torch.bfloat16, "NVIDIA_H200")
    tuned = {"path": "pairs", "gemm1": {"block_m": 16, "block_n": 64, "block_k": 256},
             "gemm2": {"block_m": 16, "block_n": 64, "block_k": 128}}
    (tmp_path / name).write_text(json.dumps({"1": tuned, "4": tuned}))
    monkeypatch.setattr(probe_gemv, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(probe_gemv, "device_key", lambda device: "NVIDIA_H200")
    best = configs.Plan(configs.ExpertsPath.GEMV, probe_gemv.cfg(8, 128, 8), probe_gemv.cfg(16, 256, 4)).to_dict()
    rows = [dict(shape="qwen3", M=1, best_plan=best, tuned_us_ab=[26.0, 26.2], gemv_us_ab=[25.0, 25.5]),
            dict(shape="qwen3", M=4, best_plan=best, tuned_us_ab=[76.0, 76.5], gemv_us_ab=[78.0, 79.0])]
    probe_gemv.apply(rows)
    table = json.loads((tmp_path / name).read_text())
    assert table["1"]["path"] == "gemv" and table["1"]["us"] == 25.0 and "26.0" in table["1"]["_from"]
    assert table["4"] == tuned
    monkeypatch.setattr(configs, "device_key", lambda device: "NVIDIA_H200")
    configs.reload()
    try:
        chosen = [configs.choose_plan(num_tokens=m, top_k=8, num_local=128, hidden=2048, inter=768,
                                      dtype=torch.bfloat16, device=torch.device("cpu")) for m in (1, 4)]
    finally:
        configs.reload()
    assert [p.path for p in chosen] == [configs.ExpertsPath.GEMV, configs.ExpertsPath.PAIRS]
    assert (chosen[0].gemm1.block_n, chosen[0].gemm1.block_k, chosen[0].gemm1.num_warps) == (8, 128, 8)
