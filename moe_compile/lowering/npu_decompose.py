"""Replace the fused op's graph nodes by the torch_npu op sequence, for TorchAir's GE mode.

GE needs a converter for every node (notes §3.2); ``moe_compile::fused_moe`` has none, so before
conversion each ``fused_moe`` / ``fused_experts`` node is traced through :class:`NpuLowering` (on
its fake inputs) and the resulting subgraph is inlined in its place. Two entry points:

- :func:`decompose_fused_moe_for_npu` (graph-level; for a post-grad custom pass, or any FX graph
  whose nodes carry ``meta["val"]``);
- :func:`npu_decompositions` (a decomposition table; hand it to ``torchair.get_npu_backend(
  custom_decompositions=...)`` or ``make_fx(..., decomposition_table=...)``).

Only the static dispatcher is graphable: the dynamic one needs host-side split sizes and
``npu_moe_token_(un)permute``, which GE cannot convert (notes §3.5); asking for it raises.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

log = logging.getLogger("moe_compile")


def _op_defs():
    from moe_compile.ops.custom_op import fused_experts_op, fused_moe_op

    return {
        torch.ops.moe_compile.fused_moe.default: fused_moe_op,
        torch.ops.moe_compile.fused_experts.default: fused_experts_op,
    }


def _bind(op: torch._ops.OpOverload, args, kwargs) -> dict:
    schema_args = op._schema.arguments
    bound = {a.name: v for a, v in zip(schema_args, args)}
    bound.update(kwargs)
    for a in schema_args:
        if a.name not in bound and a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def _check_graphable(bound: dict) -> None:
    if bound.get("dispatcher_type") == "dynamic":
        raise ValueError("dispatcher_type='dynamic' cannot go into a TorchAir graph: its all-to-all split sizes "
                         "are a host sync (no GE graph, no aclgraph capture) and npu_moe_token_permute/unpermute "
                         "have no GE converter; use dispatcher_type='static' (EP with active_expert_range) or run "
                         "the op eagerly (inner_compiler='aot_eager')")


def _decomposition(op: torch._ops.OpOverload, op_def):
    def decompose(*args, **kwargs):
        bound = _bind(op, args, kwargs)
        _check_graphable(bound)
        bound["lowering"] = "npu"  # GE runs on the NPU whatever the traced device said
        return op_def._init_fn(**bound)

    return decompose


def npu_decompositions() -> dict:
    """``{fused op overload: function}`` that runs the NPU lowering in place of the op."""
    return {op: _decomposition(op, op_def) for op, op_def in _op_defs().items()}


def decompose_fused_moe_for_npu(gm: fx.GraphModule) -> fx.GraphModule:
    """Inline the NPU lowering for every fused-op node of ``gm`` (mutated and returned)."""
    table = npu_decompositions()
    targets = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in table]
    if targets:
        _ensure_vals(gm, targets)
    count = 0
    for node in targets:
        _inline(gm, node, table[node.target])
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
        log.debug("decompose_fused_moe_for_npu: inlined %d fused MoE node(s)", count)
    return gm


def _ensure_vals(gm: fx.GraphModule, targets) -> None:
    """Nodes a pass inserted may lack ``meta["val"]``: propagate fake values from the placeholders."""
    inputs = {leaf for node in targets for leaf in pytree.tree_leaves((node.args, node.kwargs))
              if isinstance(leaf, fx.Node)}
    if all("val" in n.meta for n in inputs):
        return
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not all("val" in n.meta for n in placeholders):
        return  # nothing to start from; _trace_node names the inputs without a value
    vals = [n.meta["val"] for n in placeholders]
    FakeTensorProp(gm, detect_fake_mode(vals)).propagate_dont_convert_inputs(*vals)


def _trace_node(node: fx.Node, fn):
    """Trace ``fn`` on the node's fake inputs; returns (subgraph module, flat leaves, positions of Nodes)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)]
    missing = [leaves[i].name for i in positions if "val" not in leaves[i].meta]
    if missing:
        raise ValueError(f"decompose_fused_moe_for_npu: inputs {missing} of {node.name} have no meta['val']; "
                         f"trace the graph with fake tensors (Dynamo/AOT or make_fx) first")
    vals = [leaves[i].meta["val"] for i in positions]

    def traced(*tensors):
        filled = list(leaves)
        for pos, t in zip(positions, tensors):
            filled[pos] = t
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return fn(*args, **kwargs)

    fake_mode = detect_fake_mode(vals) or FakeTensorMode()
    with fake_mode:
        sub = make_fx(traced, tracing_mode="real")(*vals)
    return sub, leaves, positions


def _inline(gm: fx.GraphModule, node: fx.Node, fn) -> None:
    sub, leaves, positions = _trace_node(node, fn)
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
