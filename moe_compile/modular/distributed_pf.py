"""PrepareAndFinalize implementations that move tokens over ``torch.distributed``.

::

    static  (TP, EP static)  prepare: [all-gather tokens if sharded]    experts: all local pairs
                             finalize: weight+reduce, then all-reduce (full tokens) or reduce-scatter
    dynamic (EP)             prepare: [take this rank's chunk], exchange counts, all-to-all pair rows
                             finalize: all-to-all rows back, weight+reduce, [all-gather chunks]
    batched (EP, low latency) like dynamic with fixed-capacity [E, cap, H] buffers: equal-split
                             all-to-alls, no host sync (graph-capturable)

TP and EP static share one class: they differ only in what the experts compute (TP: an
intermediate slice of every expert; EP: this rank's experts, others' pairs masked through the
expert map the kernel is given). The dynamic and batched classes place only local pairs, so they
run with ``expert_map=None``. Experts are owned in contiguous ranges: global expert ``e`` lives on
rank ``e // E_local`` (``moe_compile.distributed.sharding.ep_expert_range``).

Names: ``T`` tokens, ``C`` this rank's token chunk, ``P`` (token, k) pairs, ``R`` received rows,
``H`` hidden, ``E`` global experts, ``L`` local experts, ``W`` group size, ``K`` top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_compile.distributed.comm import (
    all_gather_rows,
    all_reduce_,
    all_to_all_rows,
    reduce_scatter_rows,
    token_chunk,
)
from moe_compile.modular.base import ActivationFormat, ExpertTokensMetadata, PrepareAndFinalize, PrepareResult
from moe_compile.modular.prepare_finalize import weight_input
from moe_compile.modular.slots import batched_slots
from moe_compile.modular.weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
)


def _standard_reduce(weight_and_reduce, **kwargs) -> torch.Tensor:
    if isinstance(weight_and_reduce, TopKWeightAndReduceDelegate):
        weight_and_reduce = TopKWeightAndReduceContiguous()
    return weight_and_reduce.apply(**kwargs)


class _GroupPrepareAndFinalize(PrepareAndFinalize):
    def __init__(self, *, group, tokens_full: bool):
        self.group = group
        self.tokens_full = tokens_full
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def num_dispatchers(self) -> int:
        return self.world_size


class StaticPrepareAndFinalize(_GroupPrepareAndFinalize):
    """TP and EP static (MindIE-SD's static dispatcher over a group).

    tokens_full=True: every rank holds all tokens; finalize all-reduces the partial sums when
    ``reduce_results`` (else returns them for the caller to reduce). tokens_full=False: each rank
    holds an even shard; prepare all-gathers tokens, weights and ids, finalize reduce-scatters
    (``reduce_results`` does not apply: the shard owner needs the full sum).
    """

    def __init__(self, *, group, tokens_full: bool, reduce_results: bool = True):
        super().__init__(group=group, tokens_full=tokens_full)
        self.reduce_results = reduce_results

    @property
    def activation_format(self):
        return ActivationFormat.STANDARD

    def output_is_reduced(self) -> bool:
        return not self.tokens_full or self.reduce_results

    def prepare(self, *, hidden_states, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input):
        if apply_router_weight_on_input:
            hidden_states = weight_input(hidden_states, topk_weights)
        if not self.tokens_full:
            hidden_states = all_gather_rows(hidden_states, self.group)
            topk_weights = all_gather_rows(topk_weights, self.group)
            topk_ids = all_gather_rows(topk_ids, self.group)
        return PrepareResult(hidden_states, topk_weights, topk_ids)

    def finalize(self, *, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce):
        out_TH = _standard_reduce(weight_and_reduce, output=output, fused_expert_output=fused_expert_output,
                                  topk_weights=topk_weights, topk_ids=topk_ids,
                                  apply_router_weight_on_input=apply_router_weight_on_input)
        if not self.tokens_full:
            return reduce_scatter_rows(out_TH, self.group)
        if self.reduce_results:
            all_reduce_(out_TH, self.group)
        return out_TH


@dataclass(frozen=True)
class _Chunk:
    """This rank's tokens of a call: ``[start, end)`` of ``num_tokens``, padded to ``chunk`` rows."""

    start: int
    end: int
    chunk: int
    num_tokens: int


def _my_chunk(num_tokens: int, tokens_full: bool, rank: int, world_size: int) -> _Chunk:
    if not tokens_full:
        return _Chunk(0, num_tokens, num_tokens, num_tokens)
    start, end, chunk = token_chunk(num_tokens, rank, world_size)
    return _Chunk(start, end, chunk, num_tokens)


def _gather_chunks(y_CH: torch.Tensor, chunk: _Chunk, group) -> torch.Tensor:
    """Every rank's padded chunk result -> the ``[T, H]`` output on every rank."""
    pad = chunk.chunk - y_CH.shape[0]
    if pad:
        y_CH = torch.cat([y_CH, y_CH.new_zeros(pad, y_CH.shape[1])])
    return all_gather_rows(y_CH, group)[: chunk.num_tokens]


@dataclass(frozen=True)
class _AllToAllState:
    order_P: torch.Tensor  # pairs sorted by global expert (hence by destination rank)
    send_splits: list[int]
    recv_splits: list[int]
    topk_weights: torch.Tensor  # [C, K] of this rank's own tokens
    chunk: _Chunk


class AllToAllPrepareAndFinalize(_GroupPrepareAndFinalize):
    """EP dynamic (MindIE-SD's dynamic dispatcher): pair rows travel to their expert's owner.

    prepare: (tokens_full=True: keep this rank's chunk of the full tokens) -> sort the pairs by
    expert -> exchange per-expert counts (a fixed-size all-to-all) -> the split sizes come to the
    host (the one sync) -> all-to-all the rows. The received rows, in (source rank, local expert)
    order, go to the experts as single-expert tokens (ids local, weight 1). finalize: the expert
    rows go back through the reverse all-to-all, are weighted and summed per token at their source,
    and with tokens_full=True the chunks are all-gathered. ``reduce_results`` is not used (as in
    MindIE-SD): every token's result is complete where it ends up.
    """

    def __init__(self, *, group, tokens_full: bool, num_local_experts: int):
        super().__init__(group=group, tokens_full=tokens_full)
        self.num_local_experts = num_local_experts
        self._state: _AllToAllState | None = None

    @property
    def activation_format(self):
        return ActivationFormat.STANDARD

    def output_is_reduced(self) -> bool:
        return True

    def prepare(self, *, hidden_states, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input):
        chunk = _my_chunk(hidden_states.shape[0], self.tokens_full, self.rank, self.world_size)
        x_CH = hidden_states[chunk.start:chunk.end]
        w_CK, ids_CK = topk_weights[chunk.start:chunk.end], topk_ids[chunk.start:chunk.end]
        if apply_router_weight_on_input:
            x_CH = weight_input(x_CH, w_CK)
        top_k = ids_CK.shape[1]
        ids_P = ids_CK.reshape(-1).long()
        order_P = torch.sort(ids_P, stable=True).indices
        # scatter_add, not bincount: bincount sizes its output from the data (a second host sync)
        send_counts_E = torch.zeros(num_experts, dtype=torch.long, device=ids_P.device)
        send_counts_E.scatter_add_(0, ids_P, torch.ones_like(ids_P))
        recv_counts_WL = all_to_all_rows(send_counts_E.view(self.world_size, self.num_local_experts), self.group)
        # the one host sync of this dispatcher: all_to_all_single takes split sizes as Python ints
        splits = torch.stack([send_counts_E.view(self.world_size, -1).sum(1), recv_counts_WL.sum(1)]).tolist()
        send_splits, recv_splits = splits
        recv_x = all_to_all_rows(x_CH.index_select(0, order_P // top_k), self.group,
                                 send_splits=send_splits, recv_splits=recv_splits)
        local_ids = torch.arange(self.num_local_experts, device=recv_x.device).repeat(self.world_size)
        local_ids_R = torch.repeat_interleave(local_ids, recv_counts_WL.reshape(-1),
                                              output_size=recv_x.shape[0])
        self._state = _AllToAllState(order_P, send_splits, recv_splits, w_CK, chunk)
        ones = torch.ones(recv_x.shape[0], 1, dtype=torch.float32, device=recv_x.device)
        return PrepareResult(recv_x, ones, local_ids_R.to(torch.int32).unsqueeze(1))

    def finalize(self, *, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce):
        state, self._state = self._state, None
        rows_RH = _standard_reduce(weight_and_reduce, output=output, fused_expert_output=fused_expert_output,
                                   topk_weights=topk_weights, topk_ids=topk_ids,
                                   apply_router_weight_on_input=apply_router_weight_on_input)
        back_PH = all_to_all_rows(rows_RH, self.group, send_splits=state.recv_splits,
                                  recv_splits=state.send_splits)
        pairs_PH = torch.empty_like(back_PH)
        pairs_PH.index_copy_(0, state.order_P, back_PH)
        num_tok, top_k = state.topk_weights.shape
        pairs_CKH = pairs_PH.view(num_tok, top_k, back_PH.shape[1]).float()
        if not apply_router_weight_on_input:
            pairs_CKH = pairs_CKH * state.topk_weights.float().unsqueeze(-1)
        y_CH = pairs_CKH.sum(1).to(rows_RH.dtype)
        return _gather_chunks(y_CH, state.chunk, self.group) if self.tokens_full else y_CH


@dataclass(frozen=True)
class _BatchedState:
    pack_index: torch.Tensor  # [W * L * cap] row of each received slot in the packed buffer (sink if empty)
    chunk: _Chunk


class BatchedAllToAllPrepareAndFinalize(_GroupPrepareAndFinalize):
    """EP low-latency: fixed-capacity per-expert buffers, batched format, no host sync.

    Each rank lays its pairs out as ``[E, cap, H]`` (slot = the pair's rank among its expert's
    pairs, as ``BatchedPrepareAndFinalize`` does), which is ``[W, L, cap, H]`` by destination, and
    exchanges it with an equal-split all-to-all, with the per-expert counts beside it. The receiver
    packs each local expert's valid rows to the front: ``[L, W * cap, H]`` with
    ``expert_num_tokens`` -- the batched experts' format. finalize reverses the packing and the
    all-to-all and weights the rows per token (``TopKWeightAndReduceNaiveBatched`` over all E).

    ``cap`` (``max_num_tokens``) defaults to this rank's token chunk, the most pairs one expert can
    get from one rank; it must be equal on all ranks. tokens_full=True pads every chunk to
    ``ceil(T / W)`` tokens with pairs that go nowhere, so every shape is static.
    """

    def __init__(self, *, group, tokens_full: bool, num_local_experts: int, max_num_tokens: int | None = None):
        super().__init__(group=group, tokens_full=tokens_full)
        self.num_local_experts = num_local_experts
        self.max_num_tokens = max_num_tokens
        self._state: _BatchedState | None = None

    @property
    def activation_format(self):
        return ActivationFormat.BATCHED

    def max_num_tokens_per_rank(self) -> int | None:
        return self.max_num_tokens

    def output_is_reduced(self) -> bool:
        return True

    def _chunk_inputs(self, hidden_states, topk_weights, topk_ids, chunk: _Chunk):
        x, w, ids = (t[chunk.start:chunk.end] for t in (hidden_states, topk_weights, topk_ids))
        pad = chunk.chunk - x.shape[0]
        if pad:  # padded pairs get id -1: no expert, weight 0
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
            ids = torch.cat([ids, ids.new_full((pad, ids.shape[1]), -1)])
        return x, w, ids

    def prepare(self, *, hidden_states, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input):
        chunk = _my_chunk(hidden_states.shape[0], self.tokens_full, self.rank, self.world_size)
        x_CH, w_CK, ids_CK = self._chunk_inputs(hidden_states, topk_weights, topk_ids, chunk)
        if apply_router_weight_on_input:
            x_CH = weight_input(x_CH, w_CK)
        cap = self.max_num_tokens or x_CH.shape[0]
        if cap < x_CH.shape[0]:
            raise ValueError(f"BatchedAllToAllPrepareAndFinalize holds max_num_tokens={cap} tokens per "
                             f"expert and rank but this rank has {x_CH.shape[0]} tokens.")
        hidden, top_k = x_CH.shape[1], ids_CK.shape[1]
        slots = batched_slots(ids_CK, num_experts, None)
        sink = num_experts * cap
        send = x_CH.new_zeros(sink + 1, hidden)
        row_P = torch.where(slots.valid, slots.local_expert * cap + slots.slot, sink)
        token_P = torch.arange(row_P.numel(), device=row_P.device) // top_k
        send.index_copy_(0, row_P, x_CH.index_select(0, token_P))
        recv = all_to_all_rows(send[:sink], self.group)
        recv_counts_WL = all_to_all_rows(slots.expert_num_tokens.view(self.world_size, -1), self.group)
        pack_index = self._pack_index(recv_counts_WL, cap)
        packed = recv.new_zeros(pack_index.numel() + 1, hidden)
        packed.index_copy_(0, pack_index, recv)  # empty slots all land on the sink row
        batched = packed[:-1].view(self.num_local_experts, self.world_size * cap, hidden)
        meta = ExpertTokensMetadata(recv_counts_WL.sum(0).to(torch.int32))
        self._state = _BatchedState(pack_index, chunk)
        return PrepareResult(batched, w_CK, ids_CK, meta)

    def _pack_index(self, recv_counts_WL: torch.Tensor, cap: int) -> torch.Tensor:
        """Received slot ``(src, e, j)`` -> row ``e * W cap + (rows of e from sources < src) + j``."""
        world, local = self.world_size, self.num_local_experts
        counts = recv_counts_WL.long()
        before_WL = torch.cumsum(counts, 0) - counts
        j = torch.arange(cap, device=counts.device)
        valid_WLC = j.view(1, 1, cap) < counts.unsqueeze(-1)
        row_WLC = (torch.arange(local, device=counts.device).view(1, local, 1) * (world * cap)
                   + before_WL.unsqueeze(-1) + j.view(1, 1, cap))
        return torch.where(valid_WLC, row_WLC, local * world * cap).reshape(-1)

    def finalize(self, *, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce):
        state, self._state = self._state, None
        if not isinstance(weight_and_reduce, (TopKWeightAndReduceDelegate, TopKWeightAndReduceNaiveBatched)):
            raise ValueError(f"BatchedAllToAllPrepareAndFinalize combines batched expert rows itself and "
                             f"cannot apply {type(weight_and_reduce).__name__}; expected batched experts "
                             f"that delegate the weight-and-reduce.")
        hidden = fused_expert_output.shape[-1]
        flat = fused_expert_output.reshape(-1, hidden)
        flat = torch.cat([flat, flat.new_zeros(1, hidden)])  # the sink row reads back as zeros
        back = all_to_all_rows(flat.index_select(0, state.pack_index), self.group)
        num_experts = self.world_size * self.num_local_experts
        rows_ECH = back.view(num_experts, state.pack_index.numel() // num_experts, hidden)
        y_CH = TopKWeightAndReduceNaiveBatched(None).apply(
            output=output, fused_expert_output=rows_ECH, topk_weights=topk_weights, topk_ids=topk_ids,
            apply_router_weight_on_input=apply_router_weight_on_input)
        return _gather_chunks(y_CH, state.chunk, self.group) if self.tokens_full else y_CH


# -- registry entries (this module is one of registry.PLUGIN_MODULES) ---------------------------
def _distributed_ready() -> tuple[bool, str]:
    if not dist.is_available():
        return False, "torch.distributed is not available in this build"
    if not dist.is_initialized():
        return False, "torch.distributed is not initialised (init_process_group first)"
    return True, ""


def _group_of(ctx, *, ep_only: bool):
    from moe_compile.distributed.groups import resolve_group

    name = ctx.ep_group_name or (None if ep_only else ctx.tp_group_name)
    if name is None:
        wanted = "ep_group_name" if ep_only else "ep_group_name or tp_group_name"
        raise ValueError(f"this PrepareAndFinalize needs BuildContext.{wanted} (the group's name).")
    return resolve_group(name)


def _register() -> None:
    from moe_compile.modular.registry import register_prepare_finalize

    common = dict(min_world_size=2, requires=_distributed_ready)
    register_prepare_finalize(
        "StaticPrepareAndFinalize", activation_format=ActivationFormat.STANDARD, **common,
        factory=lambda ctx: StaticPrepareAndFinalize(group=_group_of(ctx, ep_only=False), tokens_full=True))
    register_prepare_finalize(
        "AllToAllPrepareAndFinalize", activation_format=ActivationFormat.STANDARD, **common,
        factory=lambda ctx: AllToAllPrepareAndFinalize(group=_group_of(ctx, ep_only=True), tokens_full=True,
                                                       num_local_experts=ctx.num_local_experts))
    register_prepare_finalize(
        "BatchedAllToAllPrepareAndFinalize", activation_format=ActivationFormat.BATCHED, **common,
        factory=lambda ctx: BatchedAllToAllPrepareAndFinalize(
            group=_group_of(ctx, ep_only=True), tokens_full=True, num_local_experts=ctx.num_local_experts,
            max_num_tokens=ctx.max_num_tokens))


_register()
