"""When the op lowers to CUDA the router GEMM becomes ``moe_compile::router_logits``: an fp32
router over an upcast bf16 input (DeepSeek-V3's ``F.linear(x.float(), w.float())``) on the bf16
input, the experts then taking the bf16 input itself instead of a round trip through fp32; a bf16
router (Mixtral, Qwen3) with bf16 logits (the GEMV kernel at decode sizes).

Without a GPU the rewrite is forced on (the pass's CUDA check patched) while the op runs its CPU
lowering, so the rewritten graph's numbers are checked against eager here; the CUDA kernels behind
the router op are checked in ``tests/kernels/test_triton_router.py``.
"""
from __future__ import annotations

import pytest
import torch

from moe_compile.passes.moe_pass import MoEFusionPass
from moe_compile.testing import zoo

from .helpers import TOL, explain_and_compare

ROUTER_OP = "moe_compile.router_logits"


def _deepseek(fp32_router: bool):
    model, kwargs = zoo.build_model("deepseek_v3", num_layers=2, dtype=torch.bfloat16)
    if fp32_router:  # as the benchmark keeps it (HF computes the router in fp32 either way)
        for module in model.modules():
            if type(module).__name__.endswith("TopkRouter"):
                module.float()
    return model, kwargs


@pytest.mark.parametrize("fp32_router", [False, True], ids=["bf16-weight-upcast", "fp32-weight"])
def test_fp32_router_becomes_the_router_op_when_lowering_to_cuda(fp32_router, monkeypatch):
    monkeypatch.setattr(MoEFusionPass, "_lowers_to_cuda", lambda self, ctx, anchor: True)
    model, kwargs = _deepseek(fp32_router)
    report, diff = explain_and_compare(model, kwargs)
    moe = [b for b in report.blocks if b.rewritten]
    assert moe and all("router_logits" in b.router for b in moe), str(report)
    after = "\n".join(report.graphs_after)
    assert after.count(ROUTER_OP + ".default(") == len(moe), after
    # the fp32 copy of the block input is gone: nothing converts a [T, H] activation to fp32
    # any more (the router op reads bf16, the experts take the input itself)
    assert "moe_compile.fused_moe.default(convert_element_type" not in after.replace(" ", "")
    assert diff <= TOL[torch.bfloat16], (diff, str(report))


def test_router_stays_a_plain_gemm_on_other_lowerings():
    model, kwargs = _deepseek(fp32_router=True)
    report, diff = explain_and_compare(model, kwargs)
    assert report.rewritten and ROUTER_OP not in "\n".join(report.graphs_after)
    assert diff <= TOL[torch.bfloat16]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_bf16_routers_become_the_router_op_with_bf16_logits(family, monkeypatch):
    """Qwen3-MoE's and Mixtral's routers run in the model's dtype: the GEMM becomes the router op
    asking for bf16 logits, on the block input and the stored weight."""
    monkeypatch.setattr(MoEFusionPass, "_lowers_to_cuda", lambda self, ctx, anchor: True)
    model, kwargs = zoo.build_model(family, num_layers=1, dtype=torch.bfloat16)
    report, diff = explain_and_compare(model, kwargs)
    moe = [b for b in report.blocks if b.rewritten]
    assert moe and all("bf16 router GEMM" in b.router for b in moe), str(report)
    after = "\n".join(report.graphs_after)
    calls = [line for line in after.splitlines() if ROUTER_OP + ".default(" in line]
    assert len(calls) == len(moe) and all(", None, torch.bfloat16)" in line for line in calls), after
    assert diff <= TOL[torch.bfloat16], (diff, str(report))


def test_fp16_routers_are_left_alone(monkeypatch):
    """The kernels take bf16 activations only; an fp16 model keeps its own GEMM (the op would run
    the fp32 reference there)."""
    monkeypatch.setattr(MoEFusionPass, "_lowers_to_cuda", lambda self, ctx, anchor: True)
    model, kwargs = zoo.build_model("qwen3_moe", num_layers=1, dtype=torch.float16)
    report, diff = explain_and_compare(model, kwargs)
    assert report.rewritten and ROUTER_OP not in "\n".join(report.graphs_after)
    assert diff <= TOL[torch.float16]


@pytest.mark.parametrize("router_bias", [False, True], ids=["mm", "addmm-bias"])
def test_hand_written_fp32_router_with_and_without_bias(router_bias, monkeypatch):
    """A hand-written DeepSeek-like block (fp32 router ``F.linear(x.float(), w.float(), b)``,
    ModuleList experts, shared expert) in bf16: the router GEMM, an ``addmm`` with the bias,
    becomes the router op with the bias, and the block still matches eager."""
    from moe_compile.testing.blocks import MoEBlockConfig, V4GroupedSigmoidMoE
    from moe_compile.testing.zoo import redraw_parameters

    class OneBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = V4GroupedSigmoidMoE(MoEBlockConfig(router_bias=router_bias))

        def forward(self, hidden_states):
            return self.mlp(hidden_states)

    monkeypatch.setattr(MoEFusionPass, "_lowers_to_cuda", lambda self, ctx, anchor: True)
    torch.manual_seed(0)
    model = OneBlock()
    redraw_parameters(model, seed=0)
    model = model.to(torch.bfloat16).eval()
    kwargs = {"hidden_states": torch.randn(1, 5, 64).bfloat16()}
    report, diff = explain_and_compare(model, kwargs)
    assert report.rewritten == ["mlp"], str(report)
    after = "\n".join(report.graphs_after)
    assert after.count(ROUTER_OP + ".default(") == 1 and "addmm" not in after, after
    call = next(line for line in after.splitlines() if ROUTER_OP + ".default(" in line)
    assert ("addmm" in "\n".join(report.graphs_before)) == router_bias
    assert (", None)" not in call) == router_bias, call  # the bias reaches the op
    assert diff <= TOL[torch.bfloat16], (diff, str(report))
