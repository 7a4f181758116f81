"""The one list of TorchAir GE converters the NPU lowering relies on, per torch_npu version.

TorchAir's GE mode (``max-autotune``) needs a converter for every node of the graph (notes §3.2).
This module records which ops have one, from reading the shipped converters:

- torch_npu ops: ``torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/custom/`` of the
  torch_npu 2.14.0 wheel (notes §3.5);
- aten ops and functional collectives: ``_ge_concrete_graph/ge_converter/aten/*.py`` and the
  ``_c10d_functional`` converters of TorchAir (github.com/Ascend/torchair), read op by op for the
  ones below marked ``read``. Some aten overloads are registered but *raise* (e.g.
  ``aten.sort.stable``: "ge_converter is not supported"), so a file's existence proves nothing.

:func:`check_ge_convertible` (in ``torchair.py``) walks a lowered graph against these sets.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("moe_compile")

Version = tuple[int, int, int]


@dataclass(frozen=True)
class GeConverter:
    op: str  # "namespace::name.overload"
    ge_ir: str
    source: str  # the converter file that registers it


def _npu(name: str, ge_ir: str, source: str, overloads=("default",)) -> dict[str, GeConverter]:
    return {f"npu::{name}.{o}": GeConverter(f"npu::{name}.{o}", ge_ir, f"custom/{source}") for o in overloads}


# torch_npu 2.14.0 (notes §3.5). MoeInitRoutingV2 lowers to GE MoeInitRoutingV3.
_TORCH_NPU_2_14: dict[str, GeConverter] = {
    **_npu("npu_moe_gating_top_k_softmax", "MoeGatingTopKSoftmax", "moe_gating_top_k_softmax.py"),
    **_npu("npu_moe_gating_top_k_softmax_v2", "MoeGatingTopKSoftmax", "npu_moe_gating_top_k_softmax_v2.py"),
    **_npu("npu_moe_gating_top_k", "MoeGatingTopK", "npu_moe_gating_top_k.py"),
    **_npu("npu_moe_init_routing", "MoeInitRouting", "moe_init_routing.py"),
    **_npu("npu_moe_init_routing_v2", "MoeInitRoutingV3", "npu_moe_init_routing_v2.py"),
    **_npu("npu_grouped_matmul", "GroupedMatmul", "grouped_matmul.py", overloads=("default", "List")),
    **_npu("npu_swiglu", "SwiGlu", "npu_swiglu.py"),
    **_npu("npu_moe_finalize_routing", "MoeFinalizeRouting / MoeFinalizeRoutingV2", "npu_moe_finalize_routing.py"),
    **_npu("npu_moe_compute_expert_tokens", "MoeComputeExpertTokens", "npu_moe_compute_expert_tokens.py"),
    **_npu("npu_moe_re_routing", "MoeReRouting", "npu_moe_re_routing.py"),
    **_npu("npu_moe_update_expert", "MoeUpdateExpert", "npu_moe_update_expert.py"),
    **_npu("npu_moe_distribute_dispatch", "MoeDistributeDispatch", "moe_distribute_dispatch.py"),
    **_npu("npu_moe_distribute_dispatch_v2", "MoeDistributeDispatchV2", "moe_distribute_dispatch_v2.py"),
    **_npu("npu_moe_distribute_combine", "MoeDistributeCombine", "moe_distribute_combine.py"),
    **_npu("npu_moe_distribute_combine_v2", "MoeDistributeCombineV2", "moe_distribute_combine_v2.py"),
    **_npu("npu_grouped_matmul_swiglu_quant_v2", "GroupedMatmulSwigluQuantV2", "npu_grouped_matmul_swiglu_quant_v2.py"),
    **_npu("npu_grouped_matmul_finalize_routing", "GroupedMatmulFinalizeRouting", "npu_grouped_matmul_finalize_routing.py"),
    **_npu("npu_dynamic_quant", "DynamicQuant", "npu_dynamic_quant.py"),
    **_npu("npu_dynamic_mx_quant", "DynamicMxQuant", "npu_dynamic_mx_quant.py"),
}

# Ops known to have no GE converter in 2.14.0 (notes §3.5), with what to do instead.
NO_GE_CONVERTER: dict[str, str] = {
    "npu::npu_moe_token_permute": "only the dynamic EP dispatcher uses it; compile with the static dispatcher",
    "npu::npu_moe_token_unpermute": "the static combine uses index_select + where + sum instead",
    "npu::npu_grouped_matmul_swiglu_quant": "use npu_grouped_matmul_swiglu_quant_v2",
    "npu::npu_format_cast": "cast weights once, outside the graph",
}

# torch_npu version -> its converter table. A version between two entries uses the older entry.
_BY_VERSION: dict[Version, dict[str, GeConverter]] = {(2, 14, 0): _TORCH_NPU_2_14}
TARGET_TORCH_NPU: Version = (2, 14, 0)

# aten / functional-collective overloads the lowering emits, each checked in TorchAir's converter
# source ("read": the converter body builds GE ops rather than raising).
ATEN_GE_CONVERTERS: dict[str, str] = {
    "aten::where.self": "read: aten/where.py -> SelectV2",
    "aten::index_select.default": "read: aten/index_select.py -> GatherV2",
    "aten::gather.default": "read: aten/gather.py -> GatherElements",
    "aten::topk.default": "read: aten/topk.py -> TopKV2",
    "aten::slice.Tensor": "read: aten/slice.py -> StridedSlice",
    "aten::zeros_like.default": "read: aten/zeros_like.py",
    "aten::ge.Scalar": "read: aten/ge.py -> GreaterEqual",
    "aten::clamp.default": "read: aten/clamp.py",
    "aten::masked_fill.Scalar": "read: aten/masked_fill.py -> MaskedFill",
    "aten::scatter.value": "read: aten/scatter.py -> ScatterElements",
    "aten::max.dim": "read: aten/max.py -> ArgMaxWithValue",
    "aten::sum.dim_IntList": "read: aten/sum.py -> ReduceSum",
    "aten::_softmax.default": "read: aten/_softmax.py -> SoftmaxV2 (half_to_float=False)",
    "aten::erf.default": "read: aten/erf.py -> Erf",
    "aten::tanh.default": "read: aten/tanh.py -> Tanh",
    "aten::relu.default": "read: aten/relu.py -> Relu",
    "aten::pow.Tensor_Scalar": "read: aten/pow.py -> Pow",
    # sqrt-softplus routing (aten.softplus's converter raises NotImplementedError, so it is spelled out)
    "aten::exp.default": "read: aten/exp.py -> Exp",
    "aten::log1p.default": "read: aten/log1p.py -> Log1p",
    "aten::sqrt.default": "read: aten/sqrt.py -> Sqrt",
    "aten::gt.Scalar": "read: aten/gt.py -> Greater",
    # basic arithmetic, casts and views: present in every TorchAir release, not read one by one
    "aten::add.Tensor": "assumed", "aten::mul.Tensor": "assumed", "aten::div.Tensor": "assumed",
    "aten::sub.Tensor": "assumed", "aten::sigmoid.default": "assumed", "aten::eq.Scalar": "assumed",
    "aten::unsqueeze.default": "assumed", "aten::view.default": "assumed", "aten::_to_copy.default": "assumed",
    "aten::expand.default": "assumed", "aten::clone.default": "assumed",
    "_c10d_functional::all_reduce.default": "read: HcomAllReduce (torch >= 2.3.1)",
    "_c10d_functional::all_gather_into_tensor.default": "read: HcomAllGather (torch >= 2.3.1)",
    "_c10d_functional::reduce_scatter_tensor.default": "read: HcomReduceScatter (torch >= 2.3.1)",
    "_c10d_functional::wait_tensor.default": "read: Identity (torch >= 2.3.1)",
}


def parse_version(text: str) -> Version:
    """``"2.14.0.post3+git1a2b"`` -> ``(2, 14, 0)``; a ValueError when no version is in it."""
    core = text.split("+", 1)[0]
    parts = []
    for piece in core.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ValueError(f"cannot parse a torch_npu version from {text!r}")
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def npu_ge_converters(version: Version | str | None = None) -> dict[str, GeConverter]:
    """The torch_npu-op converters of ``version`` (default: the targeted one)."""
    if version is None:
        version = TARGET_TORCH_NPU
    if isinstance(version, str):
        version = parse_version(version)
    known = sorted(_BY_VERSION)
    older = [v for v in known if v <= version]
    if not older:
        # [infer] older torch_npu releases shipped fewer converters; nothing here was read for them.
        log.warning("torch_npu %s is older than every converter list (%s); checking against %s, which may "
                    "overstate what it can convert", ".".join(map(str, version)),
                    ", ".join(".".join(map(str, v)) for v in known), ".".join(map(str, known[0])))
        return _BY_VERSION[known[0]]
    return _BY_VERSION[older[-1]]
