"""Each rank's share of the expert weights (and of the tokens) for EP and TP.

All functions take the *op layout*: ``w13 [E, H, N]`` (``N = 2I`` gated as ``[gate | up]``, or
interleaved gate/up columns, or ``I`` non-gated), ``w2 [E, I, H]``, ``w13_bias [E, N]``,
``w2_bias [E, H]``. Transposed views of HF weights are fine. By default the shards are copies
laid out in the input's stride order (a shard of ``gate_up_proj.transpose(1, 2)`` is again the
transpose of a contiguous ``[E/W, 2I, H]`` tensor), so dropping the full tensors frees their
memory; ``copy=False`` returns views of the full storage where the shard is one slice (EP, and TP
of non-gated or interleaved ``w13``), and still copies TP's two-slice gated ``w13``.

- EP: rank ``r`` of ``W`` owns experts ``[r E/W, (r+1) E/W)`` -- the contiguous ranges the
  static, dynamic and batched dispatchers assume.
- TP: every rank holds every expert with the intermediate slice ``[r I/W, (r+1) I/W)``: ``w13``'s
  gate and up columns of that slice (still ``[gate | up]``, or interleaved), ``w2``'s rows of it.
  ``w2_bias`` is added after the down projection, so it stays on rank 0 only (zeros elsewhere):
  the TP reduction then adds it exactly once.
"""
from __future__ import annotations

import torch

from moe_compile.modular.base import ExpertWeights
from moe_compile.ops.config import Activation, parse_enum


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, but got {world_size!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), but got {rank!r}.")


def _like_strides(ref: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An empty ``shape`` tensor whose dims are laid out in ``ref``'s stride order (so a shard of
    a transposed view is again a transposed view of a contiguous tensor)."""
    order = sorted(range(ref.dim()), key=lambda d: -ref.stride(d))
    buf = ref.new_empty([shape[d] for d in order])
    inverse = sorted(range(ref.dim()), key=lambda i: order[i])
    return buf.permute(inverse)


def _take(t: torch.Tensor | None, dim: int, parts: tuple[slice, ...], copy: bool) -> torch.Tensor | None:
    """The concatenation of ``t``'s ``parts`` along ``dim`` (a view when one part and not ``copy``)."""
    if t is None:
        return None
    pieces = [t.narrow(dim, p.start, p.stop - p.start) for p in parts]
    if len(pieces) == 1 and not copy:
        return pieces[0]
    shape = list(t.shape)
    shape[dim] = sum(p.shape[dim] for p in pieces)
    out = _like_strides(t, tuple(shape))
    offset = 0
    for piece in pieces:
        out.narrow(dim, offset, piece.shape[dim]).copy_(piece)
        offset += piece.shape[dim]
    return out


def ep_expert_range(num_experts: int, *, rank: int, world_size: int) -> range:
    """The global expert ids rank ``rank`` owns under EP (ValueError when E is not divisible by W)."""
    _check_rank(rank, world_size)
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by the ep_group size {world_size}.")
    local = num_experts // world_size
    return range(rank * local, (rank + 1) * local)


def expert_map(num_experts: int, *, rank: int, world_size: int, device=None) -> torch.Tensor:
    """``[E]`` int32: the local id of each global expert on this rank, ``-1`` for other ranks' experts."""
    owned = ep_expert_range(num_experts, rank=rank, world_size=world_size)
    out = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    out[owned.start:owned.stop] = torch.arange(len(owned), dtype=torch.int32, device=device)
    return out


def shard_experts_for_ep(w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
                         w2_bias: torch.Tensor | None = None, *, rank: int, world_size: int,
                         copy: bool = True) -> ExpertWeights:
    """This rank's experts of the full ``[E, ...]`` weights (the op's ``ep_group`` layout)."""
    owned = ep_expert_range(w13.shape[0], rank=rank, world_size=world_size)
    if w2.shape[0] != w13.shape[0]:
        raise ValueError(f"w2.shape[0]={w2.shape[0]} must equal w13.shape[0]={w13.shape[0]} (experts).")
    rows = (slice(owned.start, owned.stop),)
    return ExpertWeights(_take(w13, 0, rows, copy), _take(w2, 0, rows, copy),
                         _take(w13_bias, 0, rows, copy), _take(w2_bias, 0, rows, copy))


def tp_intermediate_slice(intermediate_size: int, *, rank: int, world_size: int) -> slice:
    """The intermediate columns ``[r I/W, (r+1) I/W)`` rank ``rank`` holds under TP."""
    _check_rank(rank, world_size)
    if intermediate_size % world_size:
        raise ValueError(f"intermediate_size={intermediate_size} must be divisible by the tp_group size "
                         f"{world_size}.")
    local = intermediate_size // world_size
    return slice(rank * local, (rank + 1) * local)


def _w13_columns(n_cols: int, inter: slice, activation: Activation, interleaved: bool) -> tuple[slice, ...]:
    if not activation.is_gated:
        return (inter,)
    if interleaved:  # columns g0 u0 g1 u1 ...: the slice's pairs are contiguous
        return (slice(2 * inter.start, 2 * inter.stop),)
    half = n_cols // 2
    return inter, slice(half + inter.start, half + inter.stop)


def shard_for_tp(w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None, *, rank: int, world_size: int,
                 activation: str | Activation = "silu", gate_up_interleaved: bool = False,
                 copy: bool = True) -> ExpertWeights:
    """This rank's intermediate slice of every expert (the op's ``tp_group`` layout).

    ``w13 [E, H, N] -> [E, H, N/W]`` (gated: ``[gate slice | up slice]``), ``w2 [E, I, H] ->
    [E, I/W, H]``, ``w13_bias`` like ``w13``'s columns, ``w2_bias`` kept on rank 0, zeros elsewhere.
    """
    act = parse_enum(Activation, activation, "activation")
    inter_size = w2.shape[1]
    want = 2 * inter_size if act.is_gated else inter_size
    if w13.shape[2] != want:
        raise ValueError(f"w13.shape[2]={w13.shape[2]} must equal {want} for activation={act.value} "
                         f"and w2 of shape {tuple(w2.shape)}.")
    inter = tp_intermediate_slice(inter_size, rank=rank, world_size=world_size)
    cols = _w13_columns(w13.shape[2], inter, act, gate_up_interleaved)
    bias2 = w2_bias
    if w2_bias is not None:
        bias2 = (w2_bias.clone() if copy else w2_bias) if rank == 0 else torch.zeros_like(w2_bias)
    return ExpertWeights(_take(w13, 2, cols, copy), _take(w2, 1, (inter,), copy),
                         _take(w13_bias, 1, cols, copy), bias2)


def shard_tokens(x: torch.Tensor, *, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s even shard of ``x [T, ...]`` along dim 0 (the ``tokens_full=False`` layout)."""
    _check_rank(rank, world_size)
    if x.shape[0] % world_size:
        raise ValueError(f"the token count {x.shape[0]} must be divisible by the group size {world_size} "
                         f"for tokens_full=False.")
    local = x.shape[0] // world_size
    return x.narrow(0, rank * local, local)


def _size_and_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def shard_for_groups(w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None, *, ep_group=None, tp_group=None,
                     activation: str | Activation = "silu", gate_up_interleaved: bool = False,
                     copy: bool = True) -> ExpertWeights:
    """This rank's weights for a call with these groups, by the op's rule: EP when ``ep_group`` has
    more than one rank, else TP when ``tp_group`` does, else the weights unchanged (no copy).

    This is what a caller that rewrites a model for ``fused_moe(..., ep_group=, tp_group=)`` keeps;
    ``e_score_correction_bias`` and the router stay global (they index all experts).
    """
    ep_size, ep_rank = _size_and_rank(ep_group)
    if ep_size > 1:
        return shard_experts_for_ep(w13, w2, w13_bias, w2_bias, rank=ep_rank, world_size=ep_size, copy=copy)
    tp_size, tp_rank = _size_and_rank(tp_group)
    if tp_size > 1:
        return shard_for_tp(w13, w2, w13_bias, w2_bias, rank=tp_rank, world_size=tp_size, activation=activation,
                            gate_up_interleaved=gate_up_interleaved, copy=copy)
    return ExpertWeights(w13, w2, w13_bias, w2_bias)
