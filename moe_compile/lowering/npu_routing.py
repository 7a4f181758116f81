"""select_experts on the NPU gating ops (notes §1.4, §2.1, §2.2).

Which op runs:

- softmax, no groups, no selection bias -> ``npu_moe_gating_top_k_softmax`` (MindIE-SD's choice);
- softmax with groups or a bias, and normalised sigmoid -> ``npu_moe_gating_top_k``;
- sqrt-softplus (DeepSeek-V4): plain torch ops (norm_type 2 is newer CANN than torch_npu 2.14 documents);
- anything the ops cannot express -> plain torch ops (:func:`torch_routing`), logged once with the
  reason. It has the reference's semantics (``ops.routing.select_experts``) but selects with
  ``torch.topk``, not the reference's stable sort: TorchAir converts ``aten.topk`` (GE TopKV2) but
  rejects ``aten.sort.stable`` ("ge_converter is not supported"). [AMBIG] TopKV2's order among
  exactly equal scores is undocumented; the gating ops and the reference pick the lower index.

Both ops get fp32 logits: the kernels compute in fp32 anyway, the weights then come out in fp32
like the reference's, and a fp32 ``e_score_correction_bias`` needs no rounding to bf16 to satisfy
the op's "bias dtype == x dtype" rule (which could flip a near-tie in the selection).
Softmax renormalisation and ``routed_scaling_factor`` are applied in torch after the op, as
MindIE-SD does: the 2.14 op supports only ``renorm=0`` for softmax, and scaling inside the op would
come before our renormalisation.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from moe_compile.ops.config import RoutingConfig, RoutingMethod
from moe_compile.ops.routing import select_experts, torch_topk

log = logging.getLogger("moe_compile")

# Documented limits (torch_npu 2.14 docs, notes §2.1/§2.2).
SOFTMAX_OP_MAX_K = 1024
GATING_OP_MAX_EXPERTS = 2048
_logged_reasons: set[str] = set()


class GatingOp(enum.Enum):
    TOP_K_SOFTMAX = "npu_moe_gating_top_k_softmax"
    TOP_K = "npu_moe_gating_top_k"
    TORCH = "torch"  # plain torch ops: the NPU ops cannot express this routing


@dataclass(frozen=True)
class GatingPlan:
    op: GatingOp
    reason: str = ""


def plan_gating(cfg: RoutingConfig, has_bias: bool) -> GatingPlan:
    """Which gating op can compute ``cfg``; TORCH with the reason when none can."""
    if cfg.scoring_after_topk:
        return GatingPlan(GatingOp.TORCH, "scoring_after_topk (Llama-4) selects on raw logits; the NPU gating "
                                          "ops select on softmax/sigmoid scores")
    if cfg.method is RoutingMethod.SQRTSOFTPLUS:
        return GatingPlan(GatingOp.TORCH, "npu_moe_gating_top_k's norm_type 2 (sqrt(softplus), DeepSeek-V4) is in "
                                          "newer CANN only; torch_npu 2.14 documents norm_type 0 and 1")
    if cfg.method is RoutingMethod.SIGMOID and not cfg.normalize_sigmoid:
        return GatingPlan(GatingOp.TORCH, "npu_moe_gating_top_k always renormalises sigmoid weights (norm_type=1), "
                                          "but normalize_sigmoid=False asks for raw sigmoid scores")
    if cfg.method is RoutingMethod.SOFTMAX and not cfg.grouped and not has_bias:
        if cfg.top_k > SOFTMAX_OP_MAX_K:
            return GatingPlan(GatingOp.TORCH, f"npu_moe_gating_top_k_softmax needs k <= {SOFTMAX_OP_MAX_K}")
        return GatingPlan(GatingOp.TOP_K_SOFTMAX)
    reason = _gating_op_limit(cfg)
    if reason:
        return GatingPlan(GatingOp.TORCH, reason)
    return GatingPlan(GatingOp.TOP_K)


def _gating_op_limit(cfg: RoutingConfig) -> str:
    """Why ``npu_moe_gating_top_k`` cannot take ``cfg`` ('' when it can)."""
    num_experts = cfg.num_experts
    if num_experts > GATING_OP_MAX_EXPERTS:
        return f"npu_moe_gating_top_k needs num_experts <= {GATING_OP_MAX_EXPERTS}, got {num_experts}"
    if cfg.grouped:
        per_group = num_experts // cfg.group_count
        # [AMBIG] torch_npu 2.14 says E/G > 2, newer CANN E/G > group_select_mode: take the stricter.
        if per_group <= 2:
            return f"npu_moe_gating_top_k needs > 2 experts per group (torch_npu 2.14), got {per_group}"
        if (per_group + 31) // 32 * 32 * cfg.group_count > GATING_OP_MAX_EXPERTS:
            return "npu_moe_gating_top_k needs align32(E/G) * G <= 2048"
    # [AMBIG] CANN before 8.3.RC1 accepted only the DeepSeek pattern (E=256, k_group=4, bias) on
    # A2/A3 (vllm-ascend PR #4050); the targeted torch_npu 2.14 documents the general op.
    return ""


def import_torch_npu():
    """``torch_npu``, or an ImportError that says how to get it (a device, or the CPU emulation)."""
    try:
        import torch_npu
    except ImportError as exc:
        raise ImportError("lowering='npu' needs torch_npu (an Ascend NPU with CANN), or run inside "
                          "moe_compile.testing.emulated_npu() to use the CPU emulation of its MoE ops") from exc
    return torch_npu


def _log_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        log.info("npu lowering: routing in plain torch ops: %s", reason)


def select_experts_npu(logits_TE: torch.Tensor, cfg: RoutingConfig,
                       bias_E: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k] fp32, topk_ids [T, k] int32)`` with the reference's semantics."""
    plan = plan_gating(cfg, bias_E is not None)
    if plan.op is GatingOp.TORCH:
        _log_once(plan.reason)
        return torch_routing(logits_TE, cfg, bias_E)
    torch_npu = import_torch_npu()

    logits_f32 = logits_TE.float()
    if plan.op is GatingOp.TOP_K_SOFTMAX:
        weights_TK, ids_TK, _ = torch_npu.npu_moe_gating_top_k_softmax(logits_f32, None, k=cfg.top_k)
    else:
        weights_TK, ids_TK, _ = torch_npu.npu_moe_gating_top_k(
            logits_f32, cfg.top_k, bias=None if bias_E is None else bias_E.float(),
            k_group=cfg.k_group, group_count=cfg.group_count, group_select_mode=cfg.group_select_mode,
            renorm=0, norm_type=0 if cfg.method is RoutingMethod.SOFTMAX else 1, out_flag=False,
            routed_scaling_factor=1.0, eps=cfg.sigmoid_eps,
        )
    if cfg.method is RoutingMethod.SOFTMAX and cfg.renormalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    if cfg.routed_scaling_factor != 1.0:
        weights_TK = weights_TK * cfg.routed_scaling_factor
    return weights_TK, ids_TK


def torch_routing(logits_TE: torch.Tensor, cfg: RoutingConfig,
                  bias_E: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.routing.select_experts`` with plain ``torch.topk``: the same semantics in ops that GE
    converts (GE has no stable sort, so exact ties may resolve differently; documented AMBIG)."""
    return select_experts(logits_TE, cfg, bias_E, topk=torch_topk)
