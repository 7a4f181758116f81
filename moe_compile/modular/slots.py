"""Where each (token, k) pair lands when tokens are grouped by expert; no host synchronisation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_compile.kernels import grouped_mm


@dataclass(frozen=True)
class ExpertSlots:
    local_expert: torch.Tensor  # [P] local expert of each pair (-1 when not on this rank)
    slot: torch.Tensor  # [P] rank of the pair among its expert's pairs, in token order
    valid: torch.Tensor  # [P] bool
    expert_num_tokens: torch.Tensor  # [E_local] int32
    order: torch.Tensor  # [P] pairs sorted by (expert, token); invalid pairs last
    offsets: torch.Tensor  # [E_local] int32 cumulative counts (end of each expert's rows)


def local_expert_ids(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global ids -> local ids (``-1`` for experts other ranks own)."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    return torch.where((ids >= 0) & (ids < num_local), ids, -1)


@dataclass(frozen=True)
class SortedPairs:
    order: torch.Tensor  # [P] pairs sorted by (local expert, token); other ranks' pairs last
    offsets: torch.Tensor  # [E_local] int32 cumulative counts (end of each expert's rows)
    valid: torch.Tensor  # [P] bool


def sorted_pairs(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None = None) -> SortedPairs:
    """Only what a grouped GEMM needs: the expert order of the pairs and each expert's end offset
    (``batched_slots`` also ranks each pair within its expert, which costs four more passes)."""
    local = local_expert_ids(topk_ids, num_local, expert_map)
    valid = local >= 0
    key = torch.where(valid, local, num_local)
    order = torch.argsort(key, stable=True)
    if grouped_mm.host_reads_are_free(key.device):  # on a GPU bincount reads the largest key back
        counts = torch.bincount(key, minlength=num_local + 1)
    else:
        counts = torch.zeros(num_local + 1, dtype=torch.long, device=key.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.cumsum(counts[:num_local], 0).to(torch.int32)
    return SortedPairs(order, offsets, valid)


def batched_slots(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None = None) -> ExpertSlots:
    local = local_expert_ids(topk_ids, num_local, expert_map)
    valid = local >= 0
    key = torch.where(valid, local, num_local)
    _, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    sorted_key = key[order]
    position = torch.arange(key.numel(), device=key.device) - starts[sorted_key]
    slot = torch.empty_like(position)
    slot[order] = position
    expert_num_tokens = counts[:num_local].to(torch.int32)
    offsets = torch.cumsum(counts[:num_local], 0).to(torch.int32)
    return ExpertSlots(local, slot, valid, expert_num_tokens, order, offsets)
