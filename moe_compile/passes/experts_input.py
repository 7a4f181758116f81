"""Blocks whose experts read another tensor than the router, and per-expert output scales.

Gemma-4 routes on its own RMSNorm of the layer's residual and feeds the experts a second norm of it
(``pre_feedforward_layernorm_2``), then multiplies each routing weight by ``per_expert_scale[id]``.
The fused op takes the experts' input and the router logits separately, so the first is the op's
``hidden_states`` with the logits as they are; the second is exact once folded into each expert's
down projection (and its bias): ``w * s[e] * E_e(x) = w * (s[e] * W2_e) a``.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from moe_compile.passes.experts import _REINDEX_OPS, WeightSource, is_expert_matmul
from moe_compile.passes.graph import forward_slice, val
from moe_compile.passes.router import is_weight_root

aten = torch.ops.aten

# ops that move an activation without computing on it: the experts' matmuls read their input through
# them (each expert's tokens gathered, a copy per top-k slot, views)
_GATHER_OPS = _REINDEX_OPS | {
    getattr(aten, name).default for name in ("index_select", "gather", "repeat", "expand_as") if hasattr(aten, name)
} | {aten.index.Tensor, aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor}


def routing_dependent(ctx, topk: fx.Node) -> set[fx.Node]:
    """Every node downstream of the expert choice (computed once per top-k and graph)."""
    cache = ctx.__dict__.setdefault("dependent", {})
    if topk not in cache:
        cache[topk] = forward_slice(topk)
    return cache[topk]


def experts_input(ctx, anchor, output: fx.Node, slice_nodes: set[fx.Node], stop: set[fx.Node]) -> fx.Node | None:
    """The tensor the experts' matmuls read when it is none of the router's input views (``stop``
    holds those and the logits): each operand of an expert matmul after the expert choice, followed
    back through gathers, repeats, views and casts, to the first node that computes. ``None`` when
    they read the router's input, or when no single ``[T, H]`` activation is found."""
    dependent = routing_dependent(ctx, anchor.topk)
    x_shape = ctx.conc.shape(anchor.x)
    found = set()
    for node in slice_nodes:
        if node in stop or node not in dependent or not is_expert_matmul(node):
            continue
        for src in node.all_input_nodes:
            while (src not in stop and src.op == "call_function" and src.target in _GATHER_OPS
                   and src.args and isinstance(src.args[0], fx.Node)):
                src = src.args[0]
            if src in stop or src in dependent or src.op == "get_attr" or is_weight_root(src, ctx.names):
                continue
            v = val(src)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and ctx.conc.shape(src) == x_shape:
                found.add(src)
    return found.pop() if len(found) == 1 else None


def expert_scales(slice_nodes: set[fx.Node], values: dict, num_experts: int, exclude: set[fx.Node]) -> list[fx.Node]:
    """Floating ``[E]`` graph inputs of the routed output's slice: candidate per-expert output scales."""
    out = []
    for node in slice_nodes:
        t = values.get(node)
        if (node.op in ("placeholder", "get_attr") and node not in exclude and isinstance(t, torch.Tensor)
                and t.is_floating_point() and t.numel() == num_experts and math.prod(t.shape) == t.shape[0]):
            out.append(node)
    return sorted(out, key=lambda n: n.name)


def scaled(source: WeightSource | None, scale: fx.Node | None) -> WeightSource | None:
    """``source`` with expert ``e``'s slice multiplied by ``scale[e]`` (a down projection or its bias)."""
    if source is None or scale is None:
        return source
    return WeightSource("scale", (source, scale))
