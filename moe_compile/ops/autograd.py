"""The fused ops' backward, so training graphs can run them.

The forward stays the lowering's kernels. The backward is the same math in one of two forms: traced into the
backward graph as aten ops where the grouped GEMMs can be traced (bf16: ``backward_in_graph``; the routing's
autograd too), else one opaque op per fused op,
``moe_compile::fused_moe_backward`` / ``fused_experts_backward``: the routing is recomputed under autograd
(``select_experts``), the experts' backward is written out (``experts_backward``: the pairs sorted by expert,
each expert hit recomputing its first GEMM and running four backward GEMMs), and autograd carries the routing
weights' gradient back to the router logits. The scalars travel as ``pack_calls`` packs them (``ops/packed.py``),
decoded once per distinct string. So:

- the gradients are those of the op's documented semantics, for every routing method, activation and bias;
- the forward saves only the op's inputs (the block input, router logits and weights): no activations are
  held between forward and backward, as activation checkpointing would hold none; the price is the experts'
  first GEMM and activation again inside the backward;
- the experts' GEMMs are grouped GEMMs (``torch._grouped_mm``, ``ops/experts_grad.py``) where torch runs them
  without a host sync (CUDA bf16 on sm90+, the CPU); elsewhere (CUDA fp32/fp16, unaligned sizes) a Python loop
  over the experts hit, which reads the expert counts on the host. So the backward ops carry
  ``torch.Tag.cudagraph_unsafe``, which Inductor's CUDA graphs keep out (a partition of their own, or no graph for
  that backward); the forward still is capturable.

The selection itself (``topk_ids``) has no gradient; the selection bias (``e_score_correction_bias``) gets
none, as in the models. Expert- and tensor-parallel groups are refused in the backward.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
from typing import Optional

import torch
import torch.nn.functional as F

from moe_compile.ops import custom_op as co
from moe_compile.ops import experts_grad
from moe_compile.ops.packed import FUSED_EXPERTS_SCALARS, FUSED_MOE_SCALARS, TENSORS, unpack
from moe_compile.ops.activation import apply_activation, split_gate_up
from moe_compile.ops.config import Activation, ExpertsConfig, MoEConfig
from moe_compile.ops.registration import op
from moe_compile.ops.routing import select_experts

# the backward reads expert counts on the host: Inductor keeps it out of CUDA graphs (a partition or no graph)
_HOST_SYNC = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def _activation_with_backward(h: torch.Tensor, cfg: ExpertsConfig):
    """(the activation of the first GEMM's output ``h``, a function from its gradient to ``h``'s): written out for
    SiLU-gated experts, the common case; by autograd on ``h`` alone for the others."""
    if cfg.activation is Activation.SILU:
        gate, up = split_gate_up(h, cfg.gate_up_interleaved)
        # in fp32, rounded once to h's dtype (as the forward kernels round the activation); the derivative is
        # recomputed from h when asked for, so no fp32 intermediate is held across the GEMMs in between
        act = (F.silu(gate.float()) * up.float()).to(h.dtype)

        def backward(da: torch.Tensor) -> torch.Tensor:
            g, u, da32 = gate.float(), up.float(), da.float()
            sig = torch.sigmoid(g)
            dh = torch.empty_like(h)
            d_gate, d_up = split_gate_up(dh, cfg.gate_up_interleaved)
            d_gate.copy_(da32 * u * sig * (1 + g * (1 - sig)))
            d_up.copy_(da32 * g * sig)
            return dh

        return act, backward
    with torch.enable_grad():
        h_leaf = h.detach().requires_grad_()
        act = apply_activation(h_leaf, cfg)
    return act.detach(), lambda da: torch.autograd.grad(act, h_leaf, da)[0]


def _grad_buffer(t: torch.Tensor, flip: bool) -> torch.Tensor:
    """An uninitialised gradient shaped like ``t``: contiguous, or (``flip``) a transpose of its last two dims'
    contiguous layout. Decided by ``flip`` alone, never by ``t``'s strides, so the fake kernel lays it out the same
    whatever strides a compiler hands the real one."""
    if not flip:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return torch.empty(*t.shape[:-2], t.shape[-1], t.shape[-2], dtype=t.dtype, device=t.device).transpose(-1, -2)


def transposed_layout(t: Optional[torch.Tensor]) -> bool:
    """Whether ``t`` (a 3-D weight) is a transpose of its last two dims' contiguous layout (HF's [E, N, K]
    parameter read as [E, K, N])."""
    return t is not None and t.dim() == 3 and not t.is_contiguous() and t.transpose(-1, -2).is_contiguous()


def experts_backward(grad_TH: torch.Tensor, x_TH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
                     cfg: ExpertsConfig, needs: list[bool],
                     transposed: tuple = (False, False)) -> list[Optional[torch.Tensor]]:
    """Gradients of ``out[t] = sum_k w[t,k] * expert_{id[t,k]}(x[t])`` (``w13 [E, H, 2I]``, ``w2 [E, I, H]``) for
    (x, weights, w13, w2, b13, b2), each where ``needs`` says so (else None).

    The ``T*k`` pairs are sorted by expert; each expert hit recomputes its first GEMM and the activation and runs
    four backward GEMMs (as five grouped GEMMs, ``experts_grad.grouped_backward``, where ``torch._grouped_mm``
    takes the operands; else a loop over the experts hit, ``_looped_backward``). The pair weights' gradient
    ``<g, y>`` is read as ``<g @ w2^T, act>``, so the second GEMM is not recomputed; the activation's derivative is
    written out for SiLU-gated experts and taken by autograd on the ``[n, 2I]`` first-GEMM output for the others."""
    need_x, need_w, need_w13, need_w2, need_b13, need_b2 = needs
    num_tokens, hidden = x_TH.shape
    top_k = ids_TK.shape[-1]
    flat = ids_TK.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    token = order // top_k
    rows = x_TH.index_select(0, token)
    pair_w = weights_TK.reshape(-1).index_select(0, order).unsqueeze(-1)
    grad_rows = grad_TH.index_select(0, token)
    on_input = cfg.apply_router_weight_on_input
    x_in = rows * pair_w.to(rows.dtype) if on_input else rows
    need_in = need_x or (need_w and on_input)
    inner = [need_in, need_w and not on_input, need_w13, need_w2, need_b13, need_b2]
    if experts_grad.usable(x_TH, w13, w2):
        grad_in, grad_pair, d13, d2, db13, db2 = experts_grad.grouped_backward(
            flat.index_select(0, order), x_in, grad_rows, pair_w, w13, w2, b13, b2,
            functools.partial(_activation_with_backward, cfg=cfg), on_input, inner, transposed)
    else:
        counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
        grad_in, grad_pair, d13, d2, db13, db2 = _looped_backward(counts, x_in, grad_rows, pair_w, w13, w2, b13, b2,
                                                                  cfg, on_input, inner, transposed)
    dx = dw = None
    if on_input and need_w:
        grad_pair = (grad_in.float() * rows.float()).sum(-1)
    if need_x:
        grad_rows_in = grad_in * pair_w.to(grad_in.dtype) if on_input else grad_in
        # back to (token, k) order, then each token's k rows summed: no atomics, the same sum on every run
        per_pair = torch.empty_like(grad_rows_in).index_copy_(0, order, grad_rows_in)
        dx = per_pair.view(num_tokens, top_k, hidden).sum(1)  # contiguous, as the fake
    if need_w:
        dw = torch.zeros(flat.shape[0], dtype=torch.float32, device=flat.device).index_copy_(0, order, grad_pair)
        dw = dw.reshape(weights_TK.shape).to(weights_TK.dtype)
    return [dx, dw, d13, d2, db13, db2]


def _looped_backward(counts: list[int], x_in: torch.Tensor, grad_rows: torch.Tensor, pair_w: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
                     cfg: ExpertsConfig, on_input: bool, needs: list[bool], transposed: tuple) -> tuple:
    """``experts_grad.grouped_backward``'s results by a loop over the experts hit (``counts`` read on the host):
    for operands ``torch._grouped_mm`` does not take."""
    need_in, need_pair, need_w13, need_w2, need_b13, need_b2 = needs
    grad_in = torch.empty_like(x_in) if need_in else None
    grad_pair = torch.zeros(x_in.shape[0], dtype=torch.float32, device=x_in.device) if need_pair else None
    # written per expert hit; the experts nobody picked are zeroed after the loop (not the whole tensor first).
    # ``transposed``: w13 / w2 are read through a permute of a parameter stored [E, N, K] (HF): their gradients
    # are laid out so, and the parameter's own gradient is dense, which autograd accumulates without a copy
    d13, d2 = (_grad_buffer(t, flip) if need else None
               for t, need, flip in ((w13, need_w13, transposed[0]), (w2, need_w2, transposed[1])))
    db13, db2 = (_grad_buffer(t, False) if need and t is not None else None for t, need in ((b13, need_b13),
                                                                                          (b2, need_b2)))
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows_e = slice(start, start + count)
        start += count
        xe = x_in[rows_e]
        h = xe @ w13[expert]
        if b13 is not None:
            h = h + b13[expert]
        act, act_backward = _activation_with_backward(h, cfg)
        ge = grad_rows[rows_e]
        ga = ge @ w2[expert].t()  # the activation's gradient before the pair weight
        if on_input:
            dy, da = ge, ga
        else:
            we = pair_w[rows_e].to(ge.dtype)
            dy, da = ge * we, ga * we
            if need_pair:  # <g, act @ w2 + b2> without the second GEMM again: <g @ w2^T, act> + <g, b2>
                dot = (ga.float() * act.float()).sum(-1)
                grad_pair[rows_e] = dot if b2 is None else dot + ge.float() @ b2[expert].float()
        if d2 is not None:
            torch.mm(act.t(), dy, out=d2[expert])
        if db2 is not None:
            db2[expert] = dy.sum(0)
        dh = act_backward(da)
        if d13 is not None:
            torch.mm(xe.t(), dh, out=d13[expert])
        if db13 is not None:
            db13[expert] = dh.sum(0)
        if grad_in is not None:
            torch.mm(dh, w13[expert].t(), out=grad_in[rows_e])
    unhit = [e for e, count in enumerate(counts) if not count]
    if unhit:
        idle = torch.tensor(unhit, device=w13.device)
        for grad in (d13, d2, db13, db2):
            if grad is not None:
                grad.index_fill_(0, idle, 0)
    return grad_in, grad_pair, d13, d2, db13, db2


def _check_single_device(cfg: MoEConfig, name: str) -> None:
    parallel = cfg.parallel
    if parallel.ep_group_name is not None or parallel.tp_group_name is not None:
        raise NotImplementedError(f"{name}: the backward runs on one device; ep_group_name="
                                  f"{parallel.ep_group_name!r} and tp_group_name={parallel.tp_group_name!r} must be "
                                  f"None (train expert- or tensor-parallel blocks without the fused op)")


def _filled(grads: list, grad_out: torch.Tensor) -> list[torch.Tensor]:
    """The op's list of gradients: an empty tensor where none was asked for (the schema has no optional list)."""
    return [grad_out.new_empty(0) if g is None else g for g in grads]


def _moe_config(scalars: str, has_bias: bool) -> MoEConfig:
    values = unpack(scalars, FUSED_MOE_SCALARS)
    return co.make_config(*values[:10], has_bias, *values[10:])


def _routing_grad(grad_weights: torch.Tensor, router_logits: torch.Tensor, bias: Optional[torch.Tensor],
                  cfg: MoEConfig) -> torch.Tensor:
    """The router logits' gradient from the routing weights' (``[T*, top_k]``), by autograd through the
    recomputed ``select_experts``."""
    with torch.enable_grad():
        logits = router_logits.detach().requires_grad_()
        weights, _ = select_experts(logits.reshape(-1, cfg.routing.num_experts), cfg.routing, bias)
    return torch.autograd.grad(weights, logits, grad_weights.reshape(weights.shape))[0].contiguous()


def _moe_grads(grad_out, hidden_states, router_logits, w13, w2, b13, b2, bias, needs, transposed,
               scalars) -> list[Optional[torch.Tensor]]:
    """``fused_moe``'s gradients (None where ``needs`` says no). Traced into a backward graph (bf16), the routing's
    autograd (``_routing_grad``) is traced too: its ops are the graph's own nodes, as the GEMMs are."""
    cfg = _moe_config(scalars, bias is not None)
    _check_single_device(cfg, "fused_moe_backward")
    hidden = hidden_states.shape[-1]
    with torch.no_grad():
        weights, ids = select_experts(router_logits.reshape(-1, cfg.routing.num_experts), cfg.routing, bias)
    grads = experts_backward(grad_out.reshape(-1, hidden), hidden_states.reshape(-1, hidden), weights, ids, w13, w2,
                             b13, b2, cfg.experts, list(needs), tuple(transposed))
    dx, dweights = grads[0], grads[1]
    dlogits = _routing_grad(dweights, router_logits, bias, cfg) if needs[1] else None
    return [None if dx is None else dx.reshape(hidden_states.shape), dlogits, *grads[2:]]


@op("moe_compile::fused_moe_backward", tags=_HOST_SYNC)
def fused_moe_backward_op(
    grad_out: torch.Tensor, hidden_states: torch.Tensor, router_logits: torch.Tensor, w13_weight: torch.Tensor,
    w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
    e_score_correction_bias: Optional[torch.Tensor], needs: list[bool], transposed: list[bool], scalars: str,
) -> list[torch.Tensor]:
    """Gradients of ``moe_compile::fused_moe`` for (hidden_states, router_logits, w13_weight, w2_weight,
    w13_bias, w2_bias): each where ``needs`` says so, else an empty tensor. ``transposed``: w13 / w2 are read
    through a permute of an [E, N, K] parameter (their gradients are laid out so). ``scalars``: the op's 21
    scalar arguments as a JSON list (``packed.unpack``)."""
    return _filled(_moe_grads(grad_out, hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias,
                              e_score_correction_bias, needs, transposed, scalars), grad_out)


@fused_moe_backward_op.register_fake
def _fused_moe_backward_fake(grad_out, hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias,
                             e_score_correction_bias, needs, transposed, scalars):
    return _fake_grads(grad_out, [hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias], needs,
                       transposed)


@op("moe_compile::fused_experts_backward", tags=_HOST_SYNC)
def fused_experts_backward_op(
    grad_out: torch.Tensor, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_weight: torch.Tensor, w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor],
    w2_bias: Optional[torch.Tensor], needs: list[bool], transposed: list[bool], scalars: str,
) -> list[torch.Tensor]:
    """Gradients of ``moe_compile::fused_experts`` for (hidden_states, topk_weights, w13_weight, w2_weight,
    w13_bias, w2_bias), as ``fused_moe_backward`` gives them; ``topk_ids`` has none."""
    return _filled(_experts_grads(grad_out, hidden_states, topk_weights, topk_ids, w13_weight, w2_weight, w13_bias,
                                  w2_bias, needs, transposed, scalars), grad_out)


def _experts_grads(grad_out, hidden_states, topk_weights, topk_ids, w13, w2, b13, b2, needs, transposed,
                   scalars) -> list[Optional[torch.Tensor]]:
    """``fused_experts``' gradients (None where ``needs`` says no)."""
    values = unpack(scalars, FUSED_EXPERTS_SCALARS)
    cfg = co.make_config(values[0], topk_ids.shape[-1], *co._ROUTING_DONE.values(), *values[1:])
    _check_single_device(cfg, "fused_experts_backward")
    hidden, top_k = hidden_states.shape[-1], topk_ids.shape[-1]
    grads = experts_backward(grad_out.reshape(-1, hidden), hidden_states.reshape(-1, hidden),
                             topk_weights.reshape(-1, top_k), topk_ids.reshape(-1, top_k), w13, w2, b13, b2,
                             cfg.experts, list(needs), tuple(transposed))
    dx, dw = grads[0], grads[1]
    return [None if dx is None else dx.reshape(hidden_states.shape),
            None if dw is None else dw.reshape(topk_weights.shape), *grads[2:]]


@fused_experts_backward_op.register_fake
def _fused_experts_backward_fake(grad_out, hidden_states, topk_weights, topk_ids, w13_weight, w2_weight, w13_bias,
                                 w2_bias, needs, transposed, scalars):
    return _fake_grads(grad_out, [hidden_states, topk_weights, w13_weight, w2_weight, w13_bias, w2_bias], needs,
                       transposed)


def _fake_grads(grad_out, inputs: list, needs: list[bool], transposed: list[bool]) -> list[torch.Tensor]:
    """As the real kernels lay them out: contiguous, the weights' as ``transposed`` says (``_grad_buffer``)."""
    flips = [False, False, *transposed, False, False]
    return [grad_out.new_empty(0) if not need or t is None else _grad_buffer(t, flip)
            for t, need, flip in zip(inputs, needs, flips)]


def _scalars(inputs) -> str:
    """The op's scalar arguments as the backward op takes them (a SymInt is made a plain int: the
    backward of one graph runs for the shapes its forward ran)."""
    return json.dumps([int(v) if isinstance(v, torch.SymInt) else v for v in inputs[TENSORS:]])


def _setup(ctx, inputs, output, *, w13_at: int) -> None:
    ctx.save_for_backward(*inputs[:TENSORS])
    ctx.scalars = _scalars(inputs)
    # read when the forward is traced (or runs eagerly): the graph's own layout, a constant of the backward's call
    ctx.transposed = [transposed_layout(inputs[w13_at]), transposed_layout(inputs[w13_at + 1])]
    ctx.in_graph = backward_in_graph(inputs[0], inputs[w13_at], inputs[w13_at + 1])


def _first_order_only(name: str) -> None:
    if torch.is_grad_enabled():  # the engine runs a backward with grad mode on only for create_graph=True
        raise NotImplementedError(f"double backward through moe_compile::{name} is not supported (its backward op "
                                  f"has no backward): take the gradient without create_graph=True")


_CHOICE = contextvars.ContextVar("moe_compile_training_backward", default="auto")


@contextlib.contextmanager
def backward_choice(choice: str):
    """Within: ``backward_in_graph`` answers for ``options['training_backward']`` = ``choice`` ('auto' / 'op')."""
    token = _CHOICE.set(choice)
    try:
        yield
    finally:
        _CHOICE.reset(token)


def backward_in_graph(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the backward is written into the graph as the grouped GEMMs' aten ops (traced by AOTAutograd, so
    Inductor fuses the elementwise work around them and no host step runs between them; nothing syncs with the
    host, as a CUDA test checks) rather than one opaque ``*_backward`` op: where the grouped GEMMs
    take the operands (``experts_grad.usable``) and torch's fake kernel of them takes the dtype (bf16), so the
    graph can be traced; otherwise the opaque op runs the same math, or the loop. Never under
    ``backward_choice('op')``. Asked when the forward is traced or run (``_setup``)."""
    return _CHOICE.get() != "op" and experts_grad.usable(x, w13, w2) and experts_grad.traceable(x.dtype)


def _fused_moe_grads(ctx, grad_out):
    _first_order_only("fused_moe")
    x, logits, w13, w2, b13, b2, bias = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:6])
    if ctx.in_graph:
        grads = _moe_grads(grad_out.contiguous(), x, logits, w13, w2, b13, b2, bias, needs, ctx.transposed,
                           ctx.scalars)
    else:
        grads = torch.ops.moe_compile.fused_moe_backward(grad_out.contiguous(), x, logits, w13, w2, b13, b2, bias,
                                                         needs, ctx.transposed, ctx.scalars)
    return (*[g if need else None for g, need in zip(grads, needs)], None, *[None] * (len(ctx.needs_input_grad) - 7))


def _fused_experts_grads(ctx, grad_out):
    _first_order_only("fused_experts")
    x, weights, ids, w13, w2, b13, b2 = ctx.saved_tensors
    slots = (0, 1, 3, 4, 5, 6)  # every input but topk_ids
    needs = [bool(ctx.needs_input_grad[i]) for i in slots]
    backward = _experts_grads if ctx.in_graph else torch.ops.moe_compile.fused_experts_backward
    grads = backward(grad_out.contiguous(), x, weights, ids, w13, w2, b13, b2, needs, ctx.transposed, ctx.scalars)
    result = [None] * len(ctx.needs_input_grad)
    for slot, g, need in zip(slots, grads, needs):
        result[slot] = g if need else None
    return tuple(result)


co.fused_moe_op.register_autograd(_fused_moe_grads, setup_context=functools.partial(_setup, w13_at=2))
co.fused_experts_op.register_autograd(_fused_experts_grads, setup_context=functools.partial(_setup, w13_at=3))

__all__ = ["backward_in_graph", "experts_backward", "fused_experts_backward_op", "fused_moe_backward_op"]
