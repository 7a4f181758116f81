"""One modular-kernel combination on one problem, checked against the per-token reference.

Shared by ``tools/check.py``, ``tools/profile.py`` and ``tests/modular/test_combinations.py``.
A problem is random but seeded: distinct expert ids per token, positive weights, inputs scaled so
the output is O(1). With ``expert_map`` the kernel holds half the experts, at least one (a shuffled
subset, in shuffled local order), as one rank does under expert parallelism; the reference then
sums only those experts, from the global weights.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from moe_compile.modular import ExpertWeights, ModularKernel
from moe_compile.modular.base import Capability
from moe_compile.modular.registry import BuildContext, compose, runnable
from moe_compile.ops.config import ExpertsConfig
from moe_compile.testing.moe_reference import reference_experts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@dataclass(frozen=True)
class Case:
    pf_type: str
    experts_type: str
    m: int = 16
    topk: int = 2
    num_experts: int = 8
    hidden: int = 64
    intermediate: int = 32
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    expert_map: bool = False
    apply_router_weight_on_input: bool = False
    bias: bool = True
    chunk_size: int = 32768
    seed: int = 0


@dataclass(frozen=True)
class Problem:
    x: torch.Tensor  # [M, K]
    topk_weights: torch.Tensor  # [M, topk] fp32
    topk_ids: torch.Tensor  # [M, topk] int32, global ids
    global_weights: ExpertWeights
    local_weights: ExpertWeights
    expert_map: torch.Tensor | None  # [E] int32 global -> local, -1 elsewhere
    owned_experts: list[int] | None  # global ids held locally; local row r holds owned_experts[r]


@dataclass(frozen=True)
class Outcome:
    ok: bool
    max_error: float
    tolerance: float
    apply_calls: int  # how often experts.apply ran (chunks)
    output: torch.Tensor
    reference: torch.Tensor


def make_problem(case: Case) -> Problem:
    gen = torch.Generator().manual_seed(case.seed)
    E, K, I, M = case.num_experts, case.hidden, case.intermediate, case.m

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(case.dtype).to(case.device)

    x = rand(M, K)
    w13, w2 = rand(E, K, 2 * I, scale=1 / math.sqrt(K)), rand(E, I, K, scale=1 / math.sqrt(I))
    b13, b2 = (rand(E, 2 * I, scale=0.1), rand(E, K, scale=0.1)) if case.bias else (None, None)
    ids = torch.stack([torch.randperm(E, generator=gen)[: case.topk] for _ in range(M)]) if M else \
        torch.zeros(0, case.topk, dtype=torch.long)
    weights = torch.softmax(torch.randn(M, case.topk, generator=gen), dim=-1)
    glob = ExpertWeights(w13, w2, b13, b2)
    if not case.expert_map:
        return Problem(x, weights.to(case.device), ids.to(torch.int32).to(case.device), glob, glob, None, None)
    owned = torch.randperm(E, generator=gen)[: num_owned_experts(E)].tolist()  # local row r: global owned[r]
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[owned] = torch.arange(len(owned), dtype=torch.int32)
    pick = torch.tensor(owned, dtype=torch.long, device=case.device)  # int64: an index tensor
    local = ExpertWeights(w13[pick], w2[pick], None if b13 is None else b13[pick], None if b2 is None else b2[pick])
    return Problem(x, weights.to(case.device), ids.to(torch.int32).to(case.device), glob, local,
                   expert_map.to(case.device), owned)


def num_owned_experts(num_experts: int) -> int:
    """How many experts the rank of an ``expert_map`` problem holds: half, but at least one.

    Every rank of an expert-parallel run holds at least one expert, so E=1 gives the rank that expert
    (an identity map, still taken through the map) rather than an empty local list, which is no real
    layout and which not every experts type can run with zero local experts.
    """
    return max(1, num_experts // 2)


def build_kernel(case: Case, problem: Problem) -> ModularKernel:
    ctx = BuildContext(
        num_experts=case.num_experts, num_local_experts=problem.local_weights.w13.shape[0],
        device=torch.device(case.device), dtype=case.dtype,
        experts_config=ExpertsConfig(apply_router_weight_on_input=case.apply_router_weight_on_input),
        expert_map=problem.expert_map,
    )
    return compose(case.pf_type, case.experts_type, ctx, chunk_size=case.chunk_size)


def count_apply_calls(kernel: ModularKernel) -> list[int]:
    """Wrap ``kernel.experts.apply`` to count its calls; returns the (mutable) counter."""
    calls = [0]
    inner = kernel.experts.apply

    def counted(**kwargs):
        calls[0] += 1
        return inner(**kwargs)

    kernel.experts.apply = counted
    return calls


def forward(kernel: ModularKernel, case: Case, problem: Problem) -> torch.Tensor:
    return kernel(problem.x, problem.topk_weights, problem.topk_ids, problem.local_weights,
                  global_num_experts=case.num_experts, expert_map=problem.expert_map,
                  apply_router_weight_on_input=case.apply_router_weight_on_input)


def run_case(case: Case) -> Outcome:
    problem = make_problem(case)
    kernel = build_kernel(case, problem)
    calls = count_apply_calls(kernel)
    out = forward(kernel, case, problem)
    g = problem.global_weights
    ref = reference_experts(
        problem.x.cpu(), problem.topk_weights.cpu(), problem.topk_ids.cpu(), g.w13.cpu(), g.w2.cpu(),
        None if g.w13_bias is None else g.w13_bias.cpu(), None if g.w2_bias is None else g.w2_bias.cpu(),
        apply_router_weight_on_input=case.apply_router_weight_on_input, only_experts=problem.owned_experts,
    )
    tol = TOLERANCE[case.dtype]
    shape_ok = tuple(out.shape) == (case.m, case.hidden) and out.dtype == case.dtype
    err = float((out.cpu().double() - ref).abs().max()) if ref.numel() else 0.0
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    ok = shape_ok and bool(torch.isfinite(out).all()) and err <= tol * scale
    return Outcome(ok, err, tol * scale, calls[0], out, ref)


def add_problem_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pf-type", required=True, help="registered PrepareAndFinalize type")
    parser.add_argument("--experts-type", required=True, help="registered experts type")
    parser.add_argument("-m", type=int, nargs="+", default=[1, 33], help="token counts")
    parser.add_argument("--topk", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=32)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="auto", help="cpu, cuda[:N], npu[:N], or auto (cuda when available)")
    parser.add_argument("--expert-map", action="store_true", help="hold half the experts behind an expert_map")
    parser.add_argument("--chunk-size", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=0)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _availability_problem(device: torch.device) -> str | None:
    """Why a parsed device has nothing behind it here, or None: torch builds the device object for any
    known type, and only the first tensor on it fails (e.g. CUDA on a CPU-only build)."""
    module = getattr(torch, device.type, None)  # torch.cuda, torch.npu, torch.mps, ...; cpu/meta always exist
    if module is None or not hasattr(module, "is_available"):
        return None
    if not module.is_available():
        return f"torch.{device.type}.is_available() is False on this machine"
    count = module.device_count() if hasattr(module, "device_count") else None
    if device.index is not None and count is not None and device.index >= count:
        return f"this machine has {count} {device.type} device(s), so index {device.index} does not exist"
    return None


def device_problem(name: str) -> str | None:
    """Why ``--device name`` cannot be used on this machine, or None.

    Checked before any work so that a bad value is a usage error naming the option, not a torch
    traceback from deep inside ``make_problem`` or the registry.
    """
    resolved = resolve_device(name)
    if resolved.split(":")[0] == "npu":
        from moe_compile.testing.emulated_npu import npu_unavailable  # only for --device npu

        problem = npu_unavailable()
        if problem:
            return problem
    try:
        device = torch.device(resolved)
    except RuntimeError:
        return "torch.device() does not accept it"
    return _availability_problem(device)


def runnable_here(pf_type: str, experts_type: str, device_name: str) -> Capability:
    """``registry.runnable`` for a ``--device`` value, also false when that device is absent here.

    The registry judges the device *type* only; a pair that "runs on cuda" cannot run on a machine
    without a GPU, and saying it can would send the caller into a torch traceback.
    """
    problem = device_problem(device_name)
    if problem:
        return False, f"device {device_name!r} is not usable here: {problem}"
    return runnable(pf_type, experts_type, device=torch.device(resolve_device(device_name)))


def check_problem_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Range and device checks argparse cannot express; exits through ``parser.error``."""
    if min(args.m) < 0:
        parser.error(f"-m values must be >= 0, got {args.m}")
    for name in ("num_experts", "hidden", "intermediate", "chunk_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    bad = [k for k in args.topk if not 1 <= k <= args.num_experts]
    if bad:
        parser.error(f"--topk values must lie in [1, num_experts={args.num_experts}], got {bad}")
    problem = device_problem(args.device)
    if problem:
        parser.error(f"--device {args.device!r}: {problem}; expected auto, cpu, or a device type available "
                     f"here (cuda[:N] with a GPU, npu[:N] with torch_npu and an NPU)")


def cases_from_args(args: argparse.Namespace) -> list[Case]:
    device = resolve_device(args.device)
    out = []
    for m in args.m:
        for topk in args.topk:
            for arwoi in ((False, True) if topk == 1 else (False,)):
                out.append(Case(args.pf_type, args.experts_type, m=m, topk=topk, num_experts=args.num_experts,
                                hidden=args.hidden, intermediate=args.intermediate, dtype=DTYPES[args.dtype],
                                device=device, expert_map=args.expert_map, apply_router_weight_on_input=arwoi,
                                chunk_size=args.chunk_size, seed=args.seed))
    return out
