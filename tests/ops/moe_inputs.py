"""Inputs for the op tests: seeded, tiny, output O(1)."""
from __future__ import annotations

import math

import torch

from moe_compile.testing.moe_reference import reference_fused_moe

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def make_inputs(*, tokens=5, hidden=16, inter=8, experts=8, dtype=torch.float32, lead=None, gated=True,
                bias=False, seed=0, hf_layout=False):
    """``fused_moe`` tensors. ``lead``: leading dims of hidden_states (default ``(tokens,)``).

    ``hf_layout``: the weights are transposed views of HF-style ``[E, 2I, H]``/``[E, H, I]`` storage,
    as the pass hands them over (non-contiguous).
    """
    gen = torch.Generator().manual_seed(seed)
    lead = (tokens,) if lead is None else tuple(lead)
    width = 2 * inter if gated else inter

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    hs = rand(*lead, hidden)
    logits = (torch.randn(*lead, experts, generator=gen) * 2).to(dtype)
    if hf_layout:
        w13 = rand(experts, width, hidden, scale=1 / math.sqrt(hidden)).transpose(1, 2)
        w2 = rand(experts, hidden, inter, scale=1 / math.sqrt(inter)).transpose(1, 2)
    else:
        w13 = rand(experts, hidden, width, scale=1 / math.sqrt(hidden))
        w2 = rand(experts, inter, hidden, scale=1 / math.sqrt(inter))
    out = dict(hidden_states=hs, router_logits=logits, num_experts=experts, w13_weight=w13, w2_weight=w2)
    if bias:
        out.update(w13_bias=rand(experts, width, scale=0.1), w2_bias=rand(experts, hidden, scale=0.1))
    return out


def check_against_reference(out, tensors, dtype, **kwargs):
    """``out`` of ``fused_moe(**tensors, **kwargs)`` vs the float64 per-token reference."""
    ref = reference_fused_moe(**tensors, **kwargs)
    assert out.shape == tensors["hidden_states"].shape, (out.shape, tensors["hidden_states"].shape)
    assert out.dtype == tensors["hidden_states"].dtype
    tol = TOL[dtype]
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(out.double(), ref, atol=tol * scale, rtol=tol)
    return ref


def seed_custom_routing_function(hidden_states, gating_output, topk, renormalize):
    """Seed 003's example custom routing function, verbatim in behaviour."""
    topk_result = gating_output.softmax(dim=-1).topk(topk, dim=-1)
    topk_weights = topk_result.values
    topk_ids = topk_result.indices
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
