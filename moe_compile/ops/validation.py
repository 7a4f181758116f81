"""Input validation of ``fused_moe``: every check of MindIE-SD's ``validate_moe_inputs`` (notes §1.9)
plus shapes, dtypes and devices of every tensor. Each failure names the parameter, the value
and what was expected; type errors raise ``TypeError``, everything else ``ValueError``.
"""
from __future__ import annotations

import math

import torch

from moe_compile.ops.config import Activation, DispatcherType, Lowering, RoutingMethod, parse_enum

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# activation value -> gated? (a dict: read on every custom-op call, cheaper than parse_enum)
_GATED = {member.value: member.is_gated for member in Activation}


def _tensor(name: str, value, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        extra = " or None" if optional else ""
        raise TypeError(f"{name} must be a torch.Tensor{extra}, but got {type(value).__name__}.")


def _int(name: str, value) -> None:  # (a SymInt: an int option made dynamic by torch.compile)
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, but got {type(value).__name__} {value!r}.")


def _bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, but got {type(value).__name__} {value!r}.")


def _float(name: str, value) -> None:
    if not isinstance(value, (float, torch.SymFloat)):
        raise TypeError(f"{name} must be a float, but got {type(value).__name__} {value!r}.")


def _group(name: str, value) -> None:
    if value is None:
        return
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, but got {type(value).__name__}.")


def group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def validate_scalars(a: dict) -> None:
    """Types and ranges of the non-tensor arguments (rules 6-14 and 21-23)."""
    check_op_scalars({**a, "has_bias": a["e_score_correction_bias"] is not None})
    _bool("use_fused_op", a["use_fused_op"])
    fn = a["custom_routing_function"]
    if fn is not None and not callable(fn):
        raise TypeError(f"custom_routing_function must be callable if provided, but got {type(fn).__name__}.")
    _group("tp_group", a["tp_group"])
    _group("ep_group", a["ep_group"])


def check_op_scalars(a: dict) -> None:
    """The scalar arguments the custom ops take (groups travel there as names; ``has_bias``: whether
    an ``e_score_correction_bias`` is given). ``make_config`` runs it once per distinct set."""
    for name in ("num_experts", "top_k", "k_group", "group_count", "group_select_mode"):
        _int(name, a[name])
    for name in ("tokens_full", "renormalize", "reduce_results", "gate_up_interleaved",
                 "scoring_after_topk", "normalize_sigmoid", "apply_router_weight_on_input"):
        _bool(name, a[name])
    for name in ("routed_scaling_factor", "swiglu_alpha", "swiglu_limit"):
        _float(name, a[name])
    for name in ("routed_scaling_factor", "swiglu_alpha"):
        if not -math.inf < a[name] < math.inf:  # (not math.isfinite: Dynamo cannot trace it on a SymFloat)
            raise ValueError(f"{name} must be a finite float, but got {a[name]!r}.")
    if not a["swiglu_limit"] > 0:
        raise ValueError(f"swiglu_limit must be > 0 (inf: no clamping), but got {a['swiglu_limit']!r}.")
    if a["dispatcher_type"] is not None:
        parse_enum(DispatcherType, a["dispatcher_type"], "dispatcher_type")
    if a["group_select_mode"] not in (0, 1):
        raise ValueError(f"group_select_mode must be 0 or 1, but got {a['group_select_mode']}.")
    parse_enum(RoutingMethod, a["routing_method"], "routing_method")
    parse_enum(Activation, a["activation"], "activation")
    parse_enum(Lowering, a["lowering"], "lowering")
    num_experts, top_k = a["num_experts"], a["top_k"]
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, but got {num_experts}.")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], but got {top_k}.")
    k_group, group_count = a["k_group"], a["group_count"]
    if group_count < 1:
        raise ValueError(f"group_count must be >= 1, but got {group_count}.")
    if k_group < 1:
        raise ValueError(f"k_group must be >= 1, but got {k_group}.")
    if k_group > group_count:
        raise ValueError(f"k_group={k_group} exceeds group_count={group_count}; expected 1 <= k_group <= group_count.")
    if num_experts % group_count:
        raise ValueError(f"num_experts={num_experts} must be divisible by group_count={group_count}.")
    per_group = num_experts // group_count
    if a["group_select_mode"] == 1 and per_group < 2:
        raise ValueError(
            f"group_select_mode=1 sums each group's top-2 scores, so every group needs >= 2 experts, "
            f"but num_experts={num_experts} / group_count={group_count} gives {per_group}."
        )
    if top_k > k_group * per_group:
        raise ValueError(
            f"top_k={top_k} exceeds the experts in the selected groups (k_group={k_group} x "
            f"{per_group} experts per group = {k_group * per_group})."
        )
    if a["scoring_after_topk"] and (group_count > 1 or a["has_bias"]):
        raise ValueError("scoring_after_topk=True (Llama-4 routing) cannot be combined with grouped routing "
                         "(group_count > 1) or e_score_correction_bias.")
    if a["apply_router_weight_on_input"] and top_k != 1:
        raise ValueError(f"apply_router_weight_on_input=True needs top_k == 1, but got top_k={top_k}.")


def validate_tensors(a: dict) -> None:
    """Types, ranks, shapes, dtypes and devices of the tensors (rules 1, 15-20)."""
    hs, rl, w13, w2 = a["hidden_states"], a["router_logits"], a["w13_weight"], a["w2_weight"]
    _tensor("hidden_states", hs)
    _tensor("router_logits", rl)
    _tensor("w13_weight", w13)
    _tensor("w2_weight", w2)
    for name in ("w13_bias", "w2_bias", "e_score_correction_bias"):
        _tensor(name, a[name], optional=True)
    ep = _ep_size(a)
    check_op_shapes(hs, rl, w13, w2, a["num_experts"], a["activation"], expert_parallel=ep is None or ep > 1)
    if hs.shape[:-1] != rl.shape[:-1]:
        raise ValueError(f"router_logits leading dims {tuple(rl.shape[:-1])} must match hidden_states leading dims "
                         f"{tuple(hs.shape[:-1])}.")
    _check_bias_shapes_and_ep(a, ep)
    _check_dtypes_devices(a)


def validate_experts_tensors(a: dict) -> None:
    """``moe_compile::fused_experts``' tensors (checked when it is traced): as :func:`validate_tensors`,
    with ``topk_weights``/``topk_ids`` [tokens, top_k] in place of the router logits."""
    ep = _ep_size(a)
    check_op_shapes(a["hidden_states"], None, a["w13_weight"], a["w2_weight"], a["num_experts"], a["activation"],
                    expert_parallel=ep is None or ep > 1)
    check_topk(a["hidden_states"], a["topk_weights"], a["topk_ids"], a["num_experts"])
    _check_bias_shapes_and_ep(a, ep)
    _check_dtypes_devices(a)


def check_op_shapes(hs, rl, w13, w2, num_experts: int, activation, expert_parallel: bool) -> None:
    """The shape checks the custom ops run on every call, kept cheap (each ``.shape`` read once);
    ``rl`` None for ``fused_experts``. Without expert parallelism every expert is local."""
    hs_shape, w13_shape, w2_shape = hs.shape, w13.shape, w2.shape
    if len(hs_shape) < 2:
        raise ValueError(f"hidden_states must have >= 2 dims [..., hidden_size], but got shape {tuple(hs_shape)}.")
    if rl is not None:
        rl_shape = rl.shape
        if len(rl_shape) < 2:
            raise ValueError(f"router_logits must have >= 2 dims [..., num_experts], but got shape {tuple(rl_shape)}.")
    if len(w13_shape) != 3:
        raise ValueError(f"w13_weight must be 3-D [local_experts, hidden_size, 2 * intermediate_size], "
                         f"but got shape {tuple(w13_shape)}.")
    if len(w2_shape) != 3:
        raise ValueError(f"w2_weight must be 3-D [local_experts, intermediate_size, hidden_size], "
                         f"but got shape {tuple(w2_shape)}.")
    if rl is not None and rl_shape[-1] != num_experts:
        raise ValueError(f"router_logits.shape[-1] must equal num_experts={num_experts}, "
                         f"but got shape {tuple(rl_shape)}.")
    local_e, w13_hidden, w13_width = w13_shape
    w2_experts, inter, w2_hidden = w2_shape
    hidden = hs_shape[-1]
    if local_e < 1:
        raise ValueError(f"w13_weight must hold >= 1 expert, but got shape {tuple(w13_shape)}.")
    if w2_experts != local_e:
        raise ValueError(f"w2_weight.shape[0]={w2_experts} must equal w13_weight.shape[0]={local_e} (local experts).")
    if hidden < 1:
        raise ValueError(f"hidden_size (hidden_states.shape[-1]) must be >= 1, but got shape {tuple(hs_shape)}.")
    if w13_hidden != hidden:
        raise ValueError(f"w13_weight.shape[1]={w13_hidden} must equal hidden_size={hidden} "
                         f"(w13_weight is [local_experts, hidden_size, 2 * intermediate_size]).")
    if w2_hidden != hidden:
        raise ValueError(f"w2_weight.shape[2]={w2_hidden} must equal hidden_size={hidden} "
                         f"(w2_weight is [local_experts, intermediate_size, hidden_size]).")
    if inter < 1:
        raise ValueError(f"intermediate_size (w2_weight.shape[1]) must be >= 1, but got w2_weight shape "
                         f"{tuple(w2_shape)}.")
    gated = _GATED.get(activation)
    if gated is None:  # an Activation member, or a bad value (then parse_enum names it)
        gated = parse_enum(Activation, activation, "activation").is_gated
    want = 2 * inter if gated else inter
    if w13_width != want:
        what = "2 * intermediate_size" if gated else "intermediate_size (non-gated activation)"
        raise ValueError(f"w13_weight.shape[2]={w13_width} must equal {what}={want} "
                         f"(from w2_weight shape {tuple(w2_shape)}).")
    if not expert_parallel and local_e != num_experts:
        raise ValueError(f"w13_weight.shape[0]={local_e} must equal num_experts={num_experts} "
                         f"(every expert is local without an ep_group).")


def check_topk(hs, topk_weights, topk_ids, num_experts: int) -> None:
    """``fused_experts``' routing tensors: [tokens, top_k] each, 1 <= top_k <= num_experts (cheap, every call)."""
    ids_shape = topk_ids.shape
    if len(ids_shape) != 2 or topk_weights.shape != ids_shape:
        raise ValueError(f"topk_weights and topk_ids must both be [tokens, top_k], but got shapes "
                         f"{tuple(topk_weights.shape)} and {tuple(ids_shape)}.")
    tokens, top_k = ids_shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"topk_ids.shape[1] (top_k) must be in [1, num_experts={num_experts}], but got {top_k}.")
    if tokens * hs.shape[-1] != hs.numel():
        raise ValueError(f"topk_ids.shape[0]={tokens} must equal the number of tokens of hidden_states "
                         f"(shape {tuple(hs.shape)}).")


def _ep_size(a: dict) -> int | None:
    """The EP group's size; ``a["ep_size"]`` when given (None: a group named but not resolvable
    here, e.g. a graph traced for analysis without torch.distributed, so the EP checks are left out)."""
    return a["ep_size"] if "ep_size" in a else group_size(a["ep_group"])


def _check_bias_shapes_and_ep(a: dict, ep: int | None) -> None:
    w13, num_experts = a["w13_weight"], a["num_experts"]
    local_e, hidden = w13.shape[0], a["hidden_states"].shape[-1]
    for name, expected in (("w13_bias", (local_e, w13.shape[2])), ("w2_bias", (local_e, hidden))):
        bias = a[name]
        if bias is not None and tuple(bias.shape) != expected:
            raise ValueError(f"{name} must have shape {expected}, but got {tuple(bias.shape)}.")
    bias = a.get("e_score_correction_bias")
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"e_score_correction_bias must have shape ({num_experts},), but got {tuple(bias.shape)}.")
    if ep is not None and ep > 1:
        if num_experts % ep:
            raise ValueError(f"num_experts={num_experts} must be divisible by the ep_group size {ep}.")
        if local_e != num_experts // ep:
            raise ValueError(f"w13_weight.shape[0]={local_e} must equal num_experts / ep_size = "
                             f"{num_experts}/{ep} = {num_experts // ep} under expert parallelism.")


def _check_dtypes_devices(a: dict) -> None:
    hs = a["hidden_states"]
    if hs.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden_states.dtype must be one of float32/bfloat16/float16, but got {hs.dtype}.")
    for name in ("router_logits", "topk_weights", "e_score_correction_bias"):
        t = a.get(name)
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name}.dtype must be a floating dtype, but got {t.dtype}.")
    ids = a.get("topk_ids")
    if ids is not None and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise TypeError(f"topk_ids.dtype must be an integer dtype, but got {ids.dtype}.")
    for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
        t = a[name]
        if t is not None and t.dtype != hs.dtype:
            raise TypeError(f"{name}.dtype must equal hidden_states.dtype={hs.dtype}, but got {t.dtype}.")
    for name in ("router_logits", "topk_weights", "topk_ids", "w13_weight", "w2_weight", "w13_bias", "w2_bias",
                 "e_score_correction_bias"):
        t = a.get(name)
        if t is not None and t.device != hs.device:
            raise ValueError(f"{name} is on {t.device} but hidden_states is on {hs.device}; "
                             f"expected every tensor on one device.")


def validate_routing_output(weights, ids, num_tokens: int, top_k: int, num_experts: int,
                            device: torch.device | None = None) -> None:
    """What a custom_routing_function returned."""
    for name, t in (("topk_weights", weights), ("topk_ids", ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"custom_routing_function must return (topk_weights, topk_ids) tensors, "
                            f"but {name} is {type(t).__name__}.")
    if tuple(weights.shape) != (num_tokens, top_k) or tuple(ids.shape) != (num_tokens, top_k):
        raise ValueError(f"custom_routing_function must return tensors of shape ({num_tokens}, {top_k}), but got "
                         f"topk_weights {tuple(weights.shape)} and topk_ids {tuple(ids.shape)}.")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"custom_routing_function's topk_ids must be an integer tensor, but got {ids.dtype}.")
    if not weights.is_floating_point():
        raise TypeError(f"custom_routing_function's topk_weights must be floating, but got {weights.dtype}.")
    for name, t in (("topk_weights", weights), ("topk_ids", ids)):
        if device is not None and t.device != device:
            raise ValueError(f"custom_routing_function's {name} is on {t.device} but hidden_states is on "
                             f"{device}; expected the same device.")
    # The range check reads the ids on the host, so it runs in eager mode only (under torch.compile
    # it would break the graph); an out-of-range id would otherwise be dropped without a word.
    if ids.numel() and not torch.compiler.is_compiling() and ids.device.type != "meta":
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"custom_routing_function's topk_ids must lie in [0, num_experts={num_experts}), "
                             f"but got values in [{low}, {high}].")
