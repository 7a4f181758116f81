"""The staged fused MoE op: public API, configuration, routing, validation and custom ops."""
from moe_compile.ops.fused_moe import fused_moe

__all__ = ["fused_moe"]
