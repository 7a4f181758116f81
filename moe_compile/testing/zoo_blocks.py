"""Hand-written block styles as test subjects: a tiny residual model stacking N blocks of one style.

``build_block_model("gptfast", num_layers=3)`` gives a model whose MoE blocks (``layers.i.moe``)
are the hand-written ones from :mod:`moe_compile.testing.blocks`; the rewritten-block count of
the pass must equal ``num_layers``.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from moe_compile.testing import blocks
from moe_compile.testing.blocks import MoEBlockConfig, ScoreFunc
from moe_compile.testing.zoo_spec import Capture, RouterKind


@dataclass(frozen=True)
class BlockStyle:
    """One hand-written block style: its class, config, and what Dynamo / the op make of it."""

    name: str
    block_class: type
    config: MoEBlockConfig
    router_kind: RouterKind
    capture: Capture
    expressible: bool = True
    skip_reason: str | None = None
    notes: str = ""
    dynamo_flags: Mapping = field(default_factory=lambda: types.MappingProxyType({}))
    # dtypes Dynamo can trace the block in: torch._grouped_mm's meta kernel (torch 2.13) rejects
    # anything but bf16, though its CPU eager kernel runs fp32.
    compile_dtypes: tuple = (torch.float32, torch.bfloat16)


_FLAGS = types.MappingProxyType(dict(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True))
_BF16 = (torch.bfloat16,)

BLOCK_STYLES = types.MappingProxyType({style.name: style for style in (
    BlockStyle("v4_mixtral", blocks.V4MoEBlock, MoEBlockConfig(), RouterKind.R1, Capture.NEEDS_FLAGS,
               notes="range(E) loop with torch.where (nonzero) + index_add_", dynamo_flags=_FLAGS),
    BlockStyle("v4_gelu_norenorm", blocks.V4MoEBlock, MoEBlockConfig(renormalize=False, activation="gelu"),
               RouterKind.R1, Capture.NEEDS_FLAGS, notes="GELU-gated experts, no renorm", dynamo_flags=_FLAGS),
    BlockStyle("gptfast", blocks.GatherEinsumMoE, MoEBlockConfig(), RouterKind.R1, Capture.ONE_GRAPH,
               notes="w[expert_indices] gathers + einsum"),
    BlockStyle("titan_softmax_gmm", blocks.TitanMoE, MoEBlockConfig(renormalize=False), RouterKind.R1,
               Capture.ONE_GRAPH, notes="histc + argsort + torch._grouped_mm + scatter_add", compile_dtypes=_BF16),
    BlockStyle("titan_sigmoid_gmm", blocks.TitanMoE,
               MoEBlockConfig(score_func=ScoreFunc.SIGMOID, renormalize=True, route_scale=2.0), RouterKind.R3,
               Capture.ONE_GRAPH, notes="sigmoid -> topk -> /(sum+1e-20) -> x route_scale, no bias",
               compile_dtypes=_BF16),
    BlockStyle("titan_loop", blocks.TitanMoE, MoEBlockConfig(use_grouped_mm=False), RouterKind.R1,
               Capture.NEEDS_FLAGS, notes="tokens_per_expert.tolist() + split + per-expert matmul loop",
               dynamo_flags=_FLAGS),
    BlockStyle("titan_score_before", blocks.TitanMoE, MoEBlockConfig(top_k=1, score_before_experts=True),
               RouterKind.R1, Capture.ONE_GRAPH, notes="router weight multiplies the expert INPUT (top-1)",
               compile_dtypes=_BF16),
    BlockStyle("v4_grouped_sigmoid", blocks.V4GroupedSigmoidMoE, MoEBlockConfig(), RouterKind.R4,
               Capture.NEEDS_FLAGS, notes="DeepSeek-V3-like router + 4.x loop + ungated shared expert",
               dynamo_flags=_FLAGS),
)})


class MoELayer(nn.Module):
    """``x + mixer(norm1(x))`` then ``x + moe(norm2(x))``; the mixer stands in for attention."""

    def __init__(self, moe: nn.Module, hidden_size: int):
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden_size, eps=1e-6)
        self.mixer = nn.Linear(hidden_size, hidden_size, bias=False)
        self.norm2 = nn.RMSNorm(hidden_size, eps=1e-6)
        self.moe = moe

    def forward(self, hidden_states_BSD):
        hidden_states_BSD = hidden_states_BSD + self.mixer(self.norm1(hidden_states_BSD))
        return hidden_states_BSD + self.moe(self.norm2(hidden_states_BSD))


class StackedMoEModel(nn.Module):
    """``num_layers`` residual MoE layers of one block style, then a final norm."""

    def __init__(self, style: BlockStyle, num_layers: int):
        super().__init__()
        hidden = style.config.hidden_size
        self.layers = nn.ModuleList([MoELayer(style.block_class(style.config), hidden) for _ in range(num_layers)])
        self.norm = nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


def get_block_style(name: str) -> BlockStyle:
    if name not in BLOCK_STYLES:
        raise ValueError(f"style must be one of {sorted(BLOCK_STYLES)}, but got {name!r}.")
    return BLOCK_STYLES[name]


def build_block_model(
    style: str,
    *,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_tokens: int = 5,
    batch: int = 1,
) -> tuple[nn.Module, dict]:
    """An eval-mode :class:`StackedMoEModel` with re-drawn weights, and ``{"hidden_states": [B, T, D]}``."""
    from moe_compile.testing.zoo import redraw_parameters

    spec = get_block_style(style)
    for name, value in (("num_layers", num_layers), ("num_tokens", num_tokens), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, but got {value!r}.")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, but got {dtype!r}.")
    model = StackedMoEModel(spec, num_layers)
    redraw_parameters(model, seed=seed)
    model = model.to(dtype).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(batch, num_tokens, spec.config.hidden_size, generator=gen).to(dtype)
    return model, {"hidden_states": hidden}


def _stack_linear_experts(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    """4.x ``ExpertMLP`` list -> (w13 ``[E, D, 2F]`` gate|up, w2 ``[E, F, D]``); copies (reference use)."""
    w13 = torch.stack([torch.cat([e.w1.weight.t(), e.w3.weight.t()], dim=-1) for e in experts])
    w2 = torch.stack([e.w2.weight.t() for e in experts])
    return w13, w2


def fused_reference_args(block: nn.Module, x_TD: torch.Tensor) -> dict:
    """The ``fused_moe`` arguments that compute ``block`` (routed part) on ``x_TD``.

    This is what a correct rewrite of the block must pass to the op; shared experts (the
    ``shared_experts`` attribute, if any) stay outside. Raises TypeError for an unknown block class.
    """
    cfg = block.cfg
    common = dict(hidden_states=x_TD, num_experts=cfg.num_experts, top_k=cfg.top_k, activation=cfg.activation)
    if isinstance(block, blocks.V4MoEBlock):
        w13, w2 = _stack_linear_experts(block.experts)
        return dict(common, router_logits=block.gate(x_TD), w13_weight=w13, w2_weight=w2,
                    renormalize=cfg.renormalize)
    if isinstance(block, blocks.GatherEinsumMoE):
        ffn = block.cond_ffn
        w13 = torch.cat([ffn.w1_EFD, ffn.w3_EFD], dim=1).transpose(1, 2)
        return dict(common, router_logits=block.gate(x_TD), w13_weight=w13, w2_weight=ffn.w2_EDF.transpose(1, 2),
                    renormalize=cfg.renormalize)
    if isinstance(block, blocks.TitanMoE):
        ex = block.experts
        w13 = torch.cat([ex.w1, ex.w3], dim=1).transpose(1, 2)
        sigmoid = cfg.score_func is ScoreFunc.SIGMOID
        return dict(common, router_logits=block.router.gate(x_TD), w13_weight=w13, w2_weight=ex.w2.transpose(1, 2),
                    routing_method=cfg.score_func.value, renormalize=cfg.renormalize and not sigmoid,
                    normalize_sigmoid=cfg.renormalize, routed_scaling_factor=cfg.route_scale,
                    apply_router_weight_on_input=cfg.score_before_experts)
    if isinstance(block, blocks.V4GroupedSigmoidMoE):
        w13, w2 = _stack_linear_experts(block.experts)
        gate = block.gate
        logits = torch.nn.functional.linear(x_TD.float(), gate.weight.float())
        return dict(common, router_logits=logits, w13_weight=w13, w2_weight=w2, routing_method="sigmoid",
                    group_count=cfg.n_group, k_group=cfg.topk_group, group_select_mode=1,
                    e_score_correction_bias=gate.e_score_correction_bias, normalize_sigmoid=cfg.renormalize,
                    routed_scaling_factor=cfg.routed_scaling_factor)
    raise TypeError(f"block must be one of the moe_compile.testing.blocks classes, but got {type(block).__name__}.")
