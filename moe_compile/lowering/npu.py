"""The NPU lowering: every stage of the fused MoE op as torch_npu ops (notes §1, §2).

::

    prepare         flatten; tokens_full=False: all_gather (TP / static EP) | dynamic EP: keep this
                    rank's share of the tokens
    select_experts  npu_moe_gating_top_k_softmax | npu_moe_gating_top_k (+ torch renorm / scaling)
    dispatch        npu_moe_init_routing_v2 (static, active_expert_range = this rank's experts)
                    | npu_moe_token_permute + all_to_all_single (dynamic EP, npu_dynamic.py)
    mlp             npu_grouped_matmul (+bias) -> npu_swiglu | torch activation -> npu_grouped_matmul
    combine         gather + select + weighted sum in aten ops (static) | token_unpermute (dynamic)
    finalize        all_reduce | reduce_scatter | all_gather (dynamic, tokens_full) | reshape

``torch_npu`` is imported inside the stages, so this module imports anywhere; under
:func:`moe_compile.testing.emulated_npu` the same code runs on CPU against the emulated ops.

Names: ``T`` tokens, ``K`` top-k, ``P = T*K`` (token, k) pairs, ``R`` expert-sorted rows, ``H`` hidden,
``E`` experts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moe_compile.lowering.base import MoEInputs, StagedLowering, tp_rank_inputs
from moe_compile.lowering.npu_activation import npu_activation
from moe_compile.lowering.npu_comm import (
    Comm, CommMode, all_gather, all_reduce, reduce_scatter, resolve_comm, verify_agreement)
from moe_compile.lowering.npu_layout import LayoutCache
from moe_compile.lowering.npu_routing import import_torch_npu, select_experts_npu
from moe_compile.modular import ExpertWeights
from moe_compile.ops.config import DispatcherType, ExpertsConfig, MoEConfig, RoutingConfig

log = logging.getLogger("moe_compile")

# npu_moe_init_routing_v2 with expert_tokens_num_type=1 gives per-expert *counts*, which
# npu_grouped_matmul reads with group_list_type=1. [AMBIG] MindIE-SD uses type 0 (cumsum), but the
# torch_npu 2.14 doc says "only 1 and 2 are supported"; counts are valid under every doc version.
EXPERT_TOKENS_COUNT = 1
GROUP_LIST_COUNTS = 1


@dataclass(frozen=True)
class Prepared:
    x_TH: torch.Tensor
    logits_TE: torch.Tensor | None
    weights_TK: torch.Tensor | None  # precomputed routing (fused_experts), else None
    ids_TK: torch.Tensor | None
    comm: Comm
    dispatcher: DispatcherType
    num_tokens_in: int  # rows before the prepare stage's gather / split


@dataclass(frozen=True)
class StaticDispatch:
    x_RH: torch.Tensor  # expert-sorted rows; rows past the valid count are undefined
    row_idx_P: torch.Tensor  # int32 [P] token-major: pair -> its row, -1 if not on this rank
    group_list: torch.Tensor  # int64 [E_local] rows per local expert


class NpuLowering(StagedLowering):
    name = "npu"

    def __init__(self):
        self.layouts = LayoutCache()

    # -- prepare --------------------------------------------------------------------------------
    def prepare_npu(self, inputs: MoEInputs, cfg: MoEConfig) -> Prepared:
        x_TH, logits_TE = super().prepare(inputs)
        weights_TK, ids_TK = inputs.topk_weights, inputs.topk_ids
        if ids_TK is not None:
            top_k = ids_TK.shape[-1]  # not -1: a zero-token batch has no size to infer
            weights_TK = weights_TK.reshape(x_TH.shape[0], top_k).float()
            ids_TK = ids_TK.reshape(x_TH.shape[0], top_k).to(torch.int32)
        comm = resolve_comm(cfg.parallel)
        dispatcher = resolve_dispatcher(cfg, comm)
        verify_agreement(comm, cfg, inputs, dispatcher)  # before any data moves: errors, not hangs
        rows_in = x_TH.shape[0]
        if dispatcher is DispatcherType.DYNAMIC:
            from moe_compile.lowering.npu_dynamic import split_tokens

            if cfg.parallel.tokens_full:
                x_TH, logits_TE, weights_TK, ids_TK = split_tokens(comm, x_TH, logits_TE, weights_TK, ids_TK)
        elif comm.mode is not CommMode.NONE and not cfg.parallel.tokens_full:
            x_TH, logits_TE, weights_TK, ids_TK = (
                None if t is None else all_gather(t, comm) for t in (x_TH, logits_TE, weights_TK, ids_TK))
        return Prepared(x_TH, logits_TE, weights_TK, ids_TK, comm, dispatcher, rows_in)

    # -- select_experts -------------------------------------------------------------------------
    def select_experts(self, logits_TE: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None):
        return select_experts_npu(logits_TE, cfg, bias)

    # -- dispatch (static) ----------------------------------------------------------------------
    def dispatch(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, num_experts: int, num_local: int,
                 comm: Comm) -> StaticDispatch:
        torch_npu = import_torch_npu()
        start = comm.rank * num_local if comm.mode is CommMode.EP else 0
        num_pairs = ids_TK.shape[0] * ids_TK.shape[1]
        # MindIE-SD passes active_num = T*K; -1 ("all valid rows") is the same for a symbolic T.
        active_num = num_pairs if isinstance(num_pairs, int) else -1
        x_RH, row_idx_P, counts, _ = torch_npu.npu_moe_init_routing_v2(
            x_TH, ids_TK, active_num=active_num, expert_num=num_experts,
            expert_tokens_num_type=EXPERT_TOKENS_COUNT, expert_tokens_num_flag=True, quant_mode=-1,
            active_expert_range=[start, start + num_local], row_idx_type=0,
        )
        return StaticDispatch(x_RH, row_idx_P, counts)

    # -- mlp ------------------------------------------------------------------------------------
    def mlp(self, x_RH: torch.Tensor, group_list: torch.Tensor, weights: ExpertWeights,
            cfg: ExpertsConfig) -> torch.Tensor:
        """Rows past ``sum(group_list)`` are undefined in the result (the GEMMs do not compute them)."""
        h_RN = self._grouped_matmul(x_RH, weights.w13, weights.w13_bias, group_list)
        return self._grouped_matmul(self.activation(h_RN, cfg), weights.w2, weights.w2_bias, group_list)

    def _grouped_matmul(self, x_RK, w_EKN, bias_EN, group_list):
        torch_npu = import_torch_npu()
        # w_EKN may be a transposed view of an [E, N, K] weight: the op takes it without a copy.
        bias = None if bias_EN is None else [self.layouts.gmm_bias(bias_EN, x_RK.dtype)]
        return torch_npu.npu_grouped_matmul(
            [x_RK], [w_EKN], bias=bias, group_list=group_list, split_item=2, group_type=0,
            group_list_type=GROUP_LIST_COUNTS,
        )[0]

    def activation(self, h_RN: torch.Tensor, cfg: ExpertsConfig) -> torch.Tensor:
        return npu_activation(h_RN, cfg)  # npu_swiglu, or elementwise ops GE converts (npu_activation.py)

    # -- combine (static) -----------------------------------------------------------------------
    def combine(self, y_RH: torch.Tensor, row_idx_P: torch.Tensor, weights_TK: torch.Tensor | None,
                num_tokens: int, top_k: int) -> torch.Tensor:
        """``out[t] = sum_k w[t,k] * y[row(t,k)]`` over the pairs on this rank, fp32 -> ``y``'s dtype.

        Never reads an undefined row into the sum: pairs of other ranks' experts (row -1) take a
        placeholder row that ``where`` *selects away* (a select, unlike MindIE-SD's
        ``abs(row_idx)`` with weight 0, lets no NaN/Inf of an undefined row through: 0*NaN = NaN,
        notes §1.5, §5). Built from aten ops only, because ``npu_moe_token_unpermute`` has no GE
        converter and ``npu_moe_finalize_routing``'s -1 handling and accuracy are disputed (§2.8).
        """
        valid_P = row_idx_P >= 0
        safe_P = torch.where(valid_P, row_idx_P, torch.zeros_like(row_idx_P)).long()
        rows_PH = torch.index_select(y_RH, 0, safe_P).float()
        rows_PH = torch.where(valid_P.unsqueeze(-1), rows_PH, torch.zeros_like(rows_PH))
        rows_TKH = rows_PH.view(num_tokens, top_k, y_RH.shape[-1])
        if weights_TK is not None:
            rows_TKH = rows_TKH * weights_TK.float().unsqueeze(-1)
        return rows_TKH.sum(dim=1).to(y_RH.dtype)

    # -- finalize -------------------------------------------------------------------------------
    def finalize_npu(self, out_TH: torch.Tensor, prepared: Prepared, inputs: MoEInputs,
                     cfg: MoEConfig) -> torch.Tensor:
        comm = prepared.comm
        if comm.mode is not CommMode.NONE:
            if not cfg.parallel.tokens_full:
                out_TH = reduce_scatter(out_TH, comm)
            elif cfg.parallel.reduce_results:
                out_TH = all_reduce(out_TH, comm)
            # else: the per-rank partial sum; the caller reduces (reduce_results=False)
        return out_TH.view(inputs.hidden_states.shape)

    # -- the pipeline ---------------------------------------------------------------------------
    def run(self, inputs: MoEInputs, cfg: MoEConfig) -> torch.Tensor:
        inputs = tp_rank_inputs(inputs, cfg)
        prepared = self.prepare_npu(inputs, cfg)
        if prepared.ids_TK is None:
            weights_TK, ids_TK = self.select_experts(prepared.logits_TE, cfg.routing, inputs.e_score_correction_bias)
        else:
            weights_TK, ids_TK = prepared.weights_TK, prepared.ids_TK
        if prepared.dispatcher is DispatcherType.DYNAMIC:
            from moe_compile.lowering.npu_dynamic import run_dynamic

            return run_dynamic(self, prepared, weights_TK, ids_TK, inputs, cfg)
        x_TH = prepared.x_TH
        if cfg.experts.apply_router_weight_on_input:  # Llama-4: the (top-1) weight scales the input
            x_TH = x_TH * weights_TK.to(x_TH.dtype)
        num_local = inputs.weights.w13.shape[0]
        disp = self.dispatch(x_TH, ids_TK, cfg.routing.num_experts, num_local, prepared.comm)
        y_RH = self.mlp(disp.x_RH, disp.group_list, inputs.weights, cfg.experts)
        combine_weights = None if cfg.experts.apply_router_weight_on_input else weights_TK
        out_TH = self.combine(y_RH, disp.row_idx_P, combine_weights, ids_TK.shape[0], ids_TK.shape[1])
        return self.finalize_npu(out_TH, prepared, inputs, cfg)


_logged_batched = False


def resolve_dispatcher(cfg: MoEConfig, comm: Comm) -> DispatcherType:
    """MindIE-SD's rule (notes §1.3): static unless EP; under EP dynamic iff top_k < ep size."""
    global _logged_batched
    requested = cfg.parallel.dispatcher_type
    if requested is DispatcherType.DYNAMIC:
        if comm.mode is not CommMode.EP:
            raise ValueError("dispatcher_type='dynamic' needs an ep_group of size > 1 (dynamic dispatch is EP-only)")
        return DispatcherType.DYNAMIC
    if requested is DispatcherType.BATCHED:
        if not _logged_batched:
            _logged_batched = True
            log.info("npu lowering: dispatcher_type='batched' runs the static dispatcher, which is already "
                     "free of host synchronisation (init_routing_v2 with active_expert_range)")
        return DispatcherType.STATIC
    if requested is DispatcherType.STATIC or comm.mode is not CommMode.EP:
        return DispatcherType.STATIC
    return DispatcherType.DYNAMIC if cfg.routing.top_k < comm.size else DispatcherType.STATIC
