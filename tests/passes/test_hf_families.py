"""The pass on real transformers MoE families (tiny configs, random weights, nothing downloaded).

For each family x experts implementation: compiled output equals eager (fp32 1e-4, bf16 2e-2
relative to the output's magnitude), rewritten blocks == MoE layers where Dynamo captures the
experts, and otherwise every block is left as it was and reported with a reason.
"""
from __future__ import annotations

import pytest
import torch

from moe_compile.testing import zoo
from moe_compile.testing.zoo_spec import Capture

from .helpers import TOL, explain_and_compare

def _pairs() -> list[tuple[str, str]]:
    """Every implementation of the families issue 3 names; the default one of every other family
    (and grouped_mm where transformers defaults to eager); the eager experts loop (which behaves alike
    in every family) for two families."""
    core = set(zoo.CORE_FAMILY_NAMES)
    out = []
    for name, impl in zoo.family_impl_pairs():
        if impl == "eager":
            if name in ("mixtral", "deepseek_v3"):
                out.append((name, impl))
        elif name in core or impl == zoo.get_family(name).default_impl.value:
            out.append((name, impl))
        elif impl == "grouped_mm" and zoo.get_family(name).default_impl.value == "eager":
            out.append((name, impl))
    return out


PAIRS = _pairs()


def _require(name: str, impl: str) -> None:
    available, why = zoo.is_available(name, impl)
    if not available:
        pytest.skip(why)


def _expect_rewrite(name: str, impl: str) -> bool:
    spec = zoo.get_family(name)
    capture = spec.capture_of(zoo.ExpertsImpl(impl))
    return spec.rewritten and capture in (Capture.ONE_GRAPH, Capture.NEEDS_FLAGS)


def _check_routers(name: str, report) -> None:
    """A family the op routes for itself names its routing; one whose router it cannot express keeps it."""
    kept = [b.router.startswith("kept as written") for b in report.blocks if b.rewritten]
    assert all(kept) if zoo.get_family(name).experts_only else not any(kept), str(report)


@pytest.mark.parametrize("name,impl", PAIRS, ids=["%s-%s" % p for p in PAIRS])
def test_family_fp32(name, impl):
    _require(name, impl)
    torch._dynamo.utils.counters.clear()
    model, kwargs = zoo.build_model(name, experts_implementation=impl)
    report, diff = explain_and_compare(model, kwargs)
    assert diff <= TOL[torch.float32], (diff, str(report))
    expected = zoo.expected_moe_layers(name)
    if _expect_rewrite(name, impl):
        assert len(report.rewritten) == expected, str(report)
        assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == expected
        # no other top-k is logged as a block left alone: the counter counts only the report's skips
        # (a grouped router's group choice was counted, until the eighteenth session, and logged as
        # "left model.layers.0.mlp as it was" for a block that was rewritten)
        assert torch._dynamo.utils.counters["moe_compile"]["skipped"] == len(report.skipped), str(report)
        assert all(b.router != "-" and b.activation != "-" for b in report.blocks if b.rewritten)
        _check_routers(name, report)
    else:
        assert not report.rewritten, str(report)
        assert report.skipped and all(reason for _, reason in report.skipped), str(report)


CORE_BF16 = [(n, i) for n, i in zoo.family_impl_pairs(core_only=True) if i in ("grouped_mm", "native")]


@pytest.mark.parametrize("name,impl", CORE_BF16, ids=["%s-%s" % p for p in CORE_BF16])
def test_family_bf16(name, impl):
    _require(name, impl)
    torch._dynamo.utils.counters.clear()
    model, kwargs = zoo.build_model(name, experts_implementation=impl, dtype=torch.bfloat16)
    report, diff = explain_and_compare(model, kwargs)
    assert diff <= TOL[torch.bfloat16], (diff, str(report))
    if _expect_rewrite(name, impl):
        assert len(report.rewritten) == zoo.expected_moe_layers(name), str(report)
        # bf16 graphs put prims casts in a grouped router's group mask: still no skip counted
        assert torch._dynamo.utils.counters["moe_compile"]["skipped"] == len(report.skipped), str(report)
        _check_routers(name, report)


def test_reason_names_the_activations_after_transformers_grouped_mm():
    """fp32 ``grouped_mm`` experts become ``transformers.grouped_mm_fallback`` under Dynamo: the skip
    reason lists the activations after it (it said "none" for inkling2's softcapped SwiGLU)."""
    _require("inkling2", "grouped_mm")
    model, kwargs = zoo.build_model("inkling2")
    report, diff = explain_and_compare(model, kwargs)
    assert diff <= TOL[torch.float32]
    assert not report.rewritten and report.skipped, str(report)
    assert all("activations tanh, sigmoid" in reason for _, reason in report.skipped), str(report)


@pytest.mark.parametrize("name,block", [("dbrx", "transformer.blocks.0.ffn"), ("step3p7", "layers.0.mlp")])
def test_a_block_compiled_in_its_own_frame_is_named_by_its_path(name, block):
    """After a graph break Dynamo compiles the block's own frame, where the only module on the top-k's
    stack is the router: the row was named after the router (``...ffn.router``, ``...mlp.gate``)."""
    if zoo.get_family(name).decorated:  # step3p7 from transformers 5.25: one graph, no frame of its own
        pytest.skip("the installed transformers decorates %s's experts with @use_experts_implementation" % name)
    _require(name, "native")
    model, kwargs = zoo.build_model(name)
    report, _ = explain_and_compare(model, kwargs)
    paths = [path for path, _ in report.skipped]
    assert block in paths and not any(p.endswith((".gate", ".router")) for p in paths), str(report)
