"""The few collectives the distributed MoE modes use, on ``torch.distributed`` (gloo, NCCL, HCCL).

All are blocking calls on a ``ProcessGroup``; none has a timeout of its own: a collective that a
peer never joins raises after the *group's* timeout (``init_process_group(timeout=...)`` /
``new_group(timeout=...)``; gloo raises ``RuntimeError``, NCCL's watchdog aborts the communicator).
Tensors stay on the caller's device (NCCL needs CUDA tensors, gloo takes CPU ones).

Names: ``T`` tokens, ``H`` hidden size, ``R`` rows, ``W`` group size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def token_chunk(num_tokens: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """Rank ``rank``'s share of ``num_tokens`` full tokens: ``(start, end, chunk)``.

    ``chunk = ceil(T / W)`` is what every rank pads its share to (so an all-gather of the results
    has equal pieces); the last ranks may own fewer than ``chunk`` tokens, or none.
    """
    chunk = -(-num_tokens // world_size)
    start = min(rank * chunk, num_tokens)
    return start, min(start + chunk, num_tokens), chunk


def all_gather_rows(x_RH: torch.Tensor, group) -> torch.Tensor:
    """``[R, ...]`` on every rank -> ``[W * R, ...]``, rank order (every rank must pass equal R)."""
    world = dist.get_world_size(group)
    x_RH = x_RH.contiguous()
    out = x_RH.new_empty((world * x_RH.shape[0],) + tuple(x_RH.shape[1:]))
    # torch 2.13 renamed all_gather_into_tensor (deprecated there); 2.11 only has the old name
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x_RH, group=group)
    return out


def reduce_scatter_rows(x_RH: torch.Tensor, group) -> torch.Tensor:
    """``[W * R, H]`` partial sums -> this rank's ``[R, H]`` slice of their sum."""
    world = dist.get_world_size(group)
    x_RH = x_RH.contiguous()
    out = x_RH.new_empty((x_RH.shape[0] // world,) + tuple(x_RH.shape[1:]))
    # as above: reduce_scatter_tensor's new name
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x_RH, group=group)
    return out


def all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over the group (a non-contiguous input is reduced through a contiguous copy)."""
    if x.is_contiguous():
        dist.all_reduce(x, group=group)
        return x
    tmp = x.contiguous()
    dist.all_reduce(tmp, group=group)
    x.copy_(tmp)
    return x


def all_to_all_rows(x_RH: torch.Tensor, group, *, send_splits: list[int] | None = None,
                    recv_splits: list[int] | None = None) -> torch.Tensor:
    """Row all-to-all: ``send_splits[d]`` rows go to rank ``d``; ``recv_splits[s]`` come from ``s``.

    Without splits every rank sends ``R / W`` rows to each peer (the fixed-size form, no host
    data needed, so it can be captured in a graph).
    """
    x_RH = x_RH.contiguous()
    rows = x_RH.shape[0] if recv_splits is None else sum(recv_splits)
    out = x_RH.new_empty((rows,) + tuple(x_RH.shape[1:]))
    dist.all_to_all_single(out, x_RH, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    return out
