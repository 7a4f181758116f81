"""The modular kernel of a distributed call (TP, EP static, EP dynamic, EP batched).

``StagedLowering.make_kernel`` calls :func:`make_distributed_kernel` when the config names a TP or
an EP group. It resolves the group, picks the communication mode (EP wins over TP) and the
dispatcher (``moe_compile.distributed.groups.choose_dispatcher``), makes every rank agree on the
call's shapes before any data moves (``moe_compile.distributed.checks``), and composes the
matching PrepareAndFinalize with the lowering's experts.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from moe_compile.distributed.checks import CallSignature, checks_enabled, dtype_code, verify_group_agreement
from moe_compile.distributed.groups import CommMode, choose_dispatcher, comm_mode, is_capturing, resolve_group
from moe_compile.distributed.sharding import expert_map as make_expert_map
from moe_compile.modular import ActivationFormat, BatchedExperts, GroupedExperts, ModularKernel, PermuteExpertsUnpermute
from moe_compile.modular.distributed_pf import (
    AllToAllPrepareAndFinalize,
    BatchedAllToAllPrepareAndFinalize,
    StaticPrepareAndFinalize,
)
from moe_compile.ops.config import DispatcherType, MoEConfig

log = logging.getLogger("moe_compile")
_DISPATCHER_CODE = {d: i + 1 for i, d in enumerate(DispatcherType)}
_logged: set[tuple] = set()


@functools.lru_cache(maxsize=64)
def _cached_expert_map(num_experts: int, rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    return make_expert_map(num_experts, rank=rank, world_size=world_size, device=device)


def _check_mode(mode: CommMode, requested: DispatcherType | None, capturing: bool) -> None:
    if mode is CommMode.TP and requested in (DispatcherType.DYNAMIC, DispatcherType.BATCHED):
        raise ValueError(f"dispatcher_type={requested.value!r} needs an ep_group of size > 1; with only a "
                         f"tp_group the static dispatcher runs (dispatcher_type='static' or None).")
    if capturing and requested is DispatcherType.DYNAMIC:
        raise ValueError("dispatcher_type='dynamic' cannot run inside CUDA-graph capture: it needs the "
                         "all-to-all split sizes on the host; use 'static' or 'batched' there.")


def _check_local(cfg: MoEConfig, mode: CommMode, world_size: int, local_experts: int) -> None:
    """Shape rules each rank can check alone (after the handshake, so all ranks raise together)."""
    num_experts = cfg.routing.num_experts
    if mode is CommMode.EP:
        if num_experts % world_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the ep_group size {world_size}.")
        if local_experts * world_size != num_experts:
            raise ValueError(f"w13_weight.shape[0]={local_experts} must equal num_experts / ep_size = "
                             f"{num_experts}/{world_size} = {num_experts // world_size} under expert parallelism.")
    elif local_experts != num_experts:
        raise ValueError(f"w13_weight.shape[0]={local_experts} must equal num_experts={num_experts} under "
                         f"tensor parallelism (every rank holds every expert's intermediate slice).")


def _signature(cfg: MoEConfig, inputs, dispatcher: DispatcherType) -> CallSignature:
    x, w = inputs.hidden_states, inputs.weights
    hidden = x.shape[-1]
    return CallSignature(
        num_tokens=x.numel() // max(hidden, 1), hidden_size=hidden, dtype=dtype_code(x.dtype),
        num_experts=cfg.routing.num_experts, top_k=cfg.routing.top_k, local_experts=w.w13.shape[0],
        w13_cols=w.w13.shape[2], w2_rows=w.w2.shape[1], has_w13_bias=int(w.w13_bias is not None),
        has_w2_bias=int(w.w2_bias is not None), dispatcher=_DISPATCHER_CODE[dispatcher],
        tokens_full=int(cfg.parallel.tokens_full),
    )


def _experts_for(pf, experts: PermuteExpertsUnpermute) -> PermuteExpertsUnpermute:
    """The lowering's experts when their format fits the dispatcher, else their counterpart in the
    dispatcher's format (``for_format``; the Triton experts have one), else the portable torch ones."""
    if experts.activation_formats()[0] is pf.activation_format:
        return experts
    substitute = experts.for_format(pf.activation_format)
    if substitute is None:
        batched = pf.activation_format is ActivationFormat.BATCHED
        substitute = (BatchedExperts if batched else GroupedExperts)(experts.config)
    key = ("experts", type(experts).__name__, type(pf).__name__)
    if key not in _logged:
        _logged.add(key)
        log.info("fused_moe: %s takes %s-format activations but %s emits %s ones; using %s",
                 type(experts).__name__, experts.activation_formats()[0].value, type(pf).__name__,
                 pf.activation_format.value, type(substitute).__name__)
    return substitute


def make_distributed_kernel(cfg: MoEConfig, inputs, experts: PermuteExpertsUnpermute
                            ) -> tuple[ModularKernel, torch.Tensor | None]:
    """``(ModularKernel, expert_map)`` for a call with a TP or EP group (``expert_map`` is None
    unless EP static masks other ranks' experts)."""
    mode, name = comm_mode(cfg.parallel)
    if mode is CommMode.NONE:
        raise ValueError("make_distributed_kernel needs cfg.parallel.tp_group_name or ep_group_name.")
    group = resolve_group(name)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = inputs.hidden_states.device
    requested, capturing = cfg.parallel.dispatcher_type, is_capturing(device)
    _check_mode(mode, requested, capturing)
    dispatcher = choose_dispatcher(requested=requested, mode=mode, ep_size=world_size,
                                   top_k=cfg.routing.top_k, tokens_full=cfg.parallel.tokens_full,
                                   capturing=capturing)
    if checks_enabled() and not capturing:
        verify_group_agreement(_signature(cfg, inputs, dispatcher), group, ep=mode is CommMode.EP, device=device)
    local_experts = inputs.weights.w13.shape[0]
    _check_local(cfg, mode, world_size, local_experts)
    _log_mode(mode, dispatcher, cfg, world_size)
    tokens_full = cfg.parallel.tokens_full
    expert_map = None
    if dispatcher is DispatcherType.STATIC:
        pf = StaticPrepareAndFinalize(group=group, tokens_full=tokens_full,
                                      reduce_results=cfg.parallel.reduce_results)
        if mode is CommMode.EP:
            expert_map = _cached_expert_map(cfg.routing.num_experts, rank, world_size, device)
    elif dispatcher is DispatcherType.DYNAMIC:
        pf = AllToAllPrepareAndFinalize(group=group, tokens_full=tokens_full, num_local_experts=local_experts)
    else:
        pf = BatchedAllToAllPrepareAndFinalize(group=group, tokens_full=tokens_full,
                                               num_local_experts=local_experts)
    return ModularKernel(pf, _experts_for(pf, experts)), expert_map


def _log_mode(mode: CommMode, dispatcher: DispatcherType, cfg: MoEConfig, world_size: int) -> None:
    key = ("mode", mode, dispatcher, cfg.parallel.tokens_full, world_size)
    if key not in _logged:
        _logged.add(key)
        log.info("fused_moe: %s over %d ranks, %s dispatcher, tokens_full=%s", mode.value, world_size,
                 dispatcher.value, cfg.parallel.tokens_full)
