"""Tensor and expert parallelism for the fused MoE op on ``torch.distributed``.

- ``groups``: groups by name, the communication mode (EP over TP) and the dispatcher rule;
- ``sharding``: each rank's share of the expert weights and tokens (what the backend keeps);
- ``checks``: the pre-collective agreement check (errors on every rank, not hangs);
- ``comm``: the collectives the PrepareAndFinalize classes (``moe_compile.modular.distributed_pf``) use.
"""
from moe_compile.distributed.groups import CommMode, choose_dispatcher, comm_mode, resolve_group
from moe_compile.distributed.sharding import (
    ep_expert_range,
    expert_map,
    shard_experts_for_ep,
    shard_for_groups,
    shard_for_tp,
    shard_tokens,
    tp_intermediate_slice,
)

__all__ = [
    "CommMode", "choose_dispatcher", "comm_mode", "ep_expert_range", "expert_map", "resolve_group",
    "shard_experts_for_ep", "shard_for_groups", "shard_for_tp", "shard_tokens", "tp_intermediate_slice",
]
