"""Parsed configuration of one fused-MoE call.

Strings live only at the edges (the public ``fused_moe`` signature and the custom op's schema);
everything inside compares the Enums and reads the frozen :class:`MoEConfig` built here.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RoutingMethod(enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    # extension: DeepSeek-V4's score function sqrt(softplus(logits)); routed like sigmoid (elementwise
    # scores, selection bias, weights normalised over the picks unless normalize_sigmoid=False)
    SQRTSOFTPLUS = "sqrtsoftplus"

    @property
    def elementwise(self) -> bool:
        """Each expert's score depends on its own logit only (sigmoid, sqrt-softplus), not softmax."""
        return self is not RoutingMethod.SOFTMAX


class Activation(enum.Enum):
    """The expert MLP's activation.

    Gated forms read ``w13``'s output as ``[gate | up]`` (or interleaved, see
    ``MoEConfig.gate_up_interleaved``) and produce ``act(gate) * up``; ``*_NO_MUL`` forms are
    not gated: ``w13`` is ``[E, H, I]`` and the activation is applied to its whole output.
    """

    SILU = "silu"  # SiLU-gated (SwiGLU), the default
    GELU = "gelu"  # GELU-gated (exact erf GELU)
    GELU_TANH = "gelu_tanh"  # GELU-gated, tanh approximation
    SWIGLU_OAI = "swigluoai"  # gpt-oss: g=clamp(g,max=L), u=clamp(u,-L,L), (u+1)*g*sigmoid(alpha*g)
    SILU_CLAMPED = "silu_clamped"  # DeepSeek-V4 style: silu(clamp(g, max=L)) * clamp(u, -L, L)
    SILU_NO_MUL = "silu_no_mul"
    GELU_NO_MUL = "gelu_no_mul"
    RELU_NO_MUL = "relu_no_mul"
    RELU2_NO_MUL = "relu2_no_mul"  # squared ReLU (nemotron-h)

    @property
    def is_gated(self) -> bool:
        return not self.value.endswith("_no_mul")


class DispatcherType(enum.Enum):
    STATIC = "static"
    DYNAMIC = "dynamic"
    BATCHED = "batched"  # low-latency EP: fixed-capacity per-expert buffers (extension)


class Lowering(enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"


# value -> member for each Enum, built eagerly: Dynamo in torch 2.11 (Python 3.12) cannot iterate an
# Enum class while tracing fused_moe, but it reads a dict of constants fine.
_MEMBERS: dict[type, dict[str, enum.Enum]] = {}


def _members(enum_cls: type[enum.Enum]) -> dict[str, enum.Enum]:
    if enum_cls not in _MEMBERS:
        _MEMBERS[enum_cls] = {member.value: member for member in enum_cls}
    return _MEMBERS[enum_cls]


def parse_enum(enum_cls: type[enum.Enum], value, name: str):
    """Turn a user string (or an enum member) into ``enum_cls``; a clear ValueError otherwise."""
    if isinstance(value, enum_cls):
        return value
    members = _members(enum_cls)
    if isinstance(value, str) and value in members:
        return members[value]
    raise ValueError(f"{name} must be one of {list(members)}, but got {value!r}.")


for _enum in (RoutingMethod, Activation, DispatcherType, Lowering):
    _members(_enum)


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits become (topk_weights, topk_ids)."""

    num_experts: int
    top_k: int
    method: RoutingMethod = RoutingMethod.SOFTMAX
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    k_group: int = 1
    group_count: int = 1
    group_select_mode: int = 0
    # Extensions (keyword-only in fused_moe):
    has_correction_bias: bool = False
    normalize_sigmoid: bool = True  # the NPU gating op always normalises sigmoid weights
    scoring_after_topk: bool = False  # Llama-4: top-k on raw logits, then score the k picks
    sigmoid_eps: float = 1e-20

    @property
    def grouped(self) -> bool:
        return self.group_count > 1


@dataclass(frozen=True)
class ExpertsConfig:
    """What each expert computes."""

    activation: Activation = Activation.SILU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    gate_up_interleaved: bool = False
    apply_router_weight_on_input: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    """Which communication mode the call runs in (groups are carried by name)."""

    tp_group_name: str | None = None
    ep_group_name: str | None = None
    dispatcher_type: DispatcherType | None = None
    tokens_full: bool = True
    reduce_results: bool = True


@dataclass(frozen=True)
class MoEConfig:
    routing: RoutingConfig
    experts: ExpertsConfig = ExpertsConfig()
    parallel: ParallelConfig = ParallelConfig()
    lowering: Lowering = Lowering.AUTO
