"""Registers ``TritonExperts`` and ``TritonBatchedExperts`` in the modular-kernel registry
without importing triton.

Listed in ``moe_compile.modular.registry.PLUGIN_MODULES``; the factory imports the kernels only
when a TritonExperts is built, and ``requires`` says why it cannot run where triton is missing.
"""
from __future__ import annotations

import torch

from moe_compile.modular.base import ActivationFormat, Capability
from moe_compile.modular.registry import BuildContext, register_experts


def triton_available() -> Capability:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return False, f"triton is not importable ({exc})"
    return True, ""


def _build(ctx: BuildContext):
    from moe_compile.kernels.triton.experts import TritonExperts

    return TritonExperts(ctx.experts_config)


def _build_batched(ctx: BuildContext):
    from moe_compile.kernels.triton.experts import TritonBatchedExperts

    return TritonBatchedExperts(ctx.experts_config)


register_experts(
    "TritonExperts", factory=_build, activation_format=ActivationFormat.STANDARD,
    dtypes=(torch.bfloat16, torch.float16, torch.float32), supports_chunking=True, supports_expert_map=True,
    device_types=("cuda",), requires=triton_available,
)
register_experts(
    "TritonBatchedExperts", factory=_build_batched, activation_format=ActivationFormat.BATCHED,
    dtypes=(torch.bfloat16, torch.float16, torch.float32), supports_chunking=False, supports_expert_map=True,
    device_types=("cuda",), requires=triton_available,
)
