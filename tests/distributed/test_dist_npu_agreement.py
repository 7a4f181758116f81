"""Errors, not hangs, for the NPU lowering (2 gloo ranks, torch_npu emulated with poison=True).

The NPU lowering runs the CPU/CUDA lowerings' agreement handshake before its first collective, so
ranks whose calls differ all raise the same ValueError instead of passing mismatched buffers to
``all_gather`` / ``all_reduce`` / ``all_to_all`` (gloo aborts the process, HCCL hangs). Uneven token
shards are refused for the dynamic dispatcher too, as on CPU/CUDA (the spec's shards are even);
afterwards the group still computes the single-process result.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import failures, run_workers

E, H, I, K = 8, 16, 8, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _problem(tokens: int = 6):
    g = torch.Generator().manual_seed(7)
    return dict(x=torch.randn(tokens, H, generator=g), logits=torch.randn(tokens, E, generator=g),
                w13=torch.randn(E, H, 2 * I, generator=g) / 4, w2=torch.randn(E, I, H, generator=g) / 3)


def _local(w: torch.Tensor, local_e: int) -> torch.Tensor:
    rank = dist.get_rank()
    return w[rank * local_e:(rank + 1) * local_e] if local_e < E else w


def _moe(tokens: int, local_e: int, **kw):
    from moe_compile import fused_moe

    p = _problem(tokens)
    return fused_moe(p["x"], p["logits"], E, K, _local(p["w13"], local_e), _local(p["w2"], local_e),
                     lowering="npu", **kw)


def _op(tokens: int, local_e: int, dispatcher: str):
    """The custom op directly, as a rewritten graph calls it (no Python-side validation first)."""
    import moe_compile  # noqa: F401  (registers the op)

    p = _problem(tokens)
    return torch.ops.moe_compile.fused_moe(
        p["x"], p["logits"], _local(p["w13"], local_e), _local(p["w2"], local_e), None, None, None,
        num_experts=E, top_k=K, routing_method="softmax", renormalize=False, routed_scaling_factor=1.0,
        k_group=1, group_count=1, group_select_mode=0, normalize_sigmoid=True, scoring_after_topk=False,
        activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0, gate_up_interleaved=False,
        apply_router_weight_on_input=False, tp_group_name=None, ep_group_name=dist.group.WORLD.group_name,
        dispatcher_type=dispatcher, tokens_full=True, reduce_results=True, lowering="npu")


def _error_cases():
    world = dist.group.WORLD
    return {
        # the hunt's repro: static EP, sharded tokens, 3 on rank 0 and 2 on rank 1
        "npu-uneven-shards-ep-static": (lambda r: _moe(3 - r, E // 2, ep_group=world, dispatcher_type="static",
                                                       tokens_full=False), "num_tokens differs across ranks: [3, 2]"),
        "npu-uneven-shards-tp": (lambda r: _moe(3 - r, E, tp_group=world, tokens_full=False),
                                 "num_tokens differs across ranks: [3, 2]"),
        "npu-full-tokens-differ-ep-static": (lambda r: _moe(4 + r, E // 2, ep_group=world, dispatcher_type="static"),
                                             "num_tokens differs across ranks: [4, 5]"),
        "npu-full-tokens-differ-ep-dynamic": (lambda r: _moe(4 + r, E // 2, ep_group=world,
                                                             dispatcher_type="dynamic"),
                                              "num_tokens differs across ranks: [4, 5]"),
        "npu-uneven-shards-ep-dynamic": (lambda r: _moe(3 - r, E // 2, ep_group=world, dispatcher_type="dynamic",
                                                        tokens_full=False), "num_tokens differs across ranks: [3, 2]"),
        "npu-full-tokens-differ-tp": (lambda r: _moe(4 + r, E, tp_group=world), "num_tokens differs across ranks"),
        "npu-ep-local-experts-one-rank-op": (lambda r: _op(4, E // 2 - r, "static"),
                                             "rank 1 holds w13_weight.shape[0]=3 experts"),
        "npu-dispatchers-differ-op": (lambda r: _op(4, E // 2, ("static", "dynamic")[r]),
                                      "dispatcher differs across ranks"),
    }


def _expect_error(call, rank: int, fragment: str) -> str | None:
    try:
        call(rank)
    except ValueError as exc:
        return None if fragment in str(exc) and "before any data moved" in str(exc) else f"message: {exc}"
    except Exception as exc:  # noqa: BLE001
        return f"expected ValueError, got {type(exc).__name__}: {exc}"
    return "expected ValueError, nothing was raised"


def _expect_reference(rank: int, dispatcher: str, rows: slice) -> str | None:
    """Sharded EP call with ``rows`` of the tokens on this rank against the single-process result."""
    from moe_compile import fused_moe

    p = _problem(6)
    want = fused_moe(p["x"], p["logits"], E, K, p["w13"], p["w2"], lowering="cpu")[rows]
    out = fused_moe(p["x"][rows], p["logits"][rows], E, K, _local(p["w13"], E // 2), _local(p["w2"], E // 2),
                    ep_group=dist.group.WORLD, dispatcher_type=dispatcher, tokens_full=False, lowering="npu")
    torch.testing.assert_close(out, want, **TOL)
    return None


def _worker(rank: int, world_size: int) -> dict:
    from moe_compile.testing import emulated_npu

    report = {}
    with emulated_npu(poison=True):
        for case_id, (call, fragment) in _error_cases().items():
            report[case_id] = _expect_error(call, rank, fragment)
        cases = {"npu-after-errors-ep-static-sharded": ("static", slice(3 * rank, 3 * rank + 3)),
                 "npu-after-errors-ep-dynamic-sharded": ("dynamic", slice(3 * rank, 3 * rank + 3))}
        for case_id, (dispatcher, rows) in cases.items():
            try:
                report[case_id] = _expect_reference(rank, dispatcher, rows)
            except Exception as exc:  # noqa: BLE001
                report[case_id] = f"{type(exc).__name__}: {exc}"
    return report


@pytest.mark.distributed
def test_npu_ranks_that_disagree_raise_the_same_error():
    reports = run_workers(_worker, 2, deadline_s=240.0)
    bad = failures(reports)
    assert not bad, f"{len(bad)} failing (rank, case):\n" + "\n".join(bad)
    assert all(len(rep) == 10 for rep in reports), [sorted(rep) for rep in reports]
