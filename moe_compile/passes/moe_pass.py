"""The MoE fusion pass over an aten-level inference graph.

For every top-k router it finds, it identifies the routing and the experts (``match.py``),
checks the exclusions, and rewrites the block into one ``moe_compile::fused_moe`` node
(``rewrite.py``). Anything it cannot handle stays exactly as it was and is reported with why.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from moe_compile.options import BackendConfig
from moe_compile.passes import router as rt
from moe_compile.passes.graph import (
    Concretizer, is_getitem, SliceEvaluator, module_path, module_stack, parent_path,
)
from moe_compile.passes import match as match_mod
from moe_compile.passes.match import GraphContext, match_block
from moe_compile.passes import experts_only
from moe_compile.passes.rewrite import rewrite_block, rewrite_experts, training_weights_reason
from moe_compile.report import BlockDecision, excluded_tensor_ids, path_excluded, record

log = logging.getLogger("moe_compile")

try:  # Inductor's hook type; the pass is also called directly on AOT graphs
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Base
except ImportError:  # pragma: no cover - older torch
    _Base = object


class MoEFusionPass(_Base):
    """``__call__(graph)`` rewrites in place; ``uuid()`` changes whenever the package's source does
    (the backend's Inductor hook adds the options and the graph: ``compile_cache.pass_uuid``)."""

    def __init__(self, config: BackendConfig, real_inputs: list, input_names: list[str],
                 op_kwargs: dict, training: bool = False):
        self.config = config
        self.training = training  # the graph records autograd (training.py): weights made in the graph
        self.real_inputs = real_inputs
        self.input_names = input_names
        self.op_kwargs = op_kwargs
        self.rewritten = 0
        self._routed_logits: dict = {}  # router logits node -> the path of the block rewritten on them

    def uuid(self):
        from moe_compile.compile_cache import package_hash

        return package_hash()

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.real_inputs):
            reason = ("the compiled graph's inputs (%d) do not line up with Dynamo's example inputs (%d)"
                      % (len(placeholders), len(self.real_inputs)))
            for topk, _ in rt.find_anchors(graph):
                record(BlockDecision(path=_block_path(topk), reason=reason))
            return
        values = dict(zip(placeholders, self.real_inputs))
        for node in graph.nodes:
            if node.op == "get_attr":
                values[node] = _fetch(gm, node.target)
        names = dict(zip(placeholders, self.input_names))
        conc = Concretizer(placeholders, self.real_inputs)
        ctx = GraphContext(graph, values, names, SliceEvaluator(graph, placeholders, self.real_inputs, gm, conc),
                           conc)
        failed, claimed, unanchored = [], set(), []
        for topk, anchor in rt.find_anchors(graph, names):
            if topk.graph is not graph or topk not in _live(graph):
                continue
            if not isinstance(anchor, str):
                claimed.add(anchor.logits)
            elif self.config.experts_only and not isinstance(anchor, rt.NotRouter) and "group-selection" not in anchor:
                unanchored.append((topk, anchor))  # no router matmul of its width: the experts alone may do
                continue
            self._one(gm, ctx, topk, anchor, failed)
        if self.config.experts_only:
            self._experts_only(gm, ctx, failed, claimed, unanchored)
        if self.rewritten:
            gm.recompile()

    def _one(self, gm, ctx: GraphContext, topk: fx.Node, anchor, failed: list) -> None:
        """Match and rewrite one top-k router's block; a block whose routing matched none of the op's goes
        to ``failed`` (the experts-only rewrite's turn) instead of the report."""
        path = _block_path(topk)
        if isinstance(anchor, str):
            if "group-selection" not in anchor:
                record(BlockDecision(path=path, reason=anchor, not_moe=isinstance(anchor, rt.NotRouter)))
            return
        real_weight = ctx.values.get(anchor.router_weight) if anchor.router_weight is not None else None
        weight_id = id(real_weight) if isinstance(real_weight, torch.Tensor) else None
        reason = self._excluded(anchor, ctx, path)
        if reason:
            record(BlockDecision(path=path, num_experts=anchor.num_experts, top_k=anchor.top_k, reason=reason,
                                 router_weight_id=weight_id))
            return
        if anchor.logits in self._routed_logits:  # e.g. the load-balancing loss over the router logits: not a block
            record(BlockDecision(path=path, reason="a top-k over router logits the block %s routes with (e.g. a "
                                 "load-balancing loss), not a block of its own" % self._routed_logits[anchor.logits],
                                 not_moe=True))
            return
        try:
            with unset_fake_temporarily():
                match = match_block(ctx, anchor)
        except Exception as exc:  # a failed match must never break the user's compile
            log.debug("moe_compile: matching %s raised", path, exc_info=True)
            match = "the matcher raised %s: %s" % (type(exc).__name__, exc)
        if not isinstance(match, str) and self.config.verify:
            with unset_fake_temporarily():
                ok = match_mod.confirm(ctx, match.probed or anchor, match.routing, match.output, match.experts,
                                       match.bias_value, trials=(2, 3, 4))
            if not ok:
                match = "verify: the rewrite disagreed with the original subgraph on fresh random inputs"
        if isinstance(match, str):
            if self.config.experts_only and match in (match_mod.ROUTING_UNMATCHED, match_mod.ROUTER_NOT_EVALUATED):
                failed.append((anchor, path, match, weight_id))
                return
            record(BlockDecision(path=path, num_experts=anchor.num_experts, top_k=anchor.top_k, reason=match,
                                 router_weight_id=weight_id))
            return
        reason = self.training and training_weights_reason(match)
        if reason:
            record(BlockDecision(path=path, num_experts=anchor.num_experts, top_k=anchor.top_k, reason=reason,
                                 router_weight_id=weight_id))
            return
        with unset_fake_temporarily():
            fused = rewrite_block(gm, match, ctx.values, self.op_kwargs, self._groups(), training=self.training,
                                  router_on_cuda=not self.training and self._lowers_to_cuda(ctx, anchor))
        self.rewritten += 1
        self._routed_logits[anchor.logits] = match.path
        router = match.router_kind()
        if fused.args[1].target is torch.ops.moe_compile.router_logits.default:
            if len(fused.args[1].args) > 3:
                router += " (bf16 router GEMM -> moe_compile::router_logits: the GEMV kernel at <= 16 tokens)"
            else:
                router += " (fp32 router GEMM -> moe_compile::router_logits on the bf16 input)"
        record(BlockDecision(
            path=match.path, router=router, experts=match.experts.form,
            num_experts=anchor.num_experts, top_k=anchor.top_k, activation=match.experts.describe(),
            rewritten=True, router_weight_id=weight_id,
        ))

    def _experts_only(self, gm, ctx: GraphContext, failed: list, claimed: set, unanchored: list) -> None:
        """Blocks whose router the op cannot express: top-k routers whose routing matched none of the op's
        (``failed``), then routed pairs next to router matmuls without a top-k (hash routing, argmax picks)
        or with a top-k that found no router matmul of its width (``unanchored``: (top-k, why))."""
        for anchor, path, reason, weight_id in failed:
            routed = experts_only.from_topk(anchor, reason)
            done = self._routed(gm, ctx, routed, path, weight_id, match_mod.scopes(anchor))
            if done is not True:
                record(BlockDecision(path=path, num_experts=anchor.num_experts, top_k=anchor.top_k,
                                     reason="%s (the experts alone: %s)" % (reason, done), router_weight_id=weight_id))
        topk_ids = {u: (topk, why) for topk, why in unanchored for u in topk.users if is_getitem(u, 1)}
        by_router: dict = {}
        try:
            found_all = experts_only.find_routed(ctx, ctx.graph, claimed, set(topk_ids))
        except Exception:  # an odd graph must not cost the blocks rewritten above
            log.debug("moe_compile: looking for routers without a top-k raised", exc_info=True)
            found_all = []
        for routed in found_all:
            by_router.setdefault(routed.logits, []).append(routed)
        for logits, found in by_router.items():
            real_weight = ctx.values.get(found[0].router_weight)
            weight_id = id(real_weight) if isinstance(real_weight, torch.Tensor) else None
            path = _block_path(found[0].ids)  # the router matmul may be a bare Linear of the block
            reasons = []
            for routed in sorted(found, key=lambda r: -r.top_k):  # the widest pick first (PhiMoE's two picks)
                if routed.ids not in _live(ctx.graph):
                    continue
                reason = self._excluded(routed, ctx, path)
                if reason:
                    record(BlockDecision(path=path, num_experts=routed.num_experts, top_k=routed.top_k, reason=reason,
                                         router_weight_id=weight_id))
                    topk_ids.pop(routed.ids, None)
                    reasons = []
                    break
                done = self._routed(gm, ctx, routed, path, weight_id, experts_only.scopes(routed))
                if done is True:
                    topk_ids.pop(routed.ids, None)
                    reasons = []
                    break
                if routed.ids in topk_ids:  # reported with its top-k's reason below
                    topk, why = topk_ids[routed.ids]
                    topk_ids[routed.ids] = (topk, "%s (the experts alone: %s)" % (why, done))
                    continue
                reasons.append((routed, done))
            shown = [(r, why) for r, why in reasons if not why.startswith(experts_only.NOT_EXPERTS)]
            if shown:  # expert weights were found: a block the user would expect rewritten
                routed, why = shown[0]
                record(BlockDecision(path=path, num_experts=routed.num_experts, top_k=routed.top_k,
                                     reason="router without a top-k (%s); the experts alone: %s" % (routed.source, why),
                                     router_weight_id=weight_id))
        for topk, why in topk_ids.values():
            record(BlockDecision(path=_block_path(topk), reason=why))

    def _routed(self, gm, ctx: GraphContext, routed, path: str, weight_id, scope_list) -> bool | str:
        """``True`` when ``routed``'s experts were rewritten into ``fused_experts``, else why not."""
        try:
            with unset_fake_temporarily():
                match = experts_only.match_routed(ctx, routed, scope_list)
        except Exception as exc:  # a failed match must never break the user's compile
            log.debug("moe_compile: matching the experts of %s raised", path, exc_info=True)
            return "the experts-only matcher raised %s: %s" % (type(exc).__name__, exc)
        if isinstance(match, str):
            return match
        reason = self.training and training_weights_reason(match)
        if reason:
            return reason
        with unset_fake_temporarily():
            rewrite_experts(gm, match, ctx.values, self.op_kwargs, self._groups(), training=self.training)
        self.rewritten += 1
        record(BlockDecision(
            path=path, router=match.router_kind(), experts=match.experts.form, num_experts=routed.num_experts,
            top_k=routed.top_k, activation=match.experts.describe(), rewritten=True, router_weight_id=weight_id,
        ))
        return True

    def _lowers_to_cuda(self, ctx: GraphContext, anchor) -> bool:
        from moe_compile.lowering import resolve
        from moe_compile.ops.config import Lowering

        real = ctx.values.get(anchor.router_weight) if anchor.router_weight is not None else None
        device = real.device if isinstance(real, torch.Tensor) else torch.device("cpu")
        requested = Lowering(self.op_kwargs.get("lowering", Lowering.AUTO.value))
        return resolve(requested, device) is Lowering.CUDA

    def _groups(self) -> dict:
        groups = {k: getattr(self.config, k) for k in ("ep_group", "tp_group") if getattr(self.config, k) is not None}
        import torch.distributed as dist

        return {k: g for k, g in groups.items() if dist.get_world_size(g) > 1}

    def _excluded(self, anchor, ctx: GraphContext, path: str) -> str:
        if path_excluded(path, self.config.exclude_paths):
            return "excluded by options['exclude'] (path glob)"
        classes = {cls for node in (anchor.topk, anchor.logits) if node is not None
                   for _, cls in module_stack(node) if cls}
        if self.config.exclude_classes and any(issubclass(c, self.config.exclude_classes) for c in classes):
            return "excluded by options['exclude'] (module class)"
        excluded = excluded_tensor_ids()
        if excluded and anchor.router_weight is not None and id(ctx.values.get(anchor.router_weight)) in excluded:
            return "excluded by moe_compile.exclude(module)"
        return ""


def _block_path(node: fx.Node) -> str:
    """The block's path from its router's top-k (or router matmul)."""
    path = module_path(node)
    stack = module_stack(node)
    # the router is usually its own module (``mlp.gate``, or dbrx's ``ffn.router.layer``); the block is
    # its parent. With one entry left, the frame Dynamo compiled is the block itself (its own frame after
    # a graph break), so a router's parent is that frame's root, ""
    while stack and stack[-1][1] is not None and match_mod.looks_like_router(stack[-1][1]):
        if len(stack) == 1 and not any(word in stack[-1][1].__name__.lower() for word in ("router", "gate")):
            break
        stack = stack[:-1]
        path = parent_path(path) or ""
    return path


def _live(graph: fx.Graph) -> set[fx.Node]:
    return set(graph.nodes)


def _fetch(module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = ["MoEFusionPass", "torch"]
