"""The record kept for each test-subject MoE family (see ``moe_compile.testing.zoo``).

One :class:`FamilySpec` says how to build a tiny random model of a transformers MoE family, which
modules are its MoE blocks, which experts implementations apply, how its router computes, and
whether the fused op can express it (with the reason when it cannot: the pass must report such
blocks as skipped with that reason).
"""
from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Mapping


class RouterKind(enum.Enum):
    """Router formulations, numbered as in ``hf_moe_families.md`` §3.B."""

    R1 = "softmax -> topk -> [renorm] -> [cast]"
    R2 = "topk(logits) -> softmax (or sigmoid) over the k picks"
    R3 = "sigmoid -> topk(scores + bias) -> gather -> [renorm(+eps)] -> [x scale]"
    R4 = "sigmoid + bias -> group top2-sum -> topk_group -> mask -> topk -> gather -> [renorm] -> x scale"
    R5 = "softmax -> [group max -> topk_group -> mask(0)] -> topk -> x scale, no renorm"
    R6 = "softmax -> topk(probs + bias) -> gather -> [renorm(clamp)] / [x scale]"
    R7 = "one of a kind"


class ExpertsImpl(enum.Enum):
    """How the experts run: transformers' three implementations, or the block's own code."""

    GROUPED_MM = "grouped_mm"
    BATCHED_MM = "batched_mm"
    EAGER = "eager"
    NATIVE = "native"  # not @use_experts_implementation-decorated: the block's own forward


class SharedExperts(enum.Enum):
    NONE = "none"
    UNGATED = "ungated"  # out + shared_mlp(x)
    SIGMOID_GATED = "sigmoid_gated"  # out + sigmoid(Linear(H->1)(x)) * shared_mlp(x)
    OUTSIDE_BLOCK = "outside_block"  # the decoder layer adds it, not the MoE block


class Capture(enum.Enum):
    """What Dynamo makes of the block (whole tiny model, T=5, torch 2.13, default config)."""

    ONE_GRAPH = "one_graph"  # the whole block, router and experts, in one graph
    NEEDS_FLAGS = "needs_flags"  # one graph only with capture_scalar_outputs/dynamic_output_shape_ops
    BREAKS = "breaks"  # the experts loop graph-breaks (frame skipped); no graph holds the experts


DECORATED = (ExpertsImpl.GROUPED_MM, ExpertsImpl.BATCHED_MM, ExpertsImpl.EAGER)
NATIVE = (ExpertsImpl.NATIVE,)

# Tiny shapes shared by every decoder-only family; each family overrides what it must.
TINY_BASE = types.MappingProxyType(dict(
    hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=128,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False, tie_word_embeddings=False,
))
# Multi-head latent attention (DeepSeek-V2/V3, LongCat, Bailing): kv heads must equal q heads.
TINY_MLA = types.MappingProxyType(dict(
    num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
))


def tiny(*overlays: Mapping, **overrides) -> Mapping:
    """``TINY_BASE`` updated by ``overlays`` then ``overrides``, frozen."""
    kwargs = dict(TINY_BASE)
    for overlay in overlays:
        kwargs.update(overlay)
    kwargs.update(overrides)
    return types.MappingProxyType(kwargs)


@dataclass(frozen=True)
class FamilySpec:
    """How to build and what to expect of one tiny MoE family.

    ``name`` is the registry key (``deepseek_v2_greedy`` is a variant of model type
    ``deepseek_v2``). ``num_moe_layers`` counts the blocks of ``block_classes`` in the tiny build
    with ``num_layers`` = ``default_layers``; :func:`moe_compile.testing.zoo.expected_moe_layers`
    scales it. ``expressible`` False means the fused op cannot compute this block, for
    ``skip_reason``; ``experts_only`` True that its router is the reason and its experts are fused
    all the same (the router stays as written, the experts become ``fused_experts``). ``capture`` says,
    per experts implementation, what Dynamo makes of it.
    """

    name: str
    model_type: str
    config_class: str
    model_class: str
    config_kwargs: Mapping
    block_classes: tuple[str, ...]
    num_moe_layers: int
    experts_impls: tuple[ExpertsImpl, ...]
    router_kind: RouterKind
    router: str
    activation: str = "silu"
    shared_experts: SharedExperts = SharedExperts.NONE
    expressible: bool = True
    skip_reason: str | None = None
    experts_only: bool = False
    capture: Mapping = field(default_factory=lambda: types.MappingProxyType({}))
    layers_key: str = "num_hidden_layers"
    per_layer_keys: tuple[str, ...] = ()  # list-valued config keys cycled to the layer count
    default_layers: int = 2
    seq2seq: bool = False
    notes: str = ""

    def __post_init__(self):
        if self.expressible == (self.skip_reason is not None):
            raise ValueError(
                f"FamilySpec {self.name!r}: skip_reason must be given exactly when expressible is False, "
                f"got expressible={self.expressible!r}, skip_reason={self.skip_reason!r}."
            )
        if self.experts_only and self.expressible:
            raise ValueError(f"FamilySpec {self.name!r}: experts_only=True is for a router the op cannot express "
                             f"(expressible=False), got expressible=True.")
        if not self.experts_impls:
            raise ValueError(f"FamilySpec {self.name!r}: experts_impls must not be empty.")

    @property
    def rewritten(self) -> bool:
        """Whether the pass rewrites this family's blocks (whole, or the experts alone)."""
        return self.expressible or self.experts_only

    @property
    def decorated(self) -> bool:
        """Whether the experts class is ``@use_experts_implementation``-decorated."""
        return ExpertsImpl.NATIVE not in self.experts_impls

    @property
    def default_impl(self) -> ExpertsImpl:
        return self.experts_impls[0]

    def capture_of(self, impl: ExpertsImpl) -> Capture | None:
        return self.capture.get(impl)


def capture_map(*, decorated: bool = True, native: Capture | None = None) -> Mapping:
    """Capture outcomes: decorated families are one graph in grouped/batched_mm and break in eager."""
    if decorated:
        table = {ExpertsImpl.GROUPED_MM: Capture.ONE_GRAPH, ExpertsImpl.BATCHED_MM: Capture.ONE_GRAPH,
                 ExpertsImpl.EAGER: Capture.BREAKS}
    else:
        table = {ExpertsImpl.NATIVE: native}
    return types.MappingProxyType(table)
