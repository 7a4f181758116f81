"""ModularKernel: the one sealed composer of PrepareAndFinalize x PermuteExpertsUnpermute.

It checks the pair once at construction, maps global expert ids to local ones through
``expert_map``, allocates the two workspaces from ``workspace_shapes``, chunks standard-format
inputs, and decides where the top-k weight-and-reduce happens: the experts say what is left to
do (``finalize_weight_and_reduce_impl``) and the PrepareAndFinalize's ``finalize`` runs it.
"""
from __future__ import annotations

from typing import final

import torch

from moe_compile.modular.base import (
    ActivationFormat,
    Capability,
    ExpertWeights,
    PermuteExpertsUnpermute,
    PrepareAndFinalize,
)

DEFAULT_CHUNK_SIZE = 32768


def check_compatible(prepare_finalize: PrepareAndFinalize, experts: PermuteExpertsUnpermute) -> Capability:
    """Whether the pair can be composed; ``(False, reason)`` otherwise."""
    pf_format = prepare_finalize.activation_format
    in_format, out_format = experts.activation_formats()
    if pf_format is not in_format:
        return False, (
            f"{type(prepare_finalize).__name__} emits {pf_format.value}-format activations but "
            f"{type(experts).__name__} takes {in_format.value}-format ones"
        )
    if out_format is not in_format:
        return False, f"{type(experts).__name__} changes the activation format ({in_format.value} -> {out_format.value})"
    return True, ""


@final
class ModularKernel:
    def __init__(self, prepare_finalize: PrepareAndFinalize, experts: PermuteExpertsUnpermute,
                 chunk_size: int = DEFAULT_CHUNK_SIZE):
        ok, reason = check_compatible(prepare_finalize, experts)
        if not ok:
            raise ValueError(f"incompatible modular kernel components: {reason}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, but got {chunk_size}")
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.chunk_size = chunk_size

    def __init_subclass__(cls, **kwargs):
        raise TypeError("ModularKernel is sealed; compose new components instead of subclassing it")

    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        weights: ExpertWeights,
        *,
        global_num_experts: int,
        expert_map: torch.Tensor | None = None,
        apply_router_weight_on_input: bool = False,
    ) -> torch.Tensor:
        """``hidden_states [M, K]`` with ``topk_weights/ids [M, topk]`` -> ``[M, K]``."""
        if expert_map is not None and not self.experts.supports_expert_map():
            raise ValueError(f"{type(self.experts).__name__} does not support an expert_map")
        ids_dtype = self.prepare_finalize.topk_indices_dtype()
        if ids_dtype is not None:
            topk_ids = topk_ids.to(ids_dtype)
        prep_kwargs = dict(
            hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids,
            num_experts=global_num_experts, expert_map=expert_map,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )
        if self.prepare_finalize.has_prepare_no_receive():
            prepared = self.prepare_finalize.prepare_no_receive(**prep_kwargs)()
        else:
            prepared = self.prepare_finalize.prepare(**prep_kwargs)
        fused_out = self._run_experts(prepared, weights, global_num_experts, expert_map,
                                      apply_router_weight_on_input)
        output = torch.empty(
            (prepared.topk_ids.shape[0], hidden_states.shape[-1]),
            dtype=hidden_states.dtype, device=hidden_states.device,
        )
        return self.prepare_finalize.finalize(
            output=output,
            fused_expert_output=fused_out,
            topk_weights=prepared.topk_weights,
            topk_ids=prepared.topk_ids,
            apply_router_weight_on_input=apply_router_weight_on_input,
            weight_and_reduce=self.experts.finalize_weight_and_reduce_impl(),
        )

    __call__ = forward

    def _shapes(self, rows: int, prepared, weights: ExpertWeights, global_num_experts: int):
        return self.experts.workspace_shapes(
            M=rows, N=weights.w13.shape[2], K=weights.w2.shape[2], topk=prepared.topk_ids.shape[1],
            global_num_experts=global_num_experts, local_num_experts=weights.w13.shape[0],
            expert_tokens_meta=prepared.expert_tokens_meta,
        )

    def _run_experts(self, prepared, weights: ExpertWeights, global_num_experts, expert_map,
                     apply_router_weight_on_input) -> torch.Tensor:
        x = prepared.hidden_states
        batched = self.prepare_finalize.activation_format is ActivationFormat.BATCHED
        rows = x.shape[1] if batched else x.shape[0]
        chunk = rows if (batched or not self.experts.supports_chunking()) else min(rows, self.chunk_size)
        full = self._shapes(rows, prepared, weights, global_num_experts)
        ws_dtype = x.dtype
        if rows == 0:
            # No token arrived (an empty batch, or an all-to-all that sent this rank nothing):
            # skip the GEMMs; finalize still runs, so every rank joins the combine.
            return torch.zeros(full.output, dtype=ws_dtype, device=x.device)
        scratch = self._shapes(chunk, prepared, weights, global_num_experts)
        workspace13 = torch.empty(scratch.workspace13, dtype=ws_dtype, device=x.device)
        workspace2 = torch.empty(scratch.workspace2, dtype=ws_dtype, device=x.device)
        fused_out = torch.empty(full.output, dtype=ws_dtype, device=x.device)
        common = dict(weights=weights, global_num_experts=global_num_experts, expert_map=expert_map,
                      workspace13=workspace13, workspace2=workspace2,
                      apply_router_weight_on_input=apply_router_weight_on_input)
        if batched or chunk >= rows:
            self.experts.apply(output=fused_out, hidden_states=x, topk_weights=prepared.topk_weights,
                               topk_ids=prepared.topk_ids, expert_tokens_meta=prepared.expert_tokens_meta,
                               **common)
            return fused_out
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            self.experts.apply(output=fused_out[start:end], hidden_states=x[start:end],
                               topk_weights=prepared.topk_weights[start:end],
                               topk_ids=prepared.topk_ids[start:end], expert_tokens_meta=None, **common)
        return fused_out
