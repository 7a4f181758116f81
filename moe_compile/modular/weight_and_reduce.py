"""The four TopKWeightAndReduce variants."""
from __future__ import annotations

import torch

from moe_compile.modular.base import TopKWeightAndReduce
from moe_compile.modular.slots import batched_slots


def _into(output: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if output is None:
        return result
    if output.data_ptr() != result.data_ptr():
        output.copy_(result)
    return output


class TopKWeightAndReduceNoOp(TopKWeightAndReduce):
    """The experts already weighted and reduced: ``[M, K]`` passes through."""

    def apply(self, *, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        return _into(output, fused_expert_output.view(-1, fused_expert_output.shape[-1]))


class TopKWeightAndReduceContiguous(TopKWeightAndReduce):
    """Unpermuted rows ``[M, topk, K]`` (or ``[M*topk, K]``) -> weighted sum ``[M, K]``."""

    def apply(self, *, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        num_tokens, topk = topk_ids.shape
        rows_MTK = fused_expert_output.view(num_tokens, topk, fused_expert_output.shape[-1])
        if apply_router_weight_on_input:
            reduced = rows_MTK.float().sum(dim=1)
        else:
            reduced = (rows_MTK.float() * topk_weights.float().unsqueeze(-1)).sum(dim=1)
        return _into(output, reduced.to(fused_expert_output.dtype))


class TopKWeightAndReduceNaiveBatched(TopKWeightAndReduce):
    """Batched rows ``[E_local, max_tokens, K]`` -> per-token weighted sum ``[M, K]``.

    A (token, k) pair's row is found again from ``topk_ids`` alone: the slot is the pair's rank
    among the pairs of its expert in token order, exactly as the batched prepare laid them out.
    """

    def __init__(self, expert_map: torch.Tensor | None = None):
        self.expert_map = expert_map

    def apply(self, *, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        num_local, max_tokens, hidden = fused_expert_output.shape
        num_tokens, topk = topk_ids.shape
        slots = batched_slots(topk_ids, num_local, self.expert_map)
        flat_rows = fused_expert_output.reshape(num_local * max_tokens, hidden)
        row_index = (slots.local_expert.clamp(min=0) * max_tokens + slots.slot.clamp(max=max_tokens - 1))
        rows_PK = flat_rows.index_select(0, row_index).float()
        scale_P = slots.valid.float()
        if not apply_router_weight_on_input:
            scale_P = scale_P * topk_weights.reshape(-1).float()
        rows_PK = torch.where(slots.valid.unsqueeze(-1), rows_PK, 0.0) * scale_P.unsqueeze(-1)
        reduced = rows_PK.view(num_tokens, topk, hidden).sum(dim=1)
        return _into(output, reduced.to(fused_expert_output.dtype))


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    """'Let the PrepareAndFinalize decide': finalize replaces it with its own default."""

    def apply(self, **kwargs):
        raise RuntimeError(
            "TopKWeightAndReduceDelegate must be replaced by the PrepareAndFinalize's own "
            "weight-and-reduce before it is applied"
        )
