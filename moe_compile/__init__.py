"""moe_compile: a torch.compile backend (``backend="moe_npu"``) that rewrites MoE blocks into one
staged fused MoE op, lowered to NPU (torch_npu), CUDA and CPU kernels."""
from moe_compile.ops import fused_moe
from moe_compile.ops.weight_cache import refresh_weights
from moe_compile.report import Report, exclude
from moe_compile import backend as _backend  # registers backend="moe_npu"
from moe_compile.explain import explain
from moe_compile.export import rewrite_exported

__all__ = ["Report", "exclude", "explain", "fused_moe", "refresh_weights", "rewrite_exported"]
__version__ = "0.1.0"
