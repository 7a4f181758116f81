"""The expert activation applied to the first GEMM's output, in plain torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_compile.ops.config import Activation, ExpertsConfig


def split_gate_up(h_NF: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, 2I]`` -> (gate ``[N, I]``, up ``[N, I]``): halves, or even/odd columns (gpt-oss)."""
    if interleaved:
        return h_NF[..., 0::2], h_NF[..., 1::2]
    half = h_NF.shape[-1] // 2
    return h_NF[..., :half], h_NF[..., half:]


def apply_activation(h_NF: torch.Tensor, cfg: ExpertsConfig) -> torch.Tensor:
    """First GEMM output ``[N, 2I]`` (gated) or ``[N, I]`` -> activation ``[N, I]``, same dtype."""
    act = cfg.activation
    if not act.is_gated:
        if act is Activation.SILU_NO_MUL:
            return F.silu(h_NF)
        if act is Activation.GELU_NO_MUL:
            return F.gelu(h_NF)
        if act is Activation.RELU_NO_MUL:
            return F.relu(h_NF)
        return torch.square(F.relu(h_NF))
    gate, up = split_gate_up(h_NF, cfg.gate_up_interleaved)
    # the activated gate is a fresh tensor: multiplying it in place saves a [N, I] buffer
    if act is Activation.SILU:
        return F.silu(gate).mul_(up)
    if act is Activation.GELU:
        return F.gelu(gate).mul_(up)
    if act is Activation.GELU_TANH:
        return F.gelu(gate, approximate="tanh").mul_(up)
    gate = gate.clamp(max=cfg.swiglu_limit)
    up = up.clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
    if act is Activation.SILU_CLAMPED:
        return F.silu(gate).mul_(up)
    # SWIGLU_OAI (gpt-oss)
    glu = gate * torch.sigmoid(gate * cfg.swiglu_alpha)
    return (up + 1) * glu


def intermediate_size(w13_width: int, activation: Activation) -> int:
    """The expert's intermediate size I from ``w13``'s last dimension."""
    return w13_width // 2 if activation.is_gated else w13_width
