"""A throwaway Qwen3-30B-A3B tuned file for the probes' ``--apply`` tests, and the plans
``choose_plan`` then picks from it (as on an H200)."""
import json

import torch

import probe_gemv
from moe_compile.kernels.triton import configs

TUNED = {"path": "pairs", "gemm1": {"block_m": 16, "block_n": 64, "block_k": 256},
         "gemm2": {"block_m": 16, "block_n": 64, "block_k": 128}}


def tuned_file(tmp_path, monkeypatch, ms):
    """The file, holding ``TUNED`` at each of ``ms``, where the probes write and the plans are read."""
    path = tmp_path / configs.config_file_name(128, 2048, 768, torch.bfloat16, "NVIDIA_H200")
    path.write_text(json.dumps({str(m): TUNED for m in ms}))
    monkeypatch.setattr(probe_gemv, "CONFIG_DIR", tmp_path)  # probe_gemv.write_entry writes for both probes
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(probe_gemv, "device_key", lambda device: "NVIDIA_H200")
    return path


def chosen_plans(monkeypatch, ms):
    monkeypatch.setattr(configs, "device_key", lambda device: "NVIDIA_H200")
    configs.reload()
    try:
        return [configs.choose_plan(num_tokens=m, top_k=8, num_local=128, hidden=2048, inter=768,
                                    dtype=torch.bfloat16, device=torch.device("cpu")) for m in ms]
    finally:
        configs.reload()
