"""Decode-sized experts in one kernel: GEMM1, activation, GEMM2 and the weighted combine.

At a few tokens the expert GEMMs only stream weights, and the ``pairs`` path spends its time in
two GEMM launches (each with its own ramp-up and last wave) and a combine launch. Here one launch
does all of it. Program ``(pair p, slice s)`` owns ``BLOCK_I`` intermediate columns of pair ``p``'s
expert ``e`` (token ``t = p // k``)::

    h[s]    = act(x[t] @ W13[e][:, gate/up cols of s] + b13)           rounded to x's dtype
    acc[t] += w[p] * (h[s] @ W2[e][rows of s, :] (+ b2[e] in slice 0))  fp32 atomics

so every weight byte of a hit expert is read once, by one program, and the ``[P, I]`` and
``[P, H]`` intermediates never reach memory. Both products run on tensor cores with the token's
row broadcast to a 16-row tile, so Triton pipelines the weight loads (the CUDA-core ``gemv``
path's loads are not pipelined, which is why it lost to ``pairs``).

Each program fences its atomics GPU-wide (in every thread: a CTA barrier alone does not order
the other warps' atomics before the ticket), then takes a ticket from a per-token counter; the
last program of each token converts the token's fp32 row to the output dtype and puts the row and
the counter back to zero, so the workspace is clean for the next call without a memset. The
workspace (``acc [T_cap, H]`` fp32 and ``T_cap`` counters) is kept per (device, stream, H, row
bucket) and never freed, so CUDA graphs that captured it stay valid. The fp32 sums over slices and
experts are taken in the order the atomics land, so two runs can round a value to the output
dtype differently (one unit in its last place, rarely). Experts not on this rank (``expert_map``
-> -1) read nothing, but their programs still take a ticket.

``finish="launch"`` leaves the rows to a second kernel (one program per token) instead of the
tickets.

Status (fifteenth session, H200, ``benchmarks/probe_decode.py``, experts alone in CUDA graphs,
each point's best of 21 block choices, then 4 rounds side by side): slower than or level with the
tuned ``pairs`` plan, so no tuned file uses it. Qwen3 M = 1: 34.9 vs 26.2 µs (1.33x); Qwen3 M = 4:
76.4 vs 76.1 µs (1.004x). The first two runs, before the fences and the exchanged reads, timed
25.3-26.2 µs at Qwen3 M = 1, but their rows were written before every slice's atomics had landed
(up to 0.4 relative error at DeepSeek-V3 M = 1 and Qwen3 M = 4): that speed was the race's. With
the ordering right, each program's end waits for its atomics, and the token's last program then
adds a ticket and a row exchange to the critical path. Mixtral and DeepSeek-V3 M = 1 were 1-3 %
slower than ``pairs`` even in the racy runs, so they were not timed again.

``decode_experts_reference`` is the plain-torch meaning (the same rounding of ``h``).
"""
from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from moe_compile.kernels.triton import cdiv, interpreting, next_pow2
from moe_compile.kernels.triton.activation import act_code, apply_act
from moe_compile.kernels.triton.launch import launch
from moe_compile.kernels.triton.pdl import pdl_enter, pdl_launch
from moe_compile.ops.activation import apply_activation, intermediate_size
from moe_compile.ops.config import ExpertsConfig


@triton.jit
def _fence(x, FENCE: tl.constexpr):
    """Every thread: its global atomics so far are performed GPU-wide before what follows (PTX
    ``fence.acq_rel.gpu``; a CTA barrier alone orders them only within the CTA). ``x``: any int32
    tensor spread over the program's threads. Off under the interpreter (which runs in order)."""
    if FENCE:
        x = tl.inline_asm_elementwise("fence.acq_rel.gpu;\n mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return x


@triton.jit
def _w13_dot(a, acc, w13_desc, ptrs, row, k0, mask, TMA: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @`` one ``[BLOCK_K, BLOCK_I]`` tile of W13: the TMA box at ``(row, k0)`` of the
    ``[E * N13, H]`` rows, or pointer loads at ``ptrs``."""
    if TMA:
        w = w13_desc.load([row, k0]).T
    else:
        w = tl.load(ptrs, mask=mask, other=0.0)
    if IEEE:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _decode_kernel(x_ptr, w13_ptr, b13_ptr, w2_ptr, b2_ptr, ids_ptr, map_ptr, tw_ptr, acc_ptr, ticket_ptr, out_ptr,
                   w13_desc, w2_desc, H, I, E_local, NUM_SLICES, N13,
                   stride_xt, stride_1e, stride_1k, stride_1n, stride_1be, stride_1bn,
                   stride_2e, stride_2k, stride_2n, stride_2be, stride_2bn, stride_ot,
                   up_off, col_mult, alpha, limit,
                   TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_B13: tl.constexpr, HAS_B2: tl.constexpr,
                   GATED: tl.constexpr, ACT: tl.constexpr, WEIGHTED: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, FINAL_N: tl.constexpr,
                   TMA: tl.constexpr, FENCE: tl.constexpr, FINISH: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    pair = pid // NUM_SLICES
    s = pid % NUM_SLICES
    t = pair // TOP_K
    e = tl.load(ids_ptr + pair)
    if HAS_MAP:
        e = tl.load(map_ptr + e)
    live = (e >= 0) & (e < E_local)
    nn = tl.arange(0, BLOCK_N)
    if live:
        rows = tl.arange(0, 16)
        i = s * BLOCK_I + tl.arange(0, BLOCK_I)
        imask = i < I
        kk = tl.arange(0, BLOCK_K)
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        g_ptrs = (w13_ptr + e.to(tl.int64) * stride_1e + kk[:, None] * stride_1k
                  + (i * col_mult)[None, :].to(tl.int64) * stride_1n)
        u_ptrs = g_ptrs + up_off * stride_1n
        g_row = e * N13 + s * BLOCK_I  # TMA: W13 as [E * N13, H] rows, whole slices inside the gate / up half
        acc_g = tl.zeros([16, BLOCK_I], dtype=tl.float32)
        acc_u = tl.zeros([16, BLOCK_I], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kmask = (k0 + kk) < H
            xk = tl.load(x_row + k0 + kk, mask=kmask, other=0.0)
            a = tl.broadcast_to(xk[None, :], (16, BLOCK_K))
            m = kmask[:, None] & imask[None, :]
            acc_g = _w13_dot(a, acc_g, w13_desc, g_ptrs, g_row, k0, m, TMA, IEEE)
            if GATED:
                acc_u = _w13_dot(a, acc_u, w13_desc, u_ptrs, g_row + up_off, k0, m, TMA, IEEE)
            g_ptrs += BLOCK_K * stride_1k
            u_ptrs += BLOCK_K * stride_1k
        if HAS_B13:
            b_base = b13_ptr + e.to(tl.int64) * stride_1be
            acc_g += tl.load(b_base + i * col_mult * stride_1bn, mask=imask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(b_base + (i * col_mult + up_off) * stride_1bn, mask=imask,
                                 other=0.0).to(tl.float32)[None, :]
        h = apply_act(acc_g, acc_u, alpha, limit, ACT)
        h = tl.where(imask[None, :], h, 0.0).to(x_ptr.dtype.element_ty)  # as the [P, I] buffer rounds it
        scale = 1.0
        if WEIGHTED:
            scale = tl.load(tw_ptr + pair)
        w2_ptrs = w2_ptr + e.to(tl.int64) * stride_2e + i[:, None].to(tl.int64) * stride_2k + nn[None, :] * stride_2n
        acc_row = acc_ptr + t.to(tl.int64) * H
        b2_end = tl.where(s == 0, H, 0)  # the bias once per pair: in slice 0
        for n0 in range(0, H, BLOCK_N):
            nmask = (n0 + nn) < H
            if TMA:  # W2 as [E * H, I] rows (HF's storage): a [BLOCK_N, BLOCK_I] box
                w2 = w2_desc.load([e * H + n0, s * BLOCK_I]).T
            else:
                w2 = tl.load(w2_ptrs, mask=imask[:, None] & nmask[None, :], other=0.0)
            if IEEE:
                y = tl.dot(h, w2, input_precision="ieee")
            else:
                y = tl.dot(h, w2)
            y0 = tl.sum(tl.where(rows[:, None] == 0, y, 0.0), axis=0)  # [BLOCK_N]: the token's row
            if HAS_B2:
                y0 += tl.load(b2_ptr + e.to(tl.int64) * stride_2be + (n0 + nn) * stride_2bn,
                              mask=(n0 + nn) < b2_end, other=0.0).to(tl.float32)
            tl.atomic_add(acc_row + n0 + nn, y0 * scale, mask=nmask, sem="relaxed")
            w2_ptrs += BLOCK_N * stride_2n
        _fence(nn, FENCE)
    if FINISH:  # every program of token t takes a ticket once its atomics are performed; the last finishes the row
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + t, 1, sem="acq_rel")
        if ticket == TOP_K * NUM_SLICES - 1:
            _fence(nn, FENCE)
            _finish_row(acc_ptr, out_ptr, t, H, stride_ot, FINAL_N)
            tl.atomic_xchg(ticket_ptr + t, 0)


@triton.jit
def _finish_row(acc_ptr, out_ptr, t, H, stride_ot, FINAL_N: tl.constexpr):
    """Token ``t``'s fp32 row -> ``out`` in its dtype, and the row back to zero: read and zeroed by
    atomic exchanges, at L2, so no stale L1 line of an earlier call can be read."""
    fn = tl.arange(0, FINAL_N)
    acc_row = acc_ptr.to(tl.pointer_type(tl.int32)) + t.to(tl.int64) * H  # the fp32 bits (exchanged as int32)
    for n0 in range(0, H, FINAL_N):
        nmask = (n0 + fn) < H
        v = tl.atomic_xchg(acc_row + n0 + fn, tl.zeros([FINAL_N], dtype=tl.int32), mask=nmask).to(tl.float32,
                                                                                                 bitcast=True)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + n0 + fn, v.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _finish_kernel(acc_ptr, out_ptr, H, stride_ot, FINAL_N: tl.constexpr, PDL: tl.constexpr = False):
    """``finish="launch"``: one program per token after the decode kernel."""
    pdl_enter(PDL)
    _finish_row(acc_ptr, out_ptr, tl.program_id(0), H, stride_ot, FINAL_N)


def _descriptors(w13: torch.Tensor, w2: torch.Tensor, block_i: int, block_k: int, block_n: int, *,
                 interleaved: bool, inter: int) -> tuple[object, object] | None:
    """TMA descriptors of both weights where their storage is HF's (``[E, N13, H]`` and
    ``[E, H, I]``, rows 16-byte aligned) and the blocks tile whole gate / up halves; else ``None``."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    num_local, hidden, n13 = w13.shape
    esize = w13.element_size()
    ok = (not interleaved and inter % block_i == 0 and hidden % block_n == 0
          and w13.stride(1) == 1 and w13.stride(2) == hidden and w13.stride(0) == n13 * hidden
          and w2.stride(1) == 1 and w2.stride(2) == inter and w2.stride(0) == hidden * inter
          and (hidden * esize) % 16 == 0 and (inter * esize) % 16 == 0
          and w13.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0)
    if not ok:
        return None
    rows13 = w13.transpose(1, 2).reshape(num_local * n13, hidden)  # views of the storage, no copies
    rows2 = w2.transpose(1, 2).reshape(num_local * hidden, inter)
    return (TensorDescriptor.from_tensor(rows13, [block_i, block_k]),
            TensorDescriptor.from_tensor(rows2, [block_n, block_i]))


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_LOCK = threading.Lock()


def _device_stream(device: torch.device) -> tuple[str, int, int]:
    """``(type, index, stream)``: ``cuda`` and ``cuda:0`` (the current device) are one key."""
    if device.type != "cuda":
        return device.type, device.index or 0, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device.type, index, torch.cuda.current_stream(index).cuda_stream


def workspace(device: torch.device, num_tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(acc fp32 [T_cap, H], tickets int32 [T_cap])``, zero between calls (the kernel cleans them).

    One per (device, stream, H, power-of-two row bucket), allocated once and never freed: a CUDA
    graph that captured a launch keeps pointing at it."""
    cap = max(16, next_pow2(num_tokens))
    key = (*_device_stream(device), hidden, cap)
    with _LOCK:
        ws = _WORKSPACES.get(key)
        if ws is None:
            ws = (torch.zeros(cap, hidden, dtype=torch.float32, device=device),
                  torch.zeros(cap, dtype=torch.int32, device=device))
            _WORKSPACES[key] = ws
    return ws


def decode_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, config: ExpertsConfig, out: torch.Tensor, *,
                   w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                   expert_map: torch.Tensor | None = None, weighted: bool = True, block_i: int = 32,
                   block_k: int = 128, block_n: int = 128, num_warps: int = 4, num_stages: int = 3,
                   tma: bool = False, finish: str = "ticket") -> torch.Tensor:
    """``x [T, H]``, contiguous fp32 ``topk_weights [T, k]`` and int32 ``topk_ids [T, k]``, weights
    ``w13 [E, H, N13]`` / ``w2 [E, I, H]`` (any strides) -> ``out [T, H]`` (see the module doc).

    ``block_i``: intermediate columns per program (>= 16, a power of two); ``block_k``: the first
    product's K step; ``block_n``: the second product's output columns per step; ``tma``: both
    weights by TMA descriptors where their storage allows (HF's layout, blocks tiling the halves),
    pointer loads otherwise; ``finish``: ``"ticket"`` (the last program of a token writes its row)
    or ``"launch"`` (a second, one-program-per-token kernel does)."""
    num_tokens, top_k = topk_ids.shape
    num_local, hidden, _ = w13.shape
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous() or topk_ids.dtype != torch.int32 \
            or not topk_ids.is_contiguous():
        raise TypeError(f"decode_experts: topk_weights must be contiguous fp32 and topk_ids contiguous int32, but got "
                        f"{topk_weights.dtype} and {topk_ids.dtype}.")
    if tuple(out.shape) != (num_tokens, hidden) or out.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"decode_experts: x and out must be [{num_tokens}, {hidden}] with contiguous rows, but got "
                         f"x {tuple(x.shape)} strides {x.stride()} and out {tuple(out.shape)} strides {out.stride()}.")
    for name, v in (("block_i", block_i), ("block_k", block_k), ("block_n", block_n)):
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"decode_experts: {name}={v!r} must be a power of two >= 16.")
    if finish not in ("ticket", "launch"):
        raise ValueError(f"decode_experts: finish={finish!r} must be 'ticket' or 'launch'.")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"decode_experts: x.dtype={x.dtype} must be one of bf16/fp16/fp32.")
    inter = w2.shape[1]
    if intermediate_size(w13.shape[2], config.activation) != inter:
        raise ValueError(f"decode_experts: w13 has {w13.shape[2]} columns but w2 has {inter} rows (activation "
                         f"{config.activation.value}).")
    if num_tokens == 0:
        return out
    gated = config.activation.is_gated
    interleaved = gated and config.gate_up_interleaved
    acc, tickets = workspace(x.device, num_tokens, hidden)
    slices = cdiv(inter, block_i)
    emap = expert_map if expert_map is not None else topk_ids
    final_n = min(1024, next_pow2(hidden))
    descs = _descriptors(w13, w2, block_i, block_k, block_n, interleaved=interleaved, inter=inter) if tma else None
    launch(_decode_kernel, (num_tokens * top_k * slices,),
        x, w13, w13_bias if w13_bias is not None else w13, w2, w2_bias if w2_bias is not None else w2,
        topk_ids, emap, topk_weights, acc, tickets, out, *(descs or (None, None)),
        hidden, inter, num_local, slices, w13.shape[2],
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        0 if w13_bias is None else w13_bias.stride(0), 0 if w13_bias is None else w13_bias.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        0 if w2_bias is None else w2_bias.stride(0), 0 if w2_bias is None else w2_bias.stride(1), out.stride(0),
        1 if interleaved else inter, 2 if interleaved else 1, float(config.swiglu_alpha), float(config.swiglu_limit),
        TOP_K=top_k, HAS_MAP=expert_map is not None, HAS_B13=w13_bias is not None, HAS_B2=w2_bias is not None,
        GATED=gated, ACT=act_code(config), WEIGHTED=weighted, IEEE=x.dtype == torch.float32,
        BLOCK_I=block_i, BLOCK_K=block_k, BLOCK_N=block_n, FINAL_N=final_n, TMA=descs is not None,
        FENCE=not interpreting(), FINISH=finish == "ticket", num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(x.device))
    if finish == "launch":
        launch(_finish_kernel, (num_tokens,), acc, out, hidden, out.stride(0), FINAL_N=final_n, num_warps=4,
               **pdl_launch(x.device))
    return out


def decode_experts_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                             w2: torch.Tensor, config: ExpertsConfig, *, w13_bias: torch.Tensor | None = None,
                             w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                             weighted: bool = True) -> torch.Tensor:
    """fp32 ``[T, H]``: per pair ``act(x @ W13 + b13)`` rounded to x's dtype, ``@ W2 + b2``, weighted, summed."""
    out = torch.zeros(x.shape[0], w13.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
            if e < 0 or e >= w13.shape[0]:
                continue
            h = x[t].float() @ w13[e].float()
            if w13_bias is not None:
                h = h + w13_bias[e].float()
            h = apply_activation(h[None], config)[0].to(x.dtype).float()
            y = h @ w2[e].float()
            if w2_bias is not None:
                y = y + w2_bias[e].float()
            out[t] += y * (float(topk_weights[t, j]) if weighted else 1.0)
    return out


__all__ = ["decode_experts", "decode_experts_reference", "workspace"]
