"""Test helpers shipped with the package (the CPU emulation of the torch_npu MoE ops)."""
from moe_compile.testing.emulated_npu import EmulatedNpu, emulated_npu

__all__ = ["EmulatedNpu", "emulated_npu"]
