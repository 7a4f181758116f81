"""Router logits from bf16 activations: fp32 without an fp32 copy of the activations, or bf16.

DeepSeek-V3-style routers compute ``F.linear(x.float(), w.float())``: a cast pass over the whole
``[T, H]`` input and an fp32 GEMM on CUDA cores (at ``T = 8192, H = 7168, E = 256`` on an H200:
0.84 ms for the GEMM and 0.21 ms for the cast, measured with ``benchmarks/kernel_breakdown.py``).
``router_logits`` gives the same fp32 result from the bf16 input directly:

- few tokens (``T <= 16``): a GEMV kernel, one program per expert, that reads each weight row
  once in wide loads, casting in registers and accumulating fp32 products on CUDA cores (the
  memory-bound case);
- more tokens (``T > 16``): a tensor-core GEMM. bf16 weights are multiplied as they are (their
  products with bf16 inputs are exact in the fp32 accumulator, exactly what the upcast computes).
  fp32 weights are split in registers into three bf16 parts ``hi + mid + lo`` that together hold
  the fp32 significand, and the input is multiplied with each part: three bf16 products per
  element, exact in fp32. Each 64-wide K-chunk is summed on the tensor cores and added to the
  running fp32 total on CUDA cores, because Hopper's tensor cores truncate their fp32
  accumulation (over K = 7168 a single tensor-core accumulator drifted to 2e-5 of the largest
  logit on an H200, against 3e-7 for cuBLAS's fp32 GEMM). Where the token x expert tiles are
  fewer than the SMs, H is cut into ranges (``h_splits``) whose partial sums are added in a fixed
  order afterwards, so the grid fills the GPU and every call gives the same bits.

On an H200 at DeepSeek-V3's router shape (``benchmarks/bench_router.py``, CUDA graphs, fp32
weights) the GEMM took 0.86x the time of the cast + cuBLAS fp32 GEMM at T = 17, 0.53x at 256,
0.36x at 2048 and 0.34x at 8192 (bf16 weights: 0.11-0.33x), with a smaller error against fp64
than cuBLAS at every T measured (1.4-6.1e-7 of the largest logit vs 2.8e-7-2.6e-6).

bf16 routers (Mixtral, Qwen3: ``F.linear(x, w)`` in bf16) ask for ``out_dtype=torch.bfloat16``:
the same fp32 sum, rounded once to nearest even in the kernel's store. Up to 16 tokens the GEMV
kernel, launched with PDL, replaces cuBLAS's launch (one token on the H200: 1.7-2.7 us against
5.1-5.6, and 3.9-4.1 us off the whole layer); above that cuBLAS's bf16 GEMM is faster than one
tensor-core program per tile over the whole H axis, so ``router_logits`` calls it.

``router_logits_reference`` is the plain-torch meaning (rounded to ``out_dtype``). Inputs other
than bf16 activations (or shapes the kernels do not take) go to the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe_compile.kernels.triton import cdiv, next_pow2
from moe_compile.kernels.triton.gemm import num_programs
from moe_compile.kernels.triton.launch import launch
from moe_compile.kernels.triton.pdl import pdl_enter, pdl_launch
from moe_compile.ops.routing import check_out_dtype, check_router_inputs, router_logits_reference

GEMV_MAX_TOKENS = 16


@triton.jit
def _store_rounded(ptrs, acc, mask, OUT_BF16: tl.constexpr):
    """Store fp32 ``acc``; bf16 outputs are rounded to nearest even by integer arithmetic (Triton's
    interpreter truncates its fp32 -> bf16 casts, the GPU rounds to nearest), fp16 by the
    store's own cast (to nearest on both)."""
    if OUT_BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        tl.store(ptrs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, T, H, stride_xt, stride_we, stride_ot,
                 HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Program ``e``: expert ``e``'s logits for every token; its weight row is read once, in as few
    wide loads as registers allow (one for ``T <= 2`` and ``H <= 8192``). The fp32 sum is rounded
    once, to ``out``'s dtype, by the store."""
    pdl_enter(PDL)
    e = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    tmask = t < T
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hmask = (h0 + h) < H
        w = tl.load(w_ptr + e.to(tl.int64) * stride_we + h0 + h, mask=hmask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + t[:, None] * stride_xt + (h0 + h)[None, :], mask=tmask[:, None] & hmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x * w[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e).to(tl.float32)
    _store_rounded(out_ptr + t * stride_ot + e, acc, tmask, OUT_BF16)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, T, E, H, h_per_program, stride_xt, stride_we, stride_ot,
                 stride_os, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Tile (tokens ``program_id(0)``, experts ``program_id(1)``) over the H range
    ``program_id(2)`` (``h_per_program`` wide, a multiple of ``BLOCK_H``); that range's partial
    sums go to ``out + program_id(2) * stride_os`` (the bias with range 0's), rounded to ``out``'s
    dtype by the store (bf16 logits come from one range only)."""
    pdl_enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    part_id = tl.program_id(2)
    h = tl.arange(0, BLOCK_H)
    tmask, emask = t < T, e < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    h_lo = part_id * h_per_program
    h_hi = tl.minimum(h_lo + h_per_program, H)
    for h0 in range(h_lo, h_hi, BLOCK_H):
        hmask = (h0 + h) < H
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + (h0 + h)[None, :],
                    mask=tmask[:, None] & hmask[None, :], other=0.0)
        w = tl.load(w_ptr + e[None, :].to(tl.int64) * stride_we + (h0 + h)[:, None],
                    mask=hmask[:, None] & emask[None, :], other=0.0)  # [BLOCK_H, BLOCK_E]
        # each K-chunk's products are summed on the tensor cores from zero and added to the fp32
        # total on CUDA cores: Hopper's tensor cores truncate their fp32 accumulation, which over
        # the whole K = 7168 drifted to 8e-6 of the largest logit (2e-5 with the split weights)
        if SPLIT:  # fp32 weights: hi + mid + lo, three bf16 parts holding the fp32 significand
            hi = w.to(tl.bfloat16)
            rest = w - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            part = tl.dot(x, lo)
            part = tl.dot(x, mid, part)
            acc += tl.dot(x, hi, part)
        elif IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:  # a zero the compiler cannot see, so it does not fold the add into the dot's accumulator
            acc += tl.dot(x, w, acc * 0.0)
    if HAS_BIAS:
        if part_id == 0:
            acc += tl.load(b_ptr + e, mask=emask, other=0.0).to(tl.float32)[None, :]
    out_ptr += part_id.to(tl.int64) * stride_os
    _store_rounded(out_ptr + t[:, None].to(tl.int64) * stride_ot + e[None, :], acc,
                   tmask[:, None] & emask[None, :], OUT_BF16)


def kernels_take(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernels compute these (checked) inputs, else the reference does: bf16
    activations, bf16 or fp32 weights, unit inner strides."""
    return (x.dtype == torch.bfloat16 and weight.dtype in (torch.bfloat16, torch.float32) and x.stride(1) == 1
            and weight.stride(1) == 1)


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``F.linear(x.float(), weight.float(), bias)`` -> ``[T, E]`` in ``out_dtype`` (see the module
    doc): fp32, or bf16/fp16, the fp32 sum rounded once (what a bf16 ``F.linear`` computes).

    bf16 logits from bf16 weights (Mixtral's and Qwen3's routers): the GEMV kernel up to
    ``GEMV_MAX_TOKENS`` tokens, cuBLAS's own bf16 ``F.linear`` above (on the H200 the GEMV took
    1.7-2.7 us where cuBLAS took 5.1-5.6 at one token, and the one-range tensor-core kernel
    6.7-30 us where cuBLAS took 5.4-18.9 at 32-8192 tokens: ``benchmarks/probe_router_bf16.py``)."""
    check_router_inputs(x, weight, bias)
    check_out_dtype(out_dtype)
    num_tokens, hidden = x.shape
    if not kernels_take(x, weight, bias):
        return router_logits_reference(x, weight, bias).to(out_dtype)
    if num_tokens > GEMV_MAX_TOKENS and out_dtype == x.dtype == weight.dtype and (bias is None
                                                                                  or bias.dtype == x.dtype):
        return F.linear(x, weight, bias)
    num_experts = weight.shape[0]
    out = torch.empty(num_tokens, num_experts, dtype=out_dtype, device=x.device)
    if num_tokens == 0:
        return out
    if num_tokens > GEMV_MAX_TOKENS:
        return _gemm(x, weight, bias, out)
    block_t = next_pow2(num_tokens)
    block_h = min(next_pow2(hidden), max(512, 16384 // block_t))
    launch(_gemv_kernel, (num_experts,), x, weight, bias if bias is not None else out, out, num_tokens, hidden,
           x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
           BLOCK_T=block_t, BLOCK_H=block_h, OUT_BF16=out.dtype == torch.bfloat16, num_warps=8,
           **pdl_launch(x.device))
    return out


def lowp_tiles(num_tokens: int, num_experts: int, num_sms: int) -> tuple[int, int]:
    """``(block_t, block_e)`` of the tensor-core kernel for low-precision logits, which take the
    whole H axis in one program (a split would need an fp32 pass before the rounding): the
    largest tiles that still give every SM a program, at least 16 x 16."""
    block_t = min(64, max(16, next_pow2(num_tokens)))
    block_e = min(128, max(16, next_pow2(num_experts)))
    while cdiv(num_tokens, block_t) * cdiv(num_experts, block_e) < num_sms:
        if block_e >= block_t and block_e > 16:
            block_e //= 2
        elif block_t > 16:
            block_t //= 2
        else:
            break
    return block_t, block_e


def h_splits(num_tokens: int, num_experts: int, hidden: int, num_sms: int) -> tuple[int, int, int, int]:
    """``(block_t, block_e, splits, h_per_program)`` of the tensor-core kernel: token x expert
    tiles, and the H axis cut into ``splits`` ranges (multiples of 64 wide, at least 8 steps
    each) while the grid stays within one program per SM."""
    block_t = min(64 if num_tokens <= 1024 else 128, max(16, next_pow2(num_tokens)))
    block_e = min(128, max(16, next_pow2(num_experts)))
    tiles = cdiv(num_tokens, block_t) * cdiv(num_experts, block_e)
    steps = cdiv(hidden, 64)
    splits = max(1, min(num_sms // tiles, steps // 8))
    h_per_program = cdiv(steps, splits) * 64
    return block_t, block_e, cdiv(hidden, h_per_program), h_per_program


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
          tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """The tensor-core kernel (fp32 inputs, which only the interpreter tests use, take fp32 FMA).
    fp32 ``out``: with the H axis split, each range's partial sums land in ``[splits, T, E]`` and
    are added in a fixed order (``sum`` over the first dim): the same bits on every call.
    Low-precision ``out``: one range, ``tiles`` (``(block_t, block_e)``) or ``lowp_tiles``'."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    split = x.dtype == torch.bfloat16 and weight.dtype == torch.float32
    if out.dtype == torch.float32:
        block_t, block_e, splits, h_per = h_splits(num_tokens, num_experts, hidden, num_programs(x.device))
    else:
        block_t, block_e = tiles or lowp_tiles(num_tokens, num_experts, num_programs(x.device))
        splits, h_per = 1, cdiv(hidden, 64) * 64
    grid = (cdiv(num_tokens, block_t), cdiv(num_experts, block_e), splits)
    dest = out if splits == 1 else torch.empty(splits, num_tokens, num_experts, dtype=torch.float32,
                                               device=x.device)
    launch(_gemm_kernel, grid, x, weight, bias if bias is not None else out, dest, num_tokens, num_experts, hidden,
           h_per, x.stride(0), weight.stride(0), dest.stride(-2), dest.stride(0) if splits > 1 else 0,
           SPLIT=split, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
           BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=64, OUT_BF16=out.dtype == torch.bfloat16,
           num_warps=4 if block_t <= 64 else 8, num_stages=3, **pdl_launch(x.device))
    if splits > 1:
        torch.sum(dest, 0, out=out)
    return out


__all__ = ["GEMV_MAX_TOKENS", "h_splits", "kernels_take", "lowp_tiles",
           "router_logits", "router_logits_reference"]
