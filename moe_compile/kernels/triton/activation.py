"""The expert activation as a Triton device function, and a standalone kernel for unfused paths.

``act_codes`` maps ``ExpertsConfig`` to the integer the kernels specialise on; ``apply_act`` is
inlined into the first GEMM's epilogue (fused path). ``activation`` runs it alone over a
``[P, 2I]`` (gated) or ``[P, I]`` buffer, for the ``torch._grouped_mm`` path; its reference is
``moe_compile.ops.activation.apply_activation`` (re-exported as ``activation_reference``).
"""
from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from moe_compile.kernels.triton import cdiv
from moe_compile.kernels.triton.launch import launch
from moe_compile.ops.activation import apply_activation as activation_reference
from moe_compile.ops.config import Activation, ExpertsConfig


class ActCode(enum.IntEnum):
    SILU = 0
    GELU = 1
    GELU_TANH = 2
    SWIGLU_OAI = 3
    SILU_CLAMPED = 4
    SILU_NO_MUL = 10
    GELU_NO_MUL = 11
    RELU_NO_MUL = 12
    RELU2_NO_MUL = 13


_CODES = {
    Activation.SILU: ActCode.SILU, Activation.GELU: ActCode.GELU, Activation.GELU_TANH: ActCode.GELU_TANH,
    Activation.SWIGLU_OAI: ActCode.SWIGLU_OAI, Activation.SILU_NO_MUL: ActCode.SILU_NO_MUL,
    Activation.GELU_NO_MUL: ActCode.GELU_NO_MUL, Activation.RELU_NO_MUL: ActCode.RELU_NO_MUL,
    Activation.RELU2_NO_MUL: ActCode.RELU2_NO_MUL, Activation.SILU_CLAMPED: ActCode.SILU_CLAMPED,
}


def act_code(cfg: ExpertsConfig) -> int:
    return int(_CODES[cfg.activation])


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gelu(x, TANH: tl.constexpr):
    if TANH:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + (2.0 * _sigmoid(2.0 * inner) - 1.0))
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def apply_act(g, u, alpha, limit, ACT: tl.constexpr):
    """fp32 ``g`` (gate, or the whole output when not gated) and ``u`` (up) -> activation."""
    if ACT == 0:
        return g * _sigmoid(g) * u
    elif ACT == 1:
        return _gelu(g, False) * u
    elif ACT == 2:
        return _gelu(g, True) * u
    elif ACT == 3:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return (u + 1.0) * (g * _sigmoid(g * alpha))
    elif ACT == 4:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g * _sigmoid(g) * u
    elif ACT == 10:
        return g * _sigmoid(g)
    elif ACT == 11:
        return _gelu(g, False)
    elif ACT == 12:
        return tl.maximum(g, 0.0)
    else:
        r = tl.maximum(g, 0.0)
        return r * r


@triton.jit
def _act_kernel(h_ptr, out_ptr, rows_ptr, R, N, stride_h, stride_o, up_off, col_mult, alpha, limit,
                GATED: tl.constexpr, ACT: tl.constexpr, HAS_ROWS: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = r < R
    if HAS_ROWS:
        # only the first rows_ptr[0] rows hold data (the rest are not computed)
        rmask = rmask & (r < tl.load(rows_ptr))
    m = rmask[:, None] & (n < N)[None, :]
    base = h_ptr + r[:, None].to(tl.int64) * stride_h
    g = tl.load(base + (n * col_mult)[None, :], mask=m, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(base + (n * col_mult + up_off)[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        u = g
    y = apply_act(g, u, alpha, limit, ACT)
    tl.store(out_ptr + r[:, None].to(tl.int64) * stride_o + n[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def activation(h: torch.Tensor, cfg: ExpertsConfig, out: torch.Tensor | None = None,
               num_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``h [P, 2I]`` (gated) or ``[P, I]`` -> ``[P, I]``; ``num_rows`` (int32 [1], on device) limits the rows."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"h must be a 2-D tensor [P, N], but got {getattr(h, 'shape', type(h).__name__)}.")
    if h.stride(1) != 1:
        raise ValueError(f"h must be contiguous along its last dim, but got strides {h.stride()}.")
    gated = cfg.activation.is_gated
    if gated and h.shape[1] % 2:
        raise ValueError(f"a gated activation needs an even width, but h has shape {tuple(h.shape)}.")
    rows, width = h.shape
    inter = width // 2 if gated else width
    if out is None:
        out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    if tuple(out.shape) != (rows, inter) or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {inter}] contiguous along its last dim, but got {tuple(out.shape)}.")
    if rows == 0:
        return out
    interleaved = gated and cfg.gate_up_interleaved
    up_off = 1 if interleaved else inter
    col_mult = 2 if interleaved else 1
    block_r, block_n = 8, 256
    grid = (cdiv(rows, block_r), cdiv(inter, block_n))
    launch(_act_kernel, grid, h, out, num_rows if num_rows is not None else h, rows, inter, h.stride(0), out.stride(0),
           up_off, col_mult, float(cfg.swiglu_alpha), float(cfg.swiglu_limit),
           GATED=gated, ACT=act_code(cfg), HAS_ROWS=num_rows is not None,
           BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4)
    return out


__all__ = ["ActCode", "act_code", "activation", "activation_reference", "apply_act"]
