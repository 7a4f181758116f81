"""Lowerings of the staged fused MoE op, one per device kind, chosen by ``Lowering``.

Device-specific modules (``cuda``, ``npu``) are imported only when their lowering is taken.
"""
from __future__ import annotations

import importlib

import torch

from moe_compile.lowering.base import MoEInputs, StagedLowering
from moe_compile.ops.config import Lowering

# Lowering -> "module:attribute" of a StagedLowering subclass; imported on first use.
_REGISTRY: dict[Lowering, str] = {
    Lowering.CPU: "moe_compile.lowering.base:StagedLowering",
    Lowering.CUDA: "moe_compile.lowering.cuda:CudaLowering",
    Lowering.NPU: "moe_compile.lowering.npu:NpuLowering",
}
_INSTANCES: dict[Lowering, StagedLowering] = {}


def resolve(requested: Lowering, device: torch.device) -> Lowering:
    if requested is not Lowering.AUTO:
        return requested
    if device.type == "cuda":
        return Lowering.CUDA
    if device.type == "npu":
        return Lowering.NPU
    return Lowering.CPU


def get_lowering(kind: Lowering) -> StagedLowering:
    if kind not in _INSTANCES:
        module_name, attr = _REGISTRY[kind].split(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            if kind is Lowering.CUDA:
                cls = StagedLowering  # the portable torch path still runs on CUDA
            else:
                raise
        _INSTANCES[kind] = cls()
    return _INSTANCES[kind]


__all__ = ["MoEInputs", "StagedLowering", "get_lowering", "resolve"]
