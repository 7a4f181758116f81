"""Experts-only rewrites: a router the op has no routing for stays as written, its experts become
``moe_compile::fused_experts`` on the router's own ids and weights.

Hand-written blocks (gpt-fast's gather + einsum experts) behind routers the op cannot express: a hash
table (DeepSeek-V4's hash layers), a top-k over logits plus a bias with sigmoid weights of the picked
logits (Kolibri), and a hash router that drops tokens over an expert's capacity (which must stay).
Tolerance: fp32, 1e-4 of the output's magnitude (``helpers.TOL``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.options import parse_options
from moe_compile.testing.blocks import GatherEinsumExperts, MoEBlockConfig

from .helpers import TOL, explain_and_compare, rewrites_under_dynamic

CFG = MoEBlockConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2)
VOCAB = 50


class HashRoutedMoE(nn.Module):
    """ids = table[token_ids]; weights = softmax(gate(x)) at those ids, renormalised. ``capacity``: each
    expert keeps its first 3 tokens, the rest get no output from it, by a zero routing weight
    (``"weights"``) or by zeroing the expert's output after the experts ran (``"outputs"``)."""

    def __init__(self, cfg: MoEBlockConfig = CFG, capacity: str | None = None, distinct: bool = True):
        super().__init__()
        self.cfg, self.capacity = cfg, capacity
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GatherEinsumExperts(cfg)
        gen = torch.Generator().manual_seed(0)
        table = torch.rand(VOCAB, cfg.num_experts, generator=gen).argsort(dim=1)[:, :cfg.top_k]
        self.register_buffer("table", table if distinct else torch.zeros_like(table))

    def forward(self, x_BSD, token_ids_BS):
        x_TD = x_BSD.reshape(-1, self.cfg.hidden_size)
        scores_TE = self.gate(x_TD).softmax(dim=-1)
        ids_TK = self.table[token_ids_BS.reshape(-1)]
        weights_TK = scores_TE.gather(1, ids_TK)
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        keep_TK = None
        if self.capacity is not None:
            position_TE = F.one_hot(ids_TK, self.cfg.num_experts).sum(dim=1).cumsum(dim=0)
            keep_TK = position_TE.gather(1, ids_TK) <= 3
        if self.capacity == "weights":
            weights_TK = weights_TK * keep_TK
        out_TKD = self.experts(x_TD, ids_TK)
        if self.capacity == "outputs":
            out_TKD = out_TKD * keep_TK.unsqueeze(-1)
        return torch.einsum("tkd,tk -> td", out_TKD, weights_TK).view_as(x_BSD)


class RawBiasTopKMoE(nn.Module):
    """Kolibri's router: top-k over logits + bias, weights sigmoid(picked logits) / their sum."""

    def __init__(self, cfg: MoEBlockConfig = CFG):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.bias = nn.Parameter(torch.linspace(-0.3, 0.3, cfg.num_experts))
        self.experts = GatherEinsumExperts(cfg)

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, self.cfg.hidden_size)
        logits_TE = self.gate(x_TD)
        ids_TK = torch.topk(logits_TE + self.bias, self.cfg.top_k, dim=-1).indices
        weights_TK = logits_TE.gather(1, ids_TK).sigmoid()
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return torch.einsum("tkd,tk -> td", self.experts(x_TD, ids_TK), weights_TK).view_as(x_BSD)


def _init(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "bias":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def _hash_inputs(tokens: int = 8, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(x_BSD=torch.randn(1, tokens, CFG.hidden_size, generator=gen),
                token_ids_BS=torch.randint(0, VOCAB, (1, tokens), generator=gen))


def test_a_hash_router_stays_and_its_experts_are_fused():
    model = _init(HashRoutedMoE())
    report, diff = explain_and_compare(model, _hash_inputs())
    assert diff <= TOL[torch.float32], (diff, str(report))
    (block,) = report.blocks
    assert block.rewritten and block.router == "kept as written (ids from a table lookup) -> fused_experts", str(report)
    assert (block.num_experts, block.top_k, block.activation) == (8, 2, "silu")
    assert "moe_compile.fused_experts" in report.graphs_after[0] and "fused_moe" not in report.graphs_after[0]
    # the router is still there: its table lookup and the gathered scores feed the op
    assert "aten.gather" in report.graphs_after[0] and "aten.index.Tensor" in report.graphs_after[0]


def test_a_topk_router_the_op_cannot_express_keeps_its_routing():
    model = _init(RawBiasTopKMoE())
    x = torch.randn(1, 8, CFG.hidden_size, generator=torch.Generator().manual_seed(2))
    report, diff = explain_and_compare(model, {"x_BSD": x})
    assert diff <= TOL[torch.float32], (diff, str(report))
    (block,) = report.blocks
    assert block.rewritten and block.router.startswith("kept as written (top-k; expert choice or weights match no"), \
        str(report)


def test_the_option_turns_it_off():
    report, _ = explain_and_compare(_init(HashRoutedMoE()), _hash_inputs(), {"experts_only": False})
    assert not report.rewritten, str(report)
    x = torch.randn(1, 8, CFG.hidden_size)
    report, _ = explain_and_compare(_init(RawBiasTopKMoE()), {"x_BSD": x}, {"experts_only": False})
    assert not report.rewritten and report.skipped, str(report)
    assert "the experts alone" not in report.skipped[0][1]
    with pytest.raises(TypeError, match=r"options\['experts_only'\] must be a bool, but got 'yes'"):
        parse_options({"experts_only": "yes"})


def test_capacity_by_zero_weights_stays_in_the_router():
    """Tokens over an expert's capacity dropped by a zero weight: the router (mask included) stays, so the
    rewrite drops them too. Checked where drops happen: every token the same, so each expert gets 8."""
    model = _init(HashRoutedMoE(capacity="weights"))
    inputs = _hash_inputs()
    inputs["token_ids_BS"] = torch.full_like(inputs["token_ids_BS"], 7)
    report, diff = explain_and_compare(model, inputs)
    assert report.rewritten == [""] and diff <= TOL[torch.float32], (diff, str(report))
    with torch.no_grad():
        assert model(**inputs).abs().amax(dim=-1)[0, 3:].max() == 0  # the drops happened


def test_capacity_in_the_experts_stays_with_a_reason():
    """Dropped by zeroing the experts' outputs: fused_experts never drops a token (the first probe's random
    ids already put a fourth token on some expert; the stress probes send every token to the same ones)."""
    model = _init(HashRoutedMoE(capacity="outputs"))
    report, diff = explain_and_compare(model, _hash_inputs())
    assert diff <= TOL[torch.float32]
    assert not report.rewritten, str(report)
    ((path, reason),) = report.skipped
    assert path == "" and reason.startswith("router without a top-k (ids from a table lookup); the experts alone: ")
    assert "capacity" in reason or "dropped tokens" in reason, reason


def test_repeated_ids_at_run_time():
    """A table that sends a token to one expert twice (an untrained hash table is all zeros): the match is
    made on distinct ids, and fused_experts sums the two picks as the block does."""
    model = _init(HashRoutedMoE(distinct=False))
    report, diff = explain_and_compare(model, _hash_inputs())
    assert report.rewritten == [""] and diff <= TOL[torch.float32], (diff, str(report))


def test_dynamic_token_counts():
    inputs = [_hash_inputs(tokens, seed=tokens) for tokens in (3, 11, 6)]
    assert rewrites_under_dynamic(_init(HashRoutedMoE()), inputs) == 1


def test_ep_and_tp_groups_reach_the_experts_only_rewrite(monkeypatch):
    """The pass hands its EP/TP groups to the rewrite, which shards the experts as the full rewrite does (the
    sharded numerics over two gloo ranks: ``tests/distributed/dist_compiled.py``, ``experts-only-ep-tp``)."""
    from moe_compile.passes import moe_pass
    from moe_compile.passes.moe_pass import MoEFusionPass

    groups = {"ep_group": object()}
    seen = []
    real = moe_pass.rewrite_experts

    def spy(gm, match, values, op_kwargs, groups=None, **kwargs):
        seen.append(groups)
        return real(gm, match, values, op_kwargs, **kwargs)  # unsharded: one process has no group to shard over

    monkeypatch.setattr(MoEFusionPass, "_groups", lambda self: groups)
    monkeypatch.setattr(moe_pass, "rewrite_experts", spy)
    report, diff = explain_and_compare(_init(HashRoutedMoE()), _hash_inputs())
    assert seen == [groups] and report.rewritten == [""] and diff <= TOL[torch.float32], str(report)


class _LookupNoExperts(nn.Module):
    """Integer [T, k] ids gathering a linear's scores, and no experts: no block, nothing reported."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(CFG.hidden_size, 8, bias=False)
        self.register_buffer("table", torch.randint(0, 8, (VOCAB, 2), generator=torch.Generator().manual_seed(0)))

    def forward(self, x_BSD, token_ids_BS):
        x_TD = x_BSD.reshape(-1, CFG.hidden_size)
        picked_TK = self.proj(x_TD).gather(1, self.table[token_ids_BS.reshape(-1)])
        return (x_TD * picked_TK.sum(dim=-1, keepdim=True)).view_as(x_BSD)


def test_a_lookup_without_experts_is_not_reported():
    report, diff = explain_and_compare(_LookupNoExperts().eval(), _hash_inputs())
    assert diff <= TOL[torch.float32] and not report.blocks, str(report)
