"""The modular kernel's component contracts (seed 000: vLLM's FusedMoEModularKernel design).

::

    router  -->  PrepareAndFinalize.prepare      (dispatch: quantise / all-to-all / batch tokens)
            -->  PermuteExpertsUnpermute.apply   (permute, GEMM1, activation, GEMM2, unpermute,
                                                  and maybe the top-k weighting + reduction)
            -->  PrepareAndFinalize.finalize     (combine; runs the TopKWeightAndReduce it is handed)

Names: ``M`` tokens, ``K`` hidden size, ``N`` w13's output width (``2I`` gated), ``topk`` experts
per token, ``E`` local experts. ``ModularKernel`` (kernel.py) is the only composer.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Callable

import torch

from moe_compile.ops.config import ExpertsConfig


class ActivationFormat(enum.Enum):
    STANDARD = "standard"  # [M, K] activations with [M, topk] ids/weights
    BATCHED = "batched"  # [E, max_tokens, K] activations with expert_num_tokens[E]


@dataclass(frozen=True)
class ExpertTokensMetadata:
    expert_num_tokens: torch.Tensor  # [E_local] int32, valid rows per expert (batched format)


@dataclass(frozen=True)
class PrepareResult:
    hidden_states: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_tokens_meta: ExpertTokensMetadata | None = None


@dataclass(frozen=True)
class WorkspaceShapes:
    workspace13: tuple[int, ...]
    workspace2: tuple[int, ...]
    output: tuple[int, ...]


@dataclass(frozen=True)
class ExpertWeights:
    w13: torch.Tensor  # [E_local, K, N]
    w2: torch.Tensor  # [E_local, N_act, K]
    w13_bias: torch.Tensor | None = None  # [E_local, N]
    w2_bias: torch.Tensor | None = None  # [E_local, K]


Capability = tuple[bool, str]


class TopKWeightAndReduce(abc.ABC):
    """Applies the top-k weights to unpermuted expert rows and sums them per token."""

    @abc.abstractmethod
    def apply(
        self,
        *,
        output: torch.Tensor | None,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """Return the ``[M, K]`` result (written into ``output`` when one is given)."""


class PrepareAndFinalize(abc.ABC):
    """Dispatch before the experts and combine after them (all-to-all lives here)."""

    @property
    @abc.abstractmethod
    def activation_format(self) -> ActivationFormat: ...

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def num_dispatchers(self) -> int:
        return 1

    def output_is_reduced(self) -> bool:
        """Whether finalize already reduced the output across ranks."""
        return False

    def has_prepare_no_receive(self) -> bool:
        return False

    @abc.abstractmethod
    def prepare(
        self,
        *,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
    ) -> PrepareResult:
        """Dispatch the tokens. With ``apply_router_weight_on_input`` (top-1 only) prepare scales
        the tokens by their router weight *here*, once; the experts and the weight-and-reduce
        then leave the output unweighted (they only read the flag to skip the weighting)."""

    def prepare_no_receive(self, **kwargs) -> Callable[[], PrepareResult]:
        """Start the dispatch and return a receiver; the default dispatches eagerly."""
        if not self.has_prepare_no_receive():
            raise NotImplementedError(
                f"{type(self).__name__} has no prepare_no_receive (has_prepare_no_receive() is False)"
            )
        result = self.prepare(**kwargs)
        return lambda: result

    @abc.abstractmethod
    def finalize(
        self,
        *,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce: TopKWeightAndReduce,
    ) -> torch.Tensor: ...


class PermuteExpertsUnpermute(abc.ABC):
    """The expert computation: permute, GEMM1, activation, GEMM2, unpermute (+ maybe reduce)."""

    def __init__(self, config: ExpertsConfig = ExpertsConfig()):
        self.config = config

    @staticmethod
    @abc.abstractmethod
    def activation_formats() -> tuple[ActivationFormat, ActivationFormat]:
        """(input format, output format)."""

    @abc.abstractmethod
    def supports_chunking(self) -> bool: ...

    @abc.abstractmethod
    def supports_expert_map(self) -> bool: ...

    def supports_device(self, device: torch.device) -> Capability:
        return True, ""

    def supports_dtype(self, dtype: torch.dtype) -> Capability:
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return True, ""
        return False, f"{type(self).__name__} computes in fp32/bf16/fp16, not {dtype}"

    def for_format(self, fmt: ActivationFormat) -> "PermuteExpertsUnpermute | None":
        """The same kind of experts taking ``fmt`` activations (a dispatcher of the other format
        picks it), or None when there is none (the caller substitutes the portable torch ones)."""
        return self if self.activation_formats()[0] is fmt else None

    @abc.abstractmethod
    def workspace_shapes(
        self,
        *,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
        expert_tokens_meta: ExpertTokensMetadata | None,
    ) -> WorkspaceShapes: ...

    @abc.abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce: ...

    @abc.abstractmethod
    def apply(
        self,
        *,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        weights: ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        """Write the result (shape ``workspace_shapes(...).output``) into ``output``."""
