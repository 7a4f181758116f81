"""Routing scales that are Python numbers Dynamo passes in as graph inputs (``dynamic=True``): the
rewritten graph reads them per call instead of baking in their compile-time value."""
from __future__ import annotations

import torch
import torch.fx as fx

from moe_compile.passes import router as rt
from moe_compile.passes.experts_input import routing_dependent
from moe_compile.passes.graph import aten, backward_slice, in_scope, val


def scalar_input(ctx, node: fx.Node) -> float | None:
    """The value of a one-element tensor computed only from Python numbers that Dynamo made graph
    inputs (a routing scale under ``dynamic=True``; AOTAutograd passes them as float64 0-d tensors),
    else ``None``. A routing scale read so is read by the rewritten graph per call (``scale_source``):
    Dynamo does not recompile when the number changes. Parameters and buffers are refused."""
    fake = val(node)
    if not isinstance(fake, torch.Tensor) or fake.numel() != 1:
        return None
    needed = backward_slice([node], set())
    for leaf in needed:
        if leaf.op == "get_attr" or (leaf.op == "placeholder" and rt.is_weight_root(leaf, ctx.names)):
            return None  # a 0-d parameter or buffer can change after compiling; a baked-in copy would not
        if leaf.op == "placeholder":
            real = ctx.values.get(leaf)
            # a Python number, or the float64 0-d tensor AOTAutograd makes of one (not a Parameter)
            tensorified = (type(real) is torch.Tensor and real.dim() == 0 and real.dtype == torch.float64)
            if not (isinstance(real, (int, float)) or tensorified):
                return None
    try:
        out = ctx.evaluator.run(needed, {}, [node])[0]
    except Exception:  # noqa: BLE001 - an unevaluable slice is simply not a scale
        return None
    return float(out.reshape(-1)[0]) if isinstance(out, torch.Tensor) else None


def scale_source(ctx, anchor, scope: str, factor: float) -> tuple | None:
    """(node, divides) when the routing scale ``factor`` is read from a one-element graph input (under
    ``dynamic=True`` Dynamo passes Python floats such as ``routed_scaling_factor`` in and does not
    recompile when they change: a baked-in constant would go stale, e.g. for a second model of the
    same class), else ``None`` (a literal, guarded by Dynamo)."""
    if factor == 1.0:
        return None
    for node in sorted(routing_dependent(ctx, anchor.topk) | set(anchor.chain), key=lambda n: n.name):
        divides = node.target in (aten.div.Tensor, aten.div.Scalar)
        if not (divides or node.target in (aten.mul.Tensor, aten.mul.Scalar)) or not in_scope(node, scope):
            continue
        for arg in node.args[1:] if divides else node.args:
            fake = val(arg) if isinstance(arg, fx.Node) else None
            if not isinstance(fake, torch.Tensor) or fake.dim() != 0:
                continue
            value = scalar_input(ctx, arg)
            if value and (1.0 / value if divides else value) == factor:
                return arg, divides
    return None
