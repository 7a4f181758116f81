"""Group the (token, k) pairs by expert with no host synchronisation and no padded buffers.

Up to ``SORT_MAX_PAIRS`` pairs without a row gather (``align_method`` picks), ``sort``: one
program histograms the pairs' experts (counts, offsets) and sorts the keys
``expert * P_PAD + pair``, which gives the expert-ordered pair list directly, pairs of one expert
in pair order (the row order is the same on every run), and its inverse ``pos``; no memset.

More pairs without the gather, ``blocks`` while its count table is small (``BLOCKS_MAX_TABLE``):

1. ``_block_hist_kernel``: each block of pairs histograms its experts into row ``i`` of a
   ``[blocks, E]`` table (every entry written, so no memset);
2. ``_block_scatter_kernel``: each block sorts its pairs by ``(expert, pair)`` and places them
   after the rows of the experts before theirs and of the blocks before it (both read off the
   table): the stable order again, the same on every call. Optionally it gathers the rows too.

Beyond that, or with the gather, ``two_launch`` (plus a memset of the ``E`` counters):

1. ``_count_kernel``: each pair takes a ticket from its expert's counter (``atomic_add`` returns
   the pair's rank among that expert's pairs); pairs of experts that are not local (``expert_map``
   gives -1) get rank -1.
2. ``_scatter_kernel``: every program derives the experts' start rows from the ``E`` counts
   (exclusive prefix sum), puts each pair at ``start[expert] + rank`` and records the inverse
   permutation ``pos`` (-1 for non-local pairs); program 0 also writes the inclusive offsets that
   ``torch._grouped_mm`` takes. Optionally the same pass gathers the token rows into expert order
   (the grid's second axis splits the row copy over H, about 512 columns per program).

The sorted list is exactly ``P`` long: there is no per-expert block padding. GEMM kernels find
their expert and row range from the counts themselves (``gemm.py``), so partial blocks are masked,
never materialised. On the ``two_launch`` path ranks inside one expert follow atomic order, so the
order of rows within an expert may change from run to run; every row is computed on its own, so
results do not.

``align_reference`` is the plain-torch version (stable order), built on ``modular.slots``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_compile.kernels.triton import cdiv, next_pow2
from moe_compile.kernels.triton.launch import launch
from moe_compile.kernels.triton.pdl import pdl_enter, pdl_launch
from moe_compile.modular.slots import batched_slots


@dataclass(frozen=True)
class Alignment:
    sorted_pair: torch.Tensor  # [P] int32: pair index (t * k + j) at each expert-ordered row
    pos: torch.Tensor  # [P] int32: row of each pair in expert order; -1 when not local
    counts: torch.Tensor  # [E_local] int32
    offsets: torch.Tensor  # [E_local] int32 inclusive prefix sum of counts
    x_sorted: torch.Tensor | None = None  # [P, H] token rows in expert order (when gathered)


@triton.jit
def _local_expert(ids_ptr, map_ptr, p, pmask, E_local, HAS_MAP: tl.constexpr):
    e = tl.load(ids_ptr + p, mask=pmask, other=-1)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=pmask & (e >= 0), other=-1)
    valid = pmask & (e >= 0) & (e < E_local)
    return tl.where(valid, e, -1), valid


@triton.jit
def _copy_rows(x_ptr, xs_ptr, token, row, valid, hid, H, CHUNK_H, stride_x, stride_xs, BLOCK_H: tl.constexpr):
    """The row gather: ``xs[row] = x[token]`` for the valid lanes, columns ``[hid * CHUNK_H,
    (hid + 1) * CHUNK_H)``."""
    src = x_ptr + token[:, None].to(tl.int64) * stride_x
    dst = xs_ptr + row[:, None].to(tl.int64) * stride_xs
    h_end = tl.minimum(H, (hid + 1) * CHUNK_H)
    for h0 in range(hid * CHUNK_H, h_end, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[None, :]
        m = valid[:, None] & (h < h_end)
        tl.store(dst + h, tl.load(src + h, mask=m), mask=m)


@triton.jit
def _sort_align_kernel(ids_ptr, map_ptr, counts_ptr, sorted_ptr, pos_ptr, offsets_ptr, P, E_local,
                       HAS_MAP: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr = False):
    """All ``P <= P_PAD`` pairs in one program: histogram -> counts/offsets, sort -> permutation.
    Non-local pairs (and the padding lanes) take bucket ``E_PAD``, so they sort after every local
    pair and fall in a histogram bin that is never stored."""
    pdl_enter(PDL)
    p = tl.arange(0, P_PAD)
    e, valid = _local_expert(ids_ptr, map_ptr, p, p < P, E_local, HAS_MAP)
    bucket = tl.where(valid, e, E_PAD)
    counts = tl.histogram(bucket, 2 * E_PAD)
    b = tl.arange(0, 2 * E_PAD)
    tl.store(counts_ptr + b, counts, mask=b < E_local)
    tl.store(offsets_ptr + b, tl.cumsum(counts, 0), mask=b < E_local)
    key = tl.sort(bucket * P_PAD + p)
    pair = key % P_PAD
    local = key < E_PAD * P_PAD
    tl.store(sorted_ptr + p, pair, mask=local)  # row p of the expert order holds pair `pair`
    tl.store(pos_ptr + pair, tl.where(local, p, -1), mask=pair < P)


@triton.jit
def _count_kernel(ids_ptr, map_ptr, counts_ptr, rank_ptr, P, E_local,
                  HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pmask = p < P
    e, valid = _local_expert(ids_ptr, map_ptr, p, pmask, E_local, HAS_MAP)
    rank = tl.atomic_add(counts_ptr + tl.where(valid, e, 0), 1, mask=valid, sem="relaxed")
    tl.store(rank_ptr + p, tl.where(valid, rank, -1), mask=pmask)


@triton.jit
def _scatter_kernel(ids_ptr, map_ptr, counts_ptr, rank_ptr, sorted_ptr, pos_ptr, offsets_ptr,
                    x_ptr, xs_ptr, P, E_local, H, CHUNK_H, stride_x, stride_xs,
                    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, GATHER: tl.constexpr,
                    E_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``(i, j)``: pairs block ``i``; the ``j == 0`` programs write the permutation, and
    with ``GATHER`` program ``j`` copies columns ``[j * CHUNK_H, (j + 1) * CHUNK_H)`` of the rows."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    hid = tl.program_id(1)
    eo = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + eo, mask=eo < E_local, other=0)
    ends = tl.cumsum(counts, 0)
    starts = ends - counts
    p = pid * BLOCK + tl.arange(0, BLOCK)
    pmask = p < P
    e, valid = _local_expert(ids_ptr, map_ptr, p, pmask, E_local, HAS_MAP)
    rank = tl.load(rank_ptr + p, mask=pmask, other=0)
    start = tl.sum(tl.where(eo[None, :] == e[:, None], starts[None, :], 0), axis=1)
    row = start + rank
    if hid == 0:
        if pid == 0:
            tl.store(offsets_ptr + eo, ends, mask=eo < E_local)
        tl.store(sorted_ptr + row, p, mask=valid)
        tl.store(pos_ptr + p, tl.where(valid, row, -1), mask=pmask)
    if GATHER:
        _copy_rows(x_ptr, xs_ptr, p // TOP_K, row, valid, hid, H, CHUNK_H, stride_x, stride_xs, BLOCK_H)


@triton.jit
def _block_hist_kernel(ids_ptr, map_ptr, table_ptr, P, E_local, HAS_MAP: tl.constexpr, E_PAD: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Row ``pid`` of the ``[NB, E_PAD]`` table: how many of pairs block ``pid`` each local expert
    takes (every entry written: no memset)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    p = pid * BLOCK + tl.arange(0, BLOCK)
    e, valid = _local_expert(ids_ptr, map_ptr, p, p < P, E_local, HAS_MAP)
    hist = tl.histogram(tl.where(valid, e, E_PAD), 2 * E_PAD)
    b = tl.arange(0, 2 * E_PAD)
    tl.store(table_ptr + pid * E_PAD + b, hist, mask=b < E_PAD)


@triton.jit
def _block_scatter_kernel(ids_ptr, map_ptr, table_ptr, counts_ptr, sorted_ptr, pos_ptr, offsets_ptr,
                          x_ptr, xs_ptr, P, E_local, NB, H, CHUNK_H, stride_x, stride_xs,
                          TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, GATHER: tl.constexpr, E_PAD: tl.constexpr,
                          NB_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Program ``(i, j)``: pairs block ``i`` sorted by ``(expert, pair)``; its rows start where the
    experts before it and the blocks before it (the table) end, so the order is the stable one.
    ``j == 0`` writes the permutation (program ``(0, 0)`` the counts and offsets); with ``GATHER``
    program ``j`` copies columns ``[j * CHUNK_H, (j + 1) * CHUNK_H)`` of the rows."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    hid = tl.program_id(1)
    rb = tl.arange(0, NB_PAD)
    eo = tl.arange(0, E_PAD)
    table = tl.load(table_ptr + rb[:, None] * E_PAD + eo[None, :], mask=(rb < NB)[:, None], other=0)
    totals = tl.sum(table, axis=0)
    ends = tl.cumsum(totals, 0)
    before = tl.sum(tl.where((rb < pid)[:, None], table, 0), axis=0)
    mine = tl.sum(tl.where((rb == pid)[:, None], table, 0), axis=0)
    # sorted slot s of expert e lands on row ends[e] - totals[e] + before[e] + (s - first slot of e)
    base = ends - totals + before - (tl.cumsum(mine, 0) - mine)
    i = tl.arange(0, BLOCK)
    e, valid = _local_expert(ids_ptr, map_ptr, pid * BLOCK + i, pid * BLOCK + i < P, E_local, HAS_MAP)
    key = tl.sort(tl.where(valid, e, E_PAD) * BLOCK + i)
    bucket = key // BLOCK
    pair = pid * BLOCK + key % BLOCK
    local = bucket < E_PAD
    row = tl.sum(tl.where(eo[None, :] == bucket[:, None], base[None, :], 0), axis=1) + i
    if hid == 0:
        if pid == 0:
            tl.store(counts_ptr + eo, totals, mask=eo < E_local)
            tl.store(offsets_ptr + eo, ends, mask=eo < E_local)
        tl.store(sorted_ptr + row, pair, mask=local)
        tl.store(pos_ptr + pair, tl.where(local, row, -1), mask=pair < P)
    if GATHER:
        _copy_rows(x_ptr, xs_ptr, pair // TOP_K, row, local, hid, H, CHUNK_H, stride_x, stride_xs, BLOCK_H)


def _check_ids(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a 2-D tensor [T, k], but got {getattr(topk_ids, 'shape', topk_ids)}.")
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise TypeError(f"topk_ids must be contiguous int32, but got {topk_ids.dtype} (contiguous="
                        f"{topk_ids.is_contiguous()}).")
    if num_local < 1:
        raise ValueError(f"num_local must be >= 1, but got {num_local}.")
    if expert_map is not None and (expert_map.dtype != torch.int32 or expert_map.dim() != 1):
        raise TypeError(f"expert_map must be a 1-D int32 tensor, but got {expert_map.dtype} {tuple(expert_map.shape)}.")


# one-program sort up to this many pairs (no row gather); beyond, the two launches are faster.
# H200, CUDA graphs (benchmarks/bench_align_combine.py --only align, results/align_combine.json):
# 256 pairs 2.9-3.3 us vs 5.7-5.9; 512 pairs 3.6 vs 5.4; 2048 pairs 19-21 vs 6.2-6.7.
SORT_MAX_PAIRS = 512
# ``blocks`` (no row gather) while its [blocks, experts] count table has at most this many
# entries (every scatter program reads all of it). H200, CUDA graphs (bench_align_combine.py
# --only align, results/align_combine.json, sixth session): 2048 pairs of 128 experts (a 32 x 128
# table) 5.1 us vs two launches' 5.9; 4096 / 16384 pairs of 8 experts 3.7 / 4.1 vs 4.5 / 6.9; but
# 2048 pairs of 256 experts (64 x 256) 6.9 vs 5.5.
BLOCKS_MAX_TABLE = 8192
METHODS = ("sort", "blocks", "two_launch")
FORCE: str | None = None  # a method for every call (benchmarks compare them side by side)


def blocks_layout(pairs: int, num_local: int) -> tuple[int, int, int]:
    """``(pairs per block, blocks, blocks padded to a power of two)`` of the ``blocks`` method:
    a block's ``[pairs, experts]`` select stays at 8192 entries."""
    block = max(16, min(256, 8192 // next_pow2(num_local)))
    nb = cdiv(pairs, block)
    return block, nb, next_pow2(nb)


def _blocks_fit(pairs: int, num_local: int) -> bool:
    """Whether the ``blocks`` method's count table stays within ``BLOCKS_MAX_TABLE`` entries."""
    return blocks_layout(pairs, num_local)[2] * next_pow2(num_local) <= BLOCKS_MAX_TABLE


def _sort_fits(pairs: int, num_local: int) -> bool:
    """Whether the sort's int32 keys ``expert * P_PAD + pair`` hold ``pairs`` pairs."""
    return (next_pow2(num_local) + 1) * next_pow2(pairs) <= 2 ** 31 - 1


def align_method(pairs: int, gather: bool, num_local: int = 1) -> str:
    """Without a row gather: ``"sort"`` up to ``SORT_MAX_PAIRS`` pairs, else ``"blocks"`` while its
    count table fits ``BLOCKS_MAX_TABLE``; else (and with the gather, whose copy the two launches
    split finer) ``"two_launch"``. ``FORCE`` overrides where that method can take the call."""
    if FORCE == "two_launch" or (FORCE == "blocks" and _blocks_fit(pairs, num_local)) or (
            FORCE == "sort" and not gather and _sort_fits(pairs, num_local)):
        return FORCE
    if gather:
        return "two_launch"
    if pairs <= SORT_MAX_PAIRS:
        return "sort"
    return "blocks" if _blocks_fit(pairs, num_local) else "two_launch"


def _sort_warps(p_pad: int) -> int:
    return 4 if p_pad <= 1024 else 8


def align(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None = None,
          x: torch.Tensor | None = None, block: int = 256, method: str | None = None) -> Alignment:
    """Sort the pairs of ``topk_ids [T, k]`` by local expert; with ``x`` also gather its rows.
    ``method`` (``METHODS``; default: ``align_method``) picks the launch; ``"sort"`` keeps the
    pairs of one expert in pair order."""
    _check_ids(topk_ids, num_local, expert_map)
    num_tokens, top_k = topk_ids.shape
    pairs = num_tokens * top_k
    method = method or align_method(pairs, x is not None, num_local)
    if method not in METHODS or (x is not None and method == "sort"):
        raise ValueError(f"method={method!r} must be one of {METHODS} (not 'sort' when x is given).")
    dev = topk_ids.device
    # sort and blocks write every count themselves; the atomic tickets of two launches need zeroed counters
    counts = (torch.zeros if method == "two_launch" else torch.empty)(num_local, dtype=torch.int32, device=dev)
    # rows past the last valid one (only with an expert_map) are never written: keep them in range
    sorted_pair = (torch.zeros if expert_map is not None else torch.empty)(pairs, dtype=torch.int32, device=dev)
    pos = torch.empty(pairs, dtype=torch.int32, device=dev)
    offsets = torch.empty(num_local, dtype=torch.int32, device=dev)
    x_sorted = None
    if x is not None:
        if x.dim() != 2 or x.shape[0] != num_tokens or x.stride(1) != 1:
            raise ValueError(f"x must be [T={num_tokens}, H] with a contiguous last dim, but got {tuple(x.shape)}.")
        x_sorted = torch.empty(pairs, x.shape[1], dtype=x.dtype, device=dev)
    if pairs == 0:
        return Alignment(sorted_pair, pos, counts.zero_(), offsets.zero_(), x_sorted)
    has_map = expert_map is not None
    ids_map = expert_map if has_map else topk_ids
    e_pad = next_pow2(num_local)
    if method == "sort":
        p_pad = next_pow2(pairs)
        if not _sort_fits(pairs, num_local):
            raise ValueError(f"method='sort' takes at most {(2 ** 31 - 1) // (e_pad + 1)} pairs with {num_local} "
                             f"local experts (int32 sort keys), but got {pairs} pairs; use method='two_launch'.")
        launch(_sort_align_kernel, (1,), topk_ids, ids_map, counts, sorted_pair, pos, offsets, pairs, num_local,
               HAS_MAP=has_map, P_PAD=p_pad, E_PAD=e_pad, num_warps=_sort_warps(p_pad),
               **pdl_launch(dev))
        return Alignment(sorted_pair, pos, counts, offsets, x_sorted)
    hidden = 0 if x is None else x.shape[1]
    block_h, chunk_h = (16, 0) if x is None else (max(16, min(256, next_pow2(hidden))), 512)
    h_chunks = cdiv(hidden, chunk_h) if x is not None else 1
    if method == "blocks":
        bblock, nb, nb_pad = blocks_layout(pairs, num_local)
        if not _blocks_fit(pairs, num_local):  # every scatter program holds the whole table
            raise ValueError(f"method='blocks' takes at most a {BLOCKS_MAX_TABLE}-entry count table, but {pairs} "
                             f"pairs of {num_local} local experts need {nb_pad} x {e_pad}; use method='two_launch'.")
        table = torch.empty(nb, e_pad, dtype=torch.int32, device=dev)
        launch(_block_hist_kernel, (nb,), topk_ids, ids_map, table, pairs, num_local, HAS_MAP=has_map, E_PAD=e_pad,
               BLOCK=bblock, num_warps=4, **pdl_launch(dev))
        launch(_block_scatter_kernel, (nb, h_chunks),
            topk_ids, ids_map, table, counts, sorted_pair, pos, offsets,
            x if x is not None else counts, x_sorted if x_sorted is not None else counts, pairs, num_local, nb,
            hidden, chunk_h, 0 if x is None else x.stride(0), 0 if x_sorted is None else x_sorted.stride(0),
            TOP_K=top_k, HAS_MAP=has_map, GATHER=x is not None, E_PAD=e_pad, NB_PAD=nb_pad, BLOCK=bblock,
            BLOCK_H=block_h, num_warps=4 if nb_pad * e_pad <= 4096 else 8, **pdl_launch(dev))
        return Alignment(sorted_pair, pos, counts, offsets, x_sorted)
    rank = torch.empty(pairs, dtype=torch.int32, device=dev)
    grid = (cdiv(pairs, block),)
    launch(_count_kernel, grid, topk_ids, ids_map, counts, rank, pairs, num_local, HAS_MAP=has_map, BLOCK=block,
           num_warps=4, **pdl_launch(dev))
    # with the row gather the copy is split over H too (chunks of 512 columns, a multiple of
    # block_h), so even a few hundred pairs fill the GPU
    scatter_block = max(16, min(block if x is None else 64, 8192 // e_pad))
    grid = (cdiv(pairs, scatter_block), h_chunks)
    launch(_scatter_kernel, grid,
        topk_ids, ids_map, counts, rank, sorted_pair, pos, offsets,
        x if x is not None else counts, x_sorted if x_sorted is not None else counts, pairs, num_local, hidden,
        chunk_h, 0 if x is None else x.stride(0), 0 if x_sorted is None else x_sorted.stride(0),
        TOP_K=top_k, HAS_MAP=has_map, GATHER=x is not None, E_PAD=e_pad, BLOCK=scatter_block,
        BLOCK_H=block_h, num_warps=4, **pdl_launch(dev))
    return Alignment(sorted_pair, pos, counts, offsets, x_sorted)


def align_reference(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None = None,
                    x: torch.Tensor | None = None) -> Alignment:
    """The same grouping in plain torch, pairs of one expert in token order."""
    slots = batched_slots(topk_ids, num_local, expert_map)
    order = slots.order.to(torch.int32)
    valid_sorted = slots.valid[slots.order]
    pos = torch.full_like(order, -1)
    pos[slots.order[valid_sorted]] = torch.arange(order.numel(), device=order.device, dtype=torch.int32)[valid_sorted]
    x_sorted = None if x is None else x[(slots.order // topk_ids.shape[1])]
    return Alignment(order, pos, slots.expert_num_tokens, slots.offsets, x_sorted)


__all__ = ["BLOCKS_MAX_TABLE", "METHODS", "SORT_MAX_PAIRS", "Alignment", "align", "align_method", "align_reference",
           "blocks_layout"]
