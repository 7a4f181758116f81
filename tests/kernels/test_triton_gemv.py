"""The decode GEMV experts (``kernels/triton/gemv.py``) against plain torch.

CPU: fp32 under Triton's interpreter, tiny shapes. CUDA: bf16 at decode sizes of the issue's
shapes. Tolerances as ``test_triton_experts.py``: fp32 1e-4, bf16 2e-2 relative Frobenius error
(and against the tuned GEMM plan on CUDA, 1e-2: both accumulate in fp32 in different orders).
"""
import pytest
import torch

pytest.importorskip("triton")

from moe_compile.kernels.triton.configs import ExpertsPath, Plan  # noqa: E402
from moe_compile.kernels.triton.experts import fused_experts, plan_for  # noqa: E402
from moe_compile.kernels.triton.gemm import GemmConfig  # noqa: E402
from moe_compile.kernels.triton.gemv import gemv_down, gemv_experts, gemv_supported, gemv_up  # noqa: E402
from moe_compile.ops.config import Activation, ExpertsConfig  # noqa: E402

from test_triton_experts import CUDA, DEV, DTYPE, _assert_close, _problem, _reference, _routing, _weights  # noqa: E402

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
SMALL = GemmConfig(block_m=1, block_n=8, block_k=16, group_m=1, num_warps=4, num_stages=1)
GEMV = Plan(ExpertsPath.GEMV, SMALL, SMALL)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["concat", "interleaved"])
def test_gemv_with_expert_map_bias_and_ragged_blocks(bias, interleaved):
    """Experts not on this rank contribute nothing (their pairs are skipped); I and H are not
    multiples of the blocks, so the last column and K blocks are partial."""
    gen = torch.Generator().manual_seed(3)
    tokens, hidden, inter = 3, 40, 20
    act = Activation.SWIGLU_OAI if interleaved else Activation.SILU
    cfg = ExpertsConfig(activation=act, gate_up_interleaved=interleaved, swiglu_limit=1.0)
    weights = _weights(4, hidden, inter, act, hf_layout=True, bias=bias, gen=gen)
    expert_map = torch.tensor([-1, 0, 1, -1, 2, -1, 3, -1], dtype=torch.int32, device=DEV)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    topk_w, topk_ids = _routing(tokens, 8, 3, gen)
    out = fused_experts(x, topk_w, topk_ids, weights, cfg, expert_map=expert_map, plan=GEMV)
    _assert_close(out, _reference(x, topk_w, topk_ids, weights, cfg, expert_map, 8))


def test_gemv_unweighted_sum():
    """``weighted=False`` (the weight was applied to the input): the k rows are summed as they are."""
    weights, x, topk_w, topk_ids = _problem(6, 32, 16, 2, 2, seed=4)
    out = fused_experts(x, topk_w, topk_ids, weights, plan=GEMV, weighted=False)
    ref = _reference(x, torch.ones_like(topk_w), topk_ids, weights, ExpertsConfig())
    _assert_close(out, ref)


def test_weights_with_a_strided_reduction_axis_take_the_gemm_paths():
    """``[E, H, N]`` storage (not HF's transposed view) has a strided reduction axis: the GEMV
    kernels decline it, and a GEMV plan runs the default GEMM plan instead, with the same result."""
    gen = torch.Generator().manual_seed(5)
    weights = _weights(4, 32, 16, Activation.SILU, hf_layout=False, bias=False, gen=gen)
    ok, reason = gemv_supported(weights.w13, weights.w2)
    assert not ok and "w13" in reason and "stride" in reason
    x = torch.randn(2, 32, generator=gen).to(DEV, DTYPE)
    topk_w, topk_ids = _routing(2, 4, 2, gen)
    with pytest.raises(ValueError, match="gemv_experts: w13"):
        gemv_experts(x, topk_w, topk_ids, weights.w13, weights.w2, ExpertsConfig(), torch.empty_like(x))
    out = fused_experts(x, topk_w, topk_ids, weights, plan=GEMV)
    _assert_close(out, _reference(x, topk_w, topk_ids, weights, ExpertsConfig()))


def test_bad_inputs_raise_naming_them():
    weights, x, topk_w, topk_ids = _problem(4, 32, 16, 2, 2, seed=6)
    args = (weights.w13, weights.w2, ExpertsConfig())
    with pytest.raises(TypeError, match="topk_weights must be contiguous fp32"):
        gemv_experts(x, topk_w.double(), topk_ids, *args, torch.empty_like(x))
    with pytest.raises(ValueError, match="out must be"):
        gemv_experts(x, topk_w, topk_ids, *args, torch.empty(2, 33, device=DEV, dtype=DTYPE))



def test_up_and_down_kernels_alone():
    """``gemv_down`` after another kernel's activations (here ``gemv_up``'s, written with a row stride
    wider than I) gives the whole path's result; a wrong ``act`` shape or a strided row is refused."""
    weights, x, topk_w, topk_ids = _problem(4, 32, 16, 2, 2, seed=7)
    act = gemv_up(x, topk_ids, weights.w13, ExpertsConfig(), 16, up=(8, 16, 4))
    wide = torch.zeros(act.shape[0], 24, device=DEV, dtype=DTYPE)
    wide[:, :16] = act
    out = gemv_down(wide[:, :16], topk_w, topk_ids, weights.w2, torch.empty_like(x), down=(8, 16, 4))
    _assert_close(out, _reference(x, topk_w, topk_ids, weights, ExpertsConfig()))
    with pytest.raises(ValueError, match=r"act must be \[4, 16\]"):
        gemv_down(act[:3], topk_w, topk_ids, weights.w2, torch.empty_like(x))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        gemv_down(act.t().contiguous().t(), topk_w, topk_ids, weights.w2, torch.empty_like(x))


@gpu
@pytest.mark.parametrize("experts,top_k,hidden,inter,tokens", [(128, 8, 2048, 768, 1), (128, 8, 2048, 768, 4),
                                                                (8, 2, 4096, 14336, 1)], ids=["qwen3-1", "qwen3-4",
                                                                                              "mixtral-1"])
def test_cuda_gemv_at_decode_shapes(experts, top_k, hidden, inter, tokens):
    weights, x, topk_w, topk_ids = _problem(experts, hidden, inter, tokens, top_k, seed=tokens)
    plan = Plan(ExpertsPath.GEMV, GemmConfig(block_n=16, block_k=256), GemmConfig(block_n=16, block_k=256))
    out = fused_experts(x, topk_w, topk_ids, weights, plan=plan)
    _assert_close(out, _reference(x, topk_w, topk_ids, weights, ExpertsConfig()))
    tuned = fused_experts(x, topk_w, topk_ids, weights, plan=plan_for(x, top_k, weights)).float()
    assert ((out.float() - tuned).norm() / tuned.norm()).item() < 1e-2
