"""The ``npu`` namespace of ``torch.library`` ops that stands in for torch_npu's MoE ops on CPU.

Schemas mirror torch_npu 2.14 (``npu_native_functions_by_codegen.yaml``, notes §2), so graphs traced
under the emulation hold exactly the ``torch.ops.npu.*`` nodes a real NPU graph holds. Each op has
a runtime kernel (``CompositeExplicitAutograd``: it runs on the tensors' device and is counted) and
a fake kernel (shapes and dtypes as in torch_npu's ``_meta_registrations.py``) so it traces as one
opaque node under FakeTensorMode / make_fx / torch.compile.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Callable

import torch

from moe_compile.testing import npu_kernels

NAMESPACE = "npu"

SCHEMAS: dict[str, str] = {
    "npu_moe_gating_top_k_softmax":
        "npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)",
    "npu_moe_gating_top_k":
        "npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, "
        "Tensor? tid2eid=None, int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, "
        "int norm_type=0, bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) "
        "-> (Tensor, Tensor, Tensor)",
    "npu_moe_init_routing_v2":
        "npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, "
        "int[2] active_expert_range=[], int row_idx_type=0, int? x_dtype=None) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
    "npu_grouped_matmul":
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
        "int? per_token_scale_dtype=None) -> Tensor[]",
    "npu_swiglu": "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
    "npu_moe_token_permute":
        "npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, bool padded_mode=False) "
        "-> (Tensor, Tensor)",
    "npu_moe_token_unpermute":
        "npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, "
        "bool padded_mode=False, int[]? restore_shape=None) -> Tensor",
    "npu_moe_finalize_routing":
        "npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
        "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, "
        "int? drop_pad_mode=0, int? k=1) -> Tensor",
}


# -- fake (meta) kernels: shapes and dtypes only --------------------------------------------------
def _fake_gating_softmax(x, finished=None, k=1):
    shape = tuple(x.shape[:-1]) + (k,)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.int32)


def _fake_gating(x, k, **kwargs):
    n, e = x.shape
    return x.new_empty(n, k), x.new_empty(n, k, dtype=torch.int32), x.new_empty(n, e, dtype=torch.float32)


def _fake_init_routing(x, expert_idx, *, active_num=-1, expert_num=-1, expert_tokens_num_type=0,
                       expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=(), **kwargs):
    total = expert_idx.shape[0] * expert_idx.shape[1]
    rows = total if active_num <= 0 else min(active_num, total)
    span = (active_expert_range[1] - active_expert_range[0]) if active_expert_range else expert_num
    if not expert_tokens_num_flag:
        counts_shape = ()
    elif expert_tokens_num_type in (0, 1):
        counts_shape = (span,)
    else:
        counts_shape = (expert_num, 2)
    x_dtype = torch.int8 if quant_mode in (0, 1) else x.dtype
    return (x.new_empty(rows, x.shape[1], dtype=x_dtype), x.new_empty(total, dtype=torch.int32),
            x.new_empty(counts_shape, dtype=torch.int64), x.new_empty(rows, dtype=torch.float32))


def _fake_grouped_matmul(x, weight, *, output_dtype=None, group_list=None, **kwargs):
    dtype = x[0].dtype if output_dtype is None else npu_kernels._scalar_type(output_dtype)
    if group_list is not None:
        return [x[0].new_empty(x[0].shape[0], weight[0].shape[-1], dtype=dtype)]
    return [xi.new_empty(xi.shape[0], wi.shape[-1], dtype=dtype) for xi, wi in zip(x, weight)]


def _fake_swiglu(self, dim=-1):
    shape = list(self.shape)
    shape[dim] //= 2
    return self.new_empty(shape)


def _fake_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    total = indices.numel()
    if not num_out_tokens:
        rows = total
    elif num_out_tokens > 0:
        rows = min(num_out_tokens, total)
    else:
        rows = total + num_out_tokens
    return tokens.new_empty(rows, tokens.shape[-1]), indices.new_empty(total, dtype=torch.int32)


def _fake_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    top_k = 1 if probs is None else probs.shape[1]
    return permuted_tokens.new_empty(sorted_indices.numel() // top_k, permuted_tokens.shape[-1])


def _fake_finalize(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                   export_for_source_row, drop_pad_mode=0, k=1):
    return expanded_permuted_rows.new_empty(scales.shape[0], expanded_permuted_rows.shape[-1])


FAKES: dict[str, Callable] = {
    "npu_moe_gating_top_k_softmax": _fake_gating_softmax,
    "npu_moe_gating_top_k": _fake_gating,
    "npu_moe_init_routing_v2": _fake_init_routing,
    "npu_grouped_matmul": _fake_grouped_matmul,
    "npu_swiglu": _fake_swiglu,
    "npu_moe_token_permute": _fake_permute,
    "npu_moe_token_unpermute": _fake_unpermute,
    "npu_moe_finalize_routing": _fake_finalize,
}


def _counted(name: str, calls: Counter, poison: bool):
    kernel = npu_kernels.KERNELS[name]

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        calls[name] += 1
        return kernel(*args, poison=poison, **kwargs)

    return run


def define_ops(calls: Counter, poison: bool) -> torch.library.Library:
    """Define every op of ``SCHEMAS`` in the ``npu`` namespace; the caller owns (and destroys) the library."""
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    try:
        for name, schema in SCHEMAS.items():
            lib.define(schema)
            lib.impl(name, _counted(name, calls, poison), "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{name}", FAKES[name], lib=lib)
    except Exception:
        lib._destroy()
        raise
    return lib
