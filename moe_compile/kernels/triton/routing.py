"""Fused routing: router logits -> (topk_weights fp32 [T, k], topk_ids int32 [T, k]) in one kernel.

One program routes ``BLOCK_T`` tokens. Each token's ``E`` logits are held as a ``[G, S]`` tile
(``G`` expert groups of ``S`` experts; ``G = 1`` when not grouped), so the whole routing stays in
registers: score (softmax, sigmoid or sqrt-softplus) -> + selection bias -> group mask (mode 0: group max,
mode 1: sum of the group's top 2) -> top-k by repeated arg-max (ties to the lower expert index,
like the reference) -> gather the unbiased scores -> renormalise -> scale.

The semantics are ``moe_compile.ops.routing.select_experts`` (the plain-torch reference, re-exported
here as ``route_reference``); ``route`` is the typed wrapper that validates its input.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl

from moe_compile.kernels.triton import cdiv
from moe_compile.kernels.triton.launch import launch as launch_kernel
from moe_compile.kernels.triton.pdl import pdl_enter, pdl_launch
from moe_compile.ops.config import RoutingConfig, RoutingMethod
from moe_compile.ops.routing import select_experts as route_reference

_SCORE = {RoutingMethod.SOFTMAX: 0, RoutingMethod.SIGMOID: 1, RoutingMethod.SQRTSOFTPLUS: 2}
# Registers per program: BLOCK_T * G_PAD * S_PAD fp32 values in a few live copies.
_TILE_ELEMS = 2048


@triton.jit
def _argmax_lowest(vals, flat_idx, BIG: tl.constexpr):
    """Per token (axis 0) the max of a [BT, G, S] tile and the lowest flat index holding it."""
    best = tl.max(tl.max(vals, axis=2), axis=1)
    cand = tl.where(vals == best[:, None, None], flat_idx, BIG)
    idx = tl.min(tl.min(cand, axis=2), axis=1)
    return best, idx


@triton.jit
def _elementwise_score(x, SCORE: tl.constexpr):
    """sigmoid (SCORE 1) or sqrt(softplus) (SCORE 2, torch's threshold: x itself above 20). log1p(u) is
    log(1 + u) * u / ((1 + u) - 1), exact to a few ulp where 1 + u rounds (Goldberg), so scores of
    very negative logits keep their order instead of all rounding to 0."""
    if SCORE == 2:
        u = tl.exp(tl.minimum(x, 20.0))
        w = 1.0 + u
        rounds = w == 1.0
        log1p = tl.where(rounds, u, tl.log(w) * (u / tl.where(rounds, 1.0, w - 1.0)))
        out = tl.sqrt_rn(tl.where(x > 20.0, x, log1p))
    else:
        out = 1.0 / (1.0 + tl.exp(-x))
    return out


@triton.jit
def _group_mask(sel, g3, s3, G, K_GROUP: tl.constexpr, GROUP_MODE: tl.constexpr,
                G_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """Keep the K_GROUP best groups of each token; the other groups' entries become -inf."""
    neg_inf = float("-inf")
    first = tl.max(sel, axis=2)  # [BT, G_PAD]
    if GROUP_MODE == 1:
        first_s = tl.min(tl.where(sel == first[:, :, None], s3, S_PAD), axis=2)
        second = tl.max(tl.where(s3 == first_s[:, :, None], neg_inf, sel), axis=2)
        score = first + second
    else:
        score = first
    g2 = tl.arange(0, G_PAD)[None, :]
    score = tl.where(g2 < G, score, neg_inf)
    keep = g2 < 0
    for _ in tl.static_range(K_GROUP):
        best = tl.max(score, axis=1)
        pick = tl.min(tl.where(score == best[:, None], g2, G_PAD), axis=1)
        hit = g2 == pick[:, None]
        keep = keep | hit
        score = tl.where(hit, neg_inf, score)
    return tl.where(keep[:, :, None], sel, neg_inf)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    T, G, S, stride_lt, scaling, eps,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, K_GROUP: tl.constexpr, GROUP_MODE: tl.constexpr,
    SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, AFTER_TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    neg_inf = float("-inf")
    t1 = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t3 = t1[:, None, None]
    g3 = tl.arange(0, G_PAD)[None, :, None]
    s3 = tl.arange(0, S_PAD)[None, None, :]
    e3 = g3 * S + s3
    live = (g3 < G) & (s3 < S)
    tmask = t1 < T
    x = tl.load(logits_ptr + t3.to(tl.int64) * stride_lt + e3, mask=live & (t3 < T), other=neg_inf)
    x = tl.where(live, x.to(tl.float32), neg_inf)
    if AFTER_TOPK:
        scores = x
        sel = x
    else:
        if SCORE != 0:
            scores = _elementwise_score(x, SCORE)
        else:
            row_max = tl.max(tl.max(x, axis=2), axis=1)
            row_max = tl.where(tmask, row_max, 0.0)  # padded tokens: no -inf - -inf
            num = tl.exp(x - row_max[:, None, None])
            num = tl.where(live, num, 0.0)
            denom = tl.where(tmask, tl.sum(tl.sum(num, axis=2), axis=1), 1.0)
            scores = num / denom[:, None, None]
        sel = tl.where(live, scores, neg_inf)
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + e3, mask=live, other=0.0).to(tl.float32)
        if K_GROUP > 0:
            sel = _group_mask(sel, g3, s3, G, K_GROUP, GROUP_MODE, G_PAD, S_PAD)
    kcol = tl.arange(0, K_PAD)[None, :]
    w_tk = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    id_tk = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        _, idx = _argmax_lowest(sel, e3, G_PAD * S_PAD * 2)
        hit = e3 == idx[:, None, None]
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        w_tk = tl.where(kcol == j, w[:, None], w_tk)
        id_tk = tl.where(kcol == j, idx[:, None], id_tk)
        sel = tl.where(hit, neg_inf, sel)
    kmask = kcol < TOP_K
    if AFTER_TOPK:
        if SCORE != 0:
            w_tk = _elementwise_score(w_tk, SCORE)
            if RENORM:
                w_tk = tl.where(kmask, w_tk, 0.0)
                w_tk = w_tk / (tl.sum(w_tk, axis=1)[:, None] + eps)
        else:
            w_tk = tl.where(kmask & tmask[:, None], w_tk, neg_inf)
            top = tl.where(tmask, tl.max(w_tk, axis=1), 0.0)
            num_k = tl.where(kmask, tl.exp(w_tk - top[:, None]), 0.0)
            w_tk = num_k / tl.where(tmask, tl.sum(num_k, axis=1), 1.0)[:, None]
    elif RENORM:
        w_tk = tl.where(kmask, w_tk, 0.0)
        denom = tl.where(tmask, tl.sum(w_tk, axis=1) + eps, 1.0)  # padded tokens: no 0/0
        w_tk = w_tk / denom[:, None]
    w_tk = w_tk * scaling
    out_off = t1[:, None].to(tl.int64) * TOP_K + kcol
    omask = tmask[:, None] & kmask
    tl.store(weights_ptr + out_off, w_tk, mask=omask)
    tl.store(ids_ptr + out_off, id_tk, mask=omask)


def _validate(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"router_logits must be a 2-D tensor [T, E], but got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}.")
    if logits.shape[1] != cfg.num_experts:
        raise ValueError(f"router_logits.shape[1]={logits.shape[1]} must equal num_experts={cfg.num_experts}.")
    if not logits.is_floating_point():
        raise TypeError(f"router_logits must be floating point, but got {logits.dtype}.")
    if logits.stride(1) != 1:
        raise ValueError(f"router_logits must be contiguous along experts, but got strides {logits.stride()}.")
    if cfg.num_experts % cfg.group_count:
        raise ValueError(f"num_experts={cfg.num_experts} must be divisible by group_count={cfg.group_count}.")
    if bias is not None and tuple(bias.shape) != (cfg.num_experts,):
        raise ValueError(f"e_score_correction_bias must have shape ({cfg.num_experts},), but got {tuple(bias.shape)}.")
    if bias is not None and bias.device != logits.device:
        raise ValueError(f"e_score_correction_bias is on {bias.device} but router_logits on {logits.device}.")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def route_launch(num_tokens: int, tile: int) -> tuple[int, int]:
    """``(tokens per program, warps)`` for ``num_tokens`` tokens of ``tile`` padded scores each.

    From ``benchmarks/sweep_route.py`` on the H200 (``results/sweep_route.json``): a token of 256 or
    more scores on one warp of its own (its top-k reductions stay in the warp: DeepSeek-V3's 8 x 32
    took 3.9 us at 32-256 tokens where 8 tokens on 4 warps took 14.4), two 128-score tokens on two
    warps (Qwen3: 2.9 vs 4.6 us at 256 tokens), small rows packed about 128 scores to a warp."""
    if tile >= 256:
        return 1, 1
    block_t = min(_pow2(max(num_tokens, 1)), 2 if tile >= 128 else min(64, _TILE_ELEMS // (4 * tile)))
    return block_t, max(1, min(8, block_t * tile // 128))


def route(router_logits: torch.Tensor, cfg: RoutingConfig, e_score_correction_bias: torch.Tensor | None = None,
          *, launch: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``select_experts``: ``router_logits [T, E]`` -> ``(weights fp32 [T, k], ids int32 [T, k])``.

    ``launch``: ``(tokens per program, warps)`` instead of ``route_launch``'s (for sweeps)."""
    _validate(router_logits, cfg, e_score_correction_bias)
    num_tokens = router_logits.shape[0]
    groups = cfg.group_count if cfg.grouped else 1
    per_group = cfg.num_experts // groups
    g_pad, s_pad = _pow2(groups), _pow2(per_group)
    if launch is not None and (len(launch) != 2 or any(not isinstance(v, int) or v < 1 or v & (v - 1)
                                                        for v in launch) or launch[1] > 16):
        raise ValueError(f"launch must be (tokens per program, warps), powers of two with warps <= 16, "
                         f"but got {launch!r}.")
    block_t, num_warps = launch or route_launch(num_tokens, g_pad * s_pad)
    weights = torch.empty(num_tokens, cfg.top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, cfg.top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    elementwise = cfg.method.elementwise  # sigmoid or sqrt-softplus: normalised through normalize_sigmoid
    renorm = cfg.normalize_sigmoid if elementwise else cfg.renormalize
    # softmax renormalisation divides by the plain sum (no eps), as the reference does
    eps = cfg.sigmoid_eps if elementwise else 0.0
    bias = e_score_correction_bias
    has_bias = bias is not None and not cfg.scoring_after_topk
    grid = (cdiv(num_tokens, block_t),)
    launch_kernel(_route_kernel, grid,
        router_logits, bias if has_bias else weights, weights, ids,
        num_tokens, groups, per_group, router_logits.stride(0), float(cfg.routed_scaling_factor), float(eps),
        TOP_K=cfg.top_k, K_PAD=_pow2(cfg.top_k), K_GROUP=cfg.k_group if cfg.grouped else 0,
        GROUP_MODE=cfg.group_select_mode, SCORE=_SCORE[cfg.method], HAS_BIAS=has_bias, RENORM=renorm,
        AFTER_TOPK=cfg.scoring_after_topk, BLOCK_T=block_t, G_PAD=g_pad, S_PAD=s_pad,
        num_warps=num_warps, **pdl_launch(router_logits.device),
    )
    return weights, ids


__all__ = ["route", "route_launch", "route_reference"]
