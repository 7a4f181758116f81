"""Errors, not hangs (run inside 2 spawned ranks): bad distributed calls raise the same error on
every rank before any data moves; afterwards the group still computes correctly, also with the
agreement check switched off; and a rank left alone in a collective gets the group's timeout
as an error (the last case: it leaves its short-timeout subgroup unusable).
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dist_cases import Case, run_case
from dist_harness import device

E, H, I, K = 8, 16, 8, 2


def _weights(local_e: int, inter: int = I):
    gen = torch.Generator().manual_seed(local_e * 100 + inter)
    return (torch.randn(local_e, H, 2 * inter, generator=gen).to(device()),
            torch.randn(local_e, inter, H, generator=gen).to(device()))


def _inputs(tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, H, generator=gen).to(device()), torch.randn(tokens, E, generator=gen).to(device())


def _moe(tokens: int, local_e: int, *, inter: int = I, num_experts: int = E, **kw):
    from moe_compile import fused_moe

    x, logits = _inputs(tokens)
    w13, w2 = _weights(local_e, inter)
    return fused_moe(x, logits[:, :num_experts], num_experts, K, w13, w2, **kw)


def _op(tokens: int, local_e: int, *, num_experts: int = E, dispatcher: str | None = "static"):
    """The custom op directly, as a rewritten graph calls it: no Python-side validation first."""
    import moe_compile  # noqa: F401  (registers the op)

    x, logits = _inputs(tokens)
    w13, w2 = _weights(local_e)
    return torch.ops.moe_compile.fused_moe(
        x, logits[:, :num_experts], w13, w2, None, None, None, num_experts=num_experts, top_k=K,
        routing_method="softmax", renormalize=False, routed_scaling_factor=1.0, k_group=1, group_count=1,
        group_select_mode=0, normalize_sigmoid=True, scoring_after_topk=False, activation="silu",
        swiglu_alpha=1.702, swiglu_limit=7.0, gate_up_interleaved=False, apply_router_weight_on_input=False,
        tp_group_name=None, ep_group_name=dist.group.WORLD.group_name, dispatcher_type=dispatcher,
        tokens_full=True, reduce_results=True, lowering="cuda" if x.is_cuda else "cpu")


@dataclass(frozen=True)
class ErrorCase:
    id: str
    call: Callable[[int], object]  # rank -> runs the bad call
    error: type
    fragment: str  # must appear in the message on every rank


def _cases() -> list[ErrorCase]:
    world = dist.group.WORLD
    cases = [
        ErrorCase("experts-not-divisible", lambda r: _moe(4, 2 + r, num_experts=5, ep_group=world),
                  ValueError, "must be divisible by the ep_group size 2"),
        ErrorCase("experts-not-divisible-op", lambda r: _op(4, 2 + r, num_experts=5),
                  ValueError, "num_experts=5 must be divisible by the ep_group size 2"),
        ErrorCase("ep-local-experts-one-rank-op", lambda r: _op(4, 4 - r),
                  ValueError, "rank 1 holds w13_weight.shape[0]=3 experts but expected num_experts / ep_size = 8/2"),
        ErrorCase("tp-intermediate-shards-differ", lambda r: _moe(4, E, inter=4 - r, tp_group=world),
                  ValueError, "w2_rows differs across ranks: [4, 3]"),
        ErrorCase("full-tokens-differ", lambda r: _moe(4 + r, E // 2, ep_group=world, dispatcher_type="static"),
                  ValueError, "num_tokens differs across ranks: [4, 5]"),
        ErrorCase("dispatchers-differ", lambda r: _op(4, E // 2, dispatcher=("static", "dynamic")[r]),
                  ValueError, "dispatcher differs across ranks"),
        ErrorCase("dynamic-without-ep", lambda r: _moe(4, E, tp_group=world, dispatcher_type="dynamic"),
                  ValueError, "dispatcher_type='dynamic' needs an ep_group"),
        ErrorCase("batched-without-ep", lambda r: _moe(4, E, tp_group=world, dispatcher_type="batched"),
                  ValueError, "dispatcher_type='batched' needs an ep_group"),
    ]
    for disp in ("static", "dynamic", "batched"):
        cases.append(ErrorCase(f"uneven-shards-ep-{disp}",
                               lambda r, d=disp: _moe(3 - r, E // 2, ep_group=world, dispatcher_type=d,
                                                      tokens_full=False),
                               ValueError, "num_tokens differs across ranks: [3, 2]"))
    cases.append(ErrorCase("uneven-shards-tp", lambda r: _moe(3 - r, E, tp_group=world, tokens_full=False),
                           ValueError, "num_tokens differs across ranks: [3, 2]"))
    return cases


def _expect(case: ErrorCase, rank: int) -> str | None:
    try:
        case.call(rank)
    except case.error as exc:
        return None if case.fragment in str(exc) else f"message lacks {case.fragment!r}: {exc}"
    except Exception as exc:  # noqa: BLE001
        return f"expected {case.error.__name__}, got {type(exc).__name__}: {exc}"
    return f"expected {case.error.__name__}, nothing was raised"


def _timeout_case(rank: int) -> str | None:
    """Rank 1 fails its own validation before any collective; rank 0 is left alone in the check's
    collective and must get the (short) subgroup timeout as an error."""
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    start = time.monotonic()
    err = None
    try:
        _moe(4, 3 if rank else 4, ep_group=short, dispatcher_type="static")
        err = "the call returned"
    except ValueError as exc:
        err = None if rank == 1 and "w13_weight.shape[0]=3" in str(exc) else f"rank {rank}: ValueError {exc}"
    except RuntimeError as exc:
        elapsed = time.monotonic() - start
        if rank != 0 or not 2.0 <= elapsed <= 30.0:
            err = f"rank {rank}: RuntimeError after {elapsed:.1f}s: {exc}"
    dist.barrier()  # on the default group: rank 1 waits here until rank 0 has its timeout error
    return err


def error_report(rank: int) -> dict:
    report = {case.id: _expect(case, rank) for case in _cases()}
    # every rank raised and nothing is left half-sent: the group still computes correctly
    ok = Case("after-errors-ep-dynamic", "ep", "dynamic", tokens_full=False)
    for case in (ok, Case("after-errors-tp", "tp", "static")):
        try:
            run_case(case)
            report[case.id] = None
        except Exception as exc:  # noqa: BLE001
            report[case.id] = repr(exc)
    os.environ["MOE_COMPILE_DIST_CHECKS"] = "0"
    try:  # without the agreement check the modes still compute the same result
        for case in (Case("checks-off-ep-batched", "ep", "batched"), Case("checks-off-tp-sharded", "tp", "static",
                                                                           tokens_full=False)):
            run_case(case)
            report[case.id] = None
    except Exception as exc:  # noqa: BLE001
        report["checks-off"] = repr(exc)
    finally:
        os.environ.pop("MOE_COMPILE_DIST_CHECKS")
    if dist.get_backend() != "nccl":  # NCCL's watchdog aborts the process on a collective timeout, by design
        report["timeout-not-hang"] = _timeout_case(rank)
    return report
