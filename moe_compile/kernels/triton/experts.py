"""The CUDA experts: permute -> GEMM1 (+bias, +activation) -> GEMM2 (+bias) -> weighted combine.

``fused_experts`` runs one of three paths (``configs.py`` picks per shape from tuned data):

==============  ==============================================================  ===============
path            kernels                                                         when
==============  ==============================================================  ===============
``pairs``       gemm1(act) -> gemm2 -> combine                                  decode, many E
``gemv``        gemv1(act) -> gemv2+combine (CUDA cores, ``gemv.py``)              decode, many E
``decode``      gemm1(act)+gemm2+combine in one kernel (``decode.py``)           decode, many E
``sorted``      count -> scatter(+gather) -> gemm1(act) -> gemm2 -> combine     Triton GEMMs
``grouped_mm``  count -> scatter+gather -> _grouped_mm -> act -> _grouped_mm    CUTLASS GEMMs
                -> combine
==============  ==============================================================  ===============

Nothing reads a device value on the host, so every path can be captured in a CUDA graph; buffers
are sized from shapes alone (``P = T * k`` rows). ``TritonExperts`` wraps it as a modular-kernel
``PermuteExpertsUnpermute`` (it weights and reduces itself: ``TopKWeightAndReduceNoOp``).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from moe_compile.kernels.grouped_mm import cuda_capability
from moe_compile.kernels.triton import interpreting
from moe_compile.kernels.triton.align import align
from moe_compile.kernels.triton.activation import activation
from moe_compile.kernels.triton.combine import combine
from moe_compile.kernels.triton.configs import ExpertsPath, Plan, choose_plan, default_plan
from moe_compile.kernels.triton.decode import decode_experts
from moe_compile.kernels.triton.gemm import moe_gemm
from moe_compile.kernels.triton.gemv import gemv_experts, gemv_supported
from moe_compile.modular.base import ActivationFormat, ExpertWeights, PermuteExpertsUnpermute, WorkspaceShapes
from moe_compile.modular.experts import BatchedExperts
from moe_compile.modular.weight_and_reduce import TopKWeightAndReduceNoOp
from moe_compile.ops.activation import intermediate_size
from moe_compile.ops.config import ExpertsConfig

log = logging.getLogger("moe_compile")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_experts_supported(hidden_states: torch.Tensor, weights: ExpertWeights) -> tuple[bool, str]:
    """Whether the Triton experts run these tensors; ``(False, reason)`` otherwise."""
    device = hidden_states.device
    if device.type != "cuda" and not interpreting():
        return False, f"tensors are on {device}, the Triton experts need CUDA"
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {hidden_states.dtype} is not one of bf16/fp16/fp32"
    for name in ("w13", "w2", "w13_bias", "w2_bias"):
        t = getattr(weights, name)
        if t is not None and t.dtype != hidden_states.dtype:
            return False, f"{name} is {t.dtype} but hidden_states is {hidden_states.dtype}"
    return True, ""


def _grouped_mm_ok(x: torch.Tensor, weights: ExpertWeights) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    if weights.w13_bias is not None or weights.w2_bias is not None:
        return False
    if cuda_capability(x.device.index or 0) < (9, 0):  # cached: this runs on every call
        return False
    for w in (weights.w13, weights.w2):
        if not (w.stride(-1) == 1 or w.stride(-2) == 1) or any(s % 8 for s in w.stride() if s != 1):
            return False
    return x.shape[1] % 8 == 0 and weights.w2.shape[1] % 8 == 0


def plan_for(x: torch.Tensor, top_k: int, weights: ExpertWeights) -> Plan:
    num_local, hidden, _ = weights.w13.shape
    plan = choose_plan(num_tokens=x.shape[0], top_k=top_k, num_local=num_local, hidden=hidden,
                       inter=weights.w2.shape[1], dtype=x.dtype, device=x.device)
    if plan.path is ExpertsPath.GROUPED_MM and not _grouped_mm_ok(x, weights):
        return Plan(ExpertsPath.SORTED, plan.gemm1, plan.gemm2)
    return plan


def fused_experts(
    hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, weights: ExpertWeights,
    config: ExpertsConfig = ExpertsConfig(), *, expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None, plan: Plan | None = None, weighted: bool = True,
) -> torch.Tensor:
    """``hidden_states [T, H]``, ``topk_weights fp32 [T, k]``, ``topk_ids int32 [T, k]`` -> ``[T, H]``.

    ``weighted=False`` sums the expert rows unweighted (the weight was applied to the input).
    """
    ok, reason = triton_experts_supported(hidden_states, weights)
    if not ok:
        raise ValueError(f"fused_experts: {reason}.")
    if hidden_states.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"hidden_states must be [T, H] and topk_ids [T, k]; got {tuple(hidden_states.shape)} "
                         f"and {tuple(topk_ids.shape)}.")
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    w_tk = topk_weights.to(torch.float32).contiguous()
    num_tokens, top_k = ids.shape
    num_local, hidden, _ = weights.w13.shape
    inter = intermediate_size(weights.w13.shape[2], config.activation)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    plan = plan or plan_for(x, top_k, weights)
    pairs = num_tokens * top_k
    common = dict(topk_ids=ids, top_k=top_k, expert_map=expert_map)
    if plan.path is ExpertsPath.GEMV:
        ok, reason = gemv_supported(weights.w13, weights.w2)
        if ok:
            blocks = [(c.block_n, c.block_k, c.num_warps) for c in (plan.gemm1, plan.gemm2)]
            return gemv_experts(x, w_tk, ids, weights.w13, weights.w2, config, out, w13_bias=weights.w13_bias,
                                w2_bias=weights.w2_bias, expert_map=expert_map, weighted=weighted,
                                up=blocks[0], down=blocks[1])
        # the GEMM paths read such weights through their strides
        log.debug("moe_compile: the gemv plan runs the default GEMM plan instead: %s", reason)
        plan = default_plan(num_tokens, top_k, num_local, hidden, inter)
    if plan.path is ExpertsPath.DECODE:  # any weight strides; the block fields as configs.decode_plan sets them
        g1 = plan.gemm1
        return decode_experts(x, w_tk, ids, weights.w13, weights.w2, config, out, w13_bias=weights.w13_bias,
                              w2_bias=weights.w2_bias, expert_map=expert_map, weighted=weighted,
                              block_i=g1.block_n, block_k=g1.block_k, block_n=plan.gemm2.block_n,
                              num_warps=g1.num_warps, num_stages=g1.num_stages, tma=bool(g1.tma))
    if plan.path is ExpertsPath.GROUPED_MM:
        al = align(ids, num_local, expert_map, x=x)
        h = torch._grouped_mm(al.x_sorted, weights.w13, offs=al.offsets)
        act = activation(h, config)
        y = torch._grouped_mm(act, weights.w2, offs=al.offsets)
        return combine(y, w_tk, out, pos=al.pos, weighted=weighted)
    # split-K second GEMM: one partial [pairs, H] per K slice, which the combine sums
    split = plan.gemm2.split_k
    y = torch.empty(*((split,) if split > 1 else ()), pairs, hidden, dtype=x.dtype, device=x.device)
    if plan.path is ExpertsPath.PAIRS:
        act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        moe_gemm(x, weights.w13, act, counts=None, sorted_pair=None, bias=weights.w13_bias, experts=config,
                 gather_a=True, config=plan.gemm1, **common)
        moe_gemm(act, weights.w2, y, counts=None, sorted_pair=None, bias=weights.w2_bias, gather_a=False,
                 config=plan.gemm2, **common)
        return combine(y, w_tk, out, topk_ids=ids, expert_map=expert_map, num_local=num_local, weighted=weighted)
    al = align(ids, num_local, expert_map, x=x if plan.pre_gather else None)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    a1 = al.x_sorted if plan.pre_gather else x
    moe_gemm(a1, weights.w13, act, counts=al.counts, sorted_pair=al.sorted_pair, bias=weights.w13_bias,
             experts=config, gather_a=not plan.pre_gather, config=plan.gemm1, **common)
    moe_gemm(act, weights.w2, y, counts=al.counts, sorted_pair=al.sorted_pair, bias=weights.w2_bias,
             gather_a=False, config=plan.gemm2, **common)
    return combine(y, w_tk, out, pos=al.pos, weighted=weighted)


def _cuda_or_interpreter(experts, device: torch.device) -> tuple[bool, str]:
    if device.type == "cuda" or interpreting():
        return True, ""
    return False, f"{type(experts).__name__} runs on CUDA, not {device}"


class TritonExperts(PermuteExpertsUnpermute):
    """Standard-format experts on CUDA through ``fused_experts`` (weighted and reduced inside)."""

    @staticmethod
    def activation_formats():
        return ActivationFormat.STANDARD, ActivationFormat.STANDARD

    def supports_chunking(self) -> bool:
        return True

    def supports_expert_map(self) -> bool:
        return True

    def supports_device(self, device: torch.device):
        return _cuda_or_interpreter(self, device)

    def workspace_shapes(self, *, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        # fused_experts sizes its own buffers from the shapes; the modular kernel's are not needed
        return WorkspaceShapes((0,), (0,), (M, K))

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOp()

    def for_format(self, fmt: ActivationFormat):
        return self if fmt is ActivationFormat.STANDARD else TritonBatchedExperts(self.config)

    def apply(self, *, output, hidden_states, weights: ExpertWeights, topk_weights, topk_ids,
              global_num_experts, expert_map, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        emap = None if expert_map is None else expert_map.to(torch.int32)
        fused_experts(hidden_states, topk_weights, topk_ids, weights, self.config, expert_map=emap,
                      out=output, weighted=not apply_router_weight_on_input)


class TritonBatchedExperts(BatchedExperts):
    """Batched-format experts (``[E_local, max_tokens, H]`` in and out) on CUDA: the same Triton
    GEMMs as ``TritonExperts``, run over each expert's ``expert_num_tokens`` valid rows in place.

    Unlike the torch ``BatchedExperts`` (two ``bmm`` over every slot of every local expert), an
    expert with no rows costs nothing and its weights are never read; the padding slots are not
    computed, and their output rows are zero. The grid is sized from shapes alone (at most
    ``max_tokens * min(top_k, E_local)`` valid rows), so nothing waits for the host.
    """

    def supports_device(self, device: torch.device):
        return _cuda_or_interpreter(self, device)

    def workspace_shapes(self, *, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        n_act = intermediate_size(N, self.config.activation)
        return WorkspaceShapes((0,), (local_num_experts, M, n_act), (local_num_experts, M, K))

    def for_format(self, fmt: ActivationFormat):
        return self if fmt is ActivationFormat.BATCHED else TritonExperts(self.config)

    def apply(self, *, output, hidden_states, weights: ExpertWeights, topk_weights, topk_ids,
              global_num_experts, expert_map, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        ok, reason = triton_experts_supported(hidden_states, weights)
        if not ok:
            raise ValueError(f"TritonBatchedExperts: {reason}.")
        num_local, max_tokens, hidden = hidden_states.shape
        counts = expert_tokens_meta.expert_num_tokens.to(torch.int32).contiguous()
        top_k = topk_ids.shape[-1] if topk_ids is not None and topk_ids.dim() == 2 else num_local
        max_rows = max_tokens * min(top_k, num_local)
        plan = choose_plan(num_tokens=max(1, max_rows // max(top_k, 1)), top_k=top_k, num_local=num_local,
                           hidden=hidden, inter=weights.w2.shape[1], dtype=hidden_states.dtype,
                           device=hidden_states.device)
        x = hidden_states.reshape(num_local * max_tokens, hidden)
        if x.stride(-1) != 1:
            x = x.contiguous()
        act = workspace2.view(num_local * max_tokens, -1)
        out = output.view(num_local * max_tokens, output.shape[-1])
        out.zero_()  # the padding slots' rows, which the GEMMs never write
        common = dict(topk_ids=counts, top_k=1, counts=counts, sorted_pair=None, gather_a=False,
                      row_stride=max_tokens, max_rows=max_rows)
        moe_gemm(x, weights.w13, act, bias=weights.w13_bias, experts=self.config, config=plan.gemm1, **common)
        # the batched format's output is the workspace the finalize step reads: one slice, no split-K
        moe_gemm(act, weights.w2, out, bias=weights.w2_bias, config=replace(plan.gemm2, split_k=1), **common)


__all__ = ["TritonBatchedExperts", "TritonExperts", "fused_experts", "plan_for", "triton_experts_supported"]
