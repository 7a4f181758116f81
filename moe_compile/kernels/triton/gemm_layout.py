"""Which rows, output columns and K slice each program of the expert GEMM computes.

The launch side of ``gemm.py``: M-blocks of expert-grouped rows counted on the device from the
expert counts (no block table), with an expert's last block merged (``MERGE_M``) or left to a
second launch (``MERGE_PASS``); the order tiles run in (grouped or expert by expert); the split of
tile indices into K slices (``SPLIT_K``); and the host's upper bound on the M-blocks that sizes a
grid. ``gemm.py`` computes the tiles.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moe_compile.kernels.triton import cdiv


@triton.jit
def _num_blocks(counts, BLOCK_M: tl.constexpr, MERGE_M: tl.constexpr):
    """M-blocks of experts holding ``counts`` rows: ``BLOCK_M`` rows each, except that with
    ``MERGE_M`` an expert's last block takes up to ``BLOCK_M + MERGE_M`` rows (130 rows are one
    block of 128 + 2, not two blocks)."""
    if MERGE_M > 0:
        nblk = tl.where(counts > MERGE_M, (counts - MERGE_M + BLOCK_M - 1) // BLOCK_M, (counts > 0).to(tl.int32))
    else:
        nblk = (counts + BLOCK_M - 1) // BLOCK_M
    return nblk


@triton.jit
def _blocks_of(counts, BLOCK_M: tl.constexpr, MERGE_M: tl.constexpr, MERGE_PASS: tl.constexpr):
    """``(M-blocks, rows they cover)`` of experts holding ``counts`` rows in this launch. The first
    launch of a split merge (``MERGE_PASS == 1``) leaves out each merged last block (more than
    ``BLOCK_M`` rows past a multiple of ``BLOCK_M``, by at most ``MERGE_M``): its plain blocks
    then cover the expert's first rows only, and the second launch runs the rest."""
    if MERGE_PASS == 1:
        rem = counts % BLOCK_M
        merged = (counts > BLOCK_M) & (rem > 0) & (rem <= MERGE_M)
        rows = tl.where(merged, counts - BLOCK_M - rem, counts)
        nblk = (rows + BLOCK_M - 1) // BLOCK_M
    else:
        rows = counts
        nblk = _num_blocks(counts, BLOCK_M, MERGE_M)
    return nblk, rows


@triton.jit
def _block_rows(pid_m, counts_ptr, ids_ptr, map_ptr, E_local, row_stride,
                PAIR_BLOCKS: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                BATCHED: tl.constexpr, MERGE_M: tl.constexpr = 0, MERGE_PASS: tl.constexpr = 0):
    """(live, expert, first row, end row) of M-block ``pid_m``; ``BATCHED``: expert ``e``'s rows
    start at ``e * row_stride`` (the batched ``[E, cap, ...]`` format) instead of packed. With
    ``MERGE_M`` an expert's last block may end up to ``MERGE_M`` rows past ``first row + BLOCK_M``
    (``MERGE_PASS == 1``: such blocks are left out, see ``_blocks_of``)."""
    if PAIR_BLOCKS:
        e = tl.load(ids_ptr + pid_m)
        if HAS_MAP:
            e = tl.load(map_ptr + e)
        live = (e >= 0) & (e < E_local)
        row0 = pid_m
        row_end = pid_m + 1
    else:
        eo = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + eo, mask=eo < E_local, other=0)
        nblk, covered = _blocks_of(counts, BLOCK_M, MERGE_M, MERGE_PASS)
        blk_end = tl.cumsum(nblk, 0)
        live = pid_m < tl.sum(nblk)
        e = tl.sum((blk_end <= pid_m).to(tl.int32))
        here = eo == e
        first_blk = tl.sum(tl.where(here, blk_end - nblk, 0))
        if BATCHED:
            start = e * row_stride
            row_end = start + tl.sum(tl.where(here, covered, 0))
        elif MERGE_PASS == 1:
            start = tl.sum(tl.where(here, tl.cumsum(counts, 0) - counts, 0))
            row_end = start + tl.sum(tl.where(here, covered, 0))
        else:
            row_end_all = tl.cumsum(counts, 0)
            row_end = tl.sum(tl.where(here, row_end_all, 0))
            start = tl.sum(tl.where(here, row_end_all - counts, 0))
        row0 = start + (pid_m - first_blk) * BLOCK_M
    return live, e, row0, row_end


@triton.jit
def _grouped_pid(tile, num_blocks_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of tile ``tile``: ``GROUP_M`` M-blocks share each N-block in turn."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_rows
    pid_n = (tile % in_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _expert_pid(tile, counts_ptr, E_local, num_pid_n, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                GROUP_M: tl.constexpr, MERGE_M: tl.constexpr = 0, MERGE_PASS: tl.constexpr = 0):
    """``(pid_m, pid_n)`` of tile ``tile`` with the tiles ordered expert by expert: all tiles of
    expert 0's M-blocks, then expert 1's, ...; within one expert ``GROUP_M`` of its M-blocks share
    each N-block in turn. So an expert's weight tile is read by all of its M-blocks at about the
    same time, and a group never mixes experts (whose weights would compete for L2). Tiles past
    the live ones map to dead M-blocks."""
    eo = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + eo, mask=eo < E_local, other=0)
    nblk, _ = _blocks_of(counts, BLOCK_M, MERGE_M, MERGE_PASS)
    blk_end = tl.cumsum(nblk, 0)
    b = tile // num_pid_n  # tiles [first * n, (first + nb) * n) are expert e's: b is one of its M-blocks
    e = tl.sum((blk_end <= b).to(tl.int32))
    here = eo == e
    nb = tl.sum(tl.where(here, nblk, 0))
    first = tl.sum(tl.where(here, blk_end - nblk, 0))
    pid_m, pid_n = _grouped_pid(tile - first * num_pid_n, tl.maximum(nb, 1), num_pid_n, GROUP_M)
    live = b < tl.sum(nblk)
    return tl.where(live, first + pid_m, b), tl.where(live, pid_n, 0)


@triton.jit
def _split_of(tile, per_split, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """``(tile within its K slice, slice, first K, end K)`` of ``tile``: tiles ``[s * per_split,
    (s + 1) * per_split)`` are K slice ``s``, each slice a whole number of ``BLOCK_K`` steps."""
    if SPLIT_K == 1:
        return tile, 0, 0, K
    else:
        k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        ks = tile // per_split
        k_lo = ks * k_per
        return tile % per_split, ks.to(tl.int64), k_lo, tl.minimum(K, k_lo + k_per)  # int64: ks * stride_os


def max_m_blocks(pairs: int, num_local: int, block_m: int, pair_blocks: bool) -> int:
    """An upper bound on the M-blocks (every expert adds at most one partial block)."""
    if pair_blocks:
        return pairs
    return cdiv(pairs, block_m) + min(num_local, pairs)


__all__ = ["max_m_blocks"]
