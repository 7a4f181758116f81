"""Process groups by name, the communication mode of a call, and the dispatcher rule.

Groups travel into the custom op as ``ProcessGroup.group_name`` strings (a ProcessGroup cannot be
an op argument); :func:`resolve_group` turns the name back into the group the way torch's own
functional collectives do.
"""
from __future__ import annotations

import enum
import logging

import torch

from moe_compile.ops.config import DispatcherType, ParallelConfig

log = logging.getLogger("moe_compile")
_warned_precedence: set[tuple[str, str]] = set()


class CommMode(enum.Enum):
    NONE = "none"
    TP = "tp"
    EP = "ep"


def resolve_group(name: str):
    """``group_name`` -> ``ProcessGroup`` (ValueError naming the group when it is unknown)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(f"process group {name!r} is not known on this rank ({exc}); expected the "
                         f"group_name of a live torch.distributed ProcessGroup.") from exc


def comm_mode(parallel: ParallelConfig) -> tuple[CommMode, str | None]:
    """EP when an EP group is set, else TP when a TP group is set (MindIE-SD: EP wins, TP ignored).

    ``fused_moe`` already drops groups of size 1, so a name here means a group of size > 1.
    """
    if parallel.ep_group_name:
        if parallel.tp_group_name:
            _note_precedence(parallel.tp_group_name, parallel.ep_group_name)
        return CommMode.EP, parallel.ep_group_name
    if parallel.tp_group_name:
        return CommMode.TP, parallel.tp_group_name
    return CommMode.NONE, None


def _note_precedence(tp_name: str, ep_name: str) -> None:
    key = (tp_name, ep_name)
    if key not in _warned_precedence:
        _warned_precedence.add(key)
        log.warning("fused_moe: both tp_group (%s) and ep_group (%s) given: expert parallelism takes "
                    "precedence and the tp_group is ignored for this MoE layer", tp_name, ep_name)


def is_capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (no host syncs allowed)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def choose_dispatcher(*, requested: DispatcherType | None, mode: CommMode, ep_size: int, top_k: int,
                      tokens_full: bool, capturing: bool) -> DispatcherType:
    """The dispatcher for ``dispatcher_type=None`` (an explicit choice is returned unchanged).

    Not EP: static (the seed). Under EP, the same rule on CPU (gloo) and CUDA (NCCL), from the bytes
    each rank moves with uniform routing, ``T_l`` tokens per rank, ``W`` ranks, ``k = top_k``:

    - tokens_full=False: static all-gathers and reduce-scatters, ``2 (W-1) T_l H``; dynamic sends
      and returns its pairs' rows, ``2 k (W-1)/W T_l H`` -> dynamic iff ``k < W`` (MindIE-SD's rule);
    - tokens_full=True: static all-reduces the full ``[W T_l, H]``, ``2 (W-1) T_l H``; dynamic adds
      an all-gather of the results, ``(W-1) T_l H``, to the pair traffic -> dynamic iff ``2k < W``.

    During CUDA-graph capture it is static: dynamic needs its split sizes on the host. The rule
    reads only values that are equal on every rank (never the token count, which may differ),
    so every rank picks the same dispatcher; otherwise the collectives would not pair up.
    """
    if requested is not None:
        return requested
    if mode is not CommMode.EP or capturing:
        return DispatcherType.STATIC
    factor = 2 if tokens_full else 1
    return DispatcherType.DYNAMIC if factor * top_k < ep_size else DispatcherType.STATIC
