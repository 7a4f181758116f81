"""Replace a matched block's routed output by one ``moe_compile::fused_moe`` node.

Weights reach the op as views of the graph inputs (a ``permute`` when the model stores them
transposed), so nothing is copied per call. Only blocks whose gate and up projections are
separate tensors (``ModuleList`` experts, gpt-fast's w1/w3) need one stacked copy: made once at
compile time by ``moe_compile::stacked_weights`` from the source weights (graph inputs), which
re-makes it when they change in place (ops/weight_cache.py); EP/TP shards are made the same way.
Weights that are not graph inputs are copies taken at compile time.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import operator

import torch
import torch.fx as fx

from moe_compile.passes.experts import WeightSource
from moe_compile.passes.graph import CAST_OPS, SIDE_EFFECT_OPS, aten, backward_slice, val
from moe_compile.passes.match import BlockMatch

_counter = itertools.count()
log = logging.getLogger("moe_compile")


def _fake_mode(node: fx.Node):
    v = val(node)
    return getattr(v, "fake_mode", None)


def _set_val(node: fx.Node, template: fx.Node) -> None:
    """Give a new node its fake value by running its target on the inputs' fake values."""
    args = fx.node.map_arg(node.args, lambda n: val(n))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: val(n))
    fake_mode = _fake_mode(template)
    if fake_mode is None:
        return
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in template.meta:
            node.meta[key] = template.meta[key]


@contextlib.contextmanager
def _in_checkpoint_region(graph: fx.Graph, out: fx.Node):
    """Nodes made within carry the replaced block's activation-checkpoint tags (``recompute``, ``ac_graph_id``:
    the block ran under ``torch.utils.checkpoint``), so AOTAutograd's partitioner recomputes the stacked weights
    and the fused op's inputs in the backward as it would have the block's own ops, instead of saving them."""
    tags = {key: out.meta[key] for key in ("recompute", "ac_graph_id") if key in out.meta}
    before = set(graph.nodes) if tags else set()
    yield
    for node in graph.nodes if tags else ():
        if node not in before:
            node.meta.update(tags)


def _call(graph: fx.Graph, target, args, template: fx.Node, kwargs=None) -> fx.Node:
    node = graph.call_function(target, tuple(args), kwargs or {})
    _set_val(node, template)
    return node


def _constant(gm: fx.GraphModule, tensor: torch.Tensor, template: fx.Node) -> fx.Node:
    """A tensor the rewritten graph owns (stacked or sharded expert weights), laid out once.

    It reaches the op through a view (weights held with their last two dims swapped, so the op
    reads them K-major as it reads HF's ``[E, N, K]`` parameters): Inductor then hands its fallback
    kernel a view instead of the constant itself (a bare constant reaches the op's fake-tensor
    propagation as a real tensor, which Inductor's lowering rejects).
    """
    name = "_moe_compile_w%d" % next(_counter)
    t = tensor.detach()
    # weights [E, K, N]: held as [E, N, K], read through a permute; biases [E, N]: held as
    # [E, 1, N], read through a squeeze (still contiguous, as bias consumers expect)
    held = t.transpose(-1, -2).contiguous() if t.dim() >= 3 else t.unsqueeze(1).contiguous()
    gm.register_buffer(name, held, persistent=False)
    node = gm.graph.get_attr(name)
    fake_mode = _fake_mode(template)
    if fake_mode is not None:
        node.meta["val"] = fake_mode.from_tensor(getattr(gm, name), static_shapes=True)
    if t.dim() < 3:
        return _call(gm.graph, aten.squeeze.dim, (node, 1), template)
    dims = list(range(t.dim() - 2)) + [t.dim() - 1, t.dim() - 2]
    return _call(gm.graph, aten.permute.default, (node, dims), template)


def _leaves(source: WeightSource, out: list) -> list:
    if source.kind == "cat":
        for part in source.nodes:
            _leaves(part, out)
    elif source.kind == "scale":
        _leaves(source.nodes[0], out)
        if source.nodes[1] not in out:
            out.append(source.nodes[1])
    else:
        out.extend(n for n in source.nodes if n not in out)
    return out


def _recipe(source: WeightSource, index: dict) -> tuple:
    if source.kind == "cat":
        return ("cat", tuple(_recipe(part, index) for part in source.nodes), source.transpose)
    if source.kind == "scale":
        return ("scale", (_recipe(source.nodes[0], index), index[source.nodes[1]]), False)
    if source.kind == "stack":
        return ("stack", tuple(index[n] for n in source.nodes), source.transpose)
    return ("leaf", index[source.nodes[0]], source.transpose)


def _cached(gm: fx.GraphModule, recipes: list, leaves: list, values: dict, template: fx.Node) -> list[fx.Node]:
    """Copies made by one ``moe_compile::stacked_weights`` call from the source weights themselves
    (graph inputs), so they follow them when they change (ops/weight_cache.py); one call per block."""
    from moe_compile.ops import weight_cache

    key, held, dims = weight_cache.register(recipes, [values[n] for n in leaves])
    node = gm.graph.call_function(torch.ops.moe_compile.stacked_weights.default, (leaves, key))
    fake_mode = _fake_mode(template)
    if fake_mode is not None:
        node.meta["val"] = [fake_mode.from_tensor(h, static_shapes=True) for h in held]
    out = []
    for i, dim in enumerate(dims):
        item = gm.graph.call_function(operator.getitem, (node, i))
        if fake_mode is not None:
            item.meta["val"] = node.meta["val"][i]
        if dim < 3:
            out.append(_call(gm.graph, aten.squeeze.dim, (item, 1), template))
        else:
            out.append(_call(gm.graph, aten.permute.default, (item, list(range(dim - 2)) + [dim - 1, dim - 2]),
                             template))
    return out


def _view_or_constant(gm: fx.GraphModule, source: WeightSource | None, values: dict, template: fx.Node):
    if source is None:
        return None
    if source.copies:
        return _constant(gm, source.real(values), template)
    node = source.nodes[0]
    if not source.transpose:
        return node
    return _call(gm.graph, aten.permute.default, (node, [0, 2, 1]), template)


def _graph_input_leaves(sources) -> list | None:
    """The graph inputs the sources are made from, in order; None if any is not a graph input."""
    leaves = []
    for source in sources:
        if source is not None:
            _leaves(source, leaves)
    return leaves if all(n.op == "placeholder" for n in leaves) else None


def emit_weights(gm: fx.GraphModule, sources: tuple, values: dict, template: fx.Node) -> list:
    """The op's (w13, w2, w13_bias, w2_bias): views of graph inputs where the model's layout allows,
    and the stacked copies (separate gate/up tensors) from one ``stacked_weights`` call."""
    copied = [s for s in sources if s is not None and s.copies]
    leaves = _graph_input_leaves(copied) if copied else None
    if not leaves:
        return [_view_or_constant(gm, s, values, template) for s in sources]
    index = {n: i for i, n in enumerate(leaves)}
    made = iter(_cached(gm, [_recipe(s, index) for s in copied], leaves, values, template))
    return [next(made) if s is not None and s.copies else _view_or_constant(gm, s, values, template)
            for s in sources]


def training_weights_reason(match) -> str | None:
    """Why a training graph cannot take ``match``'s weights (None: it can): every weight must be made from
    graph inputs in the graph, so its gradient reaches them (a compile-time copy would take none)."""
    choice = match.experts
    for name, source in (("w13", choice.w13), ("w2", choice.w2), ("w13 bias", choice.b13), ("w2 bias", choice.b2)):
        if source is not None and source.copies and _graph_input_leaves([source]) is None:
            return ("autograd is recording and the experts' %s is not made from graph inputs (a copy taken at "
                    "compile time would get no gradient)" % name)
    return None


def _in_graph(graph: fx.Graph, source: WeightSource, template: fx.Node) -> fx.Node:
    """``source`` made in the graph from its graph inputs (as ``WeightSource.real`` makes it), so autograd
    carries the gradient back to them: a training graph's stacked weights."""
    if source.kind == "scale":  # expert e's slice times scale[e], rounded once
        inner = _in_graph(graph, source.nodes[0], template)
        dims = val(inner).dim()
        scale = _call(graph, aten.reshape.default, (source.nodes[1], [-1] + [1] * (dims - 1)), template)
        up = [_call(graph, torch.ops.prims.convert_element_type.default, (n, torch.float32), template)
              for n in (inner, scale)]
        product = _call(graph, aten.mul.Tensor, tuple(up), template)
        return _call(graph, torch.ops.prims.convert_element_type.default, (product, val(inner).dtype), template)
    if source.kind == "cat":
        return _call(graph, aten.cat.default, ([_in_graph(graph, part, template) for part in source.nodes], -1),
                     template)
    node = source.nodes[0]
    if source.kind == "stack":
        node = _call(graph, aten.stack.default, (list(source.nodes), 0), template)
    if not source.transpose:
        return node
    dims = val(node).dim()
    return _call(graph, aten.permute.default, (node, list(range(dims - 2)) + [dims - 1, dims - 2]), template)


def _sharded_weights(gm, match, values: dict, groups: dict, template: fx.Node):
    """This rank's share of the expert weights (EP: its experts; TP: its intermediate slice); the
    router and the selection bias stay global. Made from the model's weights by one
    ``moe_compile::stacked_weights`` call when they are graph inputs (so the shards follow them),
    else copies taken now."""
    from moe_compile.distributed import shard_for_groups

    choice = match.experts
    sources = (choice.w13, choice.w2, choice.b13, choice.b2)
    kwargs = dict(ep_group=groups.get("ep_group"), tp_group=groups.get("tp_group"),
                  activation=choice.config.activation.value, gate_up_interleaved=choice.config.gate_up_interleaved)
    shard = shard_for_groups(*[None if s is None else s.real(values) for s in sources], **kwargs)
    fields = [f for f in ("w13", "w2", "w13_bias", "w2_bias") if getattr(shard, f) is not None]
    leaves = _graph_input_leaves(sources)
    if leaves is None:
        made = {f: _constant(gm, getattr(shard, f), template) for f in fields}
    else:
        index = {n: i for i, n in enumerate(leaves)}
        recipes = tuple(None if s is None else _recipe(s, index) for s in sources)
        made = dict(zip(fields, _cached(gm, [("shard", (recipes, kwargs, f), False) for f in fields], leaves,
                                        values, template)))
    return [made.get(f) for f in ("w13", "w2", "w13_bias", "w2_bias")]


def upcast_source(node: fx.Node) -> fx.Node | None:
    """The bf16/fp16 tensor that ``node`` is an fp32 upcast of (``x.float()``), else ``None``."""
    if node.op != "call_function" or node.target not in CAST_OPS:
        return None
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if src is None or val(node).dtype != torch.float32:
        return None
    return src if val(src).dtype in (torch.bfloat16, torch.float16) else None


def _router_op(graph: fx.Graph, anchor, x_low: fx.Node | None) -> fx.Node | None:
    """The router GEMM as one ``moe_compile::router_logits`` node on the stored ``[E, H]`` weight:

    - fp32 over an upcast bf16 input (``F.linear(x.float(), w.float())``, DeepSeek-V3): on the bf16
      input, so the CUDA kernels skip the fp32 copy of the activations and the CUDA-core fp32 GEMM;
    - bf16 (``F.linear(x, w)``, Mixtral, Qwen3): bf16 logits, so decode-sized batches take the
      GEMV kernel (PDL, no cuBLAS launch) and larger ones cuBLAS, as before.

    ``None`` (the graph's own GEMM stays) for any other form."""
    logits = anchor.logits
    out_dtype = val(logits).dtype
    if out_dtype == torch.float32:
        if x_low is None or val(x_low).dtype != torch.bfloat16:
            return None
        source = x_low
    elif out_dtype == torch.bfloat16 and val(anchor.x).dtype == torch.bfloat16:
        source = anchor.x
    else:
        return None
    if logits.target is aten.mm.default:
        bias, a, b = None, logits.args[0], logits.args[1]
    elif logits.target is aten.addmm.default and not logits.kwargs:
        bias, a, b = logits.args[0], logits.args[1], logits.args[2]
    else:
        return _router_stays("the router GEMM is %s, not mm/addmm" % logits.target)
    weight = anchor.router_weight
    if a is not anchor.x or weight is None or val(source).dim() != 2 or _skip_casts(_untranspose(b)) is not weight:
        return _router_stays("the GEMM is not x @ w.t() over a 2-D input")
    wv = val(weight)
    allowed = (torch.bfloat16, torch.float32) if out_dtype == torch.float32 else (torch.bfloat16,)
    if tuple(wv.shape) != (val(logits).shape[1], val(source).shape[1]) or wv.dtype not in allowed:
        return _router_stays("the weight is stored %s %s, not [E, H] %s" % (tuple(wv.shape), wv.dtype,
                                                                           "/".join(map(str, allowed))))
    if bias is not None and tuple(val(bias).shape) != (wv.shape[0],):
        return _router_stays("the GEMM's bias is not [E]")
    args = (source, weight, bias) if out_dtype == torch.float32 else (source, weight, bias, out_dtype)
    with graph.inserting_after(logits):
        node = _call(graph, torch.ops.moe_compile.router_logits.default, args, logits)
    logits.replace_all_uses_with(node)
    return node


def _router_stays(reason: str) -> None:
    log.debug("moe_compile: the router GEMM stays as it is: %s", reason)
    return None


def _skip_casts(node: fx.Node | None) -> fx.Node | None:
    while node is not None and node.op == "call_function" and node.target in CAST_OPS:
        node = node.args[0]
    return node


def _untranspose(node: fx.Node) -> fx.Node | None:
    """``w`` for ``w.t()`` / ``w.permute(1, 0)`` / ``w.transpose(0, 1)`` of a 2-D ``w`` (casts
    before the transpose skipped), else ``None``."""
    node = _skip_casts(node)
    if node is None or node.op != "call_function":
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        return node.args[0]
    if node.target is aten.transpose.int and sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]:
        return node.args[0]
    return None


def rewrite_block(gm: fx.GraphModule, match: BlockMatch, values: dict, op_kwargs: dict,
                  groups: dict | None = None, router_on_cuda: bool = False, training: bool = False) -> fx.Node:
    """``router_on_cuda``: the op will run the CUDA lowering, so the router GEMM (fp32 over an
    upcast bf16 input, or bf16) becomes ``moe_compile::router_logits`` (see ``_router_op``).
    ``training``: the graph records autograd; the weights are made in the graph (``_in_graph``)."""
    graph = gm.graph
    out = match.output
    anchor = match.anchor
    routing, experts = match.routing, match.experts.config
    with graph.inserting_before(out), _in_checkpoint_region(graph, out):
        w13, w2, b13, b2 = _expert_weights(gm, match, values, groups, anchor.x, training)
        bias = None
        if routing.has_correction_bias:
            bias = anchor.bias
            if len(val(bias).shape) != 1:
                bias = _call(graph, aten.reshape.default, (bias, [routing.num_experts]), anchor.x)
        kwargs = dict(
            num_experts=routing.num_experts, top_k=routing.top_k, routing_method=routing.method.value,
            renormalize=routing.renormalize,
            routed_scaling_factor=1.0 if match.scale_input else float(routing.routed_scaling_factor),
            k_group=routing.k_group, group_count=routing.group_count,
            group_select_mode=routing.group_select_mode, normalize_sigmoid=routing.normalize_sigmoid,
            scoring_after_topk=routing.scoring_after_topk, activation=experts.activation.value,
            swiglu_alpha=float(experts.swiglu_alpha), swiglu_limit=float(experts.swiglu_limit),
            gate_up_interleaved=experts.gate_up_interleaved,
            apply_router_weight_on_input=experts.apply_router_weight_on_input, **op_kwargs,
        )
        act_dtype = val(w13).dtype  # the experts compute in their weights' dtype
        x_low = upcast_source(anchor.x)
        # experts_x: the experts read their own input (Gemma-4)
        x = _in_dtype(graph, anchor.experts_x or anchor.x, act_dtype, anchor.x)
        logits = anchor.logits
        if router_on_cuda:
            logits = _router_op(graph, anchor, x_low) or logits
        fused = _call(graph, torch.ops.moe_compile.fused_moe.default,
                      (x, logits, w13, w2, b13, b2, bias), out, kwargs)
        result = fused
        if match.scale_input:  # a scale Dynamo passes in per call: read it per call (linear in the weights)
            node, divides = match.scale_input
            result = _call(graph, aten.div.Tensor if divides else aten.mul.Tensor, (fused, node), out)
        if val(out).dtype != act_dtype:
            result = _call(graph, torch.ops.prims.convert_element_type.default, (result, val(out).dtype), out)
    out.replace_all_uses_with(result)
    _drop_old(graph, match, {anchor.x, anchor.logits, logits} | ({anchor.experts_x} - {None}))
    return fused


def _expert_weights(gm: fx.GraphModule, match, values: dict, groups: dict | None, template: fx.Node,
                    training: bool = False) -> list:
    """The op's ``(w13, w2, w13_bias, w2_bias)`` nodes for a block or experts-only match: this rank's shard under
    ``groups``, else the whole stacked weights; cast per call where the block computed under autocast."""
    choice = match.experts
    if groups:
        weights = _sharded_weights(gm, match, values, groups, template)
    elif training:  # made in the graph, so their gradients reach the model's weights
        weights = [None if s is None else _in_graph(gm.graph, s, template)
                   for s in (choice.w13, choice.w2, choice.b13, choice.b2)]
    else:
        weights = emit_weights(gm, (choice.w13, choice.w2, choice.b13, choice.b2), values, template)
    return _autocast(gm.graph, weights, choice.cast, template)


def _autocast(graph: fx.Graph, weights: list, cast: torch.dtype | None, template: fx.Node) -> list:
    """The op's weights cast per call to ``cast`` when the block computed in it (autocast), else as they are."""
    if cast is None:
        return list(weights)
    return [None if w is None else _call(graph, torch.ops.prims.convert_element_type.default, (w, cast), template)
            for w in weights]


def _in_dtype(graph: fx.Graph, x: fx.Node, dtype: torch.dtype, template: fx.Node) -> fx.Node:
    """``x`` in the experts' dtype: as it is, the low-precision tensor it is an upcast of (the router saw
    an upcast copy: DeepSeek-V3's ``x.float()``), or a cast."""
    if val(x).dtype == dtype:
        return x
    low = upcast_source(x)
    if low is not None and val(low).dtype == dtype:
        return low  # the block input itself, not a round trip through fp32
    return _call(graph, torch.ops.prims.convert_element_type.default, (x, dtype), template)


def rewrite_experts(gm: fx.GraphModule, match, values: dict, op_kwargs: dict, groups: dict | None = None,
                    training: bool = False) -> fx.Node:
    """An experts-only match (``experts_only.RoutedMatch``): the routed output becomes one
    ``moe_compile::fused_experts`` node on the router's own ids and weights; the router stays (global: every
    rank routes every token, as with ``rewrite_block``). ``groups``: this rank's share of the experts (EP) or of
    their intermediate columns (TP), made as ``rewrite_block`` makes them."""
    graph = gm.graph
    out, anchor, experts = match.output, match.anchor, match.experts.config
    with graph.inserting_before(out), _in_checkpoint_region(graph, out):
        w13, w2, b13, b2 = _expert_weights(gm, match, values, groups, match.x_view, training)
        act_dtype = val(w13).dtype
        x = _in_dtype(graph, match.x_view, act_dtype, match.x_view)
        k = anchor.top_k
        ids, weights = anchor.ids, match.weights  # the router's own [T, k] ids and weights
        if tuple(val(ids).shape[1:]) != (k,) or val(ids).dim() != 2:
            ids = _call(graph, aten.reshape.default, (ids, [-1, k]), ids)
        if tuple(val(weights).shape[1:]) != (k,) or val(weights).dim() != 2:
            weights = _call(graph, aten.reshape.default, (weights, [-1, k]), weights)
        kwargs = dict(
            num_experts=anchor.num_experts, activation=experts.activation.value,
            swiglu_alpha=float(experts.swiglu_alpha), swiglu_limit=float(experts.swiglu_limit),
            gate_up_interleaved=experts.gate_up_interleaved,
            apply_router_weight_on_input=experts.apply_router_weight_on_input, **op_kwargs,
        )
        fused = _call(graph, torch.ops.moe_compile.fused_experts.default, (x, weights, ids, w13, w2, b13, b2), out,
                      kwargs)
        result = fused
        if val(out).dtype != act_dtype:
            result = _call(graph, torch.ops.prims.convert_element_type.default, (result, val(out).dtype), out)
    out.replace_all_uses_with(result)
    _drop_old(graph, match, {anchor.x, match.x_view, anchor.ids, match.weights, anchor.logits})
    return fused


def _drop_old(graph: fx.Graph, match, keep: set[fx.Node]) -> None:
    """Erase runtime asserts that only guarded the replaced computation, then dead code."""
    old = match.old_nodes - keep
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SIDE_EFFECT_OPS:
            continue
        ancestors = backward_slice([node], keep) - keep - {node}
        if not ancestors & old:
            continue
        exclusive = all(
            n in old or n.op != "call_function" or all(u in ancestors or u is node for u in n.users)
            for n in ancestors
        )
        if exclusive:
            graph.erase_node(node)
    graph.eliminate_dead_code()
