"""Weighted combine: the k expert rows of each token, weighted and summed, in one pass.

``out[t, :] = sum_j w[t, j] * y[row(t, j), :]`` accumulated in fp32, where ``row(t, j)`` is
``pos[t * k + j]`` (expert-ordered rows; -1 = expert not on this rank, contributes nothing) or
the pair index itself (pair-ordered rows; validity then comes from ``topk_ids``/``expert_map``).
With ``apply_router_weight_on_input`` the weight was already applied to the input, so the rows
are summed unweighted. This is where the un-permutation and the top-k reduction happen; nothing
is read twice. ``combine_reference`` is the plain-torch meaning.

``y`` may also be ``[S, P, H]``: the K slices of a split-K second GEMM, whose partial products
are added here (in fp32, before the weight) rather than in a pass of their own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_compile.kernels.triton import cdiv, next_pow2
from moe_compile.kernels.triton.launch import launch
from moe_compile.kernels.triton.pdl import pdl_enter, pdl_launch


@triton.jit
def _combine_kernel(y_ptr, w_ptr, pos_ptr, ids_ptr, map_ptr, out_ptr, T, H, E_local, stride_y, stride_o, stride_s,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, PAIR_ROWS: tl.constexpr, HAS_MAP: tl.constexpr,
                    WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
                    SPLITS: tl.constexpr = 1):
    pdl_enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = t < T
    hmask = h < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        if PAIR_ROWS:
            e = tl.load(ids_ptr + pair, mask=tmask, other=-1)
            if HAS_MAP:
                e = tl.load(map_ptr + e, mask=tmask & (e >= 0), other=-1)
            valid = tmask & (e >= 0) & (e < E_local)
            row = pair
        else:
            row = tl.load(pos_ptr + pair, mask=tmask, other=-1)
            valid = tmask & (row >= 0)
        m = valid[:, None] & hmask[None, :]
        y_ptrs = y_ptr + row[:, None].to(tl.int64) * stride_y + h[None, :]
        y = tl.load(y_ptrs, mask=m, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLITS):  # the other K slices of a split-K GEMM
            y += tl.load(y_ptrs + s * stride_s.to(tl.int64), mask=m, other=0.0).to(tl.float32)
        if WEIGHTED:
            y = y * tl.load(w_ptr + pair, mask=valid, other=0.0)[:, None]
        acc += y
    o_ptrs = out_ptr + t[:, None].to(tl.int64) * stride_o + h[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & hmask[None, :])


def combine_blocks(hidden: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, num_warps)`` of a launch. 8 x 256 with 8 warps (8 bf16 per thread) was
    within 6 % of the fastest candidate on average and faster than the previous rule (4 x 1024,
    4 warps) at all 15 of the issue's points on the H200: e.g. Qwen3 T=256 6.4 -> 5.5 us, DeepSeek-V3
    T=2048 66.2 -> 64.4 us (``benchmarks/bench_align_combine.py``, ``results/align_combine.json``)."""
    block_h = min(256, next_pow2(hidden))
    return 8, block_h, 8 if block_h == 256 else 4


def combine(y: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, *, pos: torch.Tensor | None = None,
            topk_ids: torch.Tensor | None = None, expert_map: torch.Tensor | None = None, num_local: int = 0,
            weighted: bool = True, blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``y [P, H]`` expert rows (or ``[S, P, H]``, K slices summed) -> ``out [T, H]``. Give ``pos``
    (expert-ordered rows) or ``topk_ids`` (pair order)."""
    if (pos is None) == (topk_ids is None):
        raise ValueError("combine needs exactly one of pos (expert-ordered rows) or topk_ids (pair-ordered rows).")
    if topk_weights.dim() != 2 or topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        raise TypeError(f"topk_weights must be contiguous fp32 [T, k], but got {topk_weights.dtype} "
                        f"{tuple(topk_weights.shape)}.")
    num_tokens, top_k = topk_weights.shape
    splits = y.shape[0] if y.dim() == 3 else 1
    rows = y[0] if y.dim() == 3 else y
    if y.dim() not in (2, 3) or rows.shape[0] != num_tokens * top_k or rows.stride(1) != 1:
        raise ValueError(f"y must be [{num_tokens * top_k}, H] (or [S, {num_tokens * top_k}, H]) with a contiguous "
                         f"last dim, but got {tuple(y.shape)}.")
    hidden = rows.shape[1]
    if tuple(out.shape) != (num_tokens, hidden) or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_tokens}, {hidden}], but got {tuple(out.shape)}.")
    if num_tokens == 0:
        return out
    block_t, block_h, warps = blocks or combine_blocks(hidden)
    grid = (cdiv(num_tokens, block_t), cdiv(hidden, block_h))
    ids = topk_ids if topk_ids is not None else pos
    launch(_combine_kernel, grid, y, topk_weights, pos if pos is not None else ids, ids,
           expert_map if expert_map is not None else ids, out, num_tokens, hidden, num_local,
           rows.stride(0), out.stride(0), y.stride(0) if splits > 1 else 0, TOP_K=top_k,
           K_PAD=next_pow2(top_k),
           PAIR_ROWS=pos is None, HAS_MAP=expert_map is not None, WEIGHTED=weighted,
           BLOCK_T=block_t, BLOCK_H=block_h, SPLITS=splits, num_warps=warps, **pdl_launch(y.device))
    return out


def combine_reference(y: torch.Tensor, topk_weights: torch.Tensor, row_of_pair: torch.Tensor,
                      weighted: bool = True) -> torch.Tensor:
    """``row_of_pair [P]`` (-1 = skip) -> fp32 ``[T, H]``."""
    num_tokens, top_k = topk_weights.shape
    valid = row_of_pair >= 0
    rows = y.float()[row_of_pair.clamp(min=0).long()] * valid.unsqueeze(-1)
    if weighted:
        rows = rows * topk_weights.reshape(-1, 1).float()
    return rows.view(num_tokens, top_k, -1).sum(dim=1)


__all__ = ["combine", "combine_reference"]
