"""Row-by-row Python goldens of the torch_npu MoE ops, written from the doc formulas (notes §2).

They are deliberately naive (loops over rows and entries, fp64 arithmetic, explicit stable
ordering) and share no code with the vectorised emulation in :mod:`npu_kernels`: the tests compare
the two, and ``selfcheck`` compares the real device ops with both. Each returns only the values the
docs define (e.g. the first ``R`` rows of ``expanded_x``).
"""
from __future__ import annotations

import math

import torch


def _softmax(row: list[float]) -> list[float]:
    m = max(row)
    exps = [math.exp(v - m) for v in row]
    total = sum(exps)
    return [v / total for v in exps]


def _sigmoid(row: list[float]) -> list[float]:
    return [1.0 / (1.0 + math.exp(-v)) for v in row]


def _top(values: list[float], k: int, allowed=None) -> list[int]:
    """Indices of the k largest values, ties to the lower index."""
    candidates = range(len(values)) if allowed is None else allowed
    return sorted(candidates, key=lambda i: (-values[i], i))[:k]


def gating_top_k_softmax(x: torch.Tensor, k: int):
    """(y [N,k], expert_idx [N,k], row_idx [N,k]) for 2-D ``x``; ``row_idx[i,j] = j*N + i``."""
    rows = x.double().tolist()
    n = len(rows)
    y, idx, row_idx = [], [], []
    for i, row in enumerate(rows):
        p = _softmax(row)
        top = _top(p, k)
        y.append([p[e] for e in top])
        idx.append(top)
        row_idx.append([j * n + i for j in range(k)])
    return torch.tensor(y), torch.tensor(idx, dtype=torch.int32), torch.tensor(row_idx, dtype=torch.int32)


def gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, norm_type=0,
                 routed_scaling_factor=1.0, eps=1e-20):
    """(y [N,k], expert_idx [N,k]) following the six steps of notes §2.2 (renorm=0)."""
    bias_list = None if bias is None else bias.double().tolist()
    y, idx = [], []
    for row in x.double().tolist():
        norm = _softmax(row) if norm_type == 0 else _sigmoid(row)
        sel = [v + (bias_list[e] if bias_list else 0.0) for e, v in enumerate(norm)]
        allowed = list(range(len(row)))
        if group_count > 1:
            size = len(row) // group_count
            groups = [sel[g * size:(g + 1) * size] for g in range(group_count)]
            scores = [max(g) if group_select_mode == 0 else sum(sorted(g, reverse=True)[:2]) for g in groups]
            kept = _top(scores, k_group)
            allowed = [g * size + i for g in kept for i in range(size)]
        top = _top(sel, k, allowed)
        w = [norm[e] for e in top]
        if norm_type == 1:
            total = sum(w) + eps
            w = [v / total for v in w]
        y.append([v * routed_scaling_factor for v in w])
        idx.append(top)
    return torch.tensor(y), torch.tensor(idx, dtype=torch.int32)


def init_routing_v2(x: torch.Tensor, expert_idx: torch.Tensor, start: int, end: int, active_num: int = -1):
    """(expanded_x [R,H], expanded_row_idx [N*K] gather-style, counts [end-start]) for drop_pad_mode 0."""
    flat = expert_idx.reshape(-1).tolist()
    top_k = expert_idx.shape[1]
    keyed = [(2**31 - 1 if e < start else e, j) for j, e in enumerate(flat)]  # stable by (key, position)
    order = [j for _, j in sorted(keyed)]
    valid = sum(1 for e in flat if start <= e < end)
    kept = valid if active_num <= 0 else min(valid, active_num)
    expanded_x = torch.stack([x[order[i] // top_k] for i in range(kept)]) if kept else x[:0]
    row_idx = [-1] * len(flat)
    for i in range(valid):
        row_idx[order[i]] = i
    counts = [sum(1 for e in flat if e == s) for s in range(start, end)]
    return expanded_x, torch.tensor(row_idx, dtype=torch.int32), torch.tensor(counts, dtype=torch.int64)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int], bias: torch.Tensor | None = None):
    """``Y[r] = X[r] @ W[e(r)] (+ bias[e(r)])`` for the rows the groups cover (fp64)."""
    out = []
    row = 0
    for e, count in enumerate(counts):
        for _ in range(count):
            y = x[row].double() @ w[e].double()
            out.append(y if bias is None else y + bias[e].double())
            row += 1
    return torch.stack(out) if out else x.new_zeros(0, w.shape[-1], dtype=torch.float64)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    a, b = x[..., :half].double(), x[..., half:].double()
    return a / (1 + torch.exp(-a)) * b


def token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None):
    """(permuted, sorted_indices): ``sorted_indices[j]`` = destination row of flat entry j."""
    flat = indices.reshape(-1).tolist()
    top_k = indices.shape[1] if indices.dim() == 2 else 1
    order = sorted(range(len(flat)), key=lambda j: (flat[j], j))
    dest = [0] * len(flat)
    for i, j in enumerate(order):
        dest[j] = i
    rows = len(flat) if not num_out_tokens else min(num_out_tokens, len(flat))
    permuted = torch.stack([tokens[order[i] // top_k] for i in range(rows)])
    return permuted, torch.tensor(dest, dtype=torch.int32)


def token_unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None = None):
    """``out[t] = sum_k permuted[idx[t*K+k]] * probs[t,k]``; -1 entries skipped (fp64)."""
    top_k = 1 if probs is None else probs.shape[1]
    idx = sorted_indices.tolist()
    out = []
    for t in range(len(idx) // top_k):
        acc = torch.zeros(permuted.shape[1], dtype=torch.float64)
        for k in range(top_k):
            row = idx[t * top_k + k]
            if row >= 0:
                acc += permuted[row].double() * (1.0 if probs is None else float(probs[t, k]))
        out.append(acc)
    return torch.stack(out)


def finalize_routing(rows, skip1, skip2, bias, scales, src2dst, expert_for_row):
    """k-major combine of notes §2.8 (fp64)."""
    num_rows, top_k = scales.shape
    out = []
    for i in range(num_rows):
        acc = torch.zeros(rows.shape[1], dtype=torch.float64)
        for skip in (skip1, skip2):
            if skip is not None:
                acc += skip[i].double()
        for k in range(top_k):
            dst = int(src2dst[k * num_rows + i])
            if dst < 0:
                continue
            row = rows[dst].double()
            if bias is not None:
                row = row + bias[int(expert_for_row[i, k])].double()
            acc += float(scales[i, k]) * row
        out.append(acc)
    return torch.stack(out)
