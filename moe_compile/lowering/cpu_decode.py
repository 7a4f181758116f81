"""Few tokens on the CPU under Inductor: the experts as gather-GEMVs compiled with the graph.

At decode sizes each expert the router picks sees one or two rows. The op's CPU path then runs one
``torch.mm`` per expert, and MKL's GEMM for so few rows reads the weights at about half the rate the
memory gives a batched kernel (``python benchmarks/bench_cpu_gemv.py``). So where a graph's token
count is fixed and its top-k pairs number at most twice the experts, the backend puts this module's
torch code in place of each fused-op node before Inductor lowers the graph: the routing as the op
computes it, then for every (token, k) pair ``h = x · W13[id]``, the activation and ``y = a · W2[id]``,
each written as a gather feeding a reduction. Inductor fuses each into one kernel that reads the
picked experts' weights in place (no copy), over all cores, and the routing and the weighted sum
into its own kernels around them.

Numerics follow the op's CPU path: products and sums in fp32, the GEMMs' outputs rounded to the
activations' dtype, the activation in that dtype, the top-k rows weighted and summed in fp32.
Ids outside ``[0, E)`` contribute nothing, as in the op. Only nodes the op would run on the CPU
without TP/EP take this path; every other node stays the opaque op.
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.fx as fx

from moe_compile.lowering.inline import bind_args, fused_op_overloads, inline_node
from moe_compile.modular import ExpertWeights
from moe_compile.modular.prepare_finalize import weight_input
from moe_compile.ops.activation import apply_activation
from moe_compile.ops.config import ExpertsConfig

log = logging.getLogger("moe_compile")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# top-k pairs per expert up to which the gather-GEMVs win (bench_cpu_layer.py, E = 64, top-8, 2 cores, fp32):
# 2.2-2.6x HF eager at 1/8 to 1 (M = 1..8), 2.2x at 2 (M = 16), 0.98x at 4 (M = 32), where a pair
# re-reading its expert costs more than MKL's slower rows; results README, twenty-seventh session
PAIRS_PER_EXPERT = 2


def gather_gemv(w_EKN: torch.Tensor, ids_P: torch.Tensor, x_PK: torch.Tensor) -> torch.Tensor:
    """``out[p] = x[p] @ w[ids[p]]`` in fp32, as a gather feeding a reduction over K (Inductor keeps
    the gather inside the reduction's loads: nothing of ``w`` is copied)."""
    return (w_EKN[ids_P].float() * x_PK.float().unsqueeze(-1)).sum(1)


def pair_experts(x_TH: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, weights: ExpertWeights,
                 cfg: ExpertsConfig) -> torch.Tensor:
    """The experts for every (token, k) pair, weighted and summed per token: ``[T, H]`` in ``x``'s dtype."""
    num_tokens, hidden = x_TH.shape
    top_k = topk_ids.shape[1]
    num_local = weights.w13.shape[0]
    dtype = x_TH.dtype
    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_local)
    ids = torch.where(valid, ids, 0)
    if cfg.apply_router_weight_on_input:
        x_TH = weight_input(x_TH, topk_weights)
        row_weight = valid.float()
    else:
        row_weight = torch.where(valid, topk_weights.reshape(-1).float(), 0.0)
    x_PH = x_TH.unsqueeze(1).expand(num_tokens, top_k, hidden).reshape(num_tokens * top_k, hidden)
    h = gather_gemv(weights.w13, ids, x_PH)
    if weights.w13_bias is not None:
        h = h + weights.w13_bias[ids].float()
    a = apply_activation(h.to(dtype), cfg)
    y = gather_gemv(weights.w2, ids, a)
    if weights.w2_bias is not None:
        y = y + weights.w2_bias[ids].float()
    rows = y.to(dtype).float() * row_weight.unsqueeze(-1)
    return rows.view(num_tokens, top_k, hidden).sum(1).to(dtype)


@functools.lru_cache(maxsize=None)
def _config_params() -> tuple[str, ...]:
    from moe_compile.ops.custom_op import make_config

    return tuple(inspect.signature(make_config.__wrapped__).parameters)


def _config(bound: dict, **given):
    from moe_compile.ops.custom_op import make_config

    args = {name: bound[name] for name in _config_params() if name in bound}
    args.update(given)
    return make_config(**args)


def _fused_moe(**bound) -> torch.Tensor:
    from moe_compile.ops.routing import select_experts

    x, logits = bound["hidden_states"], bound["router_logits"]
    bias = bound["e_score_correction_bias"]
    cfg = _config(bound, has_bias=bias is not None)
    topk_weights, topk_ids = select_experts(logits.reshape(-1, logits.shape[-1]), cfg.routing, bias)
    weights = ExpertWeights(bound["w13_weight"], bound["w2_weight"], bound["w13_bias"], bound["w2_bias"])
    return pair_experts(x.reshape(-1, x.shape[-1]), topk_weights, topk_ids, weights, cfg.experts).view(x.shape)


def _fused_experts(**bound) -> torch.Tensor:
    from moe_compile.ops.custom_op import _ROUTING_DONE

    x, topk_ids = bound["hidden_states"], bound["topk_ids"]
    cfg = _config(bound, top_k=topk_ids.shape[-1], **_ROUTING_DONE)
    weights = ExpertWeights(bound["w13_weight"], bound["w2_weight"], bound["w13_bias"], bound["w2_bias"])
    top_k = topk_ids.shape[-1]
    out = pair_experts(x.reshape(-1, x.shape[-1]), bound["topk_weights"].reshape(-1, top_k),
                       topk_ids.reshape(-1, top_k), weights, cfg.experts)
    return out.view(x.shape)


def _static(value) -> bool:
    return not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def skip_reason(bound: dict) -> str | None:
    """Why this fused-op node keeps the op (None: it takes the gather-GEMV path)."""
    vals = {name: v.meta.get("val") for name, v in bound.items() if isinstance(v, fx.Node)}
    x, w13 = vals.get("hidden_states"), vals.get("w13_weight")
    if not isinstance(x, torch.Tensor) or not isinstance(w13, torch.Tensor):
        return "no fake values on the node's inputs"
    if any(t.device.type != "cpu" for t in vals.values() if isinstance(t, torch.Tensor)):
        return "not on the CPU"
    if bound.get("lowering") not in ("auto", "cpu"):
        return f"lowering={bound.get('lowering')!r}"
    if bound.get("tp_group_name") or bound.get("ep_group_name") or bound.get("dispatcher_type"):
        return "tensor or expert parallel"
    if x.dtype not in DTYPES or w13.dtype != x.dtype:
        return f"dtype {x.dtype} with weights {w13.dtype}"
    scalars = [v for v in bound.values() if not isinstance(v, fx.Node)]
    shapes = [s for t in vals.values() if isinstance(t, torch.Tensor) for s in (*t.shape, *t.stride())]
    if not all(_static(v) for v in scalars + shapes):
        return "a symbolic size or option (the token count must be fixed to choose this path)"
    w2 = vals.get("w2_weight")
    if not (w13.stride(1) == 1 and isinstance(w2, torch.Tensor) and w2.stride(1) == 1):
        # measured: over N-major weights Inductor's reduction reads no faster than the op's GEMMs
        return "weights not K-major (w13 / w2 [E, K, N] views with unit stride along K, as HF stores them)"
    top_k = vals["topk_ids"].shape[-1] if "topk_ids" in vals else bound["top_k"]
    pairs = x.numel() // x.shape[-1] * top_k
    if pairs > PAIRS_PER_EXPERT * w13.shape[0]:
        return (f"{pairs} top-k pairs > {PAIRS_PER_EXPERT} x {w13.shape[0]} experts (a pair reads its expert's "
                f"weights; past that the op's grouped GEMMs, which read each expert once, are faster)")
    return None


def inline_cpu_decode(gm: fx.GraphModule) -> int:
    """Put the gather-GEMV experts in place of every fused-op node of ``gm`` that qualifies (see the
    module doc); returns how many. A node whose tracing fails keeps the op (logged)."""
    from torch._inductor.decomposition import select_decomp_table

    bodies = {torch.ops.moe_compile.fused_moe.default: _fused_moe,
              torch.ops.moe_compile.fused_experts.default: _fused_experts}
    overloads = fused_op_overloads()
    count = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in overloads]:
        bound = bind_args(node.target, node.args, node.kwargs)
        reason = skip_reason(bound)
        if reason is not None:
            log.debug("moe_compile: %s keeps the fused op on the CPU: %s", node.name, reason)
            continue
        body = bodies[node.target]
        try:
            inline_node(gm, node, lambda *a, _op=node.target, _body=body, **k: _body(**bind_args(_op, a, k)),
                        functional=True, decompositions=select_decomp_table(), caller="inline_cpu_decode")
        except Exception as exc:  # the op stays: it computes the same
            log.info("moe_compile: %s keeps the fused op (the CPU decode path failed to trace: %s: %s)",
                     node.name, type(exc).__name__, str(exc).split("\n")[0][:200])
            continue
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        torch._dynamo.utils.counters["moe_compile"]["cpu_decode"] += count
        log.debug("moe_compile: %d fused MoE node(s) computed as gather-GEMVs in the graph (CPU, few tokens)", count)
    return count
