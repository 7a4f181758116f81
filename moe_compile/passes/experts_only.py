"""Experts-only rewrites: the model's router stays as written, its experts become ``moe_compile::fused_experts``.

Some routers have no routing method in the op: DeepSeek-V4's hash layers take the expert ids from
``input_ids`` through a table, Kolibri adds its selection bias to the raw logits, PhiMoE picks with two
masked argmaxes, Inkling normalises the routed weights together with its shared experts' scores. Their
experts are ordinary MoE experts all the same, and they are where the time goes.

A routed pair is the integer ``[T, k]`` expert ids and the floating ``[T, k]`` weights the experts read.
It is found next to a router matmul (``x @ W -> [T, E]``): ids made from the router's scores or used
with them (a top-k the routing could not be matched for, an argmax, a table lookup whose ids gather the
scores), weights computed from the scores. Probes then set x, the ids and the weights directly; the
match holds when ``fused_experts`` on them reproduces the routed output, on fresh probes, with every
expert hit in turn, with all tokens on the same experts, on large inputs and with the block's other
inputs moved (as ``probes.stress`` checks a full match). The rewrite feeds the router's own ids and
weights to one ``fused_experts`` node; everything the router computes stays in the graph.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from moe_compile.ops.config import ExpertsConfig, MoEConfig, RoutingConfig
from moe_compile.passes import experts as ex
from moe_compile.passes import match as mt
from moe_compile.passes import probes
from moe_compile.passes import router as rt
from moe_compile.passes.graph import (
    aten, backward_slice, forward_slice, in_scope, is_getitem, module_path, parent_path, val,
)

log = logging.getLogger("moe_compile")
MAX_WEIGHT_CANDIDATES = 4
CONFIRM_TRIALS = (11, 12)
_SEED = 5000  # probe seeds apart from the full match's
_PICKS = (aten.argmax.default, aten.max.dim)
_NO_OUTPUT = "no node after the expert ids is shaped like the block's output"
_NO_WEIGHTS = "no floating [tokens, top_k] weights made from the router's scores reach the block's output"
# reasons that say there are no experts here at all (not reported for routers without a top-k)
NOT_EXPERTS = (mt.NOT_CAPTURED, _NO_OUTPUT, _NO_WEIGHTS, "no [E, ...] expert weights",
               "the router matmul's input is not 2-D", "the routed ids or weights are not")


@dataclass
class RoutedAnchor:
    """A router matmul and the expert ids its block's experts read (the fields ``match``'s helpers read)."""

    x: fx.Node  # the router matmul's activation input; the experts read a view of it
    logits: fx.Node
    router_weight: fx.Node | None
    ids: fx.Node  # root of the ids' views and casts
    num_experts: int
    top_k: int
    source: str  # how the ids are made, for the report
    topk: fx.Node | None = None
    bias: fx.Node | None = None
    experts_x: fx.Node | None = None


@dataclass
class RoutedProbe:
    overrides: dict
    x2d: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


@dataclass
class RoutedMatch:
    anchor: RoutedAnchor
    weights: fx.Node  # root of the routing weights' views
    output: fx.Node
    x_view: fx.Node  # the view of x with the output's shape
    experts: ex.ExpertsChoice
    path: str
    old_nodes: set[fx.Node] = field(default_factory=set)

    def router_kind(self) -> str:
        return "kept as written (%s) -> fused_experts" % self.anchor.source


# -- finding routed pairs ---------------------------------------------------------------------
def _int_pairs(ctx, graph: fx.Graph, topk_ids: set[fx.Node]) -> list[fx.Node]:
    """Roots of integer 2-D ``[T, k]`` tensors (k <= 64), and the 1-D ``[T]`` picks of a top-1 router (an argmax
    or a max's indices over ``[T, E]`` scores); a top-k's indices only when in ``topk_ids``."""
    out = []
    for node in graph.nodes:
        v = val(node)
        if (node.op != "call_function" or not isinstance(v, torch.Tensor) or v.is_floating_point()
                or v.dtype == torch.bool or (_from_topk(node) and node not in topk_ids)):
            continue
        shape = ctx.conc.shape(node)
        if shape is None or mt._root(node) is not node:
            continue
        if (v.dim() == 2 and 1 <= shape[1] <= 64) or (v.dim() == 1 and _is_top1_pick(node)):
            out.append(node)
    return out


def _pair_shape(ctx, ids: fx.Node) -> tuple[int, int]:
    """(tokens, k) of routed ids: ``[T, k]``, or ``[T]`` for a top-1 pick."""
    shape = ctx.conc.shape(ids)
    return (shape[0], shape[1]) if len(shape) == 2 else (shape[0], 1)


def _is_top1_pick(node: fx.Node) -> bool:
    """``scores.argmax(-1)`` or ``scores.max(-1)``'s indices, over floating 2-D scores."""
    pick = node.args[0] if is_getitem(node) and node.args[1] == 1 else node
    if not isinstance(pick, fx.Node) or pick.op != "call_function" or pick.target not in _PICKS:
        return False
    scores = val(pick.args[0]) if pick.args and isinstance(pick.args[0], fx.Node) else None
    dim = pick.args[1] if len(pick.args) > 1 else pick.kwargs.get("dim")
    return (isinstance(scores, torch.Tensor) and scores.is_floating_point() and scores.dim() == 2
            and dim in (1, -1) and (pick is node) == (pick.target is aten.argmax.default))


def _from_topk(node: fx.Node) -> bool:
    if not is_getitem(node):
        return False
    src = node.args[0]
    return isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.topk.default


def _ids_source(ids: fx.Node) -> str:
    if _from_topk(ids):
        return "top-k"
    op = ids.args[0] if is_getitem(ids) and isinstance(ids.args[0], fx.Node) else ids  # max/sort's indices
    name = str(op.target).split(".")[-2] if "." in str(op.target) else str(op.target)
    return {"index": "ids from a table lookup", "cat": "ids from separate picks", "argmax": "ids from an argmax",
            "max": "ids from a max"}.get(name, "ids from %s" % name)


def find_routed(ctx, graph: fx.Graph, claimed: set[fx.Node], topk_ids: set[fx.Node]) -> list[RoutedAnchor]:
    """Routed pairs whose router matmul no top-k anchor claimed (``claimed``: their logits); ``topk_ids``:
    the indices of top-k ops that found no router matmul of their width (Inkling's has E + shared outputs)."""
    found = []
    for ids in _int_pairs(ctx, graph, topk_ids):
        tokens, k = _pair_shape(ctx, ids)
        router = _router_of(ctx, ids, tokens, k)
        if router is None or router[0] in claimed:
            continue
        logits, num_experts = router
        x, weight = rt._matmul_operands(logits, ctx.names)
        if x is None or weight is None:
            continue
        topk = ids.args[0] if ids in topk_ids else None
        found.append(RoutedAnchor(x, logits, weight, ids, num_experts, k, _ids_source(ids), topk))
    return found


def _router_of(ctx, ids: fx.Node, tokens: int, k: int, limit: int = 32) -> tuple[fx.Node, int] | None:
    """(router matmul, E): the ``[T, E]`` scores the ids are picked from (argmax, a top-k) or used with
    (``scores.gather(1, ids)`` of a hash layer), the nearest floating ``[T, E >= k]`` tensor among the
    inputs of the integer ops that make the ids and of the ids' users, and the matmul it is computed from."""
    seen, todo = set(), [ids] + list(ids.users)
    while todo and len(seen) < limit:
        node = todo.pop(0)
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        for src in node.all_input_nodes:
            v, shape = val(src), ctx.conc.shape(src)
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                todo.append(src)  # integer ops, and tuples (max / sort / topk values and indices)
            elif shape is not None and len(shape) == 2 and shape[0] == tokens and 2 <= shape[1] and k <= shape[1]:
                logits = rt._find_logits(src, shape[1])[0] or _wider_matmul(ctx, src, tokens, shape[1])
                if logits is not None:
                    return logits, shape[1]
    return None


def _wider_matmul(ctx, scores: fx.Node, tokens: int, width: int, limit: int = 24) -> fx.Node | None:
    """The nearest matmul before ``scores`` with ``[T, >= width]`` outputs: a router that scores more
    classes than it routes to (shared experts' scores sliced off)."""
    seen, todo = set(), [scores]
    while todo and len(seen) < limit:
        node = todo.pop(0)
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        shape = ctx.conc.shape(node)
        if node.target in rt.MATMUL_OPS and shape is not None and len(shape) == 2 and shape[0] == tokens \
                and shape[1] >= width:
            return node
        todo.extend(node.all_input_nodes)
    return None


def from_topk(anchor: rt.RouterAnchor, reason: str) -> RoutedAnchor:
    """The routed pair of a top-k router whose routing matched none of the op's."""
    return RoutedAnchor(anchor.x, anchor.logits, anchor.router_weight, mt._root(anchor.ids), anchor.num_experts,
                        anchor.top_k, "top-k; " + reason.split(":")[0].replace("the router's ", ""), anchor.topk)


# -- probes and the reference -----------------------------------------------------------------
def make_probe(ctx, anchor: RoutedAnchor, weights: fx.Node, trial: int, ids: torch.Tensor | None = None,
               x_scale: float = 1.0) -> RoutedProbe | str:
    x_shape = ctx.conc.shape(anchor.x)
    if x_shape is None or len(x_shape) != 2:
        return "the router matmul's input is not 2-D [tokens, hidden]"
    tokens, k, num_experts = x_shape[0], anchor.top_k, anchor.num_experts
    gen = torch.Generator().manual_seed(ctx.seed * 1000 + _SEED + trial)
    xv = val(anchor.x)
    x2d = (torch.randn(x_shape, generator=gen) * x_scale).to(device=xv.device, dtype=mt.activation_dtype(anchor.x))
    if ids is None:
        ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :k]
    w = torch.rand(tokens, k, generator=gen) * 0.75 + 0.25
    overrides = {}
    for root, value in ((anchor.x, x2d), (anchor.ids, ids), (weights, w)):
        for node in mt._family(root):
            shape, v = ctx.conc.shape(node), val(node)
            if shape is not None and isinstance(v, torch.Tensor) and math.prod(shape) == value.numel():
                overrides[node] = value.reshape(shape).to(device=xv.device, dtype=v.dtype)
    ids_v, w_v = overrides.get(anchor.ids), overrides.get(weights)
    if ids_v is None or w_v is None:
        return "the routed ids or weights are not [tokens, top_k]"
    return RoutedProbe(overrides, x2d, ids_v.reshape(tokens, k), w_v.reshape(tokens, k))


def experts_reference(probe: RoutedProbe, num_experts: int, w13, w2, b13, b2, cfg: ExpertsConfig) -> torch.Tensor:
    """``fused_experts``' plain-torch staged path on the probe's ids and weights."""
    from moe_compile.lowering.base import MoEInputs, StagedLowering
    from moe_compile.modular import ExpertWeights

    k = probe.ids.shape[1]
    inputs = MoEInputs(probe.x2d.to(w13.dtype), None, ExpertWeights(w13, w2, b13, b2), None, probe.weights, probe.ids)
    return StagedLowering().run(inputs, MoEConfig(routing=RoutingConfig(num_experts, k), experts=cfg))


# -- matching ---------------------------------------------------------------------------------
def _outputs(ctx, anchor: RoutedAnchor, scope: str, order: dict) -> list[fx.Node]:
    """Floating nodes after the ids shaped like the block input (or with its tokens split [B, S, H])."""
    tokens, hidden = ctx.conc.shape(anchor.x)
    out = []
    for node in forward_slice(anchor.ids):
        v, shape = val(node), ctx.conc.shape(node)
        if (node.op == "call_function" and isinstance(v, torch.Tensor) and v.is_floating_point() and shape
                and len(shape) >= 2 and shape[-1] == hidden and math.prod(shape) == tokens * hidden
                and in_scope(node, scope)):
            out.append(node)
    out.sort(key=order.__getitem__, reverse=True)
    return out[:mt.MAX_OUTPUT_CANDIDATES]


def _weight_candidates(ctx, anchor: RoutedAnchor, output: fx.Node, order: dict, routed: set) -> list[fx.Node]:
    """Roots of floating ``[T, k]`` tensors the output reads that the router's scores make (``routed``: what
    the router matmul reaches); 2-D ones first, latest first."""
    tokens, k = ctx.conc.shape(anchor.x)[0], anchor.top_k
    roots = set()
    for node in backward_slice([output], mt._family(anchor.x) | mt._family(anchor.ids)):
        v, shape = val(node), ctx.conc.shape(node)
        if (node in routed and isinstance(v, torch.Tensor) and v.is_floating_point() and shape is not None
                and math.prod(shape) == tokens * k and node.op == "call_function"):
            root = mt._root(node)
            if val(root).is_floating_point():  # not the ids cast to a float
                roots.add(root)
    ranked = sorted(roots, key=lambda n: (ctx.conc.shape(n) != (tokens, k), -order[n]))
    return ranked[:MAX_WEIGHT_CANDIDATES]


def _x_view(ctx, anchor: RoutedAnchor, output: fx.Node, order: dict) -> fx.Node | None:
    """A view of the block input with the output's shape, computed before the output."""
    out_shape = ctx.conc.shape(output)
    views = [n for n in mt._family(anchor.x)
             if ctx.conc.shape(n) == out_shape and order.get(n, 1 << 60) < order[output]]
    views.sort(key=lambda n: (val(n).dtype != val(anchor.x).dtype, order[n]))
    return views[0] if views else None


def match_routed(ctx, anchor: RoutedAnchor, scope_list: list[str]) -> RoutedMatch | str:
    order = {n: i for i, n in enumerate(ctx.graph.nodes)}
    routed = forward_slice(anchor.logits)
    reason, tried, first_weights = None, [], None
    for scope in scope_list:
        for output in _outputs(ctx, anchor, scope, order):
            if output in tried:
                continue
            tried.append(output)
            for weights in _weight_candidates(ctx, anchor, output, order, routed):
                first_weights = first_weights or weights
                found = _match_output(ctx, anchor, output, weights, scope, order)
                if isinstance(found, RoutedMatch):
                    return found
                reason = found or reason
    if reason:
        return reason
    if not tried:
        return _NO_OUTPUT
    weights = first_weights
    if weights is None:
        return _NO_WEIGHTS
    probe = make_probe(ctx, anchor, weights, 0)
    return mt.no_output_reason(ctx, anchor, probe, tried) if not isinstance(probe, str) else probe


def _match_output(ctx, anchor: RoutedAnchor, output: fx.Node, weights: fx.Node, scope: str, order: dict):
    probe = make_probe(ctx, anchor, weights, 0)
    if isinstance(probe, str):
        return probe
    reason = None
    num_experts = anchor.num_experts

    def reference(w13, w2, b13, b2, cfg):
        return experts_reference(probe, num_experts, w13, w2, b13, b2, cfg)

    for choice in mt.identify_experts(ctx, anchor, None, probe, output, None, reference, anchor.top_k):
        real = mt._real_weights(ctx, choice)
        reason = stress(ctx, anchor, output, weights, choice, real)
        if reason is not None:
            continue
        x_view = _x_view(ctx, anchor, output, order)
        if x_view is None:
            return "the routed output is %s but the graph holds no view of the block input of that shape" % (
                list(ctx.conc.shape(output)),)
        old = backward_slice([output], set(probe.overrides))
        return RoutedMatch(anchor, weights, output, x_view, choice, scope, old)
    return reason


def check(ctx, anchor, output, weights, choice, real, trial, ids=None, x_scale=1.0, extra=None) -> bool | None:
    """Whether ``fused_experts`` reproduces ``output`` on one probe (``None``: the block could not run on it)."""
    probe = make_probe(ctx, anchor, weights, trial, ids=ids, x_scale=x_scale)
    if isinstance(probe, str):
        return None
    got = mt._eval(ctx, mt.Probe({**probe.overrides, **(extra or {})}, probe.x2d, None), [output])
    if got is None:
        return None
    w13, w2, b13, b2 = real
    fused = experts_reference(probe, anchor.num_experts, w13, w2, b13, b2, choice.config)
    return mt.close(fused, got[0], mt.compare_dtype(got[0].dtype, w13.dtype))


def stress(ctx, anchor: RoutedAnchor, output, weights, choice, real) -> str | None:
    """``None`` when the match holds on fresh probes and every stress probe, else why not."""
    tokens, k, num_experts = ctx.conc.shape(anchor.x)[0], anchor.top_k, anchor.num_experts
    if not all(check(ctx, anchor, output, weights, choice, real, t) for t in CONFIRM_TRIALS):
        return "the experts alone disagreed with the block on fresh probes"
    rounds = probes.num_coverage_probes(tokens, num_experts, k)
    for i in range(rounds):  # consecutive ids per token: distinct, as k <= E
        ids = (torch.arange(tokens * k) + i * tokens * k).remainder(num_experts).reshape(tokens, k)
        ok = check(ctx, anchor, output, weights, choice, real, 20 + i, ids=ids)
        if not ok:
            return ("with tokens sent to every expert in turn the block's output differs from fused_experts' (the "
                    "experts are not all the same MLP?)")
    same = torch.randperm(num_experts, generator=torch.Generator().manual_seed(_SEED))[:k].expand(tokens, k)
    if not check(ctx, anchor, output, weights, choice, real, 40, ids=same.contiguous()):
        return ("with every token sent to the same experts the block's output differs from fused_experts': the block "
                "drops or rescales tokens over an expert's capacity")
    scale = probes.LARGE_SCALE.get(mt.activation_dtype(anchor.x), 32.0)
    if check(ctx, anchor, output, weights, choice, real, 41, x_scale=scale) is False:
        return "on large hidden states the block's output differs from fused_experts' (a clamp in the experts?)"
    probe = make_probe(ctx, anchor, weights, 42)
    probed = set(probe.overrides)
    others = probes.other_inputs(ctx, anchor, choice, backward_slice([output], probed), probed)
    if others:
        gen = torch.Generator().manual_seed(ctx.seed * 1000 + _SEED + 43)
        moved = {n: probes._moved(ctx.values[n], gen) for n in others}
        if not check(ctx, anchor, output, weights, choice, real, 42, extra=moved):
            names = ", ".join(probes._input_name(ctx, n) for n in others[:4])
            return ("the experts also read %s, which fused_experts does not take (a LoRA, a scale or a bias?)" % names)
    return None


def scopes(anchor: RoutedAnchor) -> list[str]:
    """The router module's parent and grandparent (``match.scopes`` for a router without a top-k)."""
    out, parent = [], parent_path(module_path(anchor.logits))
    while parent is not None and len(out) < 2:
        out.append(parent)
        parent = parent_path(parent)
    return out or [""]
