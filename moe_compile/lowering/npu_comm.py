"""Communication for the NPU lowering: the mode (MindIE-SD's rule) and functional collectives.

Groups travel by name (``ParallelConfig.*_group_name``) and the collectives are the
``torch.ops._c10d_functional`` ops, which take the name directly. They run eagerly (HCCL on NPU,
gloo in the CPU tests) and trace as graph nodes that TorchAir converts to ``HcomAllReduce`` /
``HcomAllGather`` / ``HcomReduceScatter`` in GE mode (its converters for ``_c10d_functional.*``).

Before any of them moves data, :func:`verify_agreement` runs the CPU/CUDA lowerings' handshake
(``moe_compile.distributed.checks``), so ranks whose calls differ all raise the same ValueError
instead of handing mismatched buffers to the collectives (a hang on HCCL, an abort on gloo).
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from moe_compile.ops.config import ParallelConfig

log = logging.getLogger("moe_compile")
_warned_both = False


class CommMode(enum.Enum):
    NONE = "none"
    TP = "tp"
    EP = "ep"


@dataclass(frozen=True)
class Comm:
    mode: CommMode
    group_name: str | None = None
    size: int = 1
    rank: int = 0


def resolve_comm(parallel: ParallelConfig) -> Comm:
    """EP if an EP group is given, else TP, else none: EP takes precedence (notes §1.2)."""
    global _warned_both
    name = parallel.ep_group_name or parallel.tp_group_name
    if name is None:
        return Comm(CommMode.NONE)
    if parallel.ep_group_name and parallel.tp_group_name and not _warned_both:
        _warned_both = True
        log.warning("npu lowering: both tp_group and ep_group given; EP takes precedence and the TP group "
                    "is ignored (hybrid EP x TP in one call is not supported)")
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(name)
    mode = CommMode.EP if parallel.ep_group_name else CommMode.TP
    return Comm(mode, name, dist.get_world_size(group), dist.get_rank(group))


def verify_agreement(comm: Comm, cfg, inputs, dispatcher) -> None:
    """Every rank of ``comm`` checks that all ranks make the same call (the one small all-gather of
    ``verify_group_agreement``, as ``make_distributed_kernel`` does), or raises the same ValueError.

    Skipped without a group, with ``MOE_COMPILE_DIST_CHECKS=0``, and while tracing (GE graph /
    aclgraph: no host sync there, like CUDA-graph capture on CUDA). Token shards must be even for
    every dispatcher, as on CPU/CUDA: the spec's ``tokens_full=False`` is "the tokens split evenly
    over the group", and its dynamic layout needs a token count the group size divides (the
    dynamic path itself would run uneven shards, but a model that relies on it would fail on the
    other lowerings).
    """
    if comm.mode is CommMode.NONE:
        return
    from moe_compile.distributed.checks import checks_enabled, verify_group_agreement
    from moe_compile.distributed.groups import resolve_group
    from moe_compile.lowering.distributed import _signature
    from moe_compile.lowering.npu_layout import _is_tracing

    x = inputs.hidden_states
    if not checks_enabled() or _is_tracing(x):
        return
    verify_group_agreement(_signature(cfg, inputs, dispatcher), resolve_group(comm.group_name),
                           ep=comm.mode is CommMode.EP, device=x.device)


def _functional():
    return torch.ops._c10d_functional


def all_reduce(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    f = _functional()
    return f.wait_tensor(f.all_reduce(t, "sum", comm.group_name))


def all_gather(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0 (equal sizes on every rank)."""
    f = _functional()
    return f.wait_tensor(f.all_gather_into_tensor(t.contiguous(), comm.size, comm.group_name))


def reduce_scatter(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum over ranks, then keep this rank's dim-0 slice."""
    if t.shape[0] % comm.size:
        raise ValueError(f"reduce_scatter needs dim 0 ({t.shape[0]}) divisible by the group size {comm.size}")
    f = _functional()
    return f.wait_tensor(f.reduce_scatter_tensor(t.contiguous(), "sum", comm.size, comm.group_name))


def all_to_all(t: torch.Tensor, output_splits: list[int], input_splits: list[int], comm: Comm) -> torch.Tensor:
    f = _functional()
    return f.wait_tensor(f.all_to_all_single(t.contiguous(), output_splits, input_splits, comm.group_name))
