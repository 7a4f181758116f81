"""The experts' backward as grouped GEMMs (``torch._grouped_mm``): no host sync, no loop over the experts.

``ops/autograd.py``'s ``experts_backward`` calls this where ``torch._grouped_mm`` takes the operands (``usable``):
on CUDA that is bf16 on sm90 / sm100 (CUTLASS; torch's other CUDA cases loop over the groups after a host sync,
so they keep our own loop), on the CPU every dtype torch's CPU kernel accepts; both need 16-byte aligned rows.
The math is ``experts_backward``'s, with each per-expert ``mm`` one grouped GEMM over the pairs sorted by expert
(group ends ``offs`` from a ``searchsorted``: nothing read on the host), so a layer's backward is five GEMM
launches whatever the number of experts. A 2-D x 2-D grouped GEMM (the weight gradients) writes zeros for an
expert with no rows. Where torch's fake kernel takes the dtype (``traceable``: bf16), the autograd formula runs
these ops while AOTAutograd traces the backward, so they become the backward graph's own nodes.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch

_GROUPED = getattr(torch, "_grouped_mm", None)


@functools.lru_cache(maxsize=None)
def _accepts(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs (2-D x 3-D and 2-D x 2-D) on this device for this dtype, sync-free."""
    if _GROUPED is None:
        return False
    if device.type == "cuda":  # torch's sync-free CUTLASS path: bf16 on sm90 / sm100 (others loop after a sync)
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
    if device.type != "cpu":
        return False
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # real tensors, also when first asked while a graph is traced
        try:
            a, b = torch.ones(8, 8, dtype=dtype), torch.ones(2, 8, 8, dtype=dtype)
            offs = torch.tensor([0, 8], dtype=torch.int32)
            ok = bool((_GROUPED(a, b, offs=offs) == 8).all())
            return ok and bool((_GROUPED(a.t(), a, offs=offs)[1] == 8).all())
        except (RuntimeError, NotImplementedError, TypeError):
            return False


@functools.lru_cache(maxsize=None)
def traceable(dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm``'s fake kernel takes ``dtype`` (torch 2.11-2.13: bf16 only, whatever the
    device), so that a graph can hold the grouped backward's ops."""
    if _GROUPED is None:
        return False
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs the refusal at ERROR before raising
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with _disable_current_modes(), FakeTensorMode():
            a, b = torch.empty(16, 8, dtype=dtype), torch.empty(2, 8, 8, dtype=dtype)
            offs = torch.empty(2, dtype=torch.int32)
            _GROUPED(a, b, offs=offs)
            _GROUPED(a.t(), a, offs=offs)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    finally:
        quiet.setLevel(level)


def _aligned(t: torch.Tensor) -> bool:
    """One of the last two dims unit-stride, the other's stride (and the offset into the storage, whose start
    torch's allocators align) a multiple of 16 bytes. Read from the metadata, so it answers for fake tensors too."""
    size = t.element_size()
    row, col = t.stride(-2), t.stride(-1)
    lead = row if col == 1 else col if row == 1 else None
    return lead is not None and lead * size % 16 == 0 and t.storage_offset() * size % 16 == 0


def usable(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the grouped backward takes these operands (else ``experts_backward`` loops over the experts)."""
    if not (x.dtype == w13.dtype == w2.dtype and x.device == w13.device == w2.device):
        return False
    if not _accepts(x.device, x.dtype):
        return False
    size = x.element_size()
    dims = (x.shape[-1], w13.shape[-1], w2.shape[-2])  # H, the first GEMM's width, I
    return all(d * size % 16 == 0 for d in dims) and _aligned(w13) and _aligned(w2)


def _weight_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, flip: bool) -> torch.Tensor:
    """Per expert ``a_e^T @ b_e`` ([E, a cols, b cols]) for the pairs' rows grouped by ``offs``; ``flip``: laid out
    as a transpose of its last two dims' contiguous layout (``autograd._grad_buffer``)."""
    if flip:
        return _GROUPED(b.t(), a, offs=offs).transpose(-1, -2)
    return _GROUPED(a.t(), b, offs=offs)


def _per_expert_sum(rows: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The rows summed per expert, accumulated in fp32 (a bias's gradient)."""
    out = torch.zeros(num_experts, rows.shape[-1], dtype=torch.float32, device=rows.device)
    return out.index_add_(0, expert_of_row, rows.float()).to(rows.dtype)


def grouped_backward(sorted_ids: torch.Tensor, x_in: torch.Tensor, grad_rows: torch.Tensor,
                     pair_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor],
                     b2: Optional[torch.Tensor], activation: Callable, on_input: bool, needs: list[bool],
                     transposed: tuple) -> tuple:
    """(grad of the pairs' inputs, of the pair weights (fp32), d13, d2, db13, db2) for the pairs sorted by expert
    (``sorted_ids``; rows ``x_in``, incoming gradients ``grad_rows``, pair weights ``pair_w [P, 1]``), each None
    where ``needs`` (in, pair weights, w13, w2, b13, b2) says no. ``activation(h)`` gives (act, its backward)."""
    need_in, need_pair, need_w13, need_w2, need_b13, need_b2 = needs
    num_experts = w13.shape[0]
    experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # each expert's end row
    h = _GROUPED(x_in, w13, offs=offs)
    if b13 is not None:
        h = h + b13.index_select(0, sorted_ids)
    act, act_backward = activation(h)
    ga = _GROUPED(grad_rows, w2.transpose(-1, -2), offs=offs)  # the activation's gradient before the pair weight
    grad_pair = None
    if on_input:
        dy, da = grad_rows, ga
    else:
        dy, da = grad_rows * pair_w.to(grad_rows.dtype), ga * pair_w.to(ga.dtype)
        if need_pair:  # <g, act @ w2 + b2> without the second GEMM again: <g @ w2^T, act> + <g, b2>
            grad_pair = (ga.float() * act.float()).sum(-1)
            if b2 is not None:
                grad_pair = grad_pair + (grad_rows.float() * b2.index_select(0, sorted_ids).float()).sum(-1)
    d2 = _weight_grad(act, dy, offs, transposed[1]) if need_w2 else None
    db2 = _per_expert_sum(dy, sorted_ids, num_experts) if need_b2 and b2 is not None else None
    dh = act_backward(da)
    d13 = _weight_grad(x_in, dh, offs, transposed[0]) if need_w13 else None
    db13 = _per_expert_sum(dh, sorted_ids, num_experts) if need_b13 and b13 is not None else None
    grad_in = _GROUPED(dh, w13.transpose(-1, -2), offs=offs) if need_in else None
    return grad_in, grad_pair, d13, d2, db13, db2
