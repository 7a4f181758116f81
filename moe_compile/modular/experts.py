"""PermuteExpertsUnpermute implementations in plain torch (they run on any device).

- ``ReferenceExperts``: a loop over experts (the readable oracle); unpermuted rows, weighting
  left to finalize (Contiguous).
- ``GroupedExperts``: sort the (token, k) pairs by expert, two grouped GEMMs, weight and
  scatter-add back in one pass (NoOp); no Python loop over tokens.
- ``BatchedExperts``: ``[E, max_tokens, K]`` in, two batched GEMMs, same format out (Delegate).
"""
from __future__ import annotations

import torch

from moe_compile.kernels.grouped_mm import grouped_mm
from moe_compile.modular.base import ActivationFormat, ExpertWeights, PermuteExpertsUnpermute, WorkspaceShapes
from moe_compile.modular.slots import batched_slots, local_expert_ids
from moe_compile.modular.weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
)
from moe_compile.ops.activation import apply_activation, intermediate_size


def _scratch(workspace: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous ``[rows, cols]`` view at the start of a workspace."""
    return workspace.view(-1)[: rows * cols].view(rows, cols)


class ReferenceExperts(PermuteExpertsUnpermute):
    @staticmethod
    def activation_formats():
        return ActivationFormat.STANDARD, ActivationFormat.STANDARD

    def supports_chunking(self) -> bool:
        return True

    def supports_expert_map(self) -> bool:
        return True

    def workspace_shapes(self, *, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        n_act = intermediate_size(N, self.config.activation)
        return WorkspaceShapes((M * topk, max(N, K)), (M * topk, n_act), (M, topk, K))

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceContiguous()

    def apply(self, *, output, hidden_states, weights: ExpertWeights, topk_weights, topk_ids,
              global_num_experts, expert_map, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        num_local = weights.w13.shape[0]
        topk = topk_ids.shape[1]
        local = local_expert_ids(topk_ids, num_local, expert_map)
        rows_PK = output.view(-1, output.shape[-1])
        rows_PK.zero_()
        for expert in range(num_local):
            pairs = torch.nonzero(local == expert).squeeze(1)
            if pairs.numel() == 0:
                continue
            x = hidden_states.index_select(0, pairs // topk)
            h = _scratch(workspace13, pairs.numel(), weights.w13.shape[2])
            torch.mm(x, weights.w13[expert], out=h)
            if weights.w13_bias is not None:
                h += weights.w13_bias[expert]
            a = _scratch(workspace2, pairs.numel(), weights.w2.shape[1])
            a.copy_(apply_activation(h, self.config))
            y = a @ weights.w2[expert]
            if weights.w2_bias is not None:
                y += weights.w2_bias[expert]
            rows_PK[pairs] = y


class GroupedExperts(PermuteExpertsUnpermute):
    @staticmethod
    def activation_formats():
        return ActivationFormat.STANDARD, ActivationFormat.STANDARD

    def supports_chunking(self) -> bool:
        return True

    def supports_expert_map(self) -> bool:
        return True

    def workspace_shapes(self, *, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        n_act = intermediate_size(N, self.config.activation)
        # ws13: the expert-sorted input rows; ws2: the activation rows
        return WorkspaceShapes((M * topk, K), (M * topk, n_act), (M, K))

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOp()

    def apply(self, *, output, hidden_states, weights: ExpertWeights, topk_weights, topk_ids,
              global_num_experts, expert_map, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        num_local = weights.w13.shape[0]
        num_tokens, topk = topk_ids.shape
        slots = batched_slots(topk_ids, num_local, expert_map)
        order = slots.order
        token_of_row = order // topk
        x_SK = _scratch(workspace13, order.numel(), hidden_states.shape[1])
        torch.index_select(hidden_states, 0, token_of_row, out=x_SK)
        has_bias = weights.w13_bias is not None or weights.w2_bias is not None
        expert_S = slots.local_expert[order].clamp(min=0) if has_bias else None
        # rows past the last offset (other ranks' pairs, only with an expert_map) stay undefined
        # through both GEMMs and are masked once, in the combine below
        h_SN = grouped_mm(x_SK, weights.w13, slots.offsets, zero_rest=False)
        if weights.w13_bias is not None:
            h_SN = h_SN + weights.w13_bias[expert_S]
        a_SI = _scratch(workspace2, order.numel(), weights.w2.shape[1])
        a_SI.copy_(apply_activation(h_SN, self.config))
        y_SK = grouped_mm(a_SI, weights.w2, slots.offsets, zero_rest=False)
        if weights.w2_bias is not None:
            y_SK = y_SK + weights.w2_bias[expert_S]
        # unpermute with a gather, then weight and sum each token's top-k rows in one batched
        # matmul (fp32): deterministic, no atomics, no [P, K] temporaries for the mask and the
        # weights, and far cheaper on CPU than index_add_ (whose parallel scatter dominated small calls)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y_PK = y_SK.index_select(0, inverse).float()
        scale_P = slots.valid.float()
        if not apply_router_weight_on_input:
            scale_P = scale_P * topk_weights.reshape(-1).float()
        if expert_map is not None:  # other ranks' pairs: rows the grouped GEMM never wrote
            y_PK = torch.where(slots.valid.unsqueeze(-1), y_PK, 0.0)
        out_TK = torch.bmm(scale_P.view(num_tokens, 1, topk), y_PK.view(num_tokens, topk, -1))
        output.copy_(out_TK.view(num_tokens, -1))


class BatchedExperts(PermuteExpertsUnpermute):
    @staticmethod
    def activation_formats():
        return ActivationFormat.BATCHED, ActivationFormat.BATCHED

    def supports_chunking(self) -> bool:
        return False

    def supports_expert_map(self) -> bool:
        return True  # the batched prepare already placed only local pairs

    def workspace_shapes(self, *, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        # M is max_tokens per expert here; rows are [E, max_tokens, ...]
        n_act = intermediate_size(N, self.config.activation)
        return WorkspaceShapes((local_num_experts, M, N), (local_num_experts, M, n_act), (local_num_experts, M, K))

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceDelegate()

    def apply(self, *, output, hidden_states, weights: ExpertWeights, topk_weights, topk_ids,
              global_num_experts, expert_map, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        num_local, max_tokens, _ = hidden_states.shape
        h_EMN = workspace13
        torch.bmm(hidden_states, weights.w13, out=h_EMN)
        if weights.w13_bias is not None:
            h_EMN += weights.w13_bias.unsqueeze(1)
        workspace2.copy_(apply_activation(h_EMN, self.config))
        torch.bmm(workspace2, weights.w2, out=output)
        if weights.w2_bias is not None:
            output += weights.w2_bias.unsqueeze(1)
        counts = expert_tokens_meta.expert_num_tokens.to(torch.long)
        live_EM = torch.arange(max_tokens, device=output.device).unsqueeze(0) < counts.unsqueeze(1)
        output.copy_(torch.where(live_EM.unsqueeze(-1), output, 0))
