"""Single-process tests of the distributed helpers: weight sharding, the dispatcher rule, the
token chunks and the agreement check's error messages (no process group needed)."""
from __future__ import annotations

import logging

import pytest
import torch

from moe_compile import fused_moe
from moe_compile.distributed import (
    CommMode,
    choose_dispatcher,
    comm_mode,
    ep_expert_range,
    expert_map,
    shard_experts_for_ep,
    shard_for_groups,
    shard_for_tp,
    shard_tokens,
)
from moe_compile.distributed.checks import CallSignature, _group_errors
from moe_compile.distributed.comm import token_chunk
from moe_compile.ops.config import DispatcherType, ParallelConfig
from moe_compile.testing.logs import captured_logs

E, H, I = 4, 16, 8
STATIC, DYNAMIC, BATCHED = DispatcherType.STATIC, DispatcherType.DYNAMIC, DispatcherType.BATCHED


def _full(activation="silu", biases=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = I if activation.endswith("_no_mul") else 2 * I
    w13 = torch.randn(E, H, n, generator=gen) * H ** -0.5
    w2 = torch.randn(E, I, H, generator=gen) * I ** -0.5
    b13 = torch.randn(E, n, generator=gen) * 0.1 if biases else None
    b2 = torch.randn(E, H, generator=gen) * 0.1 if biases else None
    return w13, w2, b13, b2


@pytest.mark.parametrize("activation,interleaved", [("silu", False), ("swigluoai", True), ("gelu", False),
                                                    ("relu2_no_mul", False)])
@pytest.mark.parametrize("world", [2, 4])
def test_tp_shards_sum_to_the_full_layer(activation, interleaved, world):
    """TP's algebra without a group: the partial outputs of the shards sum to the full output
    (w2_bias only on rank 0, so it is added once). fp32, rtol 1e-4 / atol 2e-5."""
    full = _full(activation)
    gen = torch.Generator().manual_seed(1)
    x, logits = torch.randn(6, H, generator=gen), torch.randn(6, E, generator=gen)
    kw = dict(activation=activation, gate_up_interleaved=interleaved, renormalize=True)
    ref = fused_moe(x, logits, E, 2, *full, **kw)
    shards = [shard_for_tp(*full, rank=r, world_size=world, activation=activation, gate_up_interleaved=interleaved)
              for r in range(world)]
    parts = [fused_moe(x, logits, E, 2, s.w13, s.w2, s.w13_bias, s.w2_bias, **kw) for s in shards]
    torch.testing.assert_close(torch.stack(parts).sum(0), ref, rtol=1e-4, atol=2e-5)
    assert not torch.allclose(parts[0], ref, atol=1e-3)  # each shard really is partial


def test_tp_shard_layout_gate_up_halves():
    w13, w2, b13, b2 = _full()
    s = shard_for_tp(w13, w2, b13, b2, rank=1, world_size=2)
    assert s.w13.shape == (E, H, I) and s.w2.shape == (E, I // 2, H)
    torch.testing.assert_close(s.w13, torch.cat([w13[..., 4:8], w13[..., 12:16]], dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(s.w13_bias, torch.cat([b13[:, 4:8], b13[:, 12:16]], dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(s.w2, w2[:, 4:8], rtol=0, atol=0)
    assert torch.count_nonzero(s.w2_bias) == 0
    torch.testing.assert_close(shard_for_tp(w13, w2, b13, b2, rank=0, world_size=2).w2_bias, b2, rtol=0, atol=0)


def test_tp_shard_interleaved_takes_contiguous_pairs():
    w13, w2, _, _ = _full()
    s = shard_for_tp(w13, w2, rank=1, world_size=4, gate_up_interleaved=True)
    torch.testing.assert_close(s.w13, w13[..., 4:8], rtol=0, atol=0)


def test_ep_shards_copy_and_keep_the_hf_layout():
    gate_up = torch.randn(E, 2 * I, H)  # HF stores [E, 2I, H]; the op sees the transposed view
    down = torch.randn(E, H, I)
    s = shard_experts_for_ep(gate_up.transpose(1, 2), down.transpose(1, 2), rank=1, world_size=2)
    torch.testing.assert_close(s.w13, gate_up[2:].transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(s.w2, down[2:].transpose(1, 2), rtol=0, atol=0)
    assert s.w13.transpose(1, 2).is_contiguous() and s.w2.transpose(1, 2).is_contiguous()
    assert s.w13.untyped_storage().data_ptr() != gate_up.untyped_storage().data_ptr()
    assert s.w13.untyped_storage().nbytes() == gate_up.untyped_storage().nbytes() // 2  # the rest can be freed
    view = shard_experts_for_ep(gate_up.transpose(1, 2), down.transpose(1, 2), rank=1, world_size=2, copy=False)
    assert view.w13.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()


def test_ep_ranges_maps_and_token_shards():
    assert ep_expert_range(8, rank=3, world_size=4) == range(6, 8)
    assert expert_map(8, rank=1, world_size=2).tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    x = torch.arange(12).view(6, 2)
    assert shard_tokens(x, rank=2, world_size=3).tolist() == [[8, 9], [10, 11]]
    assert [token_chunk(5, r, 4) for r in range(4)] == [(0, 2, 2), (2, 4, 2), (4, 5, 2), (5, 5, 2)]


@pytest.mark.parametrize("call,fragment", [
    (lambda: ep_expert_range(6, rank=0, world_size=4), "num_experts=6 must be divisible by the ep_group size 4"),
    (lambda: ep_expert_range(8, rank=4, world_size=4), "rank must be an int in [0, world_size=4)"),
    (lambda: shard_tokens(torch.zeros(5, 2), rank=0, world_size=2), "token count 5 must be divisible"),
    (lambda: shard_for_tp(torch.zeros(2, 4, 6), torch.zeros(2, 3, 4), rank=0, world_size=2),
     "intermediate_size=3 must be divisible by the tp_group size 2"),
    (lambda: shard_for_tp(torch.zeros(2, 4, 5), torch.zeros(2, 3, 4), rank=0, world_size=1),
     "w13.shape[2]=5 must equal 6"),
])
def test_sharding_errors(call, fragment):
    with pytest.raises(ValueError) as info:
        call()
    assert fragment in str(info.value)


@pytest.mark.parametrize("ep,top_k,full,expected", [
    (2, 1, False, DYNAMIC), (2, 2, False, STATIC), (8, 4, False, DYNAMIC), (8, 8, False, STATIC),
    (4, 1, True, DYNAMIC), (4, 2, True, STATIC), (16, 4, True, DYNAMIC), (16, 8, True, STATIC),
])
def test_dispatcher_rule_under_ep(ep, top_k, full, expected):
    got = choose_dispatcher(requested=None, mode=CommMode.EP, ep_size=ep, top_k=top_k, tokens_full=full,
                            capturing=False)
    assert got is expected


def test_dispatcher_rule_static_without_ep_or_while_capturing_and_explicit_wins():
    kw = dict(ep_size=8, top_k=1, tokens_full=False)
    assert choose_dispatcher(requested=None, mode=CommMode.TP, capturing=False, **kw) is STATIC
    assert choose_dispatcher(requested=None, mode=CommMode.EP, capturing=True, **kw) is STATIC
    assert choose_dispatcher(requested=BATCHED, mode=CommMode.EP, capturing=False, **kw) is BATCHED


def test_comm_mode_ep_wins_and_says_so_once():
    both = ParallelConfig(tp_group_name="tpX", ep_group_name="epX")
    with captured_logs(logging.WARNING) as messages:
        assert comm_mode(both) == (CommMode.EP, "epX")
        assert comm_mode(both) == (CommMode.EP, "epX")
    assert sum("expert parallelism takes precedence" in m for m in messages) == 1
    assert comm_mode(ParallelConfig(tp_group_name="t")) == (CommMode.TP, "t")


def _sig(**kw):
    base = dict(num_tokens=4, hidden_size=16, dtype=1, num_experts=8, top_k=2, local_experts=4, w13_cols=16,
                w2_rows=8, has_w13_bias=0, has_w2_bias=0, dispatcher=1, tokens_full=1)
    base.update(kw)
    return tuple(CallSignature(**base).__dict__.values())


def test_agreement_errors_name_the_field_and_the_ranks():
    assert _group_errors([_sig(), _sig()], ep=True, world_size=2) == []
    errs = _group_errors([_sig(), _sig(num_tokens=3, local_experts=3)], ep=True, world_size=2)
    assert "num_tokens differs across ranks: [4, 3]" in errs
    assert any("rank 1 holds w13_weight.shape[0]=3 experts" in e for e in errs)
    assert _group_errors([_sig(local_experts=8), _sig(local_experts=8)], ep=False, world_size=2) == []


def test_shard_for_groups_without_groups_keeps_the_tensors():
    w13, w2, b13, b2 = _full()
    s = shard_for_groups(w13, w2, b13, b2)
    assert s.w13 is w13 and s.w2 is w2 and s.w13_bias is b13 and s.w2_bias is b2


def test_dispatcher_format_picks_the_experts_counterpart():
    """A batched dispatcher gets the Triton experts' batched counterpart (and a standard one the
    standard Triton experts); experts without one fall back to the portable torch experts."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from moe_compile.kernels.triton.experts import TritonBatchedExperts, TritonExperts
    from moe_compile.lowering.distributed import _experts_for
    from moe_compile.modular import ActivationFormat, BatchedExperts, GroupedExperts, ReferenceExperts
    from moe_compile.ops.config import ExpertsConfig

    cfg = ExpertsConfig(activation="gelu")
    batched, standard = (SimpleNamespace(activation_format=f) for f in (ActivationFormat.BATCHED,
                                                                        ActivationFormat.STANDARD))
    picked = _experts_for(batched, TritonExperts(cfg))
    assert type(picked) is TritonBatchedExperts and picked.config == cfg
    assert type(_experts_for(standard, TritonBatchedExperts(cfg))) is TritonExperts
    assert type(_experts_for(batched, ReferenceExperts(cfg))) is BatchedExperts
    assert type(_experts_for(standard, BatchedExperts(cfg))) is GroupedExperts
    same = TritonExperts(cfg)
    assert _experts_for(standard, same) is same
