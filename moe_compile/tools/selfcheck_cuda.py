"""``python -m moe_compile selfcheck --device cuda``: check the CUDA kernels on this GPU.

Each Triton kernel of the CUDA lowering runs on the device and is compared with its plain-torch
reference: the fused routing (softmax top-k with renormalisation; DeepSeek-V3's grouped sigmoid
with a selection bias and scaling), the sync-free alignment, the experts on every path
(pairs, sorted, sorted with TMA loads, ``torch._grouped_mm`` where the GPU has it), the
batched-format experts behind a batched dispatcher, the whole op captured in a CUDA graph and
replayed on new inputs, and eager calls replaying the op's own graph (``lowering/op_graphs.py``).
A table shows check, case, max relative error, tolerance and PASS/FAIL.

``--interpret`` runs the same checks on the CPU under Triton's interpreter (fp32, tiny shapes):
that is how CI tests this tool; it says nothing about a GPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Callable

import torch


@dataclass(frozen=True)
class Check:
    name: str
    case: str
    err: float  # max |got - want| / max |want| (0 for exact checks)
    tol: float
    ok: bool
    note: str = ""


@dataclass(frozen=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    tiny: bool  # interpreter: tiny blocks, fp32

    @property
    def tol(self) -> float:
        return 1e-4 if self.dtype == torch.float32 else 2e-2


def setup_for(device: torch.device) -> Setup:
    if device.type == "cuda":
        return Setup(device, torch.bfloat16, 96, 256, 128, 16, 4, False)
    return Setup(device, torch.float32, 9, 32, 16, 8, 2, True)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = float(want.abs().max()) or 1.0
    return float((got - want).abs().max()) / scale


def _weights(s: Setup, gen: torch.Generator):
    from moe_compile.modular import ExpertWeights

    w13 = torch.randn(s.experts, 2 * s.inter, s.hidden, generator=gen) * s.hidden ** -0.5
    w2 = torch.randn(s.experts, s.hidden, s.inter, generator=gen) * s.inter ** -0.5
    to = lambda t: t.to(s.device, s.dtype).transpose(1, 2)  # noqa: E731  (HF layout, transposed views)
    return ExpertWeights(to(w13), to(w2))


def _routing_checks(s: Setup, gen: torch.Generator) -> list[Check]:
    from moe_compile.kernels.triton.routing import route
    from moe_compile.ops.config import RoutingConfig, RoutingMethod
    from moe_compile.ops.routing import select_experts

    logits = torch.randn(s.tokens, s.experts, generator=gen).to(s.device)
    bias = (torch.randn(s.experts, generator=gen) * 0.1).to(s.device)
    cases = {"softmax top-k renorm": (RoutingConfig(num_experts=s.experts, top_k=s.top_k, renormalize=True), None),
             "grouped sigmoid + bias x2.5": (RoutingConfig(
                 num_experts=s.experts, top_k=s.top_k, method=RoutingMethod.SIGMOID, renormalize=True,
                 routed_scaling_factor=2.5, group_count=4, k_group=2, group_select_mode=1,
                 has_correction_bias=True), bias),
             "sqrt-softplus + bias x1.5": (RoutingConfig(
                 num_experts=s.experts, top_k=s.top_k, method=RoutingMethod.SQRTSOFTPLUS, routed_scaling_factor=1.5,
                 has_correction_bias=True), bias)}
    out = []
    for case, (cfg, b) in cases.items():
        w, ids = route(logits, cfg, b)
        rw, rids = select_experts(logits.cpu(), cfg, None if b is None else b.cpu())
        same_ids = torch.equal(ids.cpu().long(), rids.long())
        err = _rel(w, rw)
        out.append(Check("routing", case, err, 1e-5, same_ids and err <= 1e-5, "" if same_ids else "ids differ"))
    return out


def _router_checks(s: Setup, gen: torch.Generator) -> list[Check]:
    """Router logits from the bf16 input against fp64: fp32 logits by the GEMV kernel (few tokens)
    and the split-bf16 tensor-core GEMM (run directly at this check's size), and bf16 logits from
    bf16 weights by the GEMV kernel."""
    from moe_compile.kernels.triton import router

    hidden = 7168 if not s.tiny else 64
    w = (torch.randn(s.experts * 4, hidden, generator=gen) * hidden ** -0.5).to(s.device)
    gemv_tokens = min(s.tokens, router.GEMV_MAX_TOKENS)
    x = torch.randn(s.tokens, hidden, generator=gen).bfloat16().to(s.device)
    out = [_compare("router", f"{gemv_tokens}x{hidden} fp32 weights, GEMV",
                    lambda: router.router_logits(x[:gemv_tokens], w), torch.nn.functional.linear(
                        x[:gemv_tokens].double(), w.double()), 1e-5)]
    # bf16 routers (Mixtral, Qwen3): bf16 logits, the fp32 sum rounded once -> within half a bf16
    # ulp of the largest logit, 2^-8 of it
    wb = w.bfloat16()
    out.append(_compare("router", f"{gemv_tokens}x{hidden} bf16 weights, bf16 logits, GEMV",
                        lambda: router.router_logits(x[:gemv_tokens], wb, None, torch.bfloat16),
                        torch.nn.functional.linear(x[:gemv_tokens].double(), wb.double()), 2 ** -8))
    if not s.tiny:  # the interpreter's bf16 tl.dot is not usable
        buf = torch.empty(s.tokens, w.shape[0], device=s.device)
        out.append(_compare("router", f"{s.tokens}x{hidden} fp32 weights, split-bf16 GEMM",
                            lambda: router._gemm(x, w, None, buf), torch.nn.functional.linear(x.double(), w.double()),
                            1e-5))
    return out


def _align_checks(s: Setup, gen: torch.Generator) -> list[Check]:
    from moe_compile.kernels.triton.align import METHODS

    ids = torch.randint(0, s.experts, (s.tokens, s.top_k), generator=gen, dtype=torch.int32).to(s.device)
    return [_align_check(s, ids, method) for method in METHODS]


def _align_check(s: Setup, ids: torch.Tensor, method: str) -> Check:
    from moe_compile.kernels.triton.align import align

    al = align(ids, s.experts, method=method)
    counts = torch.bincount(ids.view(-1).long().cpu(), minlength=s.experts)
    expert_of_row = ids.view(-1).long().cpu()[al.sorted_pair.long().cpu()]
    pos = al.pos.long().cpu()
    ok = (torch.equal(al.counts.long().cpu(), counts) and bool((expert_of_row.diff() >= 0).all())
          and torch.equal(al.sorted_pair.long().cpu()[pos], torch.arange(pos.numel())))
    return Check("align", f"{s.tokens}x{s.top_k} pairs, {method}", 0.0, 0.0, ok, "" if ok else "grouping wrong")


def _experts_checks(s: Setup, gen: torch.Generator) -> list[Check]:
    from moe_compile.kernels.triton.configs import ExpertsPath, Plan
    from moe_compile.kernels.triton.experts import _grouped_mm_ok, fused_experts
    from moe_compile.kernels.triton.gemm import GemmConfig
    from moe_compile.modular import ModularKernel, ReferenceExperts, StandardPrepareAndFinalize
    from moe_compile.ops.config import ExpertsConfig

    weights = _weights(s, gen)
    x = torch.randn(s.tokens, s.hidden, generator=gen).to(s.device, s.dtype)
    w, ids = torch.randn(s.tokens, s.experts, generator=gen).softmax(-1).topk(s.top_k)
    w, ids = w.to(s.device), ids.int().to(s.device)
    up = type(weights)(weights.w13.float(), weights.w2.float())
    want = ModularKernel(StandardPrepareAndFinalize(), ReferenceExperts(ExpertsConfig()))(
        x.float(), w, ids, up, global_num_experts=s.experts)
    g = GemmConfig(16, 16, 16, 2, 4, 2) if s.tiny else GemmConfig(64, 64, 64, 8, 4, 3)
    plans = {"pairs": Plan(ExpertsPath.PAIRS, g, g), "sorted": Plan(ExpertsPath.SORTED, g, g)}
    tma = GemmConfig(g.block_m, g.block_n, g.block_k, g.group_m, g.num_warps, g.num_stages, tma=1)
    plans["sorted, TMA loads"] = Plan(ExpertsPath.SORTED, tma, tma)
    plans["gemv (CUDA cores)"] = Plan(ExpertsPath.GEMV, g, g)
    plans["decode (one kernel)"] = Plan(ExpertsPath.DECODE, g, g)
    # a second GEMM split over K, whose slices the combine sums (a tuned plan uses it)
    plans["sorted, split-K GEMM2"] = Plan(ExpertsPath.SORTED, tma, replace(tma, split_k=2))
    if _grouped_mm_ok(x, weights):
        plans["grouped_mm"] = Plan(ExpertsPath.GROUPED_MM, g, g)
    out = []
    for case, plan in plans.items():
        out.append(_compare("experts", case, lambda p=plan: fused_experts(x, w, ids, weights, plan=p), want, s.tol))
    return out


def _batched_check(s: Setup, gen: torch.Generator) -> Check:
    from moe_compile.kernels.triton.experts import TritonBatchedExperts
    from moe_compile.modular import BatchedExperts, BatchedPrepareAndFinalize, ModularKernel
    from moe_compile.ops.config import ExpertsConfig

    weights = _weights(s, gen)
    x = torch.randn(s.tokens, s.hidden, generator=gen).to(s.device, s.dtype)
    w, ids = torch.randn(s.tokens, s.experts, generator=gen).softmax(-1).topk(s.top_k)
    w, ids = w.to(s.device), ids.int().to(s.device)

    def run(experts):
        return ModularKernel(BatchedPrepareAndFinalize(s.experts), experts)(x, w, ids, weights,
                                                                           global_num_experts=s.experts)
    want = run(BatchedExperts(ExpertsConfig()))
    return _compare("batched experts", "TritonBatchedExperts vs BatchedExperts",
                    lambda: run(TritonBatchedExperts(ExpertsConfig())), want, s.tol)


def _graph_check(s: Setup, gen: torch.Generator) -> Check:
    from moe_compile import fused_moe

    if s.device.type != "cuda":
        return Check("CUDA graph", "capture + replay", 0.0, 0.0, True, "not applicable without CUDA")
    weights = _weights(s, gen)
    inputs = [(torch.randn(s.tokens, s.hidden, generator=gen).to(s.device, s.dtype),
               torch.randn(s.tokens, s.experts, generator=gen).to(s.device)) for _ in range(2)]

    def layer(x, logits):
        return fused_moe(x, logits, s.experts, s.top_k, weights.w13, weights.w2, renormalize=True)
    try:
        static_x, static_l = inputs[0][0].clone(), inputs[0][1].clone()
        layer(static_x, static_l)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(static_x, static_l)
        static_x.copy_(inputs[1][0])
        static_l.copy_(inputs[1][1])
        graph.replay()
        err = _rel(out, layer(*inputs[1]))
        return Check("CUDA graph", "fused_moe replayed on new inputs vs eager", err, 0.0, err == 0.0)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Check("CUDA graph", "capture + replay", float("nan"), 0.0, False, f"{type(exc).__name__}: {exc}")


def _op_graphs_check(s: Setup, gen: torch.Generator) -> Check:
    """Three eager calls of one shape on new inputs (the second captures the op's own graph, both later ones
    replay it; ``lowering/op_graphs.py``) against the same calls with op graphs off. It starts by forgetting
    every op graph (``op_graphs.clear()``); later calls capture theirs again."""
    from moe_compile import fused_moe
    from moe_compile.lowering import op_graphs

    case = "3 eager calls, graph replays vs without"
    if s.device.type != "cuda" or not op_graphs.SETTINGS.enabled:
        why = "not applicable without CUDA" if s.device.type != "cuda" else "off (MOE_COMPILE_OP_GRAPHS=0)"
        return Check("op graphs", case, 0.0, 0.0, True, why)
    weights = _weights(s, gen)
    inputs = [(torch.randn(s.tokens, s.hidden, generator=gen).to(s.device, s.dtype),
               torch.randn(s.tokens, s.experts, generator=gen).to(s.device)) for _ in range(3)]

    def layer(x, logits):
        return fused_moe(x, logits, s.experts, s.top_k, weights.w13, weights.w2, renormalize=True)
    saved = dataclasses.replace(op_graphs.SETTINGS)
    try:
        op_graphs.configure(max_tokens=max(s.tokens, 1), max_expert_bytes=1 << 60, warm_calls=2)
        # from no graphs and no counts: an earlier check's calls may have left this very key behind (freed
        # weights hand their addresses on to these), and its first call would then replay already
        op_graphs.clear()
        graphed = [layer(*args) for args in inputs]
        replays = op_graphs.STATS["replayed"]
        op_graphs.configure(enabled=False)
        err = max(_rel(got, layer(*args)) for got, args in zip(graphed, inputs))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Check("op graphs", case, float("nan"), 0.0, False, f"{type(exc).__name__}: {exc}")
    finally:
        op_graphs.configure(**dataclasses.asdict(saved))
    # the same kernels and plan: equal but for the decode path's fp32 atomic sums, in any order
    ok = replays == 2 and err <= 5e-3
    return Check("op graphs", case, err, 5e-3, ok, "" if replays == 2 else f"{replays} replays, expected 2")


def _compare(name: str, case: str, fn: Callable[[], torch.Tensor], want: torch.Tensor, tol: float) -> Check:
    try:
        got = fn()
    except Exception as exc:  # noqa: BLE001 - one broken kernel must not hide the others
        return Check(name, case, float("nan"), tol, False, f"{type(exc).__name__}: {str(exc)[:200]}")
    finite = bool(torch.isfinite(got).all())
    err = _rel(got, want)
    return Check(name, case, err, tol, finite and err <= tol, "" if finite else "non-finite output")


def run_cuda_checks(device: torch.device, seed: int = 0) -> list[Check]:
    s = setup_for(device)
    gen = torch.Generator().manual_seed(seed)
    checks = _routing_checks(s, gen) + _router_checks(s, gen) + _align_checks(s, gen) + _experts_checks(s, gen)
    return checks + [_batched_check(s, gen), _graph_check(s, gen), _op_graphs_check(s, gen)]


def format_checks(checks: list[Check]) -> str:
    header = ("check", "case", "max rel err", "tolerance", "result")
    body = [(c.name, c.case, f"{c.err:.3g}", f"{c.tol:g}",
             ("PASS" if c.ok else "FAIL") + (f" ({c.note})" if c.note else "")) for c in checks]
    widths = [max(len(str(line[i])) for line in [header] + body) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


__all__ = ["Check", "format_checks", "run_cuda_checks", "setup_for"]
