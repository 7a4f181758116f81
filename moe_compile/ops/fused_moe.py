"""``fused_moe``: the staged fused MoE op's public entry (seed 003's signature, MindIE-SD semantics).

The positional parameters are the seed's, in its order and with its defaults. Keyword-only
extensions follow them for what real models need:

- ``e_score_correction_bias [E]``: added to the scores for expert *selection* only
  (DeepSeek-V3 / GLM-4 ``noaux_tc`` routing);
- ``activation``: ``"silu"`` (SiLU-gated, default), ``"gelu"``, ``"gelu_tanh"``, ``"swigluoai"``
  (gpt-oss clamped SwiGLU, with ``swiglu_alpha``/``swiglu_limit``), ``"silu_clamped"``
  (``silu(clamp(gate, max=L)) * clamp(up, -L, L)`` with ``L = swiglu_limit``, DeepSeek-V4 style), or a non-gated
  ``"silu_no_mul"``/``"gelu_no_mul"``/``"relu_no_mul"``/``"relu2_no_mul"`` (then ``w13`` is
  ``[E, H, I]``); ``gate_up_interleaved`` reads w13's columns as alternating gate/up (gpt-oss);
- ``scoring_after_topk``: Llama-4 routing, top-k on the raw logits then the score function on the
  k picks; ``normalize_sigmoid=False`` keeps sigmoid weights unnormalised (Llama-4, DeepSeek-V3
  with ``norm_topk_prob=False``); ``apply_router_weight_on_input`` scales the expert input by the
  (top-1) weight instead of its output (Llama-4);
- ``routing_method="sqrtsoftplus"`` (beside the seed's ``"softmax"``/``"sigmoid"``): DeepSeek-V4's
  score ``sqrt(softplus(logits))``, routed as sigmoid is (selection bias, groups, weights divided by
  their sum + 1e-20 unless ``normalize_sigmoid=False``);
- ``lowering``: ``"auto"`` (by device), ``"cpu"``, ``"cuda"`` or ``"npu"``.
"""
from __future__ import annotations

import logging

import torch

from moe_compile.ops import custom_op  # noqa: F401  (registers torch.ops.moe_compile.*)
from moe_compile.ops import autograd  # noqa: F401  (the fused ops' backward: training graphs)
from moe_compile.ops import packed  # noqa: F401  (registers the packed ops compiled graphs call)
from moe_compile.ops.config import DispatcherType, Lowering, parse_enum
from moe_compile.ops.validation import validate_routing_output, validate_scalars, validate_tensors

log = logging.getLogger("moe_compile")
_warned_fused_op = False


def _group_name(group) -> str | None:
    if group is None:
        return None
    import torch.distributed as dist

    if dist.get_world_size(group) <= 1:
        return None
    return group.group_name


def fused_moe(
    hidden_states,
    router_logits,
    num_experts,
    top_k,
    w13_weight,
    w2_weight,
    w13_bias=None,
    w2_bias=None,
    tp_group=None,
    ep_group=None,
    dispatcher_type=None,
    tokens_full=True,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    routing_method="softmax",
    renormalize=False,
    routed_scaling_factor=1.0,
    custom_routing_function=None,
    reduce_results=True,
    use_fused_op=False,
    *,
    e_score_correction_bias=None,
    activation="silu",
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    gate_up_interleaved=False,
    scoring_after_topk=False,
    normalize_sigmoid=True,
    apply_router_weight_on_input=False,
    lowering="auto",
) -> torch.Tensor:
    """Routed-experts forward of one MoE layer; returns a tensor shaped like ``hidden_states``."""
    # spelled out rather than dict(locals()): Dynamo in torch 2.11 cannot trace locals()
    args = dict(
        hidden_states=hidden_states, router_logits=router_logits, num_experts=num_experts, top_k=top_k,
        w13_weight=w13_weight, w2_weight=w2_weight, w13_bias=w13_bias, w2_bias=w2_bias, tp_group=tp_group,
        ep_group=ep_group, dispatcher_type=dispatcher_type, tokens_full=tokens_full, k_group=k_group,
        group_count=group_count, group_select_mode=group_select_mode, routing_method=routing_method,
        renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
        custom_routing_function=custom_routing_function, reduce_results=reduce_results, use_fused_op=use_fused_op,
        e_score_correction_bias=e_score_correction_bias, activation=activation, swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit, gate_up_interleaved=gate_up_interleaved, scoring_after_topk=scoring_after_topk,
        normalize_sigmoid=normalize_sigmoid, apply_router_weight_on_input=apply_router_weight_on_input,
        lowering=lowering,
    )
    validate_scalars(args)
    validate_tensors(args)
    if use_fused_op:
        _note_fused_op_fallback()
    tp_name, ep_name = _group_name(tp_group), _group_name(ep_group)
    dispatcher = None if dispatcher_type is None else parse_enum(DispatcherType, dispatcher_type, "dispatcher_type").value
    if dispatcher == "dynamic" and ep_name is None:
        raise ValueError("dispatcher_type='dynamic' needs an ep_group of size > 1 (dynamic dispatch is EP-only).")
    lowering = parse_enum(Lowering, lowering, "lowering").value
    common = dict(
        activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        gate_up_interleaved=gate_up_interleaved, apply_router_weight_on_input=apply_router_weight_on_input,
        tp_group_name=tp_name, ep_group_name=ep_name, dispatcher_type=dispatcher,
        tokens_full=tokens_full, reduce_results=reduce_results, lowering=lowering,
    )
    if custom_routing_function is not None:
        hidden = hidden_states.shape[-1]
        flat_x = hidden_states.reshape(-1, hidden)
        flat_logits = router_logits.reshape(-1, num_experts)
        if e_score_correction_bias is not None:
            raise ValueError("e_score_correction_bias only steers the built-in routing; it cannot be combined "
                             "with custom_routing_function (apply it inside the function instead).")
        routed = custom_routing_function(
            hidden_states=flat_x, gating_output=flat_logits, topk=top_k, renormalize=renormalize
        )
        if not isinstance(routed, (tuple, list)) or len(routed) != 2:
            raise TypeError(f"custom_routing_function must return a (topk_weights, topk_ids) pair, "
                            f"but got {type(routed).__name__}.")
        weights, ids = routed
        validate_routing_output(weights, ids, flat_x.shape[0], top_k, num_experts, hidden_states.device)
        if routed_scaling_factor != 1.0:
            weights = weights * routed_scaling_factor
        weights, ids = weights.float(), ids.to(torch.int32)
        tensors = (hidden_states, weights, ids, w13_weight, w2_weight, w13_bias, w2_bias)
        op = custom_op.fused_experts_impl if direct_call_ok(tensors) else torch.ops.moe_compile.fused_experts
        return op(*tensors, num_experts=num_experts, **common)
    tensors = (hidden_states, router_logits, w13_weight, w2_weight, w13_bias, w2_bias, e_score_correction_bias)
    op = custom_op.fused_moe_impl if direct_call_ok(tensors) else torch.ops.moe_compile.fused_moe
    return op(
        *tensors, num_experts=num_experts, top_k=top_k, routing_method=routing_method, renormalize=renormalize,
        routed_scaling_factor=routed_scaling_factor, k_group=k_group, group_count=group_count,
        group_select_mode=group_select_mode, normalize_sigmoid=normalize_sigmoid,
        scoring_after_topk=scoring_after_topk, **common,
    )


def direct_call_ok(tensors) -> bool:
    """Plain eager inference: call the op's implementation without the custom-op dispatch (about
    50 µs a call). Anything that must see one op node goes through ``torch.ops`` instead: torch.compile
    or ``torch.jit.trace`` tracing, a dispatch or function mode (fake tensors, export, profilers of ops), tensor
    subclasses, and autograd recording (the op declares no backward, so the error stays the op's)."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return False
        if grad and t.requires_grad:
            return False
    return True


def _note_fused_op_fallback() -> None:
    global _warned_fused_op
    if not _warned_fused_op:
        _warned_fused_op = True
        log.warning("fused_moe: use_fused_op=True: the single fused MoE kernel is not available; "
                    "running the staged path (prepare -> select_experts -> dispatch -> mlp -> combine -> finalize)")
