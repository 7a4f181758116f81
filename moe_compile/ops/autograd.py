"""The fused ops' backward, so training graphs can run them.

The forward stays the lowering's kernels. The backward is one opaque op per fused op,
``moe_compile::fused_moe_backward`` / ``fused_experts_backward``: it recomputes the block in plain torch
under autograd (the routing with ``select_experts``, the experts as one GEMM pair per expert hit, tokens
sorted by expert) and returns the gradients torch's autograd takes from that. So:

- the gradients are those of the op's documented semantics, for every routing method, activation and bias;
- the forward saves only the op's inputs (the block input, router logits and weights): no activations are
  held between forward and backward, as activation checkpointing would hold none; the price is a second
  forward of the experts inside the backward;
- the backward reads the expert counts on the host (a sort and one GEMM pair per expert hit), so it is not
  CUDA-graph capturable: the backward ops carry ``torch.Tag.cudagraph_unsafe``, which Inductor's CUDA graphs
  keep out (a partition of their own, or no graph for that backward); the forward still is capturable.

The selection itself (``topk_ids``) has no gradient; the selection bias (``e_score_correction_bias``) gets
none, as in the models. Expert- and tensor-parallel groups are refused in the backward.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from moe_compile.ops import custom_op as co
from moe_compile.ops.activation import apply_activation
from moe_compile.ops.config import ExpertsConfig, MoEConfig
from moe_compile.ops.registration import op
from moe_compile.ops.routing import select_experts

TENSORS = 7
# the backward reads expert counts on the host: Inductor keeps it out of CUDA graphs (a partition or no graph)
_HOST_SYNC = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def experts_reference(x_TH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
                      cfg: ExpertsConfig) -> torch.Tensor:
    """``sum_k w[t,k] * expert_{id[t,k]}(x[t])`` in plain, differentiable torch; ``[T, H]`` in ``x``'s dtype.

    The ``T*k`` pairs are sorted by expert; each expert hit runs its two GEMMs on its rows
    (``w13 [E, H, 2I]``, ``w2 [E, I, H]``), and the weighted rows are summed back per token."""
    num_tokens, hidden = x_TH.shape
    top_k = ids_TK.shape[-1]
    flat = ids_TK.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token = order // top_k
    rows = x_TH.index_select(0, token)
    pair_w = weights_TK.reshape(-1).index_select(0, order).unsqueeze(-1)
    if cfg.apply_router_weight_on_input:
        rows = rows * pair_w.to(rows.dtype)
    pieces, start = [], 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        h = rows[start:start + count] @ w13[expert]
        if b13 is not None:
            h = h + b13[expert]
        y = apply_activation(h, cfg) @ w2[expert]
        if b2 is not None:
            y = y + b2[expert]
        pieces.append(y)
        start += count
    out_rows = torch.cat(pieces) if pieces else rows.new_zeros(0, hidden)
    if not cfg.apply_router_weight_on_input:
        out_rows = out_rows * pair_w.to(out_rows.dtype)
    out = out_rows.new_zeros(num_tokens, hidden).index_add(0, token, out_rows)
    return out.to(x_TH.dtype)


def _check_single_device(cfg: MoEConfig, name: str) -> None:
    parallel = cfg.parallel
    if parallel.ep_group_name is not None or parallel.tp_group_name is not None:
        raise NotImplementedError(f"{name}: the backward runs on one device; ep_group_name="
                                  f"{parallel.ep_group_name!r} and tp_group_name={parallel.tp_group_name!r} must be "
                                  f"None (train expert- or tensor-parallel blocks without the fused op)")


def _grads(outputs: torch.Tensor, grad_out: torch.Tensor, inputs: list, needs: list[bool]) -> list[torch.Tensor]:
    """Gradients for ``inputs`` where ``needs`` (and the input is there), else empty placeholders."""
    wanted = [t for t, need in zip(inputs, needs) if need and t is not None]
    got = iter(torch.autograd.grad(outputs, wanted, grad_out, allow_unused=True) if wanted else ())
    result = []
    for t, need in zip(inputs, needs):
        if need and t is not None:
            g = next(got)
            result.append(torch.zeros_like(t) if g is None else g)
        else:
            result.append(grad_out.new_empty(0))
    return result


def _leaves(tensors: list) -> list:
    return [None if t is None else t.detach().requires_grad_(t.is_floating_point()) for t in tensors]


@op("moe_compile::fused_moe_backward", tags=_HOST_SYNC)
def fused_moe_backward_op(
    grad_out: torch.Tensor, hidden_states: torch.Tensor, router_logits: torch.Tensor, w13_weight: torch.Tensor,
    w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
    e_score_correction_bias: Optional[torch.Tensor], needs: list[bool], scalars: str,
) -> list[torch.Tensor]:
    """Gradients of ``moe_compile::fused_moe`` for (hidden_states, router_logits, w13_weight, w2_weight,
    w13_bias, w2_bias): each where ``needs`` says so, else an empty tensor. ``scalars``: the op's 21
    scalar arguments as a JSON list."""
    values = json.loads(scalars)
    cfg = co.make_config(*values[:10], e_score_correction_bias is not None, *values[10:])
    _check_single_device(cfg, "fused_moe_backward")
    hidden = hidden_states.shape[-1]
    with torch.enable_grad():
        x, logits, w13, w2, b13, b2 = _leaves([hidden_states, router_logits, w13_weight, w2_weight, w13_bias,
                                               w2_bias])
        weights, ids = select_experts(logits.reshape(-1, cfg.routing.num_experts), cfg.routing,
                                      e_score_correction_bias)
        out = experts_reference(x.reshape(-1, hidden), weights, ids, w13, w2, b13, b2, cfg.experts)
        return _grads(out.reshape(hidden_states.shape), grad_out, [x, logits, w13, w2, b13, b2], needs)


@fused_moe_backward_op.register_fake
def _fused_moe_backward_fake(grad_out, hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias,
                             e_score_correction_bias, needs, scalars):
    return _fake_grads(grad_out, [hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias], needs)


@op("moe_compile::fused_experts_backward", tags=_HOST_SYNC)
def fused_experts_backward_op(
    grad_out: torch.Tensor, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_weight: torch.Tensor, w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor],
    w2_bias: Optional[torch.Tensor], needs: list[bool], scalars: str,
) -> list[torch.Tensor]:
    """Gradients of ``moe_compile::fused_experts`` for (hidden_states, topk_weights, w13_weight, w2_weight,
    w13_bias, w2_bias), as ``fused_moe_backward`` gives them; ``topk_ids`` has none."""
    values = json.loads(scalars)
    cfg = co.make_config(values[0], topk_ids.shape[-1], *co._ROUTING_DONE.values(), *values[1:])
    _check_single_device(cfg, "fused_experts_backward")
    with torch.enable_grad():
        x, weights, w13, w2, b13, b2 = _leaves([hidden_states, topk_weights, w13_weight, w2_weight, w13_bias,
                                                w2_bias])
        hidden = hidden_states.shape[-1]
        out = experts_reference(x.reshape(-1, hidden), weights.reshape(-1, topk_ids.shape[-1]),
                                topk_ids.reshape(-1, topk_ids.shape[-1]), w13, w2, b13, b2, cfg.experts)
        return _grads(out.reshape(hidden_states.shape), grad_out, [x, weights, w13, w2, b13, b2], needs)


@fused_experts_backward_op.register_fake
def _fused_experts_backward_fake(grad_out, hidden_states, topk_weights, topk_ids, w13_weight, w2_weight, w13_bias,
                                 w2_bias, needs, scalars):
    return _fake_grads(grad_out, [hidden_states, topk_weights, w13_weight, w2_weight, w13_bias, w2_bias], needs)


def _fake_grads(grad_out, inputs: list, needs: list[bool]) -> list[torch.Tensor]:
    return [torch.empty_like(t, memory_format=torch.contiguous_format) if need and t is not None
            else grad_out.new_empty(0) for t, need in zip(inputs, needs)]


def _scalars(inputs) -> str:
    """The op's scalar arguments as the backward op takes them (a SymInt is made a plain int: the
    backward of one graph runs for the shapes its forward ran)."""
    return json.dumps([int(v) if isinstance(v, torch.SymInt) else v for v in inputs[TENSORS:]])


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:TENSORS])
    ctx.scalars = _scalars(inputs)


def _fused_moe_grads(ctx, grad_out):
    x, logits, w13, w2, b13, b2, bias = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:6])
    grads = torch.ops.moe_compile.fused_moe_backward(grad_out.contiguous(), x, logits, w13, w2, b13, b2, bias,
                                                     needs, ctx.scalars)
    return (*[g if need else None for g, need in zip(grads, needs)], None, *[None] * (len(ctx.needs_input_grad) - 7))


def _fused_experts_grads(ctx, grad_out):
    x, weights, ids, w13, w2, b13, b2 = ctx.saved_tensors
    slots = (0, 1, 3, 4, 5, 6)  # every input but topk_ids
    needs = [bool(ctx.needs_input_grad[i]) for i in slots]
    grads = torch.ops.moe_compile.fused_experts_backward(grad_out.contiguous(), x, weights, ids, w13, w2, b13, b2,
                                                         needs, ctx.scalars)
    result = [None] * len(ctx.needs_input_grad)
    for slot, g, need in zip(slots, grads, needs):
        result[slot] = g if need else None
    return tuple(result)


co.fused_moe_op.register_autograd(_fused_moe_grads, setup_context=_setup)
co.fused_experts_op.register_autograd(_fused_experts_grads, setup_context=_setup)

__all__ = ["experts_reference", "fused_experts_backward_op", "fused_moe_backward_op"]
