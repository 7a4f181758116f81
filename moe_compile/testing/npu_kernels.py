"""Plain-torch implementations of the torch_npu MoE ops, as documented (notes §2 of npu_ops.md).

Each function takes the op's arguments (same names, same defaults) plus ``poison``: rows and values
the docs call *undefined* are NaN (floats) or ``GARBAGE_INDEX`` (integers) with ``poison=True``,
and zeros otherwise. They compute in fp32 and cast to the documented output dtype; ties in top-k
and sorting go to the lower index (the goldens use ``kind="stable"``).

These functions check the documented limits of torch_npu 2.14 and raise ``ValueError`` (bad value)
or ``NotImplementedError`` (a documented mode the emulation does not model, e.g. quantised grouped
matmul) naming the argument, so a lowering that leans on something the real op would reject
fails here first.

Names: ``N`` rows (tokens), ``E`` experts, ``K`` top-k, ``H`` hidden size.
"""
from __future__ import annotations

import torch

INT32_MAX = 2**31 - 1
# An int "undefined" value: far out of range for any index, so a lowering that uses one fails.
GARBAGE_INDEX = -(2**30) + 7


def undefined_like(t: torch.Tensor, poison: bool) -> torch.Tensor:
    """A tensor shaped like ``t`` holding the emulation's 'undefined' value."""
    if not poison:
        return torch.zeros_like(t)
    if t.is_floating_point():
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, GARBAGE_INDEX)


def _fill_rows_from(t: torch.Tensor, start: int, poison: bool) -> torch.Tensor:
    """Rows ``>= start`` become undefined (in place); returns ``t``."""
    if start < t.shape[0]:
        t[start:] = undefined_like(t[start:], poison)
    return t


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, descending, ties to the lower index."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _need(cond: bool, message: str, exc: type = ValueError) -> None:
    if not cond:
        raise exc(message)


# -- gating -----------------------------------------------------------------------------------
def npu_moe_gating_top_k_softmax(x, finished=None, k=1, *, poison=False):
    """softmax -> top-k; no renormalisation; ``row_idx`` is k-major (``j*N + i``). Notes §2.1."""
    _need(x.dim() in (2, 3), f"npu_moe_gating_top_k_softmax: x must be 2-D or 3-D, got shape {tuple(x.shape)}")
    num_experts = x.shape[-1]
    _need(0 < k <= min(num_experts, 1024), f"npu_moe_gating_top_k_softmax: k must be in (0, min(E={num_experts}, 1024)], got {k}")
    flat = x.reshape(-1, num_experts).float()
    n = flat.shape[0]
    y, idx = stable_topk(torch.softmax(flat, dim=-1), k)
    # [AMBIG] for 3-D x, N is taken as B*S (the kernel sees a flat row count).
    row_idx = torch.arange(n * k, device=x.device, dtype=torch.int32).view(k, n).t().contiguous()
    if finished is not None:
        # [src] the kernel takes max(idx, finished*E): finished rows get the out-of-range id E;
        # the doc leaves their weights undefined.
        fin = finished.reshape(-1, 1).bool()
        idx = torch.where(fin, torch.full_like(idx, num_experts), idx)
        y = torch.where(fin, undefined_like(y, poison), y)
    out_shape = tuple(x.shape[:-1]) + (k,)
    return y.to(x.dtype).view(out_shape), idx.to(torch.int32).view(out_shape), row_idx.view(out_shape)


def _check_gating_limits(num_experts, k, k_group, group_count, group_select_mode, norm_type, renorm):
    _need(num_experts <= 2048, f"npu_moe_gating_top_k: E must be <= 2048, got {num_experts}")
    _need(group_count >= 1 and num_experts % group_count == 0,
          f"npu_moe_gating_top_k: group_count={group_count} must divide E={num_experts}")
    per_group = num_experts // group_count
    if group_count > 1:
        # [AMBIG] torch_npu 2.14 says E/G > 2; newer CANN says E/G > group_select_mode. The stricter one.
        _need(per_group > 2, f"npu_moe_gating_top_k: experts per group must be > 2 (torch_npu 2.14), got {per_group}")
        aligned = (per_group + 31) // 32 * 32
        _need(aligned * group_count <= 2048, f"npu_moe_gating_top_k: align32(E/G)*G={aligned * group_count} > 2048")
    _need(1 <= k_group <= group_count, f"npu_moe_gating_top_k: k_group must be in [1, {group_count}], got {k_group}")
    _need(1 <= k <= k_group * per_group, f"npu_moe_gating_top_k: k must be in [1, {k_group * per_group}], got {k}")
    _need(group_select_mode in (0, 1), f"npu_moe_gating_top_k: group_select_mode must be 0 or 1, got {group_select_mode}")
    _need(norm_type in (0, 1), f"npu_moe_gating_top_k: norm_type must be 0 or 1 (torch_npu 2.14), got {norm_type}")
    if norm_type == 0:
        _need(renorm == 0, f"npu_moe_gating_top_k: renorm must be 0 with norm_type=0 (torch_npu 2.14), got {renorm}")


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False,
                         routed_scaling_factor=1.0, eps=1e-20, poison=False):
    """softmax|sigmoid -> (+bias for selection) -> group mask -> top-k -> (sigmoid: /(sum+eps)) -> *scale. §2.2."""
    _need(x.dim() == 2, f"npu_moe_gating_top_k: x must be 2-D, got shape {tuple(x.shape)}")
    if input_ids is not None or tid2eid is not None:
        raise NotImplementedError("npu_moe_gating_top_k: hash mode (input_ids/tid2eid) is undocumented [AMBIG]")
    num_tokens, num_experts = x.shape
    _check_gating_limits(num_experts, k, k_group, group_count, group_select_mode, norm_type, renorm)
    logits = x.float()
    norm = torch.softmax(logits, dim=-1) if norm_type == 0 else torch.sigmoid(logits)
    sel = norm
    if bias is not None:
        _need(tuple(bias.shape) == (num_experts,), f"npu_moe_gating_top_k: bias must be [{num_experts}], got {tuple(bias.shape)}")
        _need(bias.dtype == x.dtype, f"npu_moe_gating_top_k: bias dtype must equal x dtype {x.dtype}, got {bias.dtype}", TypeError)
        sel = norm + bias.float()
    if group_count > 1:
        sel_ngs = sel.view(num_tokens, group_count, num_experts // group_count)
        if group_select_mode == 0:
            group_score = sel_ngs.max(dim=-1).values
        else:
            group_score = stable_topk(sel_ngs, 2)[0].sum(dim=-1)
        _, keep = stable_topk(group_score, k_group)
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        sel = sel_ngs.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    _, idx = stable_topk(sel, k)
    y = norm.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    norm_out = norm if out_flag else undefined_like(norm, poison)
    return y.to(x.dtype), idx.to(torch.int32), norm_out


# -- init routing -----------------------------------------------------------------------------
def _expert_token_counts(flat_sorted_valid, start, end, expert_num, num_type, flag, device, poison):
    if not flag:
        return undefined_like(torch.empty((), dtype=torch.int64, device=device), poison)
    counts = torch.bincount(flat_sorted_valid - start, minlength=end - start).to(torch.int64)
    if num_type == 1:
        return counts
    if num_type == 0:
        # [AMBIG] the 2.14 doc says only types 1 and 2; newer docs and the golden implement 0 (cumsum).
        return torch.cumsum(counts, 0)
    pairs = undefined_like(torch.empty(expert_num, 2, dtype=torch.int64, device=device), poison)
    ids = torch.nonzero(counts).squeeze(1)
    pairs[: ids.numel(), 0] = ids + start
    pairs[: ids.numel(), 1] = counts[ids]
    if ids.numel() < expert_num:
        pairs[ids.numel()] = 0  # the (0, 0) terminator row
    return pairs


def _check_init_routing_args(x, expert_idx, drop_pad_mode, quant_mode, x_dtype, expert_tokens_num_type, row_idx_type):
    _need(x.dim() == 2, f"npu_moe_init_routing_v2: x must be 2-D [N, H], got shape {tuple(x.shape)}")
    _need(expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0],
          f"npu_moe_init_routing_v2: expert_idx must be [N={x.shape[0]}, K], got {tuple(expert_idx.shape)}")
    _need(expert_idx.dtype == torch.int32, f"npu_moe_init_routing_v2: expert_idx must be int32, got {expert_idx.dtype}", TypeError)
    if drop_pad_mode != 0:
        raise NotImplementedError("npu_moe_init_routing_v2: drop_pad_mode=1 is not emulated (torch_npu 2.14: only 0)")
    if quant_mode not in (-1, 1):
        raise NotImplementedError(f"npu_moe_init_routing_v2: quant_mode={quant_mode} is not emulated (only -1 and 1)")
    if x_dtype is not None:
        raise NotImplementedError("npu_moe_init_routing_v2: x_dtype (int4/MX inputs) is not emulated")
    _need(expert_tokens_num_type in (0, 1, 2), f"npu_moe_init_routing_v2: expert_tokens_num_type must be 0/1/2, got {expert_tokens_num_type}")
    _need(row_idx_type in (0, 1), f"npu_moe_init_routing_v2: row_idx_type must be 0 or 1, got {row_idx_type}")


def _dynamic_quant_rows(rows_f32, smooth):
    xs = rows_f32 * smooth
    scale = xs.abs().amax(dim=-1) / 127.0
    q = torch.round(xs / scale.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp(-128, 127)
    return q.to(torch.int8), scale


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                            expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=(),
                            row_idx_type=0, x_dtype=None, poison=False):
    """Sort the (token, k) pairs by expert (token-major input), dropless. Notes §2.3."""
    _check_init_routing_args(x, expert_idx, drop_pad_mode, quant_mode, x_dtype, expert_tokens_num_type, row_idx_type)
    num_tokens, top_k = expert_idx.shape
    if active_expert_range:
        start, end = int(active_expert_range[0]), int(active_expert_range[1])
    else:
        _need(expert_num > 0, "npu_moe_init_routing_v2: expert_num must be > 0 without active_expert_range")
        start, end = 0, expert_num
    _need(0 <= start < end <= 10240, f"npu_moe_init_routing_v2: active_expert_range must satisfy 0 <= s < e <= 10240, got [{start}, {end}]")
    _need(expert_num <= 10240, f"npu_moe_init_routing_v2: expert_num must be <= 10240, got {expert_num}")
    flat = expert_idx.reshape(-1).long()
    key = torch.where(flat < start, torch.full_like(flat, INT32_MAX), flat)
    order = torch.sort(key, stable=True).indices
    valid = int(((flat >= start) & (flat < end)).sum())
    total = num_tokens * top_k
    rows = total if active_num <= 0 else min(active_num, total)
    kept = valid if active_num <= 0 else min(valid, active_num)
    src_token = order[:kept] // top_k
    out_dtype = torch.int8 if quant_mode == 1 else x.dtype
    expanded_x = undefined_like(torch.empty(rows, x.shape[1], dtype=x.dtype, device=x.device), poison).to(out_dtype)
    expanded_scale = undefined_like(torch.empty(rows, dtype=torch.float32, device=x.device), poison)
    if quant_mode == 1:
        smooth = _smooth_rows(scale, flat[order[:kept]] - start, x)
        q, ds = _dynamic_quant_rows(x[src_token].float(), smooth)
        expanded_x[:kept], expanded_scale[:kept] = q, ds
    else:
        expanded_x[:kept] = x[src_token]
        if scale is not None:
            expanded_scale[:kept] = scale.float()[src_token]
    if row_idx_type == 0:  # gather index: source pair j -> its row, -1 when its expert is out of range
        expanded_row_idx = torch.full((total,), -1, dtype=torch.int32, device=x.device)
        expanded_row_idx[order[:valid]] = torch.arange(valid, dtype=torch.int32, device=x.device)
    else:  # scatter index: row i -> source pair; entries past the valid count are undefined
        expanded_row_idx = order.to(torch.int32)
        _fill_rows_from(expanded_row_idx, valid, poison)
    counts = _expert_token_counts(flat[order[:valid]], start, end, expert_num, expert_tokens_num_type,
                                  expert_tokens_num_flag, x.device, poison)
    return expanded_x, expanded_row_idx, counts, expanded_scale


def _smooth_rows(scale, local_expert, x):
    if scale is None:
        return torch.ones(1, x.shape[1], device=x.device)
    _need(scale.dim() == 2 and scale.shape[1] == x.shape[1],
          f"npu_moe_init_routing_v2: dynamic-quant scale must be [experts or 1, H], got {tuple(scale.shape)}")
    return scale.float()[0:1] if scale.shape[0] == 1 else scale.float()[local_expert]


# -- grouped matmul and activation --------------------------------------------------------------
_QUANT_ARGS = ("scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale",
               "activation_input", "activation_quant_scale", "activation_quant_offset", "x_dtype",
               "weight_dtype", "scale_dtype", "per_token_scale_dtype")


def _check_bias_dtype(bias: torch.Tensor, x_dtype: torch.dtype) -> None:
    # The doc (and TorchAir's converter, which fills a missing bias as DT_FLOAT) ties the bias dtype
    # to x: fp32 for bf16 inputs, x's own dtype otherwise.
    want = torch.float32 if x_dtype == torch.bfloat16 else x_dtype
    _need(bias.dtype == want, f"npu_grouped_matmul: bias must be {want} for {x_dtype} x, got {bias.dtype}", TypeError)


def npu_grouped_matmul(x, weight, *, bias=None, group_list=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, poison=False,
                       **quant_args):
    """Grouped ``x @ W[e] (+ bias[e])``; rows past the last group end are not computed. Notes §2.4."""
    for name in _QUANT_ARGS:
        if quant_args.get(name) is not None:
            raise NotImplementedError(f"npu_grouped_matmul: {name} (quantised grouped matmul) is not emulated")
    unknown = set(quant_args) - set(_QUANT_ARGS)
    _need(not unknown, f"npu_grouped_matmul: unexpected arguments {sorted(unknown)}", TypeError)
    if act_type not in (0, None):
        raise NotImplementedError(f"npu_grouped_matmul: act_type={act_type} is only valid with per-token quant")
    out_dtype = x[0].dtype if output_dtype is None else _scalar_type(output_dtype)
    if group_list is None:
        return _matmul_per_tensor(x, weight, bias, split_item, out_dtype)
    _need(len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3,
          "npu_grouped_matmul: with group_list the emulation takes x=[X [M,K]] and weight=[W [E,K,N]]", NotImplementedError)
    _need(group_type == 0, f"npu_grouped_matmul: group_type must be 0 (group along M), got {group_type}")
    _need(split_item in (2, 3), f"npu_grouped_matmul: split_item must be 2 or 3 for one output, got {split_item}")
    x0, w = x[0], weight[0]
    _need(x0.dim() == 2 and x0.stride(-1) == 1, "npu_grouped_matmul: x must be a 2-D, non-transposed tensor")
    num_groups, inner, width = w.shape
    _need(x0.shape[1] == inner, f"npu_grouped_matmul: x is [M, {x0.shape[1]}] but weight is [E, {inner}, N]")
    _need(num_groups <= 1024 and inner < 65536, "npu_grouped_matmul: at most 1024 groups and K < 65536")
    _need(tuple(group_list.shape) == (num_groups,), f"npu_grouped_matmul: group_list must be [{num_groups}], got {tuple(group_list.shape)}")
    _need(group_list.dtype == torch.int64, f"npu_grouped_matmul: group_list must be int64, got {group_list.dtype}", TypeError)
    _need(group_list_type in (0, 1), f"npu_grouped_matmul: group_list_type must be 0 (cumsum) or 1 (counts), got {group_list_type}")
    ends = group_list if group_list_type == 0 else torch.cumsum(group_list, 0)
    ends = ends.tolist()
    # [AMBIG] the doc wants ends[-1] == M, but static EP passes ends[-1] < M in practice; allow <=.
    _need(all(b >= a for a, b in zip([0] + ends, ends)) and ends[-1] <= x0.shape[0],
          f"npu_grouped_matmul: group ends {ends} must be non-decreasing and <= M={x0.shape[0]}")
    b = None
    if bias is not None:
        b = bias[0]
        _need(tuple(b.shape) == (num_groups, width), f"npu_grouped_matmul: bias must be [{num_groups}, {width}], got {tuple(b.shape)}")
        _check_bias_dtype(b, x0.dtype)
    out = undefined_like(torch.empty(x0.shape[0], width, dtype=torch.float32, device=x0.device), poison)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            y = x0[start:end].float() @ w[e].float()
            out[start:end] = y if b is None else y + b[e].float()
        start = end
    return [out.to(out_dtype)]


def _matmul_per_tensor(x, weight, bias, split_item, out_dtype):
    _need(len(x) == len(weight), f"npu_grouped_matmul: {len(x)} x tensors but {len(weight)} weights", NotImplementedError)
    _need(split_item in (0, 1), f"npu_grouped_matmul: without group_list split_item must be 0 or 1, got {split_item}", NotImplementedError)
    outs = []
    for i, (xi, wi) in enumerate(zip(x, weight)):
        y = xi.float() @ wi.float()
        if bias is not None:
            _check_bias_dtype(bias[i], xi.dtype)
            y = y + bias[i].float()
        outs.append(y.to(out_dtype))
    return outs


def _scalar_type(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    # int? output_dtype: the ScalarType enum number (6 = float, 15 = bfloat16, 5 = half).
    table = {6: torch.float32, 15: torch.bfloat16, 5: torch.float16}
    if value not in table:
        raise NotImplementedError(f"npu_grouped_matmul: output_dtype={value} is not emulated")
    return table[value]


def npu_swiglu(self, dim=-1, *, poison=False):
    """``A, B = split(x, 2, dim)`` (A = first half); ``A * sigmoid(A) * B``. Notes §2.5."""
    _need(self.shape[dim] % 2 == 0, f"npu_swiglu: dim {dim} must have an even size, got {self.shape[dim]}")
    a, b = self.float().chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(self.dtype)


# -- token permute / unpermute / finalize ----------------------------------------------------------
def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False, *, poison=False):
    """Sort the rows by expert id (stable); ``sorted_indices[j]`` is flat entry j's row. Notes §2.6."""
    _need(not padded_mode, "npu_moe_token_permute: padded_mode must be False")
    top_k = indices.shape[1] if indices.dim() == 2 else 1
    _need(top_k <= 512, f"npu_moe_token_permute: topK must be <= 512, got {top_k}")
    flat = indices.reshape(-1).long()
    _need(flat.numel() == 0 or (int(flat.min()) >= 0 and int(flat.max()) < 16777215),
          "npu_moe_token_permute: indices must lie in [0, 16777215)")
    total = flat.numel()
    if not num_out_tokens:
        rows = total
    elif num_out_tokens > 0:
        rows = min(num_out_tokens, total)
    else:
        rows = total + num_out_tokens
    order = torch.sort(flat, stable=True).indices
    sorted_indices = torch.empty_like(order)
    sorted_indices[order] = torch.arange(total, device=flat.device)
    permuted = tokens[order[:rows] // top_k]
    return permuted, sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                            restore_shape=None, *, poison=False):
    """``out[t] = sum_k permuted[sorted_indices[t*K+k]] * probs[t,k]``. Notes §2.7."""
    _need(not padded_mode, "npu_moe_token_unpermute: padded_mode must be False")
    top_k = 1 if probs is None else probs.shape[1]
    num_tokens = sorted_indices.numel() // top_k
    idx = sorted_indices.reshape(-1).long()
    rows = permuted_tokens.shape[0]
    # An index past the rows the permute produced reads memory the op never wrote: undefined.
    padded = torch.cat([permuted_tokens.float(), undefined_like(
        permuted_tokens.new_empty(max(num_tokens * top_k - rows, 0) + 1, permuted_tokens.shape[1]).float(), poison)])
    # [AMBIG] -1 entries: the 950 path skips them (vllm-ascend PR #10579); emulated as "skip".
    skip = idx < 0
    gathered = padded[torch.where(skip, 0, idx.clamp(max=padded.shape[0] - 1))]
    gathered = torch.where(skip.unsqueeze(-1), 0.0, gathered)
    weights = torch.ones(num_tokens, top_k, device=idx.device) if probs is None else probs.float()
    out = (gathered.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)
    return out.to(permuted_tokens.dtype)


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1, *, poison=False):
    """k-major combine: ``out[i] = skip1+skip2+sum_k scales[i,k]*(rows[src2dst[k*N+i]] + bias[e])``. §2.8."""
    _need(drop_pad_mode in (0, None), f"npu_moe_finalize_routing: only drop_pad_mode=0 is emulated, got {drop_pad_mode}",
          NotImplementedError)
    _need(scales is not None, "npu_moe_finalize_routing: the emulation needs scales", NotImplementedError)
    num_rows, top_k = scales.shape  # K comes from scales; the ``k`` attribute only matters without them
    src2dst = expanded_src_to_dst_row.reshape(top_k, num_rows).long()  # k-major
    rows = expanded_permuted_rows.float()
    out = torch.zeros(num_rows, rows.shape[1], dtype=torch.float32, device=rows.device)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    for k in range(top_k):
        dst = src2dst[k]
        live = dst >= 0  # golden: -1 contributes 0
        row = torch.where(live.unsqueeze(-1), rows[dst.clamp(min=0)], 0.0)
        if bias is not None:
            row = row + bias.float()[export_for_source_row[:, k].long()]
        out = out + torch.where(live.unsqueeze(-1), scales[:, k].float().unsqueeze(-1) * row, 0.0)
    return out.to(expanded_permuted_rows.dtype)


KERNELS = {
    "npu_moe_gating_top_k_softmax": npu_moe_gating_top_k_softmax,
    "npu_moe_gating_top_k": npu_moe_gating_top_k,
    "npu_moe_init_routing_v2": npu_moe_init_routing_v2,
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_swiglu": npu_swiglu,
    "npu_moe_token_permute": npu_moe_token_permute,
    "npu_moe_token_unpermute": npu_moe_token_unpermute,
    "npu_moe_finalize_routing": npu_moe_finalize_routing,
}
