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

from moe_compile.lowering.inline import bind_args, ensure_vals, fused_op_overloads, inline_node

log = logging.getLogger("moe_compile")


def _check_graphable(bound: dict) -> None:
    if bound.get("dispatcher_type") == "dynamic":
        raise ValueError("dispatcher_type='dynamic' cannot go into a TorchAir graph: its all-to-all split sizes "
                         "are a host sync (no GE graph, no aclgraph capture) and npu_moe_token_permute/unpermute "
                         "have no GE converter; use dispatcher_type='static' (EP with active_expert_range) or run "
                         "the op eagerly (inner_compiler='aot_eager')")


def _decomposition(op: torch._ops.OpOverload, op_def):
    def decompose(*args, **kwargs):
        bound = bind_args(op, args, kwargs)
        _check_graphable(bound)
        bound["lowering"] = "npu"  # GE runs on the NPU whatever the traced device said
        return op_def._init_fn(**bound)

    return decompose


def npu_decompositions() -> dict:
    """``{fused op overload: function}`` that runs the NPU lowering in place of the op."""
    return {op: _decomposition(op, op_def) for op, op_def in fused_op_overloads().items()}


def decompose_fused_moe_for_npu(gm: fx.GraphModule) -> fx.GraphModule:
    """Inline the NPU lowering for every fused-op node of ``gm`` (mutated and returned)."""
    table = npu_decompositions()
    targets = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in table]
    if targets:
        ensure_vals(gm, targets)
    count = 0
    for node in targets:
        inline_node(gm, node, table[node.target], caller="decompose_fused_moe_for_npu")
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
        log.debug("decompose_fused_moe_for_npu: inlined %d fused MoE node(s)", count)
    return gm
