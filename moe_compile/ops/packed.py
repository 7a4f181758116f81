"""The fused ops as a compiled graph calls them: the scalar arguments packed into one string.

``moe_compile::fused_moe`` takes 28 arguments (7 tensors, 21 scalars), ``fused_experts`` 19 (7 and 12).
Inductor's wrapper calls a fallback op with its scalars as keyword arguments, and the dispatcher
converts every one of them on every call: on the H200's host a do-nothing op with ``fused_moe``'s
arguments costs 12.3 µs a call against 6.7 µs with the scalars packed into one string
(``benchmarks/probe_op_args.py``). At decode sizes without CUDA graphs a call's host time is what a
step waits for.

``fused_moe_packed(7 tensors, scalars: str)`` and ``fused_experts_packed`` take the tensors as
before and the scalars as JSON (a list in the schema's order), decoded once per distinct string
(cached). Their body and fake are the plain ops' own, so they check and compute the same.

``pack_calls(graph)`` puts them in place of the plain ops' nodes as the compiled graph's last step,
after the before/after graphs were handed to the reports (which keep the readable call). A node
with a scalar that is not a plain value (a ``SymInt`` of a dynamic shape) stays as it is.
Backend option ``pack_args=False`` leaves every call unpacked.
"""
from __future__ import annotations

import functools
import json
import logging
from typing import Optional

import torch
import torch.fx as fx

from moe_compile.lowering.inline import bind_args
from moe_compile.ops import custom_op as co
from moe_compile.ops.registration import op

log = logging.getLogger("moe_compile")

TENSORS = 7  # both ops' tensor arguments come first: 7 of them
_PLAIN = (bool, int, float, str, type(None))


@functools.lru_cache(maxsize=1024)
def unpack(scalars: str, count: int) -> tuple:
    """The ``count`` scalars packed in ``scalars`` (a JSON list), in the plain op's order."""
    try:
        values = json.loads(scalars)
    except ValueError as exc:
        raise ValueError(f"scalars={scalars!r:.80} is not the JSON list pack_calls writes ({exc})") from None
    if not isinstance(values, list) or len(values) != count:
        raise ValueError(f"scalars={scalars!r:.80} must be a JSON list of {count} values (the plain op's "
                         f"scalar arguments in order)")
    return tuple(values)


FUSED_MOE_SCALARS = len(co.fused_moe_op._opoverload._schema.arguments) - TENSORS
FUSED_EXPERTS_SCALARS = len(co.fused_experts_op._opoverload._schema.arguments) - TENSORS


@op("moe_compile::fused_moe_packed")
def fused_moe_packed_op(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, w13_weight: torch.Tensor,
    w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
    e_score_correction_bias: Optional[torch.Tensor], scalars: str,
) -> torch.Tensor:
    """``moe_compile::fused_moe`` with its 21 scalars in ``scalars`` (see the module doc)."""
    return co.fused_moe_op._init_fn(hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias,
                                    e_score_correction_bias, *unpack(scalars, FUSED_MOE_SCALARS))


@fused_moe_packed_op.register_fake
def _fused_moe_packed_fake(hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias,
                           e_score_correction_bias, scalars):
    return co._fused_moe_fake(hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias,
                              e_score_correction_bias, *unpack(scalars, FUSED_MOE_SCALARS))


@op("moe_compile::fused_experts_packed")
def fused_experts_packed_op(
    hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_weight: torch.Tensor, w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor],
    w2_bias: Optional[torch.Tensor], scalars: str,
) -> torch.Tensor:
    """``moe_compile::fused_experts`` with its 12 scalars in ``scalars`` (see the module doc)."""
    return co.fused_experts_op._init_fn(hidden_states, topk_weights, topk_ids, w13_weight, w2_weight, w13_bias,
                                        w2_bias, *unpack(scalars, FUSED_EXPERTS_SCALARS))


@fused_experts_packed_op.register_fake
def _fused_experts_packed_fake(hidden_states, topk_weights, topk_ids, w13_weight, w2_weight, w13_bias, w2_bias,
                               scalars):
    return co._fused_experts_fake(hidden_states, topk_weights, topk_ids, w13_weight, w2_weight, w13_bias, w2_bias,
                                  *unpack(scalars, FUSED_EXPERTS_SCALARS))


def packed_overloads() -> dict:
    """``{plain op overload: its packed overload}``."""
    return {
        torch.ops.moe_compile.fused_moe.default: torch.ops.moe_compile.fused_moe_packed.default,
        torch.ops.moe_compile.fused_experts.default: torch.ops.moe_compile.fused_experts_packed.default,
    }


def _values(target, args, kwargs) -> list:
    """The op's arguments in its schema's order."""
    bound = bind_args(target, args, kwargs)
    return [bound[a.name] for a in target._schema.arguments]


def pack_calls(graph: fx.Graph) -> int:
    """Replace the plain fused-op nodes of ``graph`` by their packed ops; how many were."""
    overloads = packed_overloads()
    count = 0
    for node in list(graph.nodes):
        packed = overloads.get(node.target) if node.op == "call_function" else None
        if packed is None:
            continue
        values = _values(node.target, node.args, node.kwargs)
        scalars = values[TENSORS:]
        odd = [(a.name, v) for a, v in zip(node.target._schema.arguments[TENSORS:], scalars) if type(v) not in _PLAIN]
        if odd:  # e.g. a SymInt: left as it is
            log.debug("moe_compile: %s keeps its plain call: %s=%r is not a plain value to pack", node.name, *odd[0])
            continue
        text = json.dumps(scalars)
        with graph.inserting_before(node):
            new = graph.call_function(packed, (*values[:TENSORS], text))
        new.meta.update(node.meta)
        eager = node.meta.get("eager_input_vals")
        if eager is not None:  # the eager strides Inductor holds a custom op's inputs to, as the new args
            new.meta["eager_input_vals"] = ((*_values(node.target, *eager)[:TENSORS], text), {})
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    return count


__all__ = ["fused_experts_packed_op", "fused_moe_packed_op", "pack_calls", "packed_overloads", "unpack"]
