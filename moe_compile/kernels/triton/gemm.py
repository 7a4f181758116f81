"""Expert GEMMs over expert-grouped rows, with the activation fused into the first one.

``moe_gemm`` computes, for every M-block of rows that belong to one expert ``e``::

    out[r, n] = act( A[a_row(r), :] @ W[e][:, cols(n)] + bias[e, cols(n)] )

- ``sorted`` blocks: rows ``r`` index the expert-ordered pair list of ``align.py``; a program finds
  its expert and row range from the ``E`` counts (prefix sums in registers), so no block table and
  no padded rows exist. For the first GEMM ``a_row(r) = sorted_pair[r] // top_k`` (the token rows
  are gathered on the fly), for the second ``a_row(r) = r``.
- ``pair`` blocks (few pairs, many experts: decode): block ``m`` is pair ``m`` alone, its expert
  read straight from ``topk_ids``; no sorting kernels run at all.

An expert's last block may take up to ``merge_m`` rows past a full block: they run as the narrow
N side of a transposed MMA (``W^T @ A^T``) on the same weight tiles in the same K-loop, so a few
rows past a full block neither read the weights again nor pad a whole tile.

The second GEMM may split K (``split_k``): each tile runs as that many programs over slices of K,
writing partial products to ``out[s]``, which the combine adds. A GEMM of few long-K tiles (Mixtral's
down projection, K = 14336) then fills the SMs' last wave instead of leaving most of them idle.

Gated activations compute the gate and the up tile of the same output columns in one program (two
accumulators), so the ``[P, 2I]`` intermediate never reaches memory. ``W`` is addressed through its
strides, so HF's ``[E, 2I, H]`` weights pass as a transposed ``[E, H, 2I]`` view without a copy.

Which program computes which rows, columns and K slice (block counts, tile orders, the split
into K slices) is ``gemm_layout.py``; this module computes the tiles and launches the kernel.

``moe_gemm_reference`` is the plain-torch meaning (a loop over rows' experts).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_compile.kernels.triton import cdiv, interpreting, next_pow2
from moe_compile.kernels.triton.activation import act_code, apply_act
from moe_compile.kernels.triton.gemm_layout import (
    _block_rows, _blocks_of, _expert_pid, _grouped_pid, _split_of, max_m_blocks,
)
from moe_compile.kernels.triton.launch import launch
from moe_compile.kernels.triton.pdl import pdl_enter, pdl_launch
from moe_compile.ops.activation import apply_activation
from moe_compile.ops.config import ExpertsConfig

NO_ACT = -1
log = logging.getLogger("moe_compile")


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: int = 0  # 1: weight tiles (and ungathered A tiles) by TMA descriptors where the layout allows
    persistent: int = 0  # 1: one program per SM walks the live tiles; 2: also flatten the tile loop
    tail_m: int = 0  # > 0: an expert's last block with at most this many rows runs as a tail_m-row tile
    expert_order: int = 0  # 1: the tiles go expert by expert (group_m then counts within one expert)
    merge_m: int = 0  # > 0: an expert's last block holds up to block_m + merge_m rows (the extra rows transposed)
    merge_launch: int = 0  # 1: those merged blocks run in a second launch; the first keeps the plain tile's code
    split_k: int = 1  # > 1 (second GEMM only): each tile as split_k K slices, out [split_k, P, N] to be summed

    @staticmethod
    def from_dict(d: dict) -> "GemmConfig":
        return GemmConfig(**{k: int(v) for k, v in d.items() if k in GemmConfig.__dataclass_fields__})


@triton.jit
def _gemm_tile(
    e, row0, row_end, pid_n, a_ptr, w_ptr, bias_ptr, out_ptr, sorted_ptr, w_desc, a_desc,
    N, K, k_lo, N_total, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_be, stride_bn, stride_om,
    up_off, col_mult, alpha, limit,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, PAIR_BLOCKS: tl.constexpr, GATED: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    A_TMA: tl.constexpr, EXTRA: tl.constexpr = 0,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile of expert ``e``: rows ``row0 ..`` (stored below
    ``row_end``), output columns block ``pid_n``.

    ``EXTRA > 0``: also the up to ``EXTRA`` rows after them, on the same weight tiles in the same
    K-loop, computed transposed (``W^T @ A^T``: the weight tile is the MMA's wide side, these
    rows its narrow N side, which the tensor cores take down to 16 rows). So an expert's few
    rows past its last full block neither read the weights again nor pad a whole tile."""
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    if GATHER_A:
        if PAIR_BLOCKS:
            a_rows = rows // TOP_K
        else:
            a_rows = tl.load(sorted_ptr + rows, mask=rmask, other=0) // TOP_K
    else:
        a_rows = rows
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + k[None, :] * stride_ak
    w_base = w_ptr + e.to(tl.int64) * stride_we
    g_ptrs = w_base + k[:, None] * stride_wk + (n * col_mult)[None, :].to(tl.int64) * stride_wn
    a_ptrs += k_lo * stride_ak  # this program's K range is [k_lo, K): split-K runs a slice of it
    g_ptrs += k_lo * stride_wk
    u_ptrs = g_ptrs + up_off * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if EXTRA > 0:
        rows2 = row0 + BLOCK_M + tl.arange(0, EXTRA)
        rmask2 = rows2 < row_end
        if GATHER_A:
            a2_rows = tl.load(sorted_ptr + rows2, mask=rmask2, other=0) // TOP_K
        else:
            a2_rows = rows2
        # [BLOCK_K, EXTRA]
        a2t_ptrs = a_ptr + a2_rows[None, :].to(tl.int64) * stride_am + (k_lo + k)[:, None] * stride_ak
        acc2_g = tl.zeros([BLOCK_N, EXTRA], dtype=tl.float32)
        acc2_u = tl.zeros([BLOCK_N, EXTRA], dtype=tl.float32)
    # TMA: W is [E * N_total, K] K-major (the caller checked it), whole N-blocks inside one expert
    w_row = e * N_total + pid_n * BLOCK_N
    for k0 in range(k_lo, K, BLOCK_K):
        if A_TMA:  # ungathered rows: rows past row_end are computed and never stored
            a = a_desc.load([row0, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
        else:
            kmask = (k0 + k) < K
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        if EXTRA > 0:
            if EVEN_K:
                a2t = tl.load(a2t_ptrs, mask=rmask2[None, :], other=0.0)
            else:
                a2t = tl.load(a2t_ptrs, mask=((k0 + k) < K)[:, None] & rmask2[None, :], other=0.0)
        if W_TMA:
            wg = w_desc.load([w_row, k0]).T
        elif EVEN_K:
            wg = tl.load(g_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = (k0 + k) < K
            wg = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
        if EXTRA > 0:
            if IEEE:
                acc2_g = tl.dot(wg.T, a2t, acc2_g, input_precision="ieee")
            else:
                acc2_g = tl.dot(wg.T, a2t, acc2_g)
        if GATED:
            if W_TMA:
                wu = w_desc.load([w_row + up_off, k0]).T
            elif EVEN_K:
                wu = tl.load(u_ptrs, mask=nmask[None, :], other=0.0)
            else:
                wu = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if IEEE:
                acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(a, wu, acc_u)
            if EXTRA > 0:
                if IEEE:
                    acc2_u = tl.dot(wu.T, a2t, acc2_u, input_precision="ieee")
                else:
                    acc2_u = tl.dot(wu.T, a2t, acc2_u)
            u_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
        if EXTRA > 0:
            a2t_ptrs += BLOCK_K * stride_ak
    b_base = bias_ptr + e.to(tl.int64) * stride_be
    if HAS_BIAS and k_lo == 0:  # split-K: the first K slice adds it
        acc_g += tl.load(b_base + n * col_mult * stride_bn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_base + (n * col_mult + up_off) * stride_bn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if ACT >= 0:
        acc_g = apply_act(acc_g, acc_u, alpha, limit, ACT)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + n[None, :]
    tl.store(out_ptrs, acc_g.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])
    if EXTRA > 0:  # the extra rows' tile, transposed: [BLOCK_N, EXTRA]
        if HAS_BIAS and k_lo == 0:
            acc2_g += tl.load(b_base + n * col_mult * stride_bn, mask=nmask, other=0.0).to(tl.float32)[:, None]
            if GATED:
                acc2_u += tl.load(b_base + (n * col_mult + up_off) * stride_bn, mask=nmask,
                                  other=0.0).to(tl.float32)[:, None]
        if ACT >= 0:
            acc2_g = apply_act(acc2_g, acc2_u, alpha, limit, ACT)
        out2_ptrs = out_ptr + rows2[None, :].to(tl.int64) * stride_om + n[:, None]
        tl.store(out2_ptrs, acc2_g.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & rmask2[None, :])


@triton.jit
def _block_tile(
    e, row0, row_end, pid_n, a_ptr, w_ptr, bias_ptr, out_ptr, sorted_ptr, w_desc, a_desc,
    N, K, k_lo, N_total, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_be, stride_bn, stride_om,
    up_off, col_mult, alpha, limit,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, PAIR_BLOCKS: tl.constexpr, GATED: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    A_TMA: tl.constexpr, TAIL_M: tl.constexpr, MERGE_M: tl.constexpr = 0, MERGE_PASS: tl.constexpr = 0,
):
    """An M-block's tile; with ``TAIL_M`` an expert's last block holding at most ``TAIL_M`` rows
    runs as a ``TAIL_M``-row tile (A by pointer loads), so a block that is mostly padding costs
    a fraction of a full one; with ``MERGE_M`` a last block of more than ``BLOCK_M`` rows runs
    as a full tile plus its extra rows transposed (``_gemm_tile``'s ``EXTRA``); an expert's
    earlier blocks see more than ``BLOCK_M + MERGE_M`` rows up to its end (``merge_m < block_m``).
    With ``MERGE_PASS == 1`` no block here is merged (``_blocks_of``); the second launch runs them."""
    if MERGE_M > 0 and MERGE_PASS == 0 and row_end - row0 > BLOCK_M and row_end - row0 <= BLOCK_M + MERGE_M:
        _gemm_tile(e, row0, row_end, pid_n, a_ptr, w_ptr, bias_ptr, out_ptr, sorted_ptr, w_desc, a_desc,
                   N, K, k_lo, N_total, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_be, stride_bn,
                   stride_om, up_off, col_mult, alpha, limit, TOP_K, GATHER_A, PAIR_BLOCKS, GATED, ACT, HAS_BIAS,
                   EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, A_TMA, MERGE_M)
    elif TAIL_M > 0 and row_end - row0 <= TAIL_M:
        _gemm_tile(e, row0, row_end, pid_n, a_ptr, w_ptr, bias_ptr, out_ptr, sorted_ptr, w_desc, a_desc,
                   N, K, k_lo, N_total, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_be, stride_bn,
                   stride_om, up_off, col_mult, alpha, limit, TOP_K, GATHER_A, PAIR_BLOCKS, GATED, ACT, HAS_BIAS,
                   EVEN_K, IEEE, TAIL_M, BLOCK_N, BLOCK_K, W_TMA, False)
    else:
        _gemm_tile(e, row0, row_end, pid_n, a_ptr, w_ptr, bias_ptr, out_ptr, sorted_ptr, w_desc, a_desc,
                   N, K, k_lo, N_total, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_be, stride_bn,
                   stride_om, up_off, col_mult, alpha, limit, TOP_K, GATHER_A, PAIR_BLOCKS, GATED, ACT, HAS_BIAS,
                   EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, A_TMA)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, sorted_ptr, counts_ptr, ids_ptr, map_ptr, w_desc, a_desc,
    E_local, N, K, launched, N_total, row_stride,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_be, stride_bn, stride_om, stride_os,
    up_off, col_mult, alpha, limit,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, PAIR_BLOCKS: tl.constexpr, HAS_MAP: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, E_PAD: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr,
    BATCHED: tl.constexpr, TAIL_M: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
    EXPERT_ORDER: tl.constexpr = False, PDL: tl.constexpr = False, MERGE_M: tl.constexpr = 0,
    MERGE_PASS: tl.constexpr = 0, SPLIT_K: tl.constexpr = 1,
):
    """Grid launch (``PERSISTENT`` off): one program per (M-block, N-block) of the upper bound of
    ``launched`` M-blocks; dead blocks return. Persistent: ``launched`` programs (about one per
    SM) walk the live tiles only, counted on the device from the expert counts (sorted or batched
    blocks; ``FLATTEN`` lets the compiler overlap one tile's epilogue with the next tile's loads).

    ``MERGE_PASS``: 0, merged last blocks (``MERGE_M``) run in place; 1, they are left out; 2, only
    they run, one program per (expert, N-block), so the other launch keeps the plain tile's code.

    ``SPLIT_K > 1``: every tile runs as ``SPLIT_K`` programs over K slices, slice ``s`` writing
    its partial product to ``out + s * stride_os`` (the caller sums the slices)."""
    pdl_enter(PDL)
    if MERGE_PASS == 2:
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid, ks, k_lo, k_hi = _split_of(tl.program_id(0), E_local * num_pid_n, K, BLOCK_K, SPLIT_K)
        e = pid // num_pid_n
        pid_n = pid % num_pid_n
        eo = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + eo, mask=eo < E_local, other=0)
        count = tl.sum(tl.where(eo == e, counts, 0))
        if BATCHED:
            start = e * row_stride
        else:
            start = tl.sum(tl.where(eo < e, counts, 0))
        row0 = start + _blocks_of(count, BLOCK_M, MERGE_M, 1)[1]  # past the first launch's rows
        row_end = start + count
        if row_end > row0:  # a merged last block (the rule is _blocks_of's alone)
            _gemm_tile(e, row0, row_end, pid_n, a_ptr, w_ptr, bias_ptr, out_ptr + ks * stride_os, sorted_ptr,
                       w_desc, a_desc, N, k_hi, k_lo, N_total, stride_am, stride_ak, stride_we, stride_wk, stride_wn,
                       stride_be, stride_bn, stride_om, up_off, col_mult, alpha, limit, TOP_K, GATHER_A, PAIR_BLOCKS,
                       GATED, ACT, HAS_BIAS, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, A_TMA, MERGE_M)
    elif PERSISTENT:
        eo = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + eo, mask=eo < E_local, other=0)
        live_m = tl.sum(_blocks_of(counts, BLOCK_M, MERGE_M, MERGE_PASS)[0])
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile_k in tl.range(tl.program_id(0), live_m * num_pid_n * SPLIT_K, launched, flatten=FLATTEN):
            tile, ks, k_lo, k_hi = _split_of(tile_k, live_m * num_pid_n, K, BLOCK_K, SPLIT_K)
            if EXPERT_ORDER:
                pid_m, pid_n = _expert_pid(tile, counts_ptr, E_local, num_pid_n, BLOCK_M, E_PAD, GROUP_M, MERGE_M,
                                           MERGE_PASS)
            else:
                pid_m, pid_n = _grouped_pid(tile, live_m, num_pid_n, GROUP_M)
            live, e, row0, row_end = _block_rows(pid_m, counts_ptr, ids_ptr, map_ptr, E_local, row_stride,
                                                 PAIR_BLOCKS, HAS_MAP, BLOCK_M, E_PAD, BATCHED, MERGE_M,
                                                 MERGE_PASS)
            _block_tile(e, row0, row_end, pid_n, a_ptr, w_ptr, bias_ptr, out_ptr + ks * stride_os, sorted_ptr,
                        w_desc, a_desc, N, k_hi, k_lo, N_total, stride_am, stride_ak, stride_we, stride_wk, stride_wn,
                        stride_be, stride_bn, stride_om, up_off, col_mult, alpha, limit, TOP_K, GATHER_A, PAIR_BLOCKS,
                        GATED, ACT, HAS_BIAS, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, A_TMA, TAIL_M, MERGE_M,
                        MERGE_PASS)
    else:
        tile, ks, k_lo, k_hi = _split_of(tl.program_id(0), launched * tl.cdiv(N, BLOCK_N), K, BLOCK_K, SPLIT_K)
        if EXPERT_ORDER:
            pid_m, pid_n = _expert_pid(tile, counts_ptr, E_local, tl.cdiv(N, BLOCK_N), BLOCK_M, E_PAD,
                                       GROUP_M, MERGE_M, MERGE_PASS)
        else:
            pid_m, pid_n = _grouped_pid(tile, launched, tl.cdiv(N, BLOCK_N), GROUP_M)
        live, e, row0, row_end = _block_rows(pid_m, counts_ptr, ids_ptr, map_ptr, E_local, row_stride,
                                             PAIR_BLOCKS, HAS_MAP, BLOCK_M, E_PAD, BATCHED, MERGE_M, MERGE_PASS)
        if not live:
            return
        _block_tile(e, row0, row_end, pid_n, a_ptr, w_ptr, bias_ptr, out_ptr + ks * stride_os, sorted_ptr,
                    w_desc, a_desc, N, k_hi, k_lo, N_total, stride_am, stride_ak, stride_we, stride_wk, stride_wn,
                    stride_be, stride_bn, stride_om, up_off, col_mult, alpha, limit, TOP_K, GATHER_A, PAIR_BLOCKS,
                    GATED, ACT, HAS_BIAS, EVEN_K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, A_TMA, TAIL_M, MERGE_M,
                    MERGE_PASS)


def _check(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> None:
    for name, t in (("a", a), ("w", w), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, but got {type(t).__name__}.")
    if a.dim() != 2 or w.dim() != 3 or out.dim() != 2:
        raise ValueError(f"expected a [R, K], w [E, K, N], out [P, N_out]; got {tuple(a.shape)}, "
                         f"{tuple(w.shape)}, {tuple(out.shape)}.")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"a.shape[1]={a.shape[1]} must equal w.shape[1]={w.shape[1]} (the reduction dim K).")
    if out.shape[1] != n_out or out.stride(1) != 1:
        raise ValueError(f"out must be [P, {n_out}] with a contiguous last dim, but got {tuple(out.shape)} "
                         f"strides {out.stride()}.")
    if a.dtype != w.dtype:
        raise TypeError(f"a.dtype={a.dtype} must equal w.dtype={w.dtype}.")
    if bias is not None and tuple(bias.shape) != (w.shape[0], w.shape[2]):
        raise ValueError(f"bias must have shape {(w.shape[0], w.shape[2])}, but got {tuple(bias.shape)}.")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (4 under the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_DECLINED: set[str] = set()


def _declined(reason: str) -> None:
    """A plan asked for TMA loads the layout cannot take: say why once; pointer loads run instead."""
    if reason not in _DECLINED:
        _DECLINED.add(reason)
        log.info("moe_gemm: TMA loads declined, using pointer loads: %s", reason)


def _tma_descriptors(a: torch.Tensor, w: torch.Tensor, cfg: GemmConfig, n_cols: int, *, interleaved: bool,
                     gather_a: bool, pair_blocks: bool):
    """``(w_desc, a_desc)`` TMA descriptors where the config asks for them and the layout allows
    (``None`` each otherwise): W K-major (``[E, N, K]`` storage, as HF keeps its experts), its
    N-blocks whole inside one expert's gate or up half, 16-byte aligned rows; A only when its
    rows are read in place (the second GEMM's sorted blocks)."""
    if not cfg.tma or not (a.device.type == "cuda" or interpreting()):
        return None, None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        _declined("this triton has no triton.tools.tensor_descriptor")
        return None, None
    num_local, k_dim, n_total = w.shape
    esize = w.element_size()
    w_ok = (not interleaved and w.stride(1) == 1 and w.stride(2) == k_dim and w.stride(0) == n_total * k_dim
            and n_cols % cfg.block_n == 0 and (k_dim * esize) % 16 == 0 and w.data_ptr() % 16 == 0)
    if not w_ok:
        _declined("the weights are not K-major [E, N, K] storage with whole N-blocks per gate/up half "
                  f"(w {tuple(w.shape)} strides {w.stride()}, block_n={cfg.block_n}, interleaved={interleaved})")
        return None, None
    w_rows = w.transpose(1, 2).reshape(num_local * n_total, k_dim)  # a view of the [E, N, K] storage
    w_desc = TensorDescriptor.from_tensor(w_rows, [cfg.block_n, cfg.block_k])
    a_desc = None
    if (not gather_a and not pair_blocks and a.stride(1) == 1 and (a.stride(0) * esize) % 16 == 0
            and a.data_ptr() % 16 == 0):
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    return w_desc, a_desc


def moe_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, topk_ids: torch.Tensor, top_k: int,
    counts: torch.Tensor | None, sorted_pair: torch.Tensor | None, expert_map: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, experts: ExpertsConfig | None = None, gather_a: bool,
    config: GemmConfig = GemmConfig(), row_stride: int = 0, max_rows: int | None = None,
) -> torch.Tensor:
    """One expert GEMM (see the module doc). ``counts is None`` selects pair blocks.

    ``experts`` given: the first GEMM (``w`` is w13, the activation is fused, ``out`` is
    ``[P, I]``); ``None``: the second GEMM (``out`` is ``[P, N]``).

    ``config.merge_m``: an expert's last block takes up to that many rows past a full block (see
    the module doc); with ``config.merge_launch`` those blocks run in a second launch.

    ``config.split_k > 1`` (the second GEMM only: no activation): every tile runs as that many
    programs over slices of K, so a GEMM of few, long-K tiles fills the last wave of SMs; ``out``
    is then ``[split_k, P, N]``, slice ``s`` holding the partial products over K slice ``s`` (the
    bias in slice 0), which the caller sums (``combine`` takes the slices as they are).

    ``config.persistent``: sorted or batched blocks run on about one program per SM, each walking
    the live tiles (the grid no longer carries the dead blocks of the upper bound); pair blocks
    ignore it and ``config.expert_order`` (their blocks are single pairs, not counted per expert).

    ``row_stride > 0``: batched rows, expert ``e``'s ``counts[e]`` rows start at ``e * row_stride``
    of ``a`` and ``out`` (``[E * cap, ...]`` views of the batched format; other rows are neither
    read into a result nor written); ``max_rows`` bounds the sum of ``counts`` (sizes the grid).
    """
    pair_blocks = counts is None
    gated = experts is not None and experts.activation.is_gated
    n_cols = w.shape[2] // 2 if gated else w.shape[2]
    split_k = config.split_k
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"config.split_k={split_k!r} must be an int >= 1.")
    if split_k > 1:
        if experts is not None:
            raise ValueError(f"config.split_k={split_k} needs the second GEMM (experts=None): the activation of a "
                             "K slice's partial sum is not a slice of the activation.")
        if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[0] != split_k:
            raise ValueError(f"config.split_k={split_k} needs out of shape [{split_k}, P, N] (one slice per K "
                             f"slice), but got {tuple(out.shape) if isinstance(out, torch.Tensor) else type(out)}.")
    _check(a, w, out[0] if split_k > 1 else out, bias, n_cols)
    if not pair_blocks and sorted_pair is None and gather_a:
        raise ValueError("sorted blocks with gather_a=True need sorted_pair.")
    if row_stride and (pair_blocks or gather_a or max_rows is None):
        raise ValueError("batched rows (row_stride > 0) need counts, gather_a=False and max_rows.")
    pairs = max_rows if row_stride else topk_ids.numel()
    num_local = w.shape[0]
    if pairs == 0:
        return out
    interleaved = gated and experts.gate_up_interleaved
    cfg = config
    merge_m = cfg.merge_m if not pair_blocks else 0
    if merge_m and (merge_m < 16 or merge_m & (merge_m - 1) or merge_m >= cfg.block_m):
        raise ValueError(f"config.merge_m={merge_m} must be 0 or a power of two >= 16 (the extra rows are an "
                         f"MMA's N side) and below block_m={cfg.block_m}.")
    nbm = max_m_blocks(pairs, num_local, cfg.block_m, pair_blocks)
    tiles = nbm * cdiv(n_cols, cfg.block_n) * split_k
    persistent = bool(cfg.persistent) and not pair_blocks
    if persistent:
        launched = min(tiles, num_programs(a.device))
        grid = (launched,)
    else:
        launched, grid = nbm, (tiles,)
    dummy = topk_ids
    w_desc, a_desc = _tma_descriptors(a, w, cfg, n_cols, interleaved=interleaved, gather_a=gather_a,
                                      pair_blocks=pair_blocks)
    args = (
        a, w, bias if bias is not None else w, out,
        sorted_pair if sorted_pair is not None else dummy, counts if counts is not None else dummy,
        topk_ids, expert_map if expert_map is not None else dummy, w_desc, a_desc,
        num_local, n_cols, a.shape[1], launched, w.shape[2], row_stride,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        0 if bias is None else bias.stride(0), 0 if bias is None else bias.stride(1), out.stride(-2),
        out.stride(0) if split_k > 1 else 0,
        1 if interleaved else n_cols, 2 if interleaved else 1,
        float(experts.swiglu_alpha) if experts else 0.0, float(experts.swiglu_limit) if experts else 0.0,
    )
    consts = dict(
        TOP_K=top_k, GATHER_A=gather_a, PAIR_BLOCKS=pair_blocks, HAS_MAP=expert_map is not None,
        GATED=gated, ACT=act_code(experts) if experts is not None else NO_ACT, HAS_BIAS=bias is not None,
        EVEN_K=a.shape[1] % cfg.block_k == 0, IEEE=a.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        E_PAD=next_pow2(num_local), W_TMA=w_desc is not None, A_TMA=a_desc is not None,
        BATCHED=row_stride > 0, TAIL_M=cfg.tail_m if 0 < cfg.tail_m < cfg.block_m and not pair_blocks else 0,
        PERSISTENT=persistent, FLATTEN=persistent and cfg.persistent > 1, EXPERT_ORDER=bool(cfg.expert_order) and not pair_blocks,
        MERGE_M=merge_m, MERGE_PASS=1 if merge_m and cfg.merge_launch else 0, SPLIT_K=split_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch(a.device),
    )
    launch(_moe_gemm_kernel, grid, *args, **consts)
    if consts["MERGE_PASS"]:  # the merged last blocks: one program per (expert, N-block)
        consts.update(MERGE_PASS=2, PERSISTENT=False, FLATTEN=False, EXPERT_ORDER=False)
        launch(_moe_gemm_kernel, (num_local * cdiv(n_cols, cfg.block_n) * split_k,), *args, **consts)
    return out


def moe_gemm_reference(a_rows: torch.Tensor, expert_of_row: torch.Tensor, w: torch.Tensor,
                       bias: torch.Tensor | None = None, experts: ExpertsConfig | None = None) -> torch.Tensor:
    """Row ``r`` -> ``act(a_rows[r] @ w[expert_of_row[r]] + bias)`` in fp32 (rows with expert -1 -> 0)."""
    out_rows = []
    for r in range(a_rows.shape[0]):
        e = int(expert_of_row[r])
        width = w.shape[2] // 2 if (experts is not None and experts.activation.is_gated) else w.shape[2]
        if e < 0:
            out_rows.append(torch.zeros(width))
            continue
        h = a_rows[r].float() @ w[e].float()
        if bias is not None:
            h = h + bias[e].float()
        out_rows.append(apply_activation(h.unsqueeze(0), experts)[0] if experts is not None else h)
    return torch.stack(out_rows) if out_rows else torch.zeros(0, w.shape[2])


__all__ = ["GemmConfig", "max_m_blocks", "moe_gemm", "moe_gemm_reference"]
