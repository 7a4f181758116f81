"""Put a lowering's torch code in place of a fused-op node of an FX graph.

A node of ``moe_compile::fused_moe`` / ``fused_experts`` is traced through a function on its fake
inputs (``make_fx``) and the resulting ops are copied into the graph where the node was. TorchAir's
GE graphs need this (no converter for the opaque op: ``npu_decompose.py``), and so does Inductor on
the CPU at decode sizes, where the experts compile into the graph's own kernels (``cpu_decode.py``).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


def fused_op_overloads() -> dict:
    """``{fused op overload: its custom_op definition}``."""
    from moe_compile.ops.custom_op import fused_experts_op, fused_moe_op

    return {
        torch.ops.moe_compile.fused_moe.default: fused_moe_op,
        torch.ops.moe_compile.fused_experts.default: fused_experts_op,
    }


def bind_args(op: torch._ops.OpOverload, args, kwargs) -> dict:
    """The op's arguments by name, defaults filled in."""
    schema_args = op._schema.arguments
    bound = {a.name: v for a, v in zip(schema_args, args)}
    bound.update(kwargs)
    for a in schema_args:
        if a.name not in bound and a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def ensure_vals(gm: fx.GraphModule, targets) -> None:
    """Nodes a pass inserted may lack ``meta["val"]``: propagate fake values from the placeholders."""
    inputs = {leaf for node in targets for leaf in pytree.tree_leaves((node.args, node.kwargs))
              if isinstance(leaf, fx.Node)}
    if all("val" in n.meta for n in inputs):
        return
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not all("val" in n.meta for n in placeholders):
        return  # nothing to start from; trace_node names the inputs without a value
    vals = [n.meta["val"] for n in placeholders]
    FakeTensorProp(gm, detect_fake_mode(vals)).propagate_dont_convert_inputs(*vals)


def trace_node(node: fx.Node, fn, *, functional: bool = False, decompositions: dict | None = None,
               caller: str = "inline"):
    """Trace ``fn(*node.args, **node.kwargs)`` on the node's fake inputs; returns (subgraph module,
    flat leaves of the node's arguments, positions of the Nodes among them). ``functional``: trace
    through ``torch.func.functionalize`` (no in-place ops in the result, as a post-grad graph wants);
    ``decompositions``: make_fx's table (Inductor's, for a graph Inductor has already decomposed)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)]
    missing = [leaves[i].name for i in positions if "val" not in leaves[i].meta]
    if missing:
        raise ValueError(f"{caller}: inputs {missing} of {node.name} have no meta['val']; "
                         f"trace the graph with fake tensors (Dynamo/AOT or make_fx) first")
    vals = [leaves[i].meta["val"] for i in positions]

    def traced(*tensors):
        filled = list(leaves)
        for pos, t in zip(positions, tensors):
            filled[pos] = t
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return fn(*args, **kwargs)

    if functional:
        traced = torch.func.functionalize(traced, remove="mutations")
    fake_mode = detect_fake_mode(vals) or FakeTensorMode()
    with fake_mode:
        sub = make_fx(traced, decomposition_table=decompositions, tracing_mode="real")(*vals)
    return sub, leaves, positions


def inline_node(gm: fx.GraphModule, node: fx.Node, fn, *, functional: bool = False,
                decompositions: dict | None = None, caller: str = "inline") -> None:
    """Replace ``node`` in ``gm`` by the ops ``fn`` runs on its inputs (``trace_node``'s options)."""
    sub, leaves, positions = trace_node(node, fn, functional=functional, decompositions=decompositions,
                                        caller=caller)
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for ph, pos in zip(placeholders, positions):
        env[ph] = leaves[pos]
    result = None
    with gm.graph.inserting_before(node):
        for sub_node in sub.graph.nodes:
            if sub_node.op == "placeholder":
                continue
            if sub_node.op == "output":
                result = fx.map_arg(sub_node.args[0], lambda n: env[n])
                break
            if sub_node.op == "get_attr":
                env[sub_node] = _copy_attr(gm, sub, sub_node)
                continue
            env[sub_node] = gm.graph.node_copy(sub_node, lambda n: env[n])
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)


def _copy_attr(gm: fx.GraphModule, sub: fx.GraphModule, sub_node: fx.Node) -> fx.Node:
    value = getattr(sub, sub_node.target)
    index = 0
    while hasattr(gm, f"_npu_moe_const{index}"):
        index += 1
    name = f"_npu_moe_const{index}"
    gm.register_buffer(name, value) if isinstance(value, torch.Tensor) else setattr(gm, name, value)
    new = gm.graph.get_attr(name)
    new.meta.update(sub_node.meta)
    return new
