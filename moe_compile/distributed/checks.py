"""Errors, not hangs: what every rank must agree on before the data collectives start.

A rank whose shapes differ from its peers' would pass mismatched buffers to the collectives,
which then hang (NCCL) or fail on one side only. So, before any data moves, the ranks exchange a
small signature of their call -- one ``all_gather`` of a few int64 -- and every rank checks all
signatures and raises the *same* ``ValueError`` when they disagree. Checked:

- the token count: equal on every rank (tokens_full=True: each rank holds all tokens;
  tokens_full=False: the tokens are an even shard, so a global count not divisible by the group
  size shows up here as unequal shards);
- the hidden size, dtype, ``num_experts``, ``top_k``, biases present, the dispatcher and
  ``tokens_full`` (the ranks must run the same collectives);
- the local weights against the group: EP ``w13.shape[0] == num_experts / W`` on every rank, TP
  the same intermediate shard everywhere.

The handshake costs one tiny collective and a host sync per call. It is skipped while a CUDA graph
is captured (no host syncs there) and can be switched off with ``MOE_COMPILE_DIST_CHECKS=0`` once a
deployment is known good.
"""
from __future__ import annotations

import os
from dataclasses import astuple, dataclass, fields

import torch

from moe_compile.distributed.comm import all_gather_rows

_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


def checks_enabled() -> bool:
    return os.environ.get("MOE_COMPILE_DIST_CHECKS", "1").strip().lower() not in ("0", "false", "off", "no")


@dataclass(frozen=True)
class CallSignature:
    """What one rank's call looks like; equal on every rank except where noted."""

    num_tokens: int
    hidden_size: int
    dtype: int
    num_experts: int
    top_k: int
    local_experts: int
    w13_cols: int
    w2_rows: int
    has_w13_bias: int
    has_w2_bias: int
    dispatcher: int
    tokens_full: int


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.get(dtype, 0)


def _disagreements(rows: list[tuple[int, ...]]) -> list[str]:
    names = [f.name for f in fields(CallSignature)]
    out = []
    for i, name in enumerate(names):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            out.append(f"{name} differs across ranks: {values}")
    return out


def _group_errors(rows: list[tuple[int, ...]], *, ep: bool, world_size: int) -> list[str]:
    errors = _disagreements(rows)
    if ep:
        names = [f.name for f in fields(CallSignature)]
        experts, local = names.index("num_experts"), names.index("local_experts")
        for rank, row in enumerate(rows):
            if row[experts] % world_size:
                errors.append(f"rank {rank}: num_experts={row[experts]} must be divisible by the ep_group "
                              f"size {world_size}")
            elif row[local] * world_size != row[experts]:
                errors.append(f"rank {rank} holds w13_weight.shape[0]={row[local]} experts but expected "
                              f"num_experts / ep_size = {row[experts]}/{world_size} under expert parallelism")
    return errors


def verify_group_agreement(signature: CallSignature, group, *, ep: bool, device: torch.device) -> None:
    """Exchange ``signature`` over ``group``; raise the same ValueError on every rank on a mismatch."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    mine = torch.tensor([astuple(signature)], dtype=torch.int64, device=device)
    rows = [tuple(r) for r in all_gather_rows(mine, group).tolist()]
    errors = _group_errors(rows, ep=ep, world_size=world_size)
    if errors:
        raise ValueError("distributed fused_moe: the ranks of the %s group disagree before any data "
                         "moved: %s." % ("ep" if ep else "tp", "; ".join(errors)))
