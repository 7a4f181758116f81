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
from moe_compile.modular.slots import local_expert_ids, sorted_pairs
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
        pairs = sorted_pairs(topk_ids, num_local, expert_map)
        order = pairs.order
        key_S = pairs.key[order]  # num_local for the rows of other ranks' pairs (sorted last)
        token_of_row = order // topk
        x_SK = _scratch(workspace13, order.numel(), hidden_states.shape[1])
        torch.index_select(hidden_states, 0, token_of_row, out=x_SK)
        has_bias = weights.w13_bias is not None or weights.w2_bias is not None
        expert_S = key_S.clamp(max=num_local - 1) if has_bias else None
        # rows past the last offset (other ranks' pairs, or ids past the local experts) stay
        # undefined through both GEMMs and are dropped once, in the combine below
        h_SN = grouped_mm(x_SK, weights.w13, pairs.offsets, zero_rest=False)
        if weights.w13_bias is not None:
            h_SN = h_SN + weights.w13_bias[expert_S]
        y_SK = grouped_mm(apply_activation(h_SN, self.config), weights.w2, pairs.offsets, zero_rest=False)
        if weights.w2_bias is not None:
            y_SK = y_SK + weights.w2_bias[expert_S]
        # weight the rows in expert order and sum each token's rows in fp32 (index_add_: in order on
        # the CPU; on a GPU, atomics unless torch.use_deterministic_algorithms). Rows that are not
        # this rank's (undefined, maybe NaN) go to a sink row past the tokens, so no pass over
        # [P, K] masks them
        sink_S = torch.where(key_S < num_local, token_of_row, num_tokens)
        rows_SK = y_SK if y_SK.dtype == torch.float32 else y_SK.float()
        if not apply_router_weight_on_input:
            rows_SK.mul_(topk_weights.reshape(-1).float()[order].unsqueeze(-1))
        sum_TK = torch.zeros(num_tokens + 1, y_SK.shape[1], dtype=torch.float32, device=y_SK.device)
        sum_TK.index_add_(0, sink_S, rows_SK)
        output.copy_(sum_TK[:num_tokens])


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
