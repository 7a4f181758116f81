"""Single-device PrepareAndFinalize implementations (standard and batched formats)."""
from __future__ import annotations

import torch

from moe_compile.modular.base import (
    ActivationFormat,
    ExpertTokensMetadata,
    PrepareAndFinalize,
    PrepareResult,
)
from moe_compile.modular.slots import batched_slots
from moe_compile.modular.weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
)


def weight_input(hidden_states: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Llama-4 style: the router weight scales the expert's input (top-1 only)."""
    if topk_weights.shape[1] != 1:
        raise ValueError(
            "apply_router_weight_on_input needs top_k == 1, but got top_k=%d" % topk_weights.shape[1]
        )
    return hidden_states * topk_weights.to(hidden_states.dtype)


class StandardPrepareAndFinalize(PrepareAndFinalize):
    """No dispatch: the tokens stay where they are; finalize weights and sums the top-k rows."""

    @property
    def activation_format(self):
        return ActivationFormat.STANDARD

    def has_prepare_no_receive(self) -> bool:
        return True  # nothing to wait for; the receiver returns the prepared inputs

    def prepare(self, *, hidden_states, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input):
        if apply_router_weight_on_input:
            hidden_states = weight_input(hidden_states, topk_weights)
        return PrepareResult(hidden_states, topk_weights, topk_ids)

    def finalize(self, *, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce):
        if isinstance(weight_and_reduce, TopKWeightAndReduceDelegate):
            weight_and_reduce = TopKWeightAndReduceContiguous()
        return weight_and_reduce.apply(
            output=output,
            fused_expert_output=fused_expert_output,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )


class BatchedPrepareAndFinalize(PrepareAndFinalize):
    """Scatter the pairs into ``[E_local, max_tokens, K]`` (slot = rank within the expert).

    ``max_tokens`` defaults to the call's token count, the most pairs one expert can receive
    (a token picks distinct experts), so no pair is ever dropped and no host sync is needed.
    """

    def __init__(self, num_local_experts: int, max_num_tokens: int | None = None,
                 expert_map: torch.Tensor | None = None):
        self.num_local_experts = num_local_experts
        self.max_num_tokens = max_num_tokens
        self.expert_map = expert_map

    @property
    def activation_format(self):
        return ActivationFormat.BATCHED

    def max_num_tokens_per_rank(self) -> int | None:
        return self.max_num_tokens

    def prepare(self, *, hidden_states, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input):
        if apply_router_weight_on_input:
            hidden_states = weight_input(hidden_states, topk_weights)
        expert_map = expert_map if expert_map is not None else self.expert_map
        num_tokens, topk = topk_ids.shape
        max_tokens = self.max_num_tokens or num_tokens
        if max_tokens < num_tokens:
            raise ValueError(
                "BatchedPrepareAndFinalize holds %d tokens per expert but got %d tokens"
                % (max_tokens, num_tokens)
            )
        slots = batched_slots(topk_ids, self.num_local_experts, expert_map)
        hidden = hidden_states.shape[1]
        capacity = self.num_local_experts * max_tokens
        buffer = hidden_states.new_zeros(capacity + 1, hidden)  # last row: sink for other ranks' pairs
        row = torch.where(slots.valid, slots.local_expert * max_tokens + slots.slot, capacity)
        token = torch.arange(num_tokens * topk, device=row.device) // topk
        buffer.index_copy_(0, row, hidden_states.index_select(0, token))
        batched = buffer[:capacity].view(self.num_local_experts, max_tokens, hidden)
        meta = ExpertTokensMetadata(slots.expert_num_tokens)
        self._expert_map = expert_map
        return PrepareResult(batched, topk_weights, topk_ids, meta)

    def finalize(self, *, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce):
        if isinstance(weight_and_reduce, TopKWeightAndReduceDelegate):
            weight_and_reduce = TopKWeightAndReduceNaiveBatched(getattr(self, "_expert_map", self.expert_map))
        return weight_and_reduce.apply(
            output=output,
            fused_expert_output=fused_expert_output,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )
