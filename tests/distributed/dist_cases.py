"""Distributed fused-MoE cases and their single-process reference (run inside spawned ranks).

Every rank builds the same full problem from the case's seed (on its GPU under NCCL, where the
CUDA lowering runs both sides), computes the reference with ``fused_moe`` without groups on the full
weights and tokens, then runs its share (sharded
weights, and sharded tokens for tokens_full=False) with the case's group and dispatcher and
compares. Tolerances: fp32 ``rtol=1e-4, atol=2e-5`` (only the summation order differs);
bf16 ``2e-2`` (partial sums are rounded to bf16 before the reduction, as on the device).
"""
from __future__ import annotations

import dataclasses
import traceback
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dist_harness import device
from moe_compile import fused_moe
from moe_compile.distributed import shard_experts_for_ep, shard_for_groups, shard_tokens

TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@dataclass(frozen=True)
class Case:
    id: str
    mode: str  # "tp", "ep", "both" (tp and ep groups given: EP wins), "ep_sub" (EP on size-2 subgroups)
    dispatcher: str | None = None
    tokens_full: bool = True
    dtype: torch.dtype = torch.float32
    tokens: int = 8
    hidden: int = 16
    inter: int = 8
    experts: int = 8
    top_k: int = 2
    activation: str = "silu"
    interleaved: bool = False
    biases: bool = False
    routing: dict = field(default_factory=dict, hash=False)
    correction_bias: bool = False
    reduce_results: bool = True
    custom_routing: bool = False
    transposed: bool = False  # weights as transposed views of HF-layout [E, N, H] / [E, H, I] tensors
    batch3d: bool = False  # hidden_states [B, 2, H] instead of [T, H]
    full_w2_bias: bool = False  # TP: every rank passes the whole w2_bias (the op adds it on TP rank 0 only)


@dataclass(frozen=True)
class Problem:
    x: torch.Tensor
    logits: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    correction: torch.Tensor | None


def softmax_topk(hidden_states, gating_output, topk, renormalize):
    """A custom routing function (the seed's example)."""
    weights, ids = gating_output.softmax(dim=-1).topk(topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def make_problem(case: Case, salt: int = 0) -> Problem:
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + salt)
    e, h, i, t = case.experts, case.hidden, case.inter, case.tokens
    n = 2 * i if not case.activation.endswith("_no_mul") else i

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(case.dtype)

    x = rnd(t, h)
    logits = torch.randn(t, e, generator=gen)
    if case.transposed:  # HF stores [E, N, H] and [E, H, I]; the op sees transposed views
        w13, w2 = rnd(e, n, h, scale=h ** -0.5).transpose(1, 2), rnd(e, h, i, scale=i ** -0.5).transpose(1, 2)
    else:
        w13, w2 = rnd(e, h, n, scale=h ** -0.5), rnd(e, i, h, scale=i ** -0.5)
    b13 = rnd(e, n, scale=0.1) if case.biases else None
    b2 = rnd(e, h, scale=0.1) if case.biases else None
    corr = torch.randn(e, generator=gen) if case.correction_bias else None
    if case.batch3d:
        x, logits = x.view(t // 2, 2, h), logits.view(t // 2, 2, e)
    dev = device()  # the same values on every rank and device (generated on the CPU)
    return Problem(*(None if v is None else v.to(dev) for v in (x, logits.to(case.dtype), w13, w2, b13, b2, corr)))


def _call(case: Case, p: Problem, x, logits, weights, **groups) -> torch.Tensor:
    return fused_moe(
        x, logits, case.experts, case.top_k, weights[0], weights[1], weights[2], weights[3],
        tokens_full=case.tokens_full, reduce_results=case.reduce_results,
        dispatcher_type=case.dispatcher if groups else None,
        custom_routing_function=softmax_topk if case.custom_routing else None,
        e_score_correction_bias=p.correction, activation=case.activation,
        gate_up_interleaved=case.interleaved, **case.routing, **groups,
    )


def reference(case: Case, p: Problem) -> torch.Tensor:
    """The single-process result on the full tokens and weights."""
    single = dataclasses.replace(case, tokens_full=True, reduce_results=True)
    return _call(single, p, p.x, p.logits, (p.w13, p.w2, p.w13_bias, p.w2_bias))


def groups_for(case: Case, subgroup) -> tuple[dict, object]:
    """The group keyword arguments of the case, and the group whose ranks share the work."""
    world = dist.group.WORLD
    if case.mode == "tp":
        return {"tp_group": world}, world
    if case.mode == "ep":
        return {"ep_group": world}, world
    if case.mode == "both":
        return {"tp_group": world, "ep_group": world}, world
    return {"ep_group": subgroup}, subgroup


def run_case(case: Case, subgroup=None, subgroup_index: int = 0) -> None:
    groups, group = groups_for(case, subgroup)
    p = make_problem(case, salt=subgroup_index)
    ref = reference(case, p)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    full = (p.w13, p.w2, p.w13_bias, p.w2_bias)
    w = shard_for_groups(*full, activation=case.activation, gate_up_interleaved=case.interleaved, **groups)
    if case.mode == "tp":  # the TP layout from the TP function itself
        assert w.w2.shape[1] == case.inter // world and w.w13.shape[0] == case.experts
    else:  # EP (also when both groups are given)
        assert w.w13.shape[0] == case.experts // world and w.w2.shape[1] == case.inter
    w2_bias = p.w2_bias if case.full_w2_bias else w.w2_bias
    x, logits, expected = p.x, p.logits, ref
    if not case.tokens_full:
        x, logits, expected = (shard_tokens(t, rank=rank, world_size=world) for t in (p.x, p.logits, ref))
    out = _call(case, p, x, logits, (w.w13, w.w2, w.w13_bias, w2_bias), **groups)
    if not case.reduce_results and case.tokens_full:
        assert not torch.allclose(out, expected, **TOL[case.dtype]), "reduce_results=False still reduced"
        dist.all_reduce(out, group=group)
    assert out.shape == expected.shape and out.dtype == expected.dtype, (out.shape, out.dtype, expected.shape)
    torch.testing.assert_close(out, expected, **TOL[case.dtype])


def graph_case(case: Case) -> None:
    """CUDA only: the call captured in one CUDA graph (collectives included), then replayed on new
    tokens and on the captured ones, equals the single-GPU reference on each."""
    groups, group = groups_for(case, None)
    p = make_problem(case)
    q = dataclasses.replace(p, **{k: v for k, v in vars(make_problem(case, salt=1)).items() if k in ("x", "logits")})
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    w = shard_for_groups(p.w13, p.w2, p.w13_bias, p.w2_bias, activation=case.activation,
                         gate_up_interleaved=case.interleaved, **groups)

    def tokens(prob):
        if case.tokens_full:
            return prob.x, prob.logits
        return tuple(shard_tokens(t, rank=rank, world_size=world) for t in (prob.x, prob.logits))

    x, logits = (t.clone() for t in tokens(p))
    call = lambda: _call(case, p, x, logits, (w.w13, w.w2, w.w13_bias, w.w2_bias), **groups)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (autotuning, workspaces) outside the capture
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for prob in (q, p):
        new_x, new_logits = tokens(prob)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        expected = reference(case, prob)
        if not case.tokens_full:
            expected = shard_tokens(expected, rank=rank, world_size=world)
        torch.testing.assert_close(out, expected, **TOL[case.dtype])


# -- the cases ------------------------------------------------------------------------------
MODES = {"tp": ("tp", "static"), "ep_static": ("ep", "static"), "ep_dynamic": ("ep", "dynamic"),
         "ep_batched": ("ep", "batched")}
SIGMOID_GROUPED = dict(routing_method="sigmoid", group_count=4, k_group=2, routed_scaling_factor=2.5)


def _cases() -> list[Case]:
    cases = []
    for name, (mode, disp) in MODES.items():
        for full in (True, False):
            cases.append(Case(f"{name}-full{int(full)}", mode, disp, tokens_full=full,
                              routing=dict(renormalize=True)))
        cases.append(Case(f"{name}-bf16", mode, disp, dtype=torch.bfloat16))
        cases.append(Case(f"{name}-bias-gelu-sharded", mode, disp, tokens_full=False, biases=True,
                          activation="gelu"))
        cases.append(Case(f"{name}-weight-on-input", mode, disp, top_k=1,
                          routing=dict(apply_router_weight_on_input=True)))
        cases.append(Case(f"{name}-sigmoid-grouped", mode, disp, correction_bias=True, tokens_full=False,
                          routing=SIGMOID_GROUPED))
    cases += [
        Case("tp-no-reduce", "tp", "static", reduce_results=False),
        Case("ep_static-no-reduce", "ep", "static", reduce_results=False),
        Case("tp-swigluoai-interleaved-bias", "tp", None, activation="swigluoai", interleaved=True, biases=True),
        Case("tp-full-w2-bias", "tp", None, biases=True, full_w2_bias=True),
        Case("tp-full-w2-bias-no-reduce", "tp", "static", biases=True, full_w2_bias=True, reduce_results=False),
        Case("tp-relu2-nonGated-sharded", "tp", None, tokens_full=False, activation="relu2_no_mul"),
        Case("ep_dynamic-ragged-3tokens", "ep", "dynamic", tokens=3),
        Case("ep_batched-ragged-3tokens", "ep", "batched", tokens=3),
        Case("ep_dynamic-1token", "ep", "dynamic", tokens=1, top_k=1),
        Case("ep_batched-3d-sharded", "ep", "batched", tokens_full=False, batch3d=True),
        Case("ep_dynamic-custom-routing-sharded", "ep", "dynamic", tokens_full=False, custom_routing=True,
             routing=dict(renormalize=True)),
        Case("ep_static-custom-routing", "ep", "static", custom_routing=True),
        Case("ep_dynamic-transposed-views", "ep", "dynamic", transposed=True),
        Case("tp-transposed-views-sharded", "tp", "static", tokens_full=False, transposed=True),
        Case("ep-auto-full", "ep", None, tokens_full=True),
        Case("ep-auto-sharded-top1", "ep", None, tokens_full=False, top_k=1),
        Case("both-groups-ep-wins", "both", "dynamic", tokens_full=False),
        Case("ep_dynamic-16experts-top4", "ep", "dynamic", experts=16, top_k=4, tokens=12),
    ]
    return cases


CASES = _cases()
SUB_CASES = [Case("ep_sub-dynamic", "ep_sub", "dynamic"), Case("ep_sub-static-sharded", "ep_sub", "static",
                                                                tokens_full=False),
             Case("ep_sub-batched", "ep_sub", "batched")]


def registry_case(name: str, experts_name: str) -> None:
    """A distributed PF built through the modular registry (``compose``) over the world group, EP:
    the kernel's output equals the single-device kernel's on the full weights."""
    from moe_compile.distributed import expert_map
    from moe_compile.modular import ExpertWeights, GroupedExperts, ModularKernel, StandardPrepareAndFinalize
    from moe_compile.modular.registry import BuildContext, compose
    from moe_compile.ops.config import ExpertsConfig, RoutingConfig
    from moe_compile.ops.routing import select_experts

    case = Case(f"registry-{name}", "ep")
    p = make_problem(case)
    rank, world = dist.get_rank(), dist.get_world_size()
    weights, ids = select_experts(p.logits, RoutingConfig(num_experts=case.experts, top_k=case.top_k), None)
    full = ExpertWeights(p.w13, p.w2)
    ref = ModularKernel(StandardPrepareAndFinalize(), GroupedExperts(ExpertsConfig()))(
        p.x, weights, ids, full, global_num_experts=case.experts)
    local = shard_experts_for_ep(p.w13, p.w2, rank=rank, world_size=world)
    ctx = BuildContext(num_experts=case.experts, num_local_experts=case.experts // world, device=p.x.device,
                       dtype=p.x.dtype, ep_group_name=dist.group.WORLD.group_name)
    emap = (expert_map(case.experts, rank=rank, world_size=world, device=p.x.device)
            if name == "StaticPrepareAndFinalize" else None)
    out = compose(name, experts_name, ctx)(p.x, weights, ids, local, global_num_experts=case.experts,
                                           expert_map=emap)
    torch.testing.assert_close(out, ref, **TOL[case.dtype])


def triton_batched_case() -> None:
    """EP batched all-to-all with the batched Triton experts (on GPUs, or under Triton's
    interpreter on CPU) equals the single-device kernel on the full weights."""
    from moe_compile.kernels.triton.experts import TritonBatchedExperts
    from moe_compile.modular import ExpertWeights, GroupedExperts, ModularKernel, StandardPrepareAndFinalize
    from moe_compile.modular.distributed_pf import BatchedAllToAllPrepareAndFinalize
    from moe_compile.ops.config import ExpertsConfig, RoutingConfig
    from moe_compile.ops.routing import select_experts

    case = Case("triton-batched", "ep", tokens=6)
    p = make_problem(case)
    rank, world = dist.get_rank(), dist.get_world_size()
    weights, ids = select_experts(p.logits, RoutingConfig(num_experts=case.experts, top_k=case.top_k), None)
    ref = ModularKernel(StandardPrepareAndFinalize(), GroupedExperts(ExpertsConfig()))(
        p.x, weights, ids, ExpertWeights(p.w13, p.w2), global_num_experts=case.experts)
    local = shard_experts_for_ep(p.w13, p.w2, rank=rank, world_size=world)
    pf = BatchedAllToAllPrepareAndFinalize(group=dist.group.WORLD, tokens_full=True,
                                           num_local_experts=case.experts // world)
    out = ModularKernel(pf, TritonBatchedExperts(ExpertsConfig()))(p.x, weights, ids, local,
                                                                   global_num_experts=case.experts)
    torch.testing.assert_close(out, ref, **TOL[case.dtype])


def registry_report(pairs) -> dict:
    """``{"registry-PF-EXPERTS": None | traceback}`` of :func:`registry_case` over ``pairs``."""
    out = {}
    for pf, experts in pairs:
        try:
            registry_case(pf, experts)
            out[f"registry-{pf}-{experts}"] = None
        except Exception:  # noqa: BLE001
            out[f"registry-{pf}-{experts}"] = traceback.format_exc(limit=6)
    return out


REGISTRY_CASES = [("StaticPrepareAndFinalize", "ReferenceExperts"), ("AllToAllPrepareAndFinalize", "GroupedExperts"),
                  ("AllToAllPrepareAndFinalize", "ReferenceExperts"),
                  ("BatchedAllToAllPrepareAndFinalize", "BatchedExperts")]
GRAPH_CASES = [Case(f"graph-{name}-full{int(full)}-{str(dtype)[6:]}", mode, disp, tokens_full=full, dtype=dtype, tokens=tokens,
                   routing=dict(renormalize=True))
               for name, (mode, disp) in MODES.items() if disp != "dynamic"
               for full in (True, False) for dtype, tokens in ((torch.float32, 8), (torch.bfloat16, 64))]
GRAPH_CASES.append(Case("graph-ep-auto-sigmoid-grouped", "ep", None, correction_bias=True, routing=SIGMOID_GROUPED))
CUDA_REGISTRY_CASES = [("StaticPrepareAndFinalize", "TritonExperts"), ("AllToAllPrepareAndFinalize", "TritonExperts"),
                       ("BatchedAllToAllPrepareAndFinalize", "TritonBatchedExperts")]


SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "bincount")


def host_syncs(case: Case) -> list[str]:
    """The host-syncing calls one EP call of ``case`` makes after routing (agreement check off):
    data-dependent aten ops seen by a dispatch mode, and ``Tensor.tolist`` (which bypasses it).
    The staged lowering (the CUDA one on GPUs) runs directly so the mode sees inside the op."""
    import os

    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_compile.kernels import grouped_mm
    from moe_compile.lowering.base import MoEInputs, StagedLowering
    from moe_compile.lowering.cuda import CudaLowering
    from moe_compile.modular import ExpertWeights
    from moe_compile.ops.config import DispatcherType, MoEConfig, ParallelConfig, RoutingConfig
    from moe_compile.ops.routing import select_experts

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in SYNC_OPS or (name == "repeat_interleave" and "output_size" not in (kwargs or {})):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    def tolist(t, _orig=torch.Tensor.tolist):
        seen.append("tolist")
        return _orig(t)

    p = make_problem(case)
    rank, world = dist.get_rank(), dist.get_world_size()
    w = shard_experts_for_ep(p.w13, p.w2, rank=rank, world_size=world)
    x, logits = (p.x, p.logits) if case.tokens_full else (shard_tokens(t, rank=rank, world_size=world)
                                                          for t in (p.x, p.logits))
    cfg = MoEConfig(routing=RoutingConfig(num_experts=case.experts, top_k=case.top_k),
                    parallel=ParallelConfig(ep_group_name=dist.group.WORLD.group_name, tokens_full=case.tokens_full,
                                            dispatcher_type=DispatcherType(case.dispatcher)))
    weights, ids = select_experts(logits, cfg.routing, None)
    inputs = MoEInputs(x, None, ExpertWeights(w.w13, w.w2), topk_weights=weights, topk_ids=ids)
    os.environ["MOE_COMPILE_DIST_CHECKS"] = "0"
    torch.Tensor.tolist = tolist
    free = grouped_mm.host_reads_are_free
    grouped_mm.host_reads_are_free = lambda device: False  # audit the path a GPU takes
    try:
        with Watch():
            (CudaLowering() if p.x.is_cuda else StagedLowering()).run(inputs, cfg)
    finally:
        torch.Tensor.tolist = tolist.__defaults__[0]
        grouped_mm.host_reads_are_free = free
        os.environ.pop("MOE_COMPILE_DIST_CHECKS")
    return seen
