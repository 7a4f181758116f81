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
    key: torch.Tensor  # [P] local expert of each pair; E_local for pairs not on this rank
    order: torch.Tensor  # [P] pairs sorted by key, stably (token order within an expert); other ranks' last
    counts: torch.Tensor  # [E_local + 1] int64 pairs per key (the last: other ranks' pairs)
    offsets: torch.Tensor  # [E_local] int32 cumulative counts (end of each expert's rows)


def sorted_pairs(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None = None) -> SortedPairs:
    """The pairs in expert order and each expert's end offset: what a grouped GEMM needs."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    key = torch.where((ids >= 0) & (ids < num_local), ids, num_local)
    order = torch.argsort(key, stable=True)
    if grouped_mm.host_reads_are_free(key.device):  # on a GPU bincount reads the largest key back
        counts = torch.bincount(key, minlength=num_local + 1)
    else:
        counts = torch.zeros(num_local + 1, dtype=torch.long, device=key.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.cumsum(counts[:num_local], 0).to(torch.int32)
    return SortedPairs(key, order, counts, offsets)


def batched_slots(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None = None) -> ExpertSlots:
    """``sorted_pairs`` plus each pair's rank among its expert's pairs (its slot in a batched buffer)."""
    pairs = sorted_pairs(topk_ids, num_local, expert_map)
    key, order, counts = pairs.key, pairs.order, pairs.counts
    valid = key < num_local
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(key.numel(), device=key.device) - starts[key[order]]
    slot = torch.empty_like(position)
    slot[order] = position
    local = torch.where(valid, key, -1)
    return ExpertSlots(local, slot, valid, counts[:num_local].to(torch.int32), order, pairs.offsets)
