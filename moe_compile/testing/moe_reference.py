"""A plain per-token MoE reference: one token, one selected expert at a time, in float64.

It shares no code with the op (not the activation, not the modular kernel), so the op, the
modular-kernel combinations and the lowerings can all be checked against it. It is slow by design;
use it on tiny shapes only.

Routing for :func:`reference_fused_moe` comes from ``moe_compile.ops.routing.route_per_token_reference``
(a list-based oracle of the routing semantics) or from the caller's custom routing function.
"""
from __future__ import annotations

import math
from typing import Collection

import torch

from moe_compile.ops.config import RoutingConfig, RoutingMethod
from moe_compile.ops.routing import route_per_token_reference


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _relu(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x, torch.zeros_like(x))


_UNGATED = {
    "silu_no_mul": _silu,
    "gelu_no_mul": _gelu_erf,
    "relu_no_mul": _relu,
    "relu2_no_mul": lambda x: _relu(x) ** 2,
}


def reference_activation(h: torch.Tensor, activation: str, *, interleaved: bool = False,
                         alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """One token's first-GEMM output ``[2I]`` (gated) or ``[I]`` -> ``[I]``."""
    if activation in _UNGATED:
        return _UNGATED[activation](h)
    if interleaved:
        gate, up = h[0::2], h[1::2]
    else:
        half = h.shape[0] // 2
        gate, up = h[:half], h[half:]
    if activation == "silu":
        return _silu(gate) * up
    if activation == "gelu":
        return _gelu_erf(gate) * up
    if activation == "gelu_tanh":
        return _gelu_tanh(gate) * up
    if activation == "silu_clamped":
        return _silu(torch.clamp(gate, max=limit)) * torch.clamp(up, min=-limit, max=limit)
    if activation == "swigluoai":
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
        return (up + 1.0) * gate * torch.sigmoid(alpha * gate)
    raise ValueError(f"reference_activation: unknown activation {activation!r}")


def reference_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    apply_router_weight_on_input: bool = False,
    only_experts: Collection[int] | None = None,
) -> torch.Tensor:
    """``sum_k w[t,k] * expert_{id[t,k]}(x[t])`` per token, float64 ``[T, H]``.

    ``w13``/``w2`` hold every (global) expert. With ``only_experts`` the experts not in it
    contribute nothing (one rank's share under expert parallelism).
    With ``apply_router_weight_on_input`` the weight scales the expert's input instead.
    """
    x = hidden_states.double()
    w = topk_weights.double()
    num_tokens, hidden = x.shape
    out = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for t in range(num_tokens):
        for k in range(topk_ids.shape[1]):
            expert = int(topk_ids[t, k])
            if only_experts is not None and expert not in only_experts:
                continue
            xin = x[t] * w[t, k] if apply_router_weight_on_input else x[t]
            h = xin @ w13[expert].double()
            if w13_bias is not None:
                h = h + w13_bias[expert].double()
            a = reference_activation(h, activation, interleaved=interleaved, alpha=alpha, limit=limit)
            y = a @ w2[expert].double()
            if w2_bias is not None:
                y = y + w2_bias[expert].double()
            out[t] += y if apply_router_weight_on_input else w[t, k] * y
    return out


def reference_fused_moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    num_experts: int,
    top_k: int,
    w13_weight: torch.Tensor,
    w2_weight: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    routing_method: str = "softmax",
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
    custom_routing_function=None,
    e_score_correction_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    gate_up_interleaved: bool = False,
    scoring_after_topk: bool = False,
    normalize_sigmoid: bool = True,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """What ``fused_moe`` (single device) must return, float64, shaped like ``hidden_states``."""
    hidden = hidden_states.shape[-1]
    x_TH = hidden_states.reshape(-1, hidden)
    logits_TE = router_logits.reshape(-1, num_experts)
    if custom_routing_function is not None:
        weights, ids = custom_routing_function(hidden_states=x_TH, gating_output=logits_TE, topk=top_k,
                                               renormalize=renormalize)
        weights = weights.double() * routed_scaling_factor
    else:
        cfg = RoutingConfig(
            num_experts=num_experts, top_k=top_k, method=RoutingMethod(routing_method), renormalize=renormalize,
            routed_scaling_factor=routed_scaling_factor, k_group=k_group, group_count=group_count,
            group_select_mode=group_select_mode, has_correction_bias=e_score_correction_bias is not None,
            normalize_sigmoid=normalize_sigmoid, scoring_after_topk=scoring_after_topk,
        )
        if x_TH.shape[0] == 0:
            weights = torch.zeros(0, top_k)
            ids = torch.zeros(0, top_k, dtype=torch.int32)
        else:
            weights, ids = route_per_token_reference(logits_TE, cfg, e_score_correction_bias)
    out = reference_experts(
        x_TH, weights, ids, w13_weight, w2_weight, w13_bias, w2_bias, activation=activation,
        interleaved=gate_up_interleaved, alpha=swiglu_alpha, limit=swiglu_limit,
        apply_router_weight_on_input=apply_router_weight_on_input,
    )
    return out.reshape(hidden_states.shape)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> float:
    """Compare with the stated tolerances; return the max abs error.

    fp32: ``atol = rtol = 1e-4``; bf16/fp16: ``atol = rtol = 2e-2`` relative to the reference's scale
    (``atol`` is multiplied by ``max(1, max|ref|)``), as the op computes in the input dtype.
    """
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(out.double(), ref.double(), atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}")
    return float((out.double() - ref.double()).abs().max()) if ref.numel() else 0.0
