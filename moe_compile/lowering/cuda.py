"""The CUDA lowering: fused Triton routing and Triton/CUTLASS experts, with no host synchronisation.

Stages (``StagedLowering``'s, with faster kernels):

- ``select_experts``: one Triton kernel does scoring, bias, group mask, top-k, renorm and scaling
  (``kernels/triton/routing.py``);
- single device: ``fused_experts`` straight (pairs/sorted/grouped_mm path per tuned shape; see
  ``kernels/triton/experts.py``) writing the layer output, with no modular-kernel copies;
- distributed: the modular kernel from ``make_distributed_kernel`` with ``TritonExperts``.

Single-device calls of up to 1024 tokens (and 1.5 GB of experts) outside an outer CUDA graph replay a CUDA
graph of the op's kernels from the second call of the same shapes on (``op_graphs.py``;
``MOE_COMPILE_OP_GRAPHS=0``: off).

Anything the Triton kernels cannot run falls back to the portable torch stages, logging the reason
once and counting it in ``FALLBACKS``. Triton is imported only when a stage needs it, so
``import moe_compile`` works without it.
"""
from __future__ import annotations

import collections
import logging

import torch

from moe_compile.lowering import op_graphs
from moe_compile.lowering.base import MoEInputs, StagedLowering
from moe_compile.ops.config import MoEConfig, RoutingConfig

log = logging.getLogger("moe_compile")
FALLBACKS: collections.Counter = collections.Counter()


def _fallback(stage: str, reason: str) -> None:
    key = f"{stage}: {reason}"
    if FALLBACKS[key] == 0:
        log.warning("cuda lowering: %s falls back to the torch stage: %s", stage, reason)
    FALLBACKS[key] += 1


def _triton_missing() -> str:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return ""


def _on_device(t: torch.Tensor) -> bool:
    from moe_compile.kernels.triton import interpreting

    return t.device.type == "cuda" or interpreting()


class CudaLowering(StagedLowering):
    name = "cuda"

    def routing_unsupported(self, logits_TE: torch.Tensor) -> str:
        missing = _triton_missing()
        if missing:
            return missing
        if not _on_device(logits_TE):
            return f"router_logits are on {logits_TE.device}"
        return ""

    def select_experts(self, logits_TE: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None):
        reason = self.routing_unsupported(logits_TE)
        if reason:
            _fallback("select_experts", reason)
            return super().select_experts(logits_TE, cfg, bias)
        from moe_compile.kernels.triton.routing import route

        logits = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
        return route(logits, cfg, bias)

    def experts_unsupported(self, inputs: MoEInputs) -> str:
        missing = _triton_missing()
        if missing:
            return missing
        from moe_compile.kernels.triton.experts import triton_experts_supported

        ok, reason = triton_experts_supported(inputs.hidden_states, inputs.weights)
        return "" if ok else reason

    def make_experts(self, cfg: MoEConfig, inputs: MoEInputs):
        reason = self.experts_unsupported(inputs)
        if reason:
            _fallback("experts", reason)
            return super().make_experts(cfg, inputs)
        from moe_compile.kernels.triton.experts import TritonExperts

        return TritonExperts(cfg.experts)

    def run(self, inputs: MoEInputs, cfg: MoEConfig) -> torch.Tensor:
        out = op_graphs.replay_hit(inputs, cfg)  # a repeat call with a graph kept: straight to its replay
        if out is not None:
            return out
        distributed = cfg.parallel.tp_group_name or cfg.parallel.ep_group_name
        if distributed or self.experts_unsupported(inputs):
            return super().run(inputs, cfg)  # make_experts logs the reason
        out = op_graphs.run(inputs, cfg, self.run_single)
        return self.run_single(inputs, cfg) if out is None else out

    def run_single(self, inputs: MoEInputs, cfg: MoEConfig) -> torch.Tensor:
        """One device, the Triton kernels (``run`` checked both): what ``op_graphs`` captures."""
        from moe_compile.kernels.triton.experts import fused_experts

        x_TH, logits_TE = self.prepare(inputs)
        if inputs.topk_ids is None:
            topk_weights, topk_ids = self.select_experts(logits_TE, cfg.routing, inputs.e_score_correction_bias)
        else:
            topk_weights = inputs.topk_weights.reshape(x_TH.shape[0], inputs.topk_ids.shape[-1])
            topk_ids = inputs.topk_ids.reshape(x_TH.shape[0], inputs.topk_ids.shape[-1])
        on_input = cfg.experts.apply_router_weight_on_input
        if on_input:
            # Llama-4: the (top-1) weight scales the expert input, in the input dtype as the reference does
            x_TH = x_TH * topk_weights.to(x_TH.dtype)
        out_TH = fused_experts(x_TH, topk_weights, topk_ids, inputs.weights, cfg.experts, weighted=not on_input)
        return self.finalize(out_TH, inputs)


__all__ = ["CudaLowering", "FALLBACKS"]
