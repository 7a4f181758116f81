"""Every registered PrepareAndFinalize x experts pair (seed 000's combination test).

Compatible pairs run against the per-token float64 reference (``moe_compile.testing.moe_reference``)
on a single device: M in {1, 7, 40} (40 with chunk_size=16: three chunks for chunking experts),
topk 1 and 4, E=8, fp32 and bf16, with and without an expert_map, and
apply_router_weight_on_input for topk=1. Tolerances: fp32 1e-4, bf16 2e-2 (times max(1, max|ref|)).
Incompatible pairs must say why, and composing them must raise ValueError with that reason.
"""
from __future__ import annotations

import math

import pytest
import torch

from moe_compile.modular import ActivationFormat, ModularKernel, registry
from moe_compile.modular.experts import GroupedExperts
from moe_compile.modular.registry import BuildContext, compatibility, compose
from moe_compile.tools.harness import Case, run_case

PAIRS = [(pf, ex) for pf in registry.prepare_finalize_names() for ex in registry.experts_names()]
COMPATIBLE = [pair for pair in PAIRS if compatibility(*pair)[0]]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CHUNK = 16
# (M, topk, apply_router_weight_on_input)
SHAPES = [(m, k, arwoi) for m in (1, 7, 40) for k in (1, 4) for arwoi in ((False, True) if k == 1 else (False,))]


def _pair_id(pair):
    return f"{pair[0]}-{pair[1]}"


def _runnable_device(info) -> str | None:
    """A device of this machine the type can be built on in one process, or None."""
    if info.requires()[0] and getattr(info, "min_world_size", 1) == 1:
        for device in DEVICES:
            if device in info.device_types:
                return device
    return None


def test_builtin_types_are_registered():
    assert {"StandardPrepareAndFinalize", "BatchedPrepareAndFinalize"} <= set(registry.prepare_finalize_names())
    assert {"ReferenceExperts", "GroupedExperts", "BatchedExperts"} <= set(registry.experts_names())


@pytest.mark.parametrize("name", registry.experts_names())
def test_declared_experts_capabilities_match_the_object(name):
    """The registry's declared capabilities must agree with what the built object says."""
    info = registry.get_experts(name)
    device = _runnable_device(info)
    if device is None:
        pytest.skip(f"{name} cannot be built on this machine ({info.requires()[1] or info.device_types})")
    experts = info.factory(BuildContext(num_experts=8, num_local_experts=8, device=torch.device(device)))
    assert experts.activation_formats()[0] is info.activation_format
    assert experts.supports_chunking() == info.supports_chunking
    assert experts.supports_expert_map() == info.supports_expert_map


@pytest.mark.parametrize("name", registry.prepare_finalize_names())
def test_declared_prepare_finalize_capabilities_match_the_object(name):
    info = registry.get_prepare_finalize(name)
    device = _runnable_device(info)
    if device is None:
        pytest.skip(f"{name} cannot be built in one process on this machine (needs {info.min_world_size} ranks "
                    f"or {info.device_types}); tests/distributed covers it")
    pf = info.factory(BuildContext(num_experts=8, num_local_experts=8, device=torch.device(device)))
    assert pf.activation_format is info.activation_format


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_incompatible_pairs_say_why(pair):
    pf_name, ex_name = pair
    ok, reason = compatibility(pf_name, ex_name)
    if ok:
        assert reason == ""
        return
    assert reason and isinstance(reason, str)
    ctx = BuildContext(num_experts=8, num_local_experts=8)
    with pytest.raises(ValueError) as err:
        compose(pf_name, ex_name, ctx)
    assert reason in str(err.value)
    pf_info, ex_info = registry.get_prepare_finalize(pf_name), registry.get_experts(ex_name)
    if pf_info.activation_format is not ex_info.activation_format and _runnable_device(pf_info) == "cpu" \
            and _runnable_device(ex_info) == "cpu":
        # the sealed composer refuses the pair on its own too
        with pytest.raises(ValueError, match="format"):
            ModularKernel(pf_info.factory(ctx), ex_info.factory(ctx))


def test_the_builtin_incompatible_pairs_are_reported():
    for pf, ex in [("StandardPrepareAndFinalize", "BatchedExperts"),
                   ("BatchedPrepareAndFinalize", "GroupedExperts"),
                   ("BatchedPrepareAndFinalize", "ReferenceExperts")]:
        ok, reason = compatibility(pf, ex)
        assert not ok and pf in reason and ex in reason and "format" in reason


@pytest.mark.parametrize("expert_map", [False, True], ids=["all_local", "expert_map"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", COMPATIBLE, ids=_pair_id)
def test_compatible_pair_matches_reference(pair, device, dtype, expert_map):
    pf_name, ex_name = pair
    ok, reason = compatibility(pf_name, ex_name, dtype=dtype, expert_map=expert_map)
    if not ok:
        pytest.skip(f"not a compatible combination: {reason}")  # e.g. a dtype the pair lacks
    ok, reason = registry.runnable(pf_name, ex_name, device=torch.device(device))
    if not ok:
        pytest.skip(reason)
    ex_info = registry.get_experts(ex_name)
    chunked = ex_info.supports_chunking and ex_info.activation_format is ActivationFormat.STANDARD
    for m, topk, arwoi in SHAPES:
        if arwoi and not compatibility(pf_name, ex_name, apply_router_weight_on_input=True)[0]:
            continue
        case = Case(pf_name, ex_name, m=m, topk=topk, dtype=dtype, device=device, expert_map=expert_map,
                    apply_router_weight_on_input=arwoi, chunk_size=CHUNK, seed=m * 10 + topk)
        result = run_case(case)
        assert result.ok, f"{case}: max error {result.max_error:.3g} > tolerance {result.tolerance:.3g}"
        # 40 tokens in chunks of 16 -> 3 apply calls for chunking experts, one call otherwise
        assert result.apply_calls == (math.ceil(m / CHUNK) if chunked else 1), case


def test_every_builtin_pair_runs_here():
    """The single-device built-ins must not be skipped by the loop above."""
    for pf, ex in [("StandardPrepareAndFinalize", "ReferenceExperts"),
                   ("StandardPrepareAndFinalize", "GroupedExperts"),
                   ("BatchedPrepareAndFinalize", "BatchedExperts")]:
        assert registry.runnable(pf, ex, device=torch.device("cpu")) == (True, "")


def test_zero_tokens_skip_the_experts_but_finalize():
    for pf, ex in [("StandardPrepareAndFinalize", "GroupedExperts"),
                   ("StandardPrepareAndFinalize", "ReferenceExperts"),
                   ("BatchedPrepareAndFinalize", "BatchedExperts")]:
        result = run_case(Case(pf, ex, m=0, topk=2))
        assert result.ok and result.output.shape == (0, 64) and result.apply_calls == 0


def test_a_wrong_experts_type_is_caught():
    """The harness must fail a kernel that is wrong (here: the output weighted twice)."""

    class TwiceWeighted(GroupedExperts):
        def apply(self, *, topk_weights, **kwargs):
            return super().apply(topk_weights=topk_weights * topk_weights, **kwargs)

    registry.register_experts("TwiceWeightedExperts", factory=lambda ctx: TwiceWeighted(ctx.experts_config),
                              activation_format=ActivationFormat.STANDARD, replace=True)
    try:
        result = run_case(Case("StandardPrepareAndFinalize", "TwiceWeightedExperts", m=7, topk=4))
        assert not result.ok and result.max_error > 10 * result.tolerance
    finally:
        registry.unregister_experts("TwiceWeightedExperts")
