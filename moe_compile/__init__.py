"""moe_compile: a torch.compile backend (``backend="moe_npu"``) that rewrites MoE blocks into one
staged fused MoE op, lowered to NPU (torch_npu), CUDA and CPU kernels."""
from moe_compile.ops import fused_moe

__all__ = ["fused_moe"]
__version__ = "0.1.0"
