"""select_experts: router logits -> (topk_weights, topk_ids), in plain torch.

This is the reference semantics of the op's routing stage; every lowering (NPU gating ops,
the fused CUDA routing kernel) is tested against it. It follows the NPU gating operators
(``npu_moe_gating_top_k_softmax`` / ``npu_moe_gating_top_k``, notes §1.4 and §2.1-2.2):

1. ``scores = softmax(logits)``, ``sigmoid(logits)`` or ``sqrt(softplus(logits))`` (DeepSeek-V4,
   an extension routed like sigmoid) in fp32;
2. ``sel = scores + e_score_correction_bias`` (the bias only steers selection);
3. grouped routing: view ``sel`` as ``[T, G, E/G]``, score each group by its max (mode 0) or the
   sum of its top-2 (mode 1), keep the best ``k_group`` groups, mask the rest to ``-inf``;
4. ``topk_ids = topk(sel, k)``; ``topk_weights = scores[topk_ids]`` (unbiased);
5. softmax: renormalise only when ``renormalize``; sigmoid (and sqrt-softplus): always
   ``w / (sum(w) + 1e-20)`` (unless the ``normalize_sigmoid=False`` extension is given);
6. ``w *= routed_scaling_factor``.

Llama-4 style (``scoring_after_topk``): top-k on the raw logits, then the score function on the
k picked logits (softmax over them, or an elementwise sigmoid).

Ties in top-k resolve to the lower expert index, as the NPU ops' goldens do.

``router_logits_reference`` is the meaning of ``moe_compile::router_logits`` (the fp32 router GEMM
over low-precision activations that the pass emits for DeepSeek-V3-style routers).
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_compile.ops.config import RoutingConfig, RoutingMethod


def topk_lower_index_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk`` along the last dim, but equal values resolve to the lower index.

    ``torch.topk`` gives no order among ties (on CPU it returns e.g. index 20 before 5), while
    the NPU gating ops pick the lower index first; a stable descending sort does exactly that.
    """
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _score(logits_f32: torch.Tensor, method: RoutingMethod) -> torch.Tensor:
    if method is RoutingMethod.SOFTMAX:
        return torch.softmax(logits_f32, dim=-1)
    return elementwise_score(logits_f32, method)


def elementwise_score(logits_f32: torch.Tensor, method: RoutingMethod) -> torch.Tensor:
    """The per-expert score of the elementwise methods: ``sigmoid`` or ``sqrt(softplus)`` (torch's
    softplus, beta 1 and threshold 20, spelled as ``where(x > 20, x, log1p(exp(min(x, 20))))``:
    TorchAir has no GE converter for ``aten.softplus``, and this is the formula torch's kernel uses)."""
    if method is RoutingMethod.SQRTSOFTPLUS:
        soft = torch.log1p(torch.exp(torch.clamp(logits_f32, max=20.0)))
        return torch.where(logits_f32 > 20.0, logits_f32, soft).sqrt()
    return torch.sigmoid(logits_f32)


TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def torch_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain ``torch.topk`` over the last dim (what graph compilers without a stable sort take)."""
    return torch.topk(x, k, dim=-1)


def _mask_groups(sel_TE: torch.Tensor, cfg: RoutingConfig, topk: TopK) -> torch.Tensor:
    """Keep the ``k_group`` best expert groups of each token; the rest become -inf.

    Written with out-of-place, non-boolean ops only, so the NPU lowering's GE graph converts it.
    """
    num_tokens, num_experts = sel_TE.shape
    sel_TGS = sel_TE.view(num_tokens, cfg.group_count, num_experts // cfg.group_count)
    if cfg.group_select_mode == 0:
        group_score_TG = sel_TGS.max(dim=-1).values
    else:
        group_score_TG = topk(sel_TGS, 2)[0].sum(dim=-1)
    keep_TK = topk(group_score_TG, cfg.k_group)[1]
    kept_TG = torch.zeros_like(group_score_TG).scatter(1, keep_TK, 1.0)
    masked_TGS = sel_TGS.masked_fill(kept_TG.unsqueeze(-1) == 0, float("-inf"))
    return masked_TGS.view(num_tokens, num_experts)


def select_experts(
    router_logits: torch.Tensor,
    cfg: RoutingConfig,
    e_score_correction_bias: torch.Tensor | None = None,
    *,
    topk: TopK = topk_lower_index_first,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``router_logits [T, E]``; returns ``(topk_weights [T, k] fp32, topk_ids [T, k] int32)``.

    ``topk`` picks the experts; the default resolves ties to the lower index (the NPU ops'
    semantics); the NPU lowering's GE graph passes :func:`torch_topk` (GE has no stable sort).
    """
    logits_TE = router_logits.float()
    if cfg.scoring_after_topk:
        picked_TK, topk_ids = topk(logits_TE, cfg.top_k)
        if cfg.method is RoutingMethod.SOFTMAX:
            weights_TK = torch.softmax(picked_TK, dim=-1)
        else:
            weights_TK = elementwise_score(picked_TK, cfg.method)
            if cfg.normalize_sigmoid:
                weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + cfg.sigmoid_eps)
    else:
        scores_TE = _score(logits_TE, cfg.method)
        sel_TE = scores_TE
        if e_score_correction_bias is not None:
            sel_TE = scores_TE + e_score_correction_bias.float()
        if cfg.grouped:
            sel_TE = _mask_groups(sel_TE, cfg, topk)
        topk_ids = topk(sel_TE, cfg.top_k)[1]
        weights_TK = scores_TE.gather(1, topk_ids)
        if cfg.method is RoutingMethod.SOFTMAX:
            if cfg.renormalize:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        elif cfg.normalize_sigmoid:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + cfg.sigmoid_eps)
    if cfg.routed_scaling_factor != 1.0:
        weights_TK = weights_TK * cfg.routed_scaling_factor
    return weights_TK, topk_ids.to(torch.int32)


def route_per_token_reference(
    router_logits: torch.Tensor,
    cfg: RoutingConfig,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same semantics written one token at a time with Python lists (the test oracle). Scores,
    the bias and group sums are fp32, the op's precision: in fp64 sigmoid(1.25) + sigmoid(-1.25)
    falls one ulp below sigmoid(0) + sigmoid(0) while in fp32 the two tie, which decides a group."""
    weights, ids = [], []
    bias = None if e_score_correction_bias is None else e_score_correction_bias.float()
    for row in router_logits.float().tolist():
        num_experts = len(row)
        t = torch.tensor(row, dtype=torch.float32)
        if cfg.scoring_after_topk:
            order = sorted(range(num_experts), key=lambda e: (-row[e], e))[: cfg.top_k]
            picked = t[order]
            if cfg.method is RoutingMethod.SOFTMAX:
                w = torch.softmax(picked, 0)
            else:
                w = _oracle_score(picked, cfg.method)
                if cfg.normalize_sigmoid:
                    w = w / (w.sum() + cfg.sigmoid_eps)
        else:
            scores = torch.softmax(t, 0) if cfg.method is RoutingMethod.SOFTMAX else _oracle_score(t, cfg.method)
            sel = (scores if bias is None else scores + bias).tolist()  # the fp32 sums, as the op adds them
            allowed = set(range(num_experts))
            if cfg.group_count > 1:
                size = num_experts // cfg.group_count
                groups = [sel[g * size:(g + 1) * size] for g in range(cfg.group_count)]
                if cfg.group_select_mode == 0:
                    gscore = [max(g) for g in groups]
                else:
                    gscore = [float(torch.tensor(sorted(g, reverse=True)[:2], dtype=torch.float32).sum())
                              for g in groups]
                kept = sorted(range(cfg.group_count), key=lambda g: (-gscore[g], g))[: cfg.k_group]
                allowed = {g * size + i for g in kept for i in range(size)}
            order = sorted(allowed, key=lambda e: (-sel[e], e))[: cfg.top_k]
            w = scores[order]
            if cfg.method is RoutingMethod.SOFTMAX:
                if cfg.renormalize:
                    w = w / w.sum()
            elif cfg.normalize_sigmoid:
                w = w / (w.sum() + cfg.sigmoid_eps)
        weights.append((w * cfg.routed_scaling_factor).tolist())
        ids.append(order)
    return torch.tensor(weights, dtype=torch.float32), torch.tensor(ids, dtype=torch.int32)


def _oracle_score(t: torch.Tensor, method: RoutingMethod) -> torch.Tensor:
    """The oracle's elementwise scores in fp32, through torch's own functions (``F.softplus``)."""
    if method is RoutingMethod.SQRTSOFTPLUS:
        return torch.sqrt(torch.nn.functional.softplus(t))
    return torch.sigmoid(t)


def check_router_inputs(hidden_states, weight, bias) -> None:
    """``hidden_states [T, H]``, ``weight [E, H]``, ``bias [E]`` or None, floating, one device."""
    for name, t in (("hidden_states", hidden_states), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"router_logits: {name} must be a torch.Tensor, but got {type(t).__name__}.")
        if not t.dtype.is_floating_point:
            raise TypeError(f"router_logits: {name} must be floating point, but got {t.dtype}.")
    if hidden_states.dim() != 2 or weight.dim() != 2 or hidden_states.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: hidden_states must be [T, H] and weight [E, H] with the same H, but got "
                         f"{tuple(hidden_states.shape)} and {tuple(weight.shape)}.")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"router_logits: bias must have shape ({weight.shape[0]},), but got {tuple(bias.shape)}.")
    devices = {t.device for t in (hidden_states, weight, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"router_logits: hidden_states, weight and bias must be on one device, but got {devices}.")


def check_out_dtype(out_dtype) -> None:
    """``router_logits``' ``out_dtype``: fp32, or bf16/fp16 (the fp32 sum rounded once)."""
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"router_logits: out_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                        f"but got {out_dtype!r}.")


def router_logits_reference(hidden_states: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(hidden_states.float(), weight.float(), bias)``: fp32 router logits ``[T, E]``."""
    return torch.nn.functional.linear(hidden_states.float(), weight.float(), None if bias is None else bias.float())
