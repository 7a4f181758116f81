"""Router recognition: find a top-k router in the graph and identify its routing configuration.

Structure gives the anchors: the final ``aten.topk`` over ``[T, E]`` (or ``[B, S, E]``) scores, the router logits
(the nearest matmul upstream of it with ``E`` outputs) and the block input (that matmul's
activation operand). The configuration (softmax/sigmoid/sqrt-softplus, selection bias, groups and their mode,
renormalisation, scaling, Llama-4 order) is then *identified by probing*: the captured router
slice is evaluated on probe logits and compared with ``select_experts`` under candidate configs,
ordered by what the structure suggests. This recognises every spelling of the same router
(method vs function, in-place vs not, fp32 casts or not, decomposed softmax) alike.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from moe_compile.ops.config import RoutingConfig, RoutingMethod
from moe_compile.ops.routing import select_experts
from moe_compile.passes.graph import (
    CAST_OPS, MATMUL_OPS, VIEW_OPS, aten, backward_slice, is_getitem, node_inputs, val,
)

TRANSPOSE_OPS = {aten.t.default, aten.permute.default, aten.transpose.int, aten.expand.default}

log = logging.getLogger("moe_compile")


@dataclass
class RouterAnchor:
    topk: fx.Node
    ids: fx.Node
    values: fx.Node | None
    logits: fx.Node
    x: fx.Node
    router_weight: fx.Node | None
    num_experts: int
    top_k: int
    chain: set[fx.Node] = field(default_factory=set)
    bias: fx.Node | None = None  # selection bias ([E] tensor added to the scores)
    experts_x: fx.Node | None = None  # what the experts read when not a view of ``x`` (experts_input.py)


@dataclass(frozen=True)
class RouterHints:
    methods: tuple[RoutingMethod, ...]
    scoring_after_topk: bool
    groups: tuple[tuple[int, int, int], ...]  # (group_count, k_group, mode)
    scales: tuple[float, ...]
    renorm_first: bool


def strip(node: fx.Node) -> fx.Node:
    """Follow views, transposes and casts back to the producing node."""
    while (node.op == "call_function" and node.target in VIEW_OPS | TRANSPOSE_OPS | CAST_OPS
           and node.args and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
    return node


_WEIGHT_NAME = ("_parameters_", "_buffers_", "parameters.", "buffers.")


def is_weight_root(node: fx.Node, names: dict | None = None) -> bool:
    """A weight is a get_attr, or a placeholder that Dynamo lifted from a module's parameters/buffers."""
    root = strip(node)
    if root.op == "get_attr":
        return True
    if root.op != "placeholder":
        return False
    if names is None:
        return True
    name = names.get(root, "")
    return any(key in name for key in _WEIGHT_NAME)


class NotRouter(str):
    """Why a top-k is no MoE router at all (an attention indexer's key choice, a values-only top-k):
    reported apart from the MoE blocks (``BlockDecision.not_moe``)."""


def find_anchors(graph: fx.Graph, names: dict | None = None) -> list[tuple[fx.Node, RouterAnchor | str]]:
    """Each final top-k node with its anchor, or the reason it is not a router."""
    out = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.topk.default:
            try:
                anchor = _anchor(node, names)
            except Exception as exc:  # one odd top-k must not stop the pass over the graph's other blocks
                log.debug("moe_compile: reading top-k %s raised", node.name, exc_info=True)
                anchor = "reading this top-k raised %s: %s" % (type(exc).__name__, str(exc).split("\n")[0][:160])
            out.append((node, anchor))
    return out


def _anchor(topk: fx.Node, names: dict | None) -> RouterAnchor | str:
    scores = topk.args[0]
    sval = val(scores)
    if not isinstance(sval, torch.Tensor) or sval.dim() < 2:
        return NotRouter("top-k over a tensor of fewer than 2 dims (not a per-token expert choice)")
    if sval.dim() > 2 and _feeds_another_topk(topk):
        return "top-k over %d-D scores feeds a later top-k (a group-selection step, not the expert choice)" % (
            sval.dim())
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    if dim not in (-1, sval.dim() - 1):
        return NotRouter("top-k is not over the last dimension")
    largest = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("largest", True)
    if not largest:
        return NotRouter("top-k picks the smallest scores")
    top_k = topk.args[1]
    if not isinstance(top_k, int):
        return NotRouter("top-k's k is symbolic (a router picks a fixed number of experts)")
    try:
        num_experts = int(sval.shape[-1])
    except GuardOnDataDependentSymNode:  # a data-dependent width (an attention indexer's kept keys)
        return NotRouter("top-k over a data-dependent number of scores (%s), not a fixed number of experts" % (
            sval.shape[-1],))
    ids = next((u for u in topk.users if is_getitem(u, 1)), None)
    values = next((u for u in topk.users if is_getitem(u, 0)), None)
    if ids is None:
        return NotRouter("top-k indices are unused")
    if _feeds_another_topk(topk):
        return "top-k over %d groups feeds a later top-k (a group-selection step, not the expert choice)" % (
            num_experts)
    logits, upstream = _find_logits(scores, num_experts)
    if logits is None:
        if not any(node.target in MATMUL_OPS for node in upstream):
            return ("no router matmul with %d outputs feeds the top-k: its scores are inputs of this graph "
                    "(a router in another graph after a graph break, or a top-k that is not a router, such as "
                    "a load-balancing loss over the router logits)" % num_experts)
        if _expert_choice(upstream, sval):
            return ("the top-k picks %d of the %s tokens for each of the %s experts (expert-choice routing: "
                    "the op routes each token to its experts)" % (top_k, sval.shape[-1], sval.shape[-2]))
        return "no router matmul with %d outputs feeds the top-k" % num_experts
    x, weight = _matmul_operands(logits, names)
    if x is None:
        acts = [a for a in logits.args if isinstance(a, fx.Node) and not is_weight_root(a, names)]
        if len(acts) > 1:
            return NotRouter("its scores are a product of two activations (attention-like, q @ k), not a "
                             "router matmul with a weight")
        return "the router matmul has no activation operand"
    logits = _scaled_logits(logits, backward_slice([scores], {logits}))
    chain = {n for n in backward_slice([scores], {logits}) if n.op == "call_function"}
    bias = _selection_bias(chain, num_experts)
    return RouterAnchor(topk, ids, values, logits, x, weight, num_experts, top_k, chain, bias)


def _expert_choice(upstream: set[fx.Node], scores: torch.Tensor) -> bool:
    """Whether the top-k's 2-D ``[E, T]`` scores are a router matmul's ``[T, E]`` outputs transposed."""
    if scores.dim() != 2:
        return False
    for node in upstream:
        v = val(node)
        if node.target in MATMUL_OPS and isinstance(v, torch.Tensor) and v.dim() == 2:
            with contextlib.suppress(GuardOnDataDependentSymNode):
                if v.shape[0] == scores.shape[1] and v.shape[1] == scores.shape[0] != scores.shape[1]:
                    return True
    return False


_STOP_OPS = MATMUL_OPS | {getattr(aten, name).default for name in ("_grouped_mm", "baddbmm", "einsum")
                          if hasattr(aten, name)}


def _feeds_another_topk(topk: fx.Node, limit: int = 64) -> bool:
    """Whether ``topk``'s outputs reach another ``aten.topk`` through aten/prims ops other than matmuls: a
    grouped router's group choice does (group mask, masked scores, the expert top-k: ~10 nodes);
    one block's top-k reaches the next block's only through the experts' and the next router's
    matmuls (or a custom op). Looks at ``limit`` nodes at most."""
    seen, todo = {topk}, list(topk.users)
    while todo and len(seen) < limit:
        node = todo.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if node.target is aten.topk.default:
            return True
        namespace = getattr(node.target, "namespace", None)
        if is_getitem(node) or (node.target not in _STOP_OPS and namespace in ("aten", "prims")):
            todo.extend(node.users)
    return False


def _find_logits(scores: fx.Node, num_experts: int) -> tuple[fx.Node | None, set[fx.Node]]:
    chain: set[fx.Node] = set()
    frontier = [scores]
    while frontier:
        nxt = []
        for node in frontier:
            if node in chain or node.op != "call_function":
                continue
            chain.add(node)
            v = val(node)
            if node.target in MATMUL_OPS and isinstance(v, torch.Tensor) and v.shape[-1] == num_experts:
                return node, chain
            nxt.extend(node_inputs(node))
        frontier = nxt
    return None, chain


_SCALE_OPS = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}


def _scaled_logits(mm: fx.Node, toward_scores: set[fx.Node]) -> fx.Node:
    """The router logits the op is handed: the matmul's output, or that output times or divided by one
    number (a temperature, MuseSpark's ``output_multiplier``), when that is its only way to the scores.
    The number is then computed by the graph as before (a learned temperature follows its updates);
    the op routes on what it gives. A cast alone does not move the logits (the CUDA lowering runs the
    router GEMM itself on the matmul's own output)."""
    node = found = mm
    while True:
        users = [u for u in node.users if u in toward_scores]
        if len(users) != 1:
            return found
        user = users[0]
        if user.target in CAST_OPS and user.args[0] is node:
            node = user
            continue
        if user.target not in _SCALE_OPS or (user.target in (aten.div.Tensor, aten.div.Scalar)
                                              and user.args[0] is not node):
            return found
        other = [a for a in user.args if a is not node]
        other_val = val(other[0]) if len(other) == 1 and isinstance(other[0], fx.Node) else None
        one_number = (len(other) == 1 and isinstance(other[0], (int, float))) or (
            isinstance(other_val, torch.Tensor) and other_val.numel() == 1)
        if not one_number or tuple(val(user).shape) != tuple(val(node).shape):
            return found
        node = found = user


def _matmul_operands(mm: fx.Node, names: dict | None) -> tuple[fx.Node | None, fx.Node | None]:
    operands = [a for a in mm.args if isinstance(a, fx.Node)]
    if mm.target is aten.addmm.default:
        operands = operands[1:]
    acts = [a for a in operands if not is_weight_root(a, names)]
    weights = [strip(a) for a in operands if is_weight_root(a, names)]
    if len(acts) != 1:
        return None, None
    return acts[0], (weights[0] if weights else None)


def _selection_bias(chain: set[fx.Node], num_experts: int) -> fx.Node | None:
    for node in chain:
        if node.target not in (aten.add.Tensor, aten.add_.Tensor):
            continue
        for arg in node.args:
            if isinstance(arg, fx.Node) and is_weight_root(arg):
                v = val(arg)
                if isinstance(v, torch.Tensor) and v.numel() == num_experts:
                    return arg
    return None


# -- hints -------------------------------------------------------------------------------------
def hints(anchor: RouterAnchor, region: set[fx.Node], scalar=None) -> RouterHints:
    """What the structure suggests; ``scalar(node)`` (optional) gives the value of a one-element
    graph input (or a cast of one) as a float, else ``None``."""
    targets = {n.target for n in anchor.chain}
    value_targets = {n.target for n in region}
    sigmoid_first = aten.sigmoid.default in targets or aten.sigmoid.default in value_targets
    methods = ((RoutingMethod.SIGMOID, RoutingMethod.SOFTMAX) if sigmoid_first
               else (RoutingMethod.SOFTMAX, RoutingMethod.SIGMOID))
    # DeepSeek-V4's sqrt(softplus) scores; Inductor's decompositions write softplus as where(x > 20, x, log1p(exp(x)))
    if {aten.softplus.default, aten.log1p.default} & (targets | value_targets):
        methods = (RoutingMethod.SQRTSOFTPLUS,) + methods
    after = strip(anchor.topk.args[0]) is anchor.logits
    groups = _group_hints(anchor)
    scales = _scale_hints(region, scalar)
    renorm_first = aten.sum.dim_IntList in value_targets or aten.sum.default in value_targets
    return RouterHints(methods, after, groups, scales, renorm_first)


def _group_hints(anchor: RouterAnchor) -> tuple[tuple[int, int, int], ...]:
    found = []
    for node in anchor.chain:
        if node.target is aten.topk.default and node is not anchor.topk:
            inner = val(node.args[0])
            if isinstance(inner, torch.Tensor) and inner.dim() == 2:
                group_count, k_group = int(inner.shape[-1]), node.args[1]
                if anchor.num_experts % group_count == 0 and isinstance(k_group, int):
                    modes = (0, 1) if _scores_groups_by_max(anchor.chain) else (1, 0)
                    found.extend([(group_count, k_group, m) for m in modes])
    return tuple(dict.fromkeys(found))


def _scores_groups_by_max(chain: set[fx.Node]) -> bool:
    """Group score = max (DeepSeek-V2) rather than the sum of the top two (DeepSeek-V3)."""
    top2 = any(n.target is aten.topk.default and n.args[1] == 2 and val(n.args[0]) is not None
               and val(n.args[0]).dim() == 3 for n in chain)
    return not top2 and any(n.target in (aten.max.dim, aten.amax.default) for n in chain)


def _scale_hints(region: set[fx.Node], scalar=None) -> tuple[float, ...]:
    """The constants the router's weights are multiplied or divided by: literals, and, under
    ``dynamic=True`` (Dynamo turns Python floats into graph inputs and AOTAutograd into 0-d
    tensors), one-element graph inputs, read through ``scalar``."""
    scales = [1.0]
    for node in region:
        if node.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            for arg in node.args[1:] if node.target in (aten.div.Tensor, aten.div.Scalar) else node.args:
                if isinstance(arg, fx.Node) and scalar is not None:
                    arg = scalar(arg)
                if isinstance(arg, float) and math.isfinite(arg) and arg not in (0.0, 1.0):
                    scales.append(arg if node.target in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / arg)
    return tuple(dict.fromkeys(scales))


def candidate_configs(anchor: RouterAnchor, h: RouterHints) -> list[RoutingConfig]:
    base = RoutingConfig(num_experts=anchor.num_experts, top_k=anchor.top_k,
                         has_correction_bias=anchor.bias is not None)
    groups = list(h.groups) + [(1, 1, 0)]
    renorms = (True, False) if h.renorm_first else (False, True)
    out = []
    for method, (gc, kg, mode), renorm, scale, norm_sig in itertools.product(
            h.methods, groups, renorms, h.scales, (True, False)):
        if method is RoutingMethod.SOFTMAX and not norm_sig:
            continue
        if method.elementwise and renorm:  # elementwise scores normalise through norm_sig
            continue
        after = h.scoring_after_topk and gc == 1
        cfg = replace(base, method=method, group_count=gc, k_group=kg, group_select_mode=mode,
                      renormalize=renorm, routed_scaling_factor=scale, normalize_sigmoid=norm_sig,
                      scoring_after_topk=after)
        if after and method is RoutingMethod.SOFTMAX:
            # top-k then softmax over the picks == softmax, top-k, renormalise: emit the canonical
            # form, which every lowering (the NPU gating op included) runs natively
            out.append(replace(cfg, scoring_after_topk=False, renormalize=True))
        out.append(cfg)
    return list(dict.fromkeys(out))


def ids_match(got: torch.Tensor, want: torch.Tensor) -> bool:
    got = got.reshape(want.shape).long().sort(dim=-1).values
    return bool(torch.equal(got, want.long().sort(dim=-1).values))


def weights_match(got: torch.Tensor, cfg_w: torch.Tensor, cfg_ids: torch.Tensor, rtol: float) -> bool:
    """``got`` is [T, k] (any order within a row) or a dense [T, E] scatter of the weights, or that
    dense tensor expert-major, [E, T] (Llama 4 transposes the scattered scores before the sigmoid).
    The [E, T] reading is tried only for a 2-D ``got`` of that shape, after the [T, E] one."""
    num_tokens, top_k = cfg_w.shape
    got = got.float()
    if got.numel() == num_tokens * top_k:
        a = got.reshape(num_tokens, top_k).sort(dim=-1).values
        return _close(a, cfg_w.sort(dim=-1).values, rtol)
    dense = got.reshape(num_tokens, -1)
    want = torch.zeros_like(dense).scatter_(1, cfg_ids.long(), cfg_w)
    if _close(dense, want, rtol):
        return True
    expert_major = got.dim() == 2 and tuple(got.shape) == (want.shape[1], num_tokens)
    return expert_major and _close(got.t(), want, rtol)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    return bool(torch.allclose(a, b, rtol=rtol, atol=rtol * (b.abs().max().item() + 1e-6)))


def reference_routing(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None):
    return select_experts(logits, cfg, bias)
