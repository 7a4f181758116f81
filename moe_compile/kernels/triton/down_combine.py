"""Decode: the second expert GEMM and the weighted combine in one kernel (pair-ordered rows).

``out[t, n] = sum_j w[t, j] * (act[t * k + j, :] @ W2[e(t, j)][:, n] + b2[e(t, j), n])``

One program owns token ``t`` and output columns block ``n``. Its accumulator has one row per
top-k slot: step ``(j, k0)`` of a single flattened loop loads slot ``j``'s activation row alone
(the other rows are masked to zero) and expert ``e(t, j)``'s weight tile, so after the loop row
``j`` holds slot ``j``'s GEMM in fp32; the epilogue adds the biases, weights the rows and sums
them. One loop over all ``k`` experts keeps the load pipeline full across expert boundaries, and
the ``[P, H]`` rows of the unfused path (written by the GEMM, read back by ``combine``) never
exist. Slots whose expert is not on this rank (``expert_map`` -> -1) read no weights and add
nothing. For the ``pairs`` path (few tokens): the grid is ``T x cdiv(H, block_n)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_compile.kernels.triton.pdl import pdl_enter, pdl_launch


@triton.jit
def _down_combine_kernel(
    a_ptr, w_ptr, bias_ptr, tw_ptr, ids_ptr, map_ptr, out_ptr, N, K, E_local,
    stride_am, stride_we, stride_wk, stride_wn, stride_be, stride_bn, stride_om,
    TOP_K: tl.constexpr, M_PAD: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    WEIGHTED: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    slot = tl.arange(0, M_PAD)
    kk = tl.arange(0, BLOCK_K)
    pair0 = t.to(tl.int64) * TOP_K
    a_rows = a_ptr + (pair0 + slot)[:, None] * stride_am
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    num_k = tl.cdiv(K, BLOCK_K)
    for it in range(0, TOP_K * num_k):
        j = it // num_k
        e = tl.load(ids_ptr + pair0 + j)
        if HAS_MAP:
            e = tl.load(map_ptr + e, mask=e >= 0, other=-1)
        # a slot whose expert is not local loads nothing: its K range is empty
        k_end = tl.where((e >= 0) & (e < E_local), K, 0)
        k = (it % num_k) * BLOCK_K + kk
        kmask = k < k_end
        a = tl.load(a_rows + k[None, :], mask=(slot == j)[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + e.to(tl.int64) * stride_we + k[:, None] * stride_wk + n[None, :] * stride_wn,
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    smask = slot < TOP_K
    e_s = tl.load(ids_ptr + pair0 + slot, mask=smask, other=-1)
    if HAS_MAP:
        e_s = tl.load(map_ptr + e_s, mask=e_s >= 0, other=-1)
    valid = smask & (e_s >= 0) & (e_s < E_local)
    if HAS_BIAS:
        b = tl.load(bias_ptr + e_s.to(tl.int64)[:, None] * stride_be + n[None, :] * stride_bn,
                    mask=valid[:, None] & nmask[None, :], other=0.0)
        acc += b.to(tl.float32)
    if WEIGHTED:
        scale = tl.load(tw_ptr + pair0 + slot, mask=valid, other=0.0)
    else:
        scale = tl.where(valid, 1.0, 0.0)
    res = tl.sum(acc * scale[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + n, res.to(out_ptr.dtype.element_ty), mask=nmask)


def down_combine(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 out: torch.Tensor, *, expert_map: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 weighted: bool = True, block_n: int = 32, block_k: int = 256, num_warps: int = 4,
                 num_stages: int = 4) -> torch.Tensor:
    """``act [T * k, I]`` (pair order), ``w2 [E, I, H]`` (any strides), ``topk_weights fp32 [T, k]``,
    ``topk_ids int32 [T, k]`` -> ``out [T, H]`` (see the module doc)."""
    for name, t in (("act", act), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}.")
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise TypeError(f"topk_ids must be contiguous int32 [T, k], but got {topk_ids.dtype} {tuple(topk_ids.shape)}.")
    num_tokens, top_k = topk_ids.shape
    if tuple(topk_weights.shape) != (num_tokens, top_k) or topk_weights.dtype != torch.float32 \
            or not topk_weights.is_contiguous():
        raise TypeError(f"topk_weights must be contiguous fp32 [{num_tokens}, {top_k}], but got "
                        f"{topk_weights.dtype} {tuple(topk_weights.shape)}.")
    if w2.dim() != 3 or act.dim() != 2 or act.shape != (num_tokens * top_k, w2.shape[1]) or act.stride(1) != 1:
        raise ValueError(f"act must be [{num_tokens * top_k}, I] with a contiguous last dim and w2 [E, I, H] with "
                         f"the same I; got act {tuple(act.shape)}, w2 {tuple(w2.shape)}.")
    if tuple(out.shape) != (num_tokens, w2.shape[2]) or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_tokens}, {w2.shape[2]}] with a contiguous last dim, "
                         f"but got {tuple(out.shape)}.")
    if act.dtype != w2.dtype:
        raise TypeError(f"act.dtype={act.dtype} must equal w2.dtype={w2.dtype}.")
    if bias is not None and tuple(bias.shape) != (w2.shape[0], w2.shape[2]):
        raise ValueError(f"bias must have shape {(w2.shape[0], w2.shape[2])}, but got {tuple(bias.shape)}.")
    if num_tokens == 0:
        return out
    hidden = w2.shape[2]
    grid = (num_tokens, triton.cdiv(hidden, block_n))
    _down_combine_kernel[grid](
        act, w2, bias if bias is not None else w2, topk_weights, topk_ids,
        expert_map if expert_map is not None else topk_ids, out, hidden, w2.shape[1], w2.shape[0],
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        0 if bias is None else bias.stride(0), 0 if bias is None else bias.stride(1), out.stride(0),
        TOP_K=top_k, M_PAD=max(16, triton.next_power_of_2(top_k)), HAS_MAP=expert_map is not None,
        HAS_BIAS=bias is not None, WEIGHTED=weighted, IEEE=act.dtype == torch.float32,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages, **pdl_launch(act.device),
    )
    return out


__all__ = ["down_combine"]
