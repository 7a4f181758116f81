"""A lowering runs the staged op on one kind of device:

    prepare -> select_experts -> dispatch -> mlp -> combine -> finalize

``StagedLowering`` spells the stages out with the modular kernel doing dispatch/mlp/combine;
a device lowering overrides the stages it has faster kernels for.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_compile.modular import ExpertWeights, GroupedExperts, ModularKernel, StandardPrepareAndFinalize
from moe_compile.ops.config import MoEConfig, RoutingConfig
from moe_compile.ops.routing import select_experts


@dataclass(frozen=True)
class MoEInputs:
    hidden_states: torch.Tensor  # [..., H]
    router_logits: torch.Tensor | None  # [..., E]; None when the routing was precomputed
    weights: ExpertWeights
    e_score_correction_bias: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None  # precomputed routing (custom routing function)
    topk_ids: torch.Tensor | None = None


def tp_rank_inputs(inputs: MoEInputs, cfg: MoEConfig) -> MoEInputs:
    """Under TP every rank computes a slice of each expert's intermediate dims and the partial down
    projections are summed across the ranks, so ``w2_bias`` (not sharded) is added by TP rank 0
    only: a whole ``w2_bias`` passed on every rank counts once (it counted tp_size times), and
    zeros on the other ranks (``shard_for_tp``'s layout) stay right. Other ranks get zeros of the
    same shape, so every rank still describes the same call (the group handshake)."""
    parallel, bias = cfg.parallel, inputs.weights.w2_bias
    if bias is None or not parallel.tp_group_name or parallel.ep_group_name:
        return inputs
    import torch.distributed as dist

    from moe_compile.distributed.groups import resolve_group

    if dist.get_rank(resolve_group(parallel.tp_group_name)) == 0:
        return inputs
    weights = dataclasses.replace(inputs.weights, w2_bias=torch.zeros_like(bias))
    return dataclasses.replace(inputs, weights=weights)


class StagedLowering:
    name = "torch"

    # -- stages ------------------------------------------------------------------------------
    def prepare(self, inputs: MoEInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = inputs.hidden_states.shape[-1]
        x_TH = inputs.hidden_states.reshape(-1, hidden)
        logits = inputs.router_logits
        return x_TH, None if logits is None else logits.reshape(-1, logits.shape[-1])

    def select_experts(self, logits_TE: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None):
        return select_experts(logits_TE, cfg, bias)

    def make_kernel(self, cfg: MoEConfig, inputs: MoEInputs) -> tuple[ModularKernel, torch.Tensor | None]:
        """The modular kernel for dispatch -> mlp -> combine, and the expert map (None: all local)."""
        if cfg.parallel.tp_group_name or cfg.parallel.ep_group_name:
            from moe_compile.lowering.distributed import make_distributed_kernel

            return make_distributed_kernel(cfg, inputs, self.make_experts(cfg, inputs))
        return ModularKernel(StandardPrepareAndFinalize(), self.make_experts(cfg, inputs)), None

    def make_experts(self, cfg: MoEConfig, inputs: MoEInputs):
        return GroupedExperts(cfg.experts)

    def finalize(self, out_TH: torch.Tensor, inputs: MoEInputs) -> torch.Tensor:
        return out_TH.view(inputs.hidden_states.shape)

    # -- the pipeline --------------------------------------------------------------------------
    def run(self, inputs: MoEInputs, cfg: MoEConfig) -> torch.Tensor:
        inputs = tp_rank_inputs(inputs, cfg)
        x_TH, logits_TE = self.prepare(inputs)
        if inputs.topk_ids is None:
            topk_weights, topk_ids = self.select_experts(logits_TE, cfg.routing, inputs.e_score_correction_bias)
        else:
            top_k = inputs.topk_ids.shape[-1]  # not -1: a zero-token reshape cannot infer it
            topk_weights = inputs.topk_weights.reshape(x_TH.shape[0], top_k)
            topk_ids = inputs.topk_ids.reshape(x_TH.shape[0], top_k)
        kernel, expert_map = self.make_kernel(cfg, inputs)
        out_TH = kernel(
            x_TH, topk_weights, topk_ids, inputs.weights,
            global_num_experts=cfg.routing.num_experts,
            expert_map=expert_map,
            apply_router_weight_on_input=cfg.experts.apply_router_weight_on_input,
        )
        return self.finalize(out_TH, inputs)
