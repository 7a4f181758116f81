"""Grouped GEMM over expert-sorted rows: ``out[s] = x[s] @ w[expert(s)]``.

Uses ``torch._grouped_mm`` where the device and dtype support it (CPU with 16-byte aligned rows;
CUDA sm90+ in bf16), otherwise a loop over experts (a host sync for the group sizes; it is the
portable fallback, never the CUDA fast path). On the CPU a batch with fewer rows than experts
takes the loop too: it visits only the experts that have rows.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def host_reads_are_free(device: torch.device) -> bool:
    """Whether reading a tensor's values on the host costs no synchronisation (CPU tensors). The
    portable path then takes shortcuts that would stall a GPU (``bincount``, a loop over the
    experts with rows); the host-sync audit turns this off to check the path a GPU runs."""
    return device.type == "cpu"


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    elem = x.element_size()
    if (x.shape[-1] * elem) % 16 or (w.shape[-1] * elem) % 16 or not _strides_ok(w):
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and cuda_capability(x.device.index or 0) >= (9, 0)
    return False


def _strides_ok(w: torch.Tensor) -> bool:
    """``torch._grouped_mm`` reads a weight with unit stride in one of its last two dims and every
    other stride a multiple of 16 bytes (views such as ``w[:, :, ::2]``, ``permute(2, 0, 1)`` of
    an ``[K, N, E]`` tensor or rows padded to an odd length are not; they take the loop)."""
    elem = w.element_size()
    unit = w.dim() - 1 if w.stride(-1) == 1 else w.dim() - 2 if w.stride(-2) == 1 else None
    if unit is None:
        return False
    return all((w.stride(i) * elem) % 16 == 0 for i in range(w.dim()) if i != unit and w.shape[i] > 1)


def grouped_mm(x_SK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor, *,
               zero_rest: bool = True) -> torch.Tensor:
    """``x_SK`` rows sorted by expert, ``offsets_E`` int32 end offsets; rows past the last are 0,
    or, with ``zero_rest=False`` (a caller that masks them itself, or knows there are none),
    undefined: that saves a pass over the output."""
    if host_reads_are_free(x_SK.device) and x_SK.shape[0] < w_EKN.shape[0]:
        # fewer rows than experts (decode): most groups are empty, and torch._grouped_mm's CPU
        # kernel still dispatches a select, a slice and an mm for each of them
        return grouped_mm_loop(x_SK, w_EKN, offsets_E, zero_rest=zero_rest)
    if grouped_mm_supported(x_SK, w_EKN):
        out = torch._grouped_mm(x_SK.contiguous(), w_EKN, offs=offsets_E.to(torch.int32))
        if not zero_rest:
            return out
        # rows past offsets[-1] are not written by the kernel
        valid = torch.arange(x_SK.shape[0], device=x_SK.device) < offsets_E[-1]
        return torch.where(valid.unsqueeze(-1), out, 0)
    return grouped_mm_loop(x_SK, w_EKN, offsets_E)


def grouped_mm_loop(x_SK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor, *,
                    zero_rest: bool = True) -> torch.Tensor:
    """One ``torch.mm`` per expert that has rows (reads the offsets on the host)."""
    rows = x_SK.shape[0]
    out = x_SK.new_empty(rows, w_EKN.shape[-1])
    start = 0
    for expert, end in enumerate(offsets_E.tolist()):
        if end > start:
            torch.mm(x_SK[start:end], w_EKN[expert], out=out[start:end])
        start = end
    if zero_rest and start < rows:
        out[start:].zero_()
    return out
