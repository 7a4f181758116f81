"""Match one MoE block: router anchor -> routing config -> routed output node -> experts.

Every decision is confirmed numerically on the real weights: the captured slice and the fused
op must agree on fresh probe inputs (twice) before anything is rewritten.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from moe_compile.ops.config import ExpertsConfig, RoutingConfig, RoutingMethod
from moe_compile.passes import experts as ex
from moe_compile.passes import experts_input as xin
from moe_compile.passes import probes
from moe_compile.passes import router as rt
from moe_compile.passes.scales import scalar_input, scale_source
from moe_compile.passes.graph import (
    CAST_OPS, VIEW_OPS, Concretizer, SliceEvaluator, backward_slice, forward_slice, in_scope,
    module_path, module_stack, parent_path, val,
)

log = logging.getLogger("moe_compile")
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
MAX_OUTPUT_CANDIDATES = 16
# identify_routing's reasons when the block's routing is none of the op's (its experts may still be fused)
ROUTING_UNMATCHED = "the router's expert choice or weights match no softmax/sigmoid top-k routing"
ROUTER_NOT_EVALUATED = "the router slice could not be evaluated on probe logits"
ROUTING_TRIALS = 6
ROUTING_PROBE_TOKENS = 48


@dataclass
class GraphContext:
    graph: fx.Graph
    values: dict  # placeholder/get_attr node -> real value
    names: dict  # placeholder node -> Dynamo input name
    evaluator: SliceEvaluator
    conc: Concretizer
    seed: int = 0


@dataclass
class BlockMatch:
    anchor: rt.RouterAnchor
    routing: RoutingConfig
    output: fx.Node
    experts: ex.ExpertsChoice
    path: str
    old_nodes: set[fx.Node] = field(default_factory=set)
    bias_value: torch.Tensor | None = None
    # the graph input the routing scale is read from (a Python number Dynamo passes in), and whether
    # it divides: the op then runs with scale 1 and its output is scaled per call (scale_source)
    scale_input: tuple | None = None
    probed: rt.RouterAnchor | None = None  # the anchor the probes ran with (2-D input; experts_x): verify's

    def router_kind(self) -> str:
        return describe_routing(self.routing)


def describe_routing(cfg: RoutingConfig) -> str:
    if cfg.scoring_after_topk:
        text = "topk→" + cfg.method.value
    else:
        text = cfg.method.value + ("+bias" if cfg.has_correction_bias else "")
        if cfg.grouped:
            text += "→group(%d keep %d, %s)" % (cfg.group_count, cfg.k_group,
                                                 "max" if cfg.group_select_mode == 0 else "top2-sum")
        text += "→topk"
    if cfg.method is RoutingMethod.SOFTMAX and cfg.renormalize and not cfg.scoring_after_topk:
        text += "→renorm"
    if cfg.method.elementwise and cfg.normalize_sigmoid:
        text += "→norm"
    if cfg.routed_scaling_factor != 1.0:
        text += "→×%g" % cfg.routed_scaling_factor
    return text


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """``a`` (the fused op's ``[T, H]`` output) equals ``b``, which may keep leading dims ``[B, S, H]``."""
    if a.shape != b.shape:
        if a.numel() != b.numel() or a.shape[-1:] != b.shape[-1:]:
            return False
        b = b.reshape(a.shape)
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False
    tol = TOLERANCE.get(dtype, 3e-2)
    return bool((a - b).abs().max() <= tol * (b.abs().max() + 1e-6))


def compare_dtype(target: torch.dtype, weights: torch.dtype) -> torch.dtype:
    """The dtype whose tolerance a match is judged by: the looser of the output's and the experts'
    weights'. A block whose bf16 experts sum into an fp32 output (or whose bf16 round trip a compiler
    removed: Inductor 2.11 folds ``sum.to(bf16).to(fp32)`` into the fp32 sum) still carries bf16 rounding."""
    return max((target, weights), key=lambda d: TOLERANCE.get(d, 3e-2))


# -- probes -----------------------------------------------------------------------------------
def _root(x: fx.Node) -> fx.Node:
    root = x
    while (root.op == "call_function" and root.target in VIEW_OPS | CAST_OPS
           and isinstance(root.args[0], fx.Node)):
        root = root.args[0]
    return root


def activation_dtype(x: fx.Node) -> torch.dtype:
    """The dtype of the block input before any router-only cast (``x.float()`` for the gate)."""
    return val(_root(x)).dtype


def _family(x: fx.Node) -> set[fx.Node]:
    """x and every node that is a pure view/cast of the same tensor."""
    root = _root(x)
    fam, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node in fam:
            continue
        fam.add(node)
        todo.extend(u for u in node.users if u.op == "call_function" and u.target in VIEW_OPS | CAST_OPS)
    return fam


def probe_logits(shape, dtype, gen: torch.Generator, device, spread: float | None = None) -> torch.Tensor:
    """Distinct, exactly representable logits per row (no ties in any dtype up to E=256).

    Without ``spread``: a coarse power-of-two grid over about ±2, shuffled per token. With it:
    ``E`` distinct multiples of a fine power-of-two step (±128 steps span about ±2·spread), so
    neighbouring logits are close, as a real router's are, and a small selection bias matters.
    """
    num_tokens, num_experts = shape
    if spread is None:
        grid = probes.probe_grid(num_experts, dtype)
        rows = [grid[torch.randperm(num_experts, generator=gen)] for _ in range(num_tokens)]
    else:
        span = max(256, num_experts)
        step = 2.0 ** round(math.log2(2.0 * spread / 128))
        rows = [(torch.randperm(span, generator=gen)[:num_experts].float() - span / 2) * step
                for _ in range(num_tokens)]
    return torch.stack(rows).to(device=device, dtype=dtype)


@dataclass
class Probe:
    overrides: dict
    x2d: torch.Tensor
    logits: torch.Tensor


def make_probe(ctx: GraphContext, anchor: rt.RouterAnchor, trial: int, logits: torch.Tensor | None = None,
               x_scale: float = 1.0) -> Probe | str:
    """Random unit-size hidden states (times ``x_scale``) and router logits (``logits`` when given) for
    the block's input and logits nodes, seeded by ``trial``."""
    x_node = anchor.experts_x or anchor.x
    x_shape, l_shape = ctx.conc.shape(x_node), ctx.conc.shape(anchor.logits)
    if x_shape is None or l_shape is None:
        return "the block's token count is not known from the example inputs"
    if len(x_shape) != 2 or len(l_shape) != 2:
        return "the router matmul's input %s or logits %s are not 2-D [tokens, hidden] / [tokens, experts]" % (
            list(x_shape), list(l_shape))
    xv, lv = val(anchor.x), val(anchor.logits)
    gen = torch.Generator().manual_seed(ctx.seed * 1000 + trial)
    x2d = (torch.randn(x_shape, generator=gen) * x_scale).to(device=xv.device, dtype=activation_dtype(x_node))
    if logits is None:
        # every other routing trial uses the router's own logit scale, where a selection bias or the
        # order of bias and score function changes the choice (a wide grid would hide it)
        spread = _logit_spread(ctx, anchor) if 100 <= trial < 200 and trial % 2 else None
        logits = probe_logits(l_shape, lv.dtype, gen, lv.device, spread)
    overrides = {anchor.logits: logits}
    for node in _family(anchor.x) | (_family(anchor.experts_x) if anchor.experts_x is not None else set()):
        shape = ctx.conc.shape(node)
        v = val(node)
        if shape is None or not isinstance(v, torch.Tensor) or math.prod(shape) != x2d.numel():
            continue
        overrides[node] = x2d.reshape(shape).to(v.dtype)
    return Probe(overrides, x2d, logits)


def _logit_spread(ctx: GraphContext, anchor: rt.RouterAnchor) -> float:
    """The typical size of the router's logits for unit-variance input: its rows' norm."""
    weight = ctx.values.get(anchor.router_weight)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0.25
    hidden = ctx.conc.shape(anchor.x)[-1]
    dim = 1 if weight.shape[1] == hidden else 0
    spread = float(weight.float().norm(dim=dim).mean())
    return min(max(spread, 1e-3), 4.0)


def _eval(ctx: GraphContext, probe: Probe, wanted: list[fx.Node]) -> list | None:
    stop = set(probe.overrides)
    needed = backward_slice(wanted, stop)
    try:
        return ctx.evaluator.run(needed, probe.overrides, wanted)
    except Exception:  # a slice that cannot run on probe data is simply not a match
        log.debug("moe_compile: probe evaluation failed", exc_info=True)
        return None


# -- routing ----------------------------------------------------------------------------------
def identify_routing(ctx: GraphContext, anchor: rt.RouterAnchor, probe: Probe, scope: str):
    """The routing config whose ids and weights the captured router reproduces, or a reason."""
    num_tokens = probe.logits.shape[0]
    sizes = {num_tokens * anchor.top_k, num_tokens * anchor.num_experts}
    weight_nodes = []
    for node in forward_slice(anchor.topk):
        v = val(node)
        if (node.op == "call_function" and isinstance(v, torch.Tensor) and v.is_floating_point()
                and in_scope(node, scope)):
            shape = ctx.conc.shape(node)
            if shape is not None and math.prod(shape) in sizes:
                weight_nodes.append(node)
    results = _eval(ctx, probe, [anchor.ids] + weight_nodes)
    if results is None:
        return ROUTER_NOT_EVALUATED
    got_ids, weight_values = results[0], results[1:]
    region = set(weight_nodes) | anchor.chain
    bias = None if anchor.bias is None else ctx.evaluator.run(
        backward_slice([anchor.bias], set()), {}, [anchor.bias])[0].reshape(-1).float()
    # a handful of tokens can agree by chance (group max vs top-2 sum, say): the expert choice
    # must also agree on fresh logits, on at least ROUTING_PROBE_TOKENS tokens in all
    extra = []
    for trial in range(100, 100 + max(ROUTING_TRIALS, -(-ROUTING_PROBE_TOKENS // num_tokens))):
        other = make_probe(ctx, anchor, trial)
        if isinstance(other, str):
            continue
        trial_bias = bias
        if bias is not None and trial % 3 == 2:
            # a selection bias is a parameter: at compile time it is often zero (or too small to reorder
            # anything), where "added to the scores" and "added to the logits" choose alike and its
            # updates would then follow the wrong formula. Probe with a bias that reorders.
            trial_bias = _probe_bias(bias, other.logits, trial)
            _set_bias(other, anchor, trial_bias)
        ids_other = _eval(ctx, other, [anchor.ids])
        if ids_other is not None:
            extra.append((other.logits, ids_other[0], trial_bias))
    extra += _negative_score_trial(ctx, anchor, bias)
    found = []
    for cfg in rt.candidate_configs(anchor, rt.hints(anchor, region, lambda node: scalar_input(ctx, node))):
        cfg_bias = bias if cfg.has_correction_bias else None
        w, ids = rt.reference_routing(probe.logits, cfg, cfg_bias)
        if not rt.ids_match(got_ids, ids):
            continue
        if not all(rt.ids_match(got, rt.reference_routing(logits, cfg, b if cfg.has_correction_bias else None)[1])
                   for logits, got, b in extra):
            continue
        if any(rt.weights_match(wv, w, ids, 2e-3) for wv in weight_values
               if isinstance(wv, torch.Tensor)):
            found.append(cfg)
    if found:
        return found
    return ROUTING_UNMATCHED


def _negative_score_trial(ctx: GraphContext, anchor: rt.RouterAnchor, bias) -> list:
    """One trial where every selection score is below zero: sigmoid scores of logits in about
    [-4.5, -0.5] plus a bias of -1/2. A grouped router that masks the dropped groups with 0.0 instead of
    -inf (AXK2) then picks a dropped expert over every kept one, which the op never does; a trained
    bias can do this. fp32 routers only (in bf16 the shifted scores would tie)."""
    logits_val = val(anchor.logits)
    if bias is None or logits_val.dtype not in (torch.float32, torch.float64):
        return []
    shape = ctx.conc.shape(anchor.logits)
    gen = torch.Generator().manual_seed(ctx.seed * 1000 + 300)
    logits = probe_logits(shape, logits_val.dtype, gen, logits_val.device) - 2.5
    probe = make_probe(ctx, anchor, 300, logits=logits)
    if isinstance(probe, str):
        return []
    trial_bias = torch.full_like(bias, -0.5)
    _set_bias(probe, anchor, trial_bias)
    ids = _eval(ctx, probe, [anchor.ids])
    return [] if ids is None else [(logits, ids[0], trial_bias)]


def _set_bias(probe: Probe, anchor: rt.RouterAnchor, bias: torch.Tensor) -> None:
    """Evaluate the router slice with ``bias`` (flat) in place of the block's selection bias."""
    bias_val = val(anchor.bias)
    probe.overrides[anchor.bias] = bias.reshape(bias_val.shape).to(bias_val.device, bias_val.dtype)


def _probe_bias(bias: torch.Tensor, logits: torch.Tensor, trial: int) -> torch.Tensor:
    """A random selection bias on the scale of the probe's logits (a quarter of their spread), in
    exactly representable steps: large enough to reorder experts, so the formula that applies it shows."""
    gen = torch.Generator().manual_seed(7000 + trial)
    scale = float(logits.float().std()) / 4 or 0.25
    step = 2.0 ** math.floor(math.log2(scale / 16))
    return ((torch.randn(bias.shape, generator=gen) * scale / step).round() * step).to(bias.device, bias.dtype)


# -- experts ----------------------------------------------------------------------------------
def output_candidates(ctx: GraphContext, anchor: rt.RouterAnchor, scope: str) -> list[fx.Node]:
    """Nodes after the expert choice shaped like the block input ``[T, H]``, or, when the top-k is
    over ``[B, S, E]`` scores, like ``[B, S, H]``; latest first."""
    x_shape = ctx.conc.shape(anchor.x)
    shapes = {x_shape} - {None}
    scores_shape = ctx.conc.shape(anchor.topk.args[0])
    if x_shape is not None and scores_shape is not None and len(scores_shape) > 2:
        shapes.add(scores_shape[:-1] + x_shape[-1:])
    out = []
    for node in forward_slice(anchor.ids):
        v = val(node)
        if (node.op == "call_function" and isinstance(v, torch.Tensor) and v.is_floating_point()
                and in_scope(node, scope) and v.dim() >= 2 and ctx.conc.shape(node) in shapes):
            out.append(node)
    order = {n: i for i, n in enumerate(ctx.graph.nodes)}
    out.sort(key=order.__getitem__, reverse=True)
    return out[:MAX_OUTPUT_CANDIDATES]


def fused_reference(x2d, logits, routing: RoutingConfig, bias, w13, w2, b13, b2, cfg: ExpertsConfig):
    """The fused op's plain-torch staged path on probe data (no validation, no op dispatch)."""
    from moe_compile.lowering.base import MoEInputs, StagedLowering
    from moe_compile.modular import ExpertWeights
    from moe_compile.ops.config import MoEConfig

    weights = ExpertWeights(w13, w2, b13, b2)
    # the experts compute in their weights' dtype whatever dtype the router saw
    inputs = MoEInputs(x2d.to(w13.dtype), logits, weights, bias if routing.has_correction_bias else None)
    return StagedLowering().run(inputs, MoEConfig(routing=routing, experts=cfg))


def _cached_fused(ctx: GraphContext, key: tuple, compute):
    cache = ctx.__dict__.setdefault("fused_cache", {})
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def identify_experts(ctx: GraphContext, anchor, routing, probe: Probe, output: fx.Node, bias_value, reference=None,
                     top_k: int | None = None):
    """Each experts reading under which the fused op reproduces ``output`` on the probe, in order (the
    caller stress-tests each: a per-expert scale of ones matches without being read, say).
    ``reference(w13, w2, b13, b2, cfg)``: what the op computes on the probe (default: the fused op with
    ``routing``; the experts-only rewrite passes the experts on the probe's own ids and weights)."""
    # the op's outputs are cached by id(probe): the probe must outlive the pass, or a later probe could take
    # its id and read them (the experts-only matcher's probes differ in their ids and weights only)
    ctx.__dict__.setdefault("live_probes", []).append(probe)
    if reference is None:
        def reference(w13, w2, b13, b2, cfg):
            return fused_reference(probe.x2d, probe.logits, routing, bias_value, w13, w2, b13, b2, cfg)
    stop = set(probe.overrides)
    slice_nodes = backward_slice([output], stop)
    got = _eval(ctx, probe, [output])
    if got is None:
        return
    target = got[0]
    exclude = {n for n in (anchor.router_weight, anchor.bias) if n is not None}
    mats, biases = ex.expert_inputs(slice_nodes, ctx.values, anchor.num_experts, ctx.names, exclude)
    hidden = probe.x2d.shape[-1]
    region = ex.region_of(slice_nodes)
    # a per-expert output scale (Gemma-4's per_expert_scale[id] on the weights) is tried only after
    # every reading without one
    for scale in [None] + xin.expert_scales(slice_nodes, ctx.values, anchor.num_experts, exclude):
        for w13s, w2s in ex.weight_layouts(mats, ctx.values, hidden):
            w2s = xin.scaled(w2s, scale)
            cast = ex.matmul_cast(region - stop, w13s.real(ctx.values).dtype)  # not the router's matmul
            w13, w2 = _cast(w13s.real(ctx.values), cast), _cast(w2s.real(ctx.values), cast)
            dtype = compare_dtype(target.dtype, w13.dtype)
            gated = w13.shape[-1] == 2 * w2.shape[-2]
            for b13s, b2s in ex.bias_layouts(biases, ctx.values, w13.shape[-1], hidden):
                b2s = xin.scaled(b2s, scale)
                b13 = None if b13s is None else _cast(b13s.real(ctx.values), cast)
                b2 = None if b2s is None else _cast(b2s.real(ctx.values), cast)
                for cfg in _with_input_weighting(ex.activation_candidates(region, gated), top_k or routing.top_k):
                    key = (id(probe), routing, w13s, w2s, b13s, b2s, cfg)
                    try:
                        fused = _cached_fused(ctx, key, lambda: reference(w13, w2, b13, b2, cfg))
                    except (ValueError, TypeError, RuntimeError):
                        continue
                    if close(fused, target, dtype):
                        yield ex.ExpertsChoice(w13s, w2s, b13s, b2s, cfg, ex.experts_form(region), cast)


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None else t.to(dtype)


def _with_input_weighting(cfgs: list[ExpertsConfig], top_k: int) -> list[ExpertsConfig]:
    if top_k != 1:
        return cfgs
    return cfgs + [replace(c, apply_router_weight_on_input=True) for c in cfgs]


def scopes(anchor: rt.RouterAnchor) -> list[str]:
    """Module scopes to look for the routed output in, innermost first: the router module's parent
    and grandparent, and first the router's own module when that is no router (a block that holds its
    router weight as a bare parameter computes the logits itself)."""
    node = anchor.logits if module_path(anchor.logits) else anchor.topk
    path = module_path(node)
    out = []
    parent = parent_path(path)
    while parent is not None and len(out) < 2:
        out.append(parent)
        parent = parent_path(parent)
    stack = module_stack(node)
    if path and stack and stack[-1][1] is not None and not looks_like_router(stack[-1][1]):
        out.insert(0, path)
    return out or [""]


def looks_like_router(cls: type) -> bool:
    name = cls.__name__.lower()
    return any(word in name for word in ("router", "gate", "linear", "topk"))


def match_block(ctx: GraphContext, anchor: rt.RouterAnchor) -> BlockMatch | str:
    probe = make_probe(ctx, anchor, trial=0)
    if isinstance(probe, str):
        return probe
    scope_list = scopes(anchor)
    routings = identify_routing(ctx, anchor, probe, scope_list[-1])
    if isinstance(routings, str):
        return routings
    bias_value = None
    if anchor.bias is not None:
        bias_value = ctx.evaluator.run(backward_slice([anchor.bias], set()), {}, [anchor.bias])[0].reshape(-1)
    tried: dict[fx.Node, None] = {}
    reason = None
    for scope in scope_list:
        for output in output_candidates(ctx, anchor, scope):
            if output in tried:
                continue
            tried[output] = None
            found = _match_output(ctx, anchor, probe, routings, output, scope, bias_value)
            if isinstance(found, BlockMatch) or (found and found.startswith(_PER_CALL_SCALE)):
                return found
            reason = found or reason
    return reason or no_output_reason(ctx, anchor, probe, list(tried))


_PER_CALL_SCALE = "the routing scale is a Python number passed in per call"


def _match_output(ctx, anchor, probe, routings, output, scope, bias_value) -> BlockMatch | str | None:
    """The match whose routed output is ``output``, or why the last reading that reproduced it was
    refused (``None``: none did)."""
    reason = None
    block, block_probe = _experts_anchor(ctx, anchor, probe, output)
    for routing in routings:
        for choice in identify_experts(ctx, block, routing, block_probe, output, bias_value):
            weights = _real_weights(ctx, choice)  # a stacked copy of every expert: made once here
            if not confirm(ctx, block, routing, output, choice, bias_value, trials=(1,), weights=weights):
                continue
            reason = probes.stress(ctx, block, routing, output, choice, bias_value, weights)
            if reason is not None:
                continue
            fused_anchor = _with_output_dims(ctx, block, output)
            if isinstance(fused_anchor, str):  # an earlier candidate may hold the same values flat
                return fused_anchor
            old = backward_slice([output], set(block_probe.overrides))
            scale = scale_source(ctx, block, scope, routing.routed_scaling_factor)
            if scale is not None and choice.config.apply_router_weight_on_input:
                return (_PER_CALL_SCALE + " (dynamic=True) and the weights multiply the experts' input: the op "
                        "cannot take that scale per call")
            return BlockMatch(fused_anchor, routing, output, choice, scope, old, bias_value, scale, block)
    return reason


def _experts_anchor(ctx: GraphContext, anchor: rt.RouterAnchor, probe: Probe, output: fx.Node):
    """(anchor, trial-0 probe) for ``output``: with ``experts_x`` set, and a probe that sets it too, when
    the experts read another tensor than the router (``experts_input.py``)."""
    stop = set(probe.overrides)
    node = xin.experts_input(ctx, anchor, output, backward_slice([output], stop), stop)
    if node is None:
        return anchor, probe
    block = replace(anchor, experts_x=node)
    block_probe = make_probe(ctx, block, trial=0)
    return (anchor, probe) if isinstance(block_probe, str) else (block, block_probe)


def _real_weights(ctx: GraphContext, choice: ex.ExpertsChoice) -> tuple:
    """(w13, w2, b13, b2) as the op reads them, from the graph's real inputs."""
    return tuple(None if s is None else _cast(s.real(ctx.values), choice.cast)
                 for s in (choice.w13, choice.w2, choice.b13, choice.b2))


NOT_CAPTURED = "no node of the block equals the routed experts' weighted sum (experts not captured in this graph?)"


def no_output_reason(ctx: GraphContext, anchor: rt.RouterAnchor, probe: Probe, tried: list[fx.Node]) -> str:
    """Why no candidate output matched, from what the candidates' slices hold: expert weights in a
    form the op has no activation or layout for, weights computed in the graph, every expert in one
    matrix; ``NOT_CAPTURED`` when no expert weights are there at all."""
    stop = set(probe.overrides)
    exclude = {n for n in (anchor.router_weight, anchor.bias) if n is not None}
    hidden = probe.x2d.shape[-1]
    best = None
    for output in tried:
        nodes = backward_slice([output], stop)
        mats, _ = ex.expert_inputs(nodes, ctx.values, anchor.num_experts, ctx.names, exclude)
        layouts = ex.weight_layouts(mats, ctx.values, hidden)
        computed = ex.computed_weights(nodes, stop, ctx.values, hidden)
        folded = ex.folded_weights(nodes, ctx.values, anchor.num_experts, hidden, exclude)
        score = (bool(layouts), len(mats) + len(computed) + len(folded))
        if best is None or score > best[0]:
            best = (score, nodes, mats, layouts, computed, folded)
    if best is None or best[0][1] == 0:
        return NOT_CAPTURED
    _, nodes, mats, layouts, computed, folded = best
    found = "expert weights %s" % ex.describe_sources(mats, ctx.values) if mats else "no [E, ...] expert weights"
    if computed:
        shapes = ", ".join("%s by %s" % (list(val(n).shape), _op_name(n)) for n in computed[:4])
        return ("the experts' weights are computed in the graph from parameters (%s) rather than read as "
                "stored: the fused op takes stored weights, so the block is left as it was" % shapes)
    if layouts:
        acts = ex.activations_seen(nodes, stop)
        gated = sorted({"gated" if ex.is_gated(w13, w2, ctx.values) else "non-gated" for w13, w2 in layouts})
        kind = " or ".join(gated)
        if ex.unsupported_activations(acts, "gated" in gated, "non-gated" in gated):
            return ("%s found (read as %s experts), but no activation or layout the fused op supports reproduces "
                    "the routed output: no node of the block equals the op's output (activations after the expert "
                    "matmuls: %s; the op has %s)" % (found, kind, ", ".join(acts) or "none", ex.SUPPORTED_ACTIVATIONS))
        return ("%s found (read as %s experts, activations %s), but no node of the block equals the fused op's "
                "output on them: the block computes something the op does not (expert outputs changed before "
                "weighting, dropped tokens, another combine?)" % (found, kind, ", ".join(acts) or "none"))
    if folded:
        shapes = ", ".join(str(list(ctx.values[n].shape)) for n in folded[:4])
        widths = {d for m in mats for d in m.real(ctx.values).shape[-2:]} - {hidden}
        if all(set(ctx.values[n].shape) - {hidden} <= widths for n in folded):
            # [H, n] matrices whose n is a width of the 3-D experts: projections into and out of them
            return ("%s found, but no gate/up and down pair of the block's hidden size %d: the experts run at "
                    "another width, between projections %s (the op's experts read and write the hidden size)" % (
                        found, hidden, shapes))
        return ("%s found, and a weight %s that holds all %d experts in one matrix (one Linear for every expert): "
                "not a per-expert layout the fused op takes" % (found, shapes, anchor.num_experts))
    return ("%s found, but not as gate/up and down (or gate, up and down) tensors of hidden size %d: no layout "
            "the fused op takes" % (found, hidden))


def _op_name(node: fx.Node) -> str:
    return str(node.target).replace("aten.", "").split(".")[0]


def _with_output_dims(ctx: GraphContext, anchor: rt.RouterAnchor, output: fx.Node) -> rt.RouterAnchor | str:
    """The anchor whose block input and router logits keep the routed output's leading dims (the
    fused op returns its input's shape): ``[B, S, H]`` / ``[B, S, E]`` views of the ``[T, H]`` input
    and ``[T, E]`` logits when the block never flattens its tokens; the anchor itself otherwise."""
    out_shape = ctx.conc.shape(output)
    x_node = anchor.experts_x or anchor.x
    if out_shape == ctx.conc.shape(x_node):
        return anchor
    order = {n: i for i, n in enumerate(ctx.graph.nodes)}
    before = [n for n in _family(x_node) if order.get(n, len(order)) < order[output]]
    xs = [n for n in before if ctx.conc.shape(n) == out_shape]
    xs.sort(key=lambda n: (val(n).dtype != val(x_node).dtype, order[n]))
    logits_shape = out_shape[:-1] + (anchor.num_experts,)
    views, seen, todo = [], set(), [anchor.logits]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if ctx.conc.shape(node) == logits_shape and order[node] < order[output]:
            views.append(node)
        todo.extend(u for u in node.users if u.op == "call_function" and u.target in VIEW_OPS)
    if not xs or not views:
        return ("the routed output is %s (top-k over %d-D scores) but the graph holds no %s view of the block input "
                "and %s view of the router logits to hand the fused op" % (
                    list(out_shape), len(out_shape), list(out_shape), list(logits_shape)))
    field = "experts_x" if anchor.experts_x is not None else "x"
    return replace(anchor, **{field: xs[0]}, logits=min(views, key=order.__getitem__))


def confirm(ctx, anchor, routing, output, choice: ex.ExpertsChoice, bias_value, trials, weights=None) -> bool:
    """Re-check a match on fresh probes (also what ``verify`` runs); ``weights``: ``_real_weights``'s."""
    w13, w2, b13, b2 = weights if weights is not None else _real_weights(ctx, choice)
    for trial in trials:
        probe = make_probe(ctx, anchor, trial)
        if isinstance(probe, str):
            return False
        got = _eval(ctx, probe, [output])
        if got is None:
            return False
        fused = fused_reference(probe.x2d, probe.logits, routing, bias_value, w13, w2, b13, b2, choice.config)
        if not close(fused, got[0], compare_dtype(got[0].dtype, w13.dtype)):
            return False
    return True
