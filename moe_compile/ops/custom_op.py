"""The fused MoE as ``torch.library`` custom ops, so torch.compile sees one opaque node.

Two ops:

- ``moe_compile::fused_moe``: router logits in, the routing runs inside the op;
- ``moe_compile::fused_experts``: routing already done (``topk_weights``/``topk_ids`` in). This is
  how a ``custom_routing_function`` stays compatible with ``fullgraph=True``: ``fused_moe()``
  calls the Python function *outside* the op (Dynamo traces it like any other code) and hands
  the result to this op.

Process groups cannot be op arguments; they travel by name (``ProcessGroup.group_name``) and
are resolved inside the op with ``_resolve_process_group``, as torch's functional collectives do.
All scalar options are plain ints/floats/bools/strings parsed once into a frozen ``MoEConfig``.

Called through ``torch.ops`` the ops check their arguments like the public ``fused_moe`` does, at
no real cost per call: the scalars once per distinct set (``make_config`` is cached), every tensor
rule in the fake (trace time only), and a few cheap shape checks on every call.
``fused_moe()``, which has checked everything already, calls ``fused_*_impl`` directly in eager.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from moe_compile.lowering import MoEInputs, get_lowering, resolve
from moe_compile.modular import ExpertWeights
from moe_compile.ops.config import (
    Activation,
    DispatcherType,
    ExpertsConfig,
    Lowering,
    MoEConfig,
    ParallelConfig,
    RoutingConfig,
    RoutingMethod,
)
from moe_compile.ops.registration import op
from moe_compile.ops.validation import (
    check_op_scalars,
    check_op_shapes,
    check_topk,
    validate_experts_tensors,
    validate_tensors,
)


@functools.lru_cache(maxsize=1024)
def make_config(num_experts: int, top_k: int, routing_method: str, renormalize: bool,
                routed_scaling_factor: float, k_group: int, group_count: int, group_select_mode: int,
                normalize_sigmoid: bool, scoring_after_topk: bool, has_bias: bool, activation: str,
                swiglu_alpha: float, swiglu_limit: float, gate_up_interleaved: bool,
                apply_router_weight_on_input: bool, tp_group_name: Optional[str],
                ep_group_name: Optional[str], dispatcher_type: Optional[str], tokens_full: bool,
                reduce_results: bool, lowering: str) -> MoEConfig:
    check_op_scalars(locals())  # once per distinct set of scalars (cached): free per call
    routing = RoutingConfig(
        num_experts=num_experts, top_k=top_k, method=RoutingMethod(routing_method),
        renormalize=renormalize, routed_scaling_factor=routed_scaling_factor, k_group=k_group,
        group_count=group_count, group_select_mode=group_select_mode, has_correction_bias=has_bias,
        normalize_sigmoid=normalize_sigmoid, scoring_after_topk=scoring_after_topk,
    )
    experts = ExpertsConfig(
        activation=Activation(activation), swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        gate_up_interleaved=gate_up_interleaved, apply_router_weight_on_input=apply_router_weight_on_input,
    )
    parallel = ParallelConfig(
        tp_group_name=tp_group_name, ep_group_name=ep_group_name,
        dispatcher_type=None if dispatcher_type is None else DispatcherType(dispatcher_type),
        tokens_full=tokens_full, reduce_results=reduce_results,
    )
    return MoEConfig(routing=routing, experts=experts, parallel=parallel, lowering=Lowering(lowering))


def _run(cfg: MoEConfig, inputs: MoEInputs) -> torch.Tensor:
    lowering = get_lowering(resolve(cfg.lowering, inputs.hidden_states.device))
    return lowering.run(inputs, cfg)


def fused_moe_impl(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, w13_weight: torch.Tensor,
    w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
    e_score_correction_bias: Optional[torch.Tensor], num_experts: int, top_k: int,
    routing_method: str, renormalize: bool, routed_scaling_factor: float, k_group: int,
    group_count: int, group_select_mode: int, normalize_sigmoid: bool, scoring_after_topk: bool,
    activation: str, swiglu_alpha: float, swiglu_limit: float, gate_up_interleaved: bool,
    apply_router_weight_on_input: bool, tp_group_name: Optional[str], ep_group_name: Optional[str],
    dispatcher_type: Optional[str], tokens_full: bool, reduce_results: bool, lowering: str,
) -> torch.Tensor:
    """The op's body, after its checks; ``fused_moe()`` (which checked everything) calls it directly in
    plain eager inference."""
    cfg = make_config(num_experts, top_k, routing_method, renormalize, routed_scaling_factor, k_group,
                      group_count, group_select_mode, normalize_sigmoid, scoring_after_topk,
                      e_score_correction_bias is not None, activation, swiglu_alpha, swiglu_limit,
                      gate_up_interleaved, apply_router_weight_on_input, tp_group_name, ep_group_name,
                      dispatcher_type, tokens_full, reduce_results, lowering)
    weights = ExpertWeights(w13_weight, w2_weight, w13_bias, w2_bias)
    return _run(cfg, MoEInputs(hidden_states, router_logits, weights, e_score_correction_bias))


def _ep_size_by_name(name: Optional[str]) -> Optional[int]:
    """The EP group's size at trace time; None when the name resolves to no live group here (a
    graph traced for analysis, without torch.distributed): the fake then leaves the EP checks out,
    and the op checks the group when it runs."""
    if name is None:
        return 1
    from moe_compile.distributed.groups import resolve_group
    from moe_compile.ops.validation import group_size

    try:
        return group_size(resolve_group(name))
    except (ValueError, RuntimeError):
        return None


@op("moe_compile::fused_moe")
def fused_moe_op(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, w13_weight: torch.Tensor,
    w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
    e_score_correction_bias: Optional[torch.Tensor], num_experts: int, top_k: int,
    routing_method: str, renormalize: bool, routed_scaling_factor: float, k_group: int,
    group_count: int, group_select_mode: int, normalize_sigmoid: bool, scoring_after_topk: bool,
    activation: str, swiglu_alpha: float, swiglu_limit: float, gate_up_interleaved: bool,
    apply_router_weight_on_input: bool, tp_group_name: Optional[str], ep_group_name: Optional[str],
    dispatcher_type: Optional[str], tokens_full: bool, reduce_results: bool, lowering: str,
) -> torch.Tensor:
    """What ``moe_compile::fused_moe`` runs: a few cheap shape checks, then ``fused_moe_impl``. The checks
    cost about 1 us a call next to the op's ~30 us dispatch (``benchmarks/host_overhead.py``); the
    scalars are checked in the cached ``make_config``, everything else in the fake at trace time."""
    check_op_shapes(hidden_states, router_logits, w13_weight, w2_weight, num_experts, activation,
                    expert_parallel=ep_group_name is not None)
    return fused_moe_impl(
        hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias, e_score_correction_bias,
        num_experts, top_k, routing_method, renormalize, routed_scaling_factor, k_group, group_count,
        group_select_mode, normalize_sigmoid, scoring_after_topk, activation, swiglu_alpha, swiglu_limit,
        gate_up_interleaved, apply_router_weight_on_input, tp_group_name, ep_group_name, dispatcher_type,
        tokens_full, reduce_results, lowering)


@fused_moe_op.register_fake
def _fused_moe_fake(hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias,
                    e_score_correction_bias, num_experts, top_k, routing_method, renormalize,
                    routed_scaling_factor, k_group, group_count, group_select_mode, normalize_sigmoid,
                    scoring_after_topk, activation, swiglu_alpha, swiglu_limit, gate_up_interleaved,
                    apply_router_weight_on_input, tp_group_name, ep_group_name, dispatcher_type, tokens_full,
                    reduce_results, lowering):
    # trace time only: every check of the public fused_moe (not through the cached make_config: under
    # torch.compile an int option can be a SymInt, which does not hash)
    check_op_scalars({**locals(), "has_bias": e_score_correction_bias is not None})
    validate_tensors(dict(
        hidden_states=hidden_states, router_logits=router_logits, w13_weight=w13_weight, w2_weight=w2_weight,
        w13_bias=w13_bias, w2_bias=w2_bias, e_score_correction_bias=e_score_correction_bias,
        num_experts=num_experts, activation=activation, ep_group=None, ep_size=_ep_size_by_name(ep_group_name)))
    # contiguous, like the real output (empty_like would copy a transposed input's strides)
    return hidden_states.new_empty(hidden_states.shape)


# fused_experts' routing arguments of make_config (after top_k, in its order): the routing is done
_ROUTING_DONE = dict(routing_method="softmax", renormalize=False, routed_scaling_factor=1.0, k_group=1, group_count=1,
                     group_select_mode=0, normalize_sigmoid=True, scoring_after_topk=False, has_bias=False)


def fused_experts_impl(
    hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_weight: torch.Tensor, w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor],
    w2_bias: Optional[torch.Tensor], num_experts: int, activation: str, swiglu_alpha: float,
    swiglu_limit: float, gate_up_interleaved: bool, apply_router_weight_on_input: bool,
    tp_group_name: Optional[str], ep_group_name: Optional[str], dispatcher_type: Optional[str],
    tokens_full: bool, reduce_results: bool, lowering: str,
) -> torch.Tensor:
    """What ``moe_compile::fused_experts`` runs (the routing already done)."""
    cfg = make_config(num_experts, topk_ids.shape[-1], *_ROUTING_DONE.values(), activation, swiglu_alpha, swiglu_limit,
                      gate_up_interleaved, apply_router_weight_on_input, tp_group_name, ep_group_name,
                      dispatcher_type, tokens_full, reduce_results, lowering)
    weights = ExpertWeights(w13_weight, w2_weight, w13_bias, w2_bias)
    return _run(cfg, MoEInputs(hidden_states, None, weights, None, topk_weights, topk_ids))


@op("moe_compile::fused_experts")
def fused_experts_op(
    hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_weight: torch.Tensor, w2_weight: torch.Tensor, w13_bias: Optional[torch.Tensor],
    w2_bias: Optional[torch.Tensor], num_experts: int, activation: str, swiglu_alpha: float,
    swiglu_limit: float, gate_up_interleaved: bool, apply_router_weight_on_input: bool,
    tp_group_name: Optional[str], ep_group_name: Optional[str], dispatcher_type: Optional[str],
    tokens_full: bool, reduce_results: bool, lowering: str,
) -> torch.Tensor:
    """What ``moe_compile::fused_experts`` runs: cheap checks as for ``fused_moe`` (and the routing
    tensors' shapes), then ``fused_experts_impl``."""
    check_op_shapes(hidden_states, None, w13_weight, w2_weight, num_experts, activation,
                    expert_parallel=ep_group_name is not None)
    check_topk(hidden_states, topk_weights, topk_ids, num_experts)
    return fused_experts_impl(
        hidden_states, topk_weights, topk_ids, w13_weight, w2_weight, w13_bias, w2_bias, num_experts,
        activation, swiglu_alpha, swiglu_limit, gate_up_interleaved, apply_router_weight_on_input,
        tp_group_name, ep_group_name, dispatcher_type, tokens_full, reduce_results, lowering)


@fused_experts_op.register_fake
def _fused_experts_fake(hidden_states, topk_weights, topk_ids, w13_weight, w2_weight, w13_bias, w2_bias,
                        num_experts, activation, swiglu_alpha, swiglu_limit, gate_up_interleaved,
                        apply_router_weight_on_input, tp_group_name, ep_group_name, dispatcher_type,
                        tokens_full, reduce_results, lowering):
    # trace time only: every check (the routing tensors first: top_k is topk_ids.shape[-1])
    validate_experts_tensors(dict(
        hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids, w13_weight=w13_weight,
        w2_weight=w2_weight, w13_bias=w13_bias, w2_bias=w2_bias, num_experts=num_experts, activation=activation,
        ep_group=None, ep_size=_ep_size_by_name(ep_group_name)))
    check_op_scalars({**locals(), **_ROUTING_DONE, "top_k": topk_ids.shape[-1]})
    # contiguous, like the real output (empty_like would copy a transposed input's strides)
    return hidden_states.new_empty(hidden_states.shape)


@op("moe_compile::router_logits")
def router_logits_op(hidden_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Router logits ``F.linear(hidden_states.float(), weight.float(), bias)`` without an fp32 copy
    of ``hidden_states``, in ``out_dtype`` (fp32 by default; bf16/fp16: that sum rounded once, what
    a low-precision ``F.linear`` computes). CUDA kernels in ``kernels/triton/router.py``;
    elsewhere that formula."""
    out_dtype = torch.float32 if out_dtype is None else out_dtype
    if hidden_states.device.type == "cuda":
        from moe_compile.kernels.triton.router import router_logits

        return router_logits(hidden_states, weight, bias, out_dtype)  # checks its inputs
    from moe_compile.ops.routing import check_out_dtype, check_router_inputs, router_logits_reference

    check_router_inputs(hidden_states, weight, bias)
    check_out_dtype(out_dtype)
    return router_logits_reference(hidden_states, weight, bias).to(out_dtype)


@router_logits_op.register_fake
def _router_logits_fake(hidden_states, weight, bias, out_dtype=None):
    return hidden_states.new_empty((hidden_states.shape[0], weight.shape[0]),
                                    dtype=torch.float32 if out_dtype is None else out_dtype)
