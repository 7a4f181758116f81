"""The expert activation for the NPU lowering, in ops that mean the same in eager and in GE mode.

SiLU-gated with ``[gate | up]`` halves is ``npu_swiglu`` (A = first half, notes §2.5). Everything
else is written out in elementwise aten ops, computed in fp32 and cast back:

- no torch_npu op matches gelu-gated, gpt-oss's clamped swiglu (alpha, limit, ``up + 1``,
  interleaved gate/up) or the non-gated forms;
- GELU is spelled with ``erf`` / ``tanh`` instead of ``F.gelu``: TorchAir lowers ``aten.gelu`` to
  GE ``Gelu`` and, in the converter versions read, either rejects ``approximate="tanh"`` or ignores
  it, so ``F.gelu`` could compute a different curve in GE mode than eagerly.
"""
from __future__ import annotations

import math

import torch

from moe_compile.ops.activation import split_gate_up
from moe_compile.ops.config import Activation, ExpertsConfig

_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x * _SQRT_HALF))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def _relu2(x: torch.Tensor) -> torch.Tensor:
    r = torch.relu(x)
    return r * r


_UNGATED = {
    Activation.SILU_NO_MUL: _silu,
    Activation.GELU_NO_MUL: _gelu_erf,
    Activation.RELU_NO_MUL: torch.relu,
    Activation.RELU2_NO_MUL: _relu2,
}
_GATED = {Activation.SILU: _silu, Activation.GELU: _gelu_erf, Activation.GELU_TANH: _gelu_tanh}


def npu_activation(h_RN: torch.Tensor, cfg: ExpertsConfig) -> torch.Tensor:
    """First GEMM output ``[R, 2I]`` (gated) or ``[R, I]`` -> ``[R, I]`` in ``h_RN``'s dtype."""
    act = cfg.activation
    if act is Activation.SILU and not cfg.gate_up_interleaved:
        from moe_compile.lowering.npu_routing import import_torch_npu

        return import_torch_npu().npu_swiglu(h_RN, dim=-1)  # silu(first half) * second half
    h = h_RN.float()
    if not act.is_gated:
        return _UNGATED[act](h).to(h_RN.dtype)
    gate, up = split_gate_up(h, cfg.gate_up_interleaved)
    if act in (Activation.SWIGLU_OAI, Activation.SILU_CLAMPED):  # gpt-oss; DeepSeek-V4 style
        gate = gate.clamp(max=cfg.swiglu_limit)
        up = up.clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
        out = _silu(gate) * up if act is Activation.SILU_CLAMPED else (
            (up + 1.0) * gate * torch.sigmoid(gate * cfg.swiglu_alpha))
    else:
        out = _GATED[act](gate) * up
    return out.to(h_RN.dtype)
