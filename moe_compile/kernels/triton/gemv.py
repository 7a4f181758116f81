"""Decode-sized experts on CUDA cores: two GEMV kernels, the second with the combine fused in.

At a few tokens over many experts (the ``pairs`` path's batches) the expert GEMMs only stream
weights: each (token, expert) pair is one row, and a tensor-core tile pads it to 16. This path
reads the weights in wide row loads and sums products in fp32 on CUDA cores:

- ``_gemv_up_kernel``: program (pair, block of ``BLOCK_N`` intermediate columns) -> the gate and up
  rows of that block against the token's input row, bias, activation -> ``act [P, I]``;
- ``_gemv_down_kernel``: program (token, block of ``BLOCK_N`` output columns) -> for each of the
  token's k experts the down rows against its ``act`` row, bias, rounded to the activation dtype
  (as the GEMM path's ``y`` is), times the router weight, summed over the k experts in fp32 ->
  ``out [T, H]``. The ``[P, H]`` rows and the combine pass of the GEMM path are gone.

Experts that are not on this rank (``expert_map`` -> -1) are skipped: their loads are masked off,
so their weights are never read. Both kernels need the weights' reduction axis contiguous
(``w13 [E, H, N]`` and ``w2 [E, I, H]`` with ``stride(1) == 1``, e.g. HF's ``[E, N, H]`` storage
seen transposed); ``gemv_supported`` says whether they are.

Status (ninth session, H200, ``benchmarks/probe_gemv.py``, each point's best blocks against the
tuned ``pairs`` plan side by side): slower at all four decode points measured -- Qwen3 M = 1
29.3 vs 26.1 us, M = 4 78.7 vs 76.2, Mixtral M = 1 188.9 vs 175.4, DeepSeek-V3 M = 1 178.7 vs
167.5. Triton pipelines the tensor-core path's weight loads (TMA, several stages in flight); these
kernels' loads feed FMAs and are not pipelined, so they stream slower even though the padded MMA
rows cost nothing there. So no tuned plan uses this path; ``probe_gemv.py --apply`` would write it
into the tuned configs on a GPU where it wins. The down kernel after the tuned ``pairs`` GEMM1
(``benchmarks/probe_mixed.py``, seventeenth session) was not faster either: Qwen3 M = 1 28.1 vs
24.5 us, DeepSeek-V3 M = 1 169.4 vs 163.8, Mixtral M = 1 172.1 vs 173.8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_compile.kernels.triton import cdiv
from moe_compile.kernels.triton.activation import act_code, apply_act
from moe_compile.kernels.triton.launch import launch
from moe_compile.kernels.triton.pdl import pdl_enter, pdl_launch
from moe_compile.ops.activation import intermediate_size
from moe_compile.ops.config import ExpertsConfig


@triton.jit
def _gemv_up_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, map_ptr, act_ptr, H, I, E_local,
                    stride_xt, stride_we, stride_wk, stride_wn, stride_be, stride_bn, stride_at,
                    up_off, col_mult, alpha, limit,
                    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                    ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair)
    if HAS_MAP:
        e = tl.load(map_ptr + e)
    if (e < 0) | (e >= E_local):
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xt
    g_rows = w_ptr + e.to(tl.int64) * stride_we + (n * col_mult)[:, None].to(tl.int64) * stride_wn
    u_rows = g_rows + up_off * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + k
        kmask = kk < H
        xk = tl.load(x_row + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
        m = nmask[:, None] & kmask[None, :]
        acc_g += tl.load(g_rows + kk[None, :] * stride_wk, mask=m, other=0.0).to(tl.float32) * xk
        if GATED:
            acc_u += tl.load(u_rows + kk[None, :] * stride_wk, mask=m, other=0.0).to(tl.float32) * xk
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if HAS_BIAS:
        b_base = b_ptr + e.to(tl.int64) * stride_be
        g += tl.load(b_base + n * col_mult * stride_bn, mask=nmask, other=0.0).to(tl.float32)
        if GATED:
            u += tl.load(b_base + (n * col_mult + up_off) * stride_bn, mask=nmask, other=0.0).to(tl.float32)
    out = apply_act(g, u, alpha, limit, ACT)
    tl.store(act_ptr + pair.to(tl.int64) * stride_at + n, out.to(act_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gemv_down_kernel(act_ptr, w_ptr, b_ptr, ids_ptr, map_ptr, tw_ptr, out_ptr, I, H, E_local,
                      stride_at, stride_we, stride_wk, stride_wn, stride_be, stride_bn, stride_ot,
                      TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    k = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair)
        if HAS_MAP:
            e = tl.load(map_ptr + e)
        live = (e >= 0) & (e < E_local)
        e = tl.where(live, e, 0)
        k_end = tl.where(live, I, 0)  # a dead expert's loads are all masked off
        a_row = act_ptr + pair.to(tl.int64) * stride_at
        w_rows = w_ptr + e.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + k
            kmask = kk < k_end
            a = tl.load(a_row + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_rows + kk[None, :] * stride_wk, mask=nmask[:, None] & kmask[None, :],
                           other=0.0).to(tl.float32) * a
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + e.to(tl.int64) * stride_be + n * stride_bn, mask=n < tl.where(live, H, 0),
                         other=0.0).to(tl.float32)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # the expert's output row, as the GEMM path rounds it
        if WEIGHTED:
            y = y * tl.load(tw_ptr + pair)
        total += tl.where(live, y, 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + n, total.to(out_ptr.dtype.element_ty), mask=nmask)


def gemv_supported(w13: torch.Tensor, w2: torch.Tensor) -> tuple[bool, str]:
    """Whether the GEMV kernels take these weights: the reduction axis (dim 1) contiguous."""
    for name, w in (("w13", w13), ("w2", w2)):
        if w.stride(1) != 1:
            return False, f"{name}'s reduction axis (dim 1) has stride {w.stride(1)}, not 1"
    return True, ""


def gemv_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, config: ExpertsConfig, out: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None, weighted: bool = True,
                 up: tuple[int, int, int] = (16, 256, 4), down: tuple[int, int, int] = (16, 256, 4)) -> torch.Tensor:
    """``x [T, H]``, contiguous fp32 ``topk_weights [T, k]`` and int32 ``topk_ids [T, k]`` ->
    ``out [T, H]`` (see the module doc). ``up``/``down``: ``(BLOCK_N, BLOCK_K, num_warps)``."""
    ok, reason = gemv_supported(w13, w2)
    if not ok:
        raise ValueError(f"gemv_experts: {reason}.")
    num_tokens, top_k = topk_ids.shape
    _, hidden, n13 = w13.shape
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous() or topk_ids.dtype != torch.int32:
        raise TypeError(f"gemv_experts: topk_weights must be contiguous fp32 and topk_ids int32, but got "
                        f"{topk_weights.dtype} and {topk_ids.dtype}.")
    if tuple(out.shape) != (num_tokens, hidden) or out.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv_experts: x and out must be [{num_tokens}, {hidden}] with contiguous rows, but got "
                         f"x {tuple(x.shape)} strides {x.stride()} and out {tuple(out.shape)} strides {out.stride()}.")
    inter = intermediate_size(n13, config.activation)
    if num_tokens * top_k == 0:
        return out
    act = gemv_up(x, topk_ids, w13, config, inter, w13_bias=w13_bias, expert_map=expert_map, up=up)
    return gemv_down(act, topk_weights, topk_ids, w2, out, w2_bias=w2_bias, expert_map=expert_map,
                     weighted=weighted, down=down)


def gemv_up(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, config: ExpertsConfig, inter: int, *,
            w13_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
            up: tuple[int, int, int] = (16, 256, 4)) -> torch.Tensor:
    """The up kernel alone: ``act [T * k, inter]`` (checked inputs, as ``gemv_experts`` takes them)."""
    num_tokens, top_k = topk_ids.shape
    pairs = num_tokens * top_k
    gated = config.activation.is_gated
    interleaved = gated and config.gate_up_interleaved
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    emap = expert_map if expert_map is not None else topk_ids
    bn, bk, warps = up
    launch(_gemv_up_kernel, (pairs, cdiv(inter, bn)),
        x, w13, w13_bias if w13_bias is not None else w13, topk_ids, emap, act, w13.shape[1], inter, w13.shape[0],
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        0 if w13_bias is None else w13_bias.stride(0), 0 if w13_bias is None else w13_bias.stride(1), act.stride(0),
        1 if interleaved else inter, 2 if interleaved else 1, float(config.swiglu_alpha), float(config.swiglu_limit),
        TOP_K=top_k, HAS_MAP=expert_map is not None, HAS_BIAS=w13_bias is not None, GATED=gated,
        ACT=act_code(config), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **pdl_launch(x.device))
    return act


def gemv_down(act: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w2: torch.Tensor,
              out: torch.Tensor, *, w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
              weighted: bool = True, down: tuple[int, int, int] = (16, 256, 4)) -> torch.Tensor:
    """The down kernel alone, the combine fused in: ``act [T * k, I]`` (pair ``t * k + j`` is token
    ``t``'s ``j``-th expert, any row stride), ``w2 [E, I, H]`` with ``stride(1) == 1``, fp32
    ``topk_weights`` and int32 ``topk_ids`` ``[T, k]`` contiguous -> ``out [T, H]`` (contiguous rows)."""
    num_tokens, top_k = topk_ids.shape
    num_local, inter, hidden = w2.shape
    if w2.stride(1) != 1 or act.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"gemv_down: w2's dim 1, act's and out's rows must be contiguous, but got strides "
                         f"{w2.stride()}, {act.stride()} and {out.stride()}.")
    if tuple(act.shape) != (num_tokens * top_k, inter) or tuple(out.shape) != (num_tokens, hidden):
        raise ValueError(f"gemv_down: act must be [{num_tokens * top_k}, {inter}] and out [{num_tokens}, {hidden}], "
                         f"but got {tuple(act.shape)} and {tuple(out.shape)}.")
    if num_tokens == 0:
        return out
    emap = expert_map if expert_map is not None else topk_ids
    bn, bk, warps = down
    launch(_gemv_down_kernel, (num_tokens, cdiv(hidden, bn)),
        act, w2, w2_bias if w2_bias is not None else w2, topk_ids, emap, topk_weights, out, inter, hidden, num_local,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        0 if w2_bias is None else w2_bias.stride(0), 0 if w2_bias is None else w2_bias.stride(1), out.stride(0),
        TOP_K=top_k, HAS_MAP=expert_map is not None, HAS_BIAS=w2_bias is not None, WEIGHTED=weighted,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **pdl_launch(act.device))
    return out


__all__ = ["gemv_down", "gemv_experts", "gemv_supported", "gemv_up"]
