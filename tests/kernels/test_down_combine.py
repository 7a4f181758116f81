"""The fused second GEMM + weighted combine (decode, pair-ordered rows) against plain torch.

CPU: fp32 under Triton's interpreter, tiny shapes (K and H not multiples of the blocks, so the
masks run). CUDA: bf16 at Qwen3-like decode sizes. Tolerances: fp32 1e-4; bf16 2e-2 relative
Frobenius error (one bf16 rounding of the output, fp32 accumulation in another order).
"""
import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from moe_compile.kernels.triton.configs import ExpertsPath, Plan  # noqa: E402
from moe_compile.kernels.triton.down_combine import down_combine  # noqa: E402
from moe_compile.kernels.triton.experts import fused_experts  # noqa: E402
from moe_compile.kernels.triton.gemm import GemmConfig  # noqa: E402
from moe_compile.modular import ExpertWeights  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


def reference(act, w2, topk_w, topk_ids, expert_map=None, bias=None, weighted=True):
    """fp32 ``sum_j w[t, j] * (act[t*k + j] @ w2[e] + b[e])`` over slots whose expert is local."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, w2.shape[2])
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(topk_ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
            if e < 0:
                continue
            row = act[t * top_k + j].float().cpu() @ w2[e].float().cpu()
            if bias is not None:
                row = row + bias[e].float().cpu()
            out[t] += (float(topk_w[t, j]) if weighted else 1.0) * row
    return out


def _close(out, ref):
    assert out.dtype == DTYPE and torch.isfinite(out).all()
    if DTYPE == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    else:
        assert ((out.float().cpu() - ref).norm() / ref.norm()).item() < 2e-2


def _problem(tokens, top_k, num_experts, inter, hidden, gen, hf_layout=True):
    act = torch.randn(tokens * top_k, inter, generator=gen).to(DEV, DTYPE)
    if hf_layout:  # HF keeps [E, H, I]; the op gets the transposed [E, I, H] view
        w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEV, DTYPE).transpose(1, 2)
    else:
        w2 = (torch.randn(num_experts, inter, hidden, generator=gen) * inter ** -0.5).to(DEV, DTYPE)
    topk_w = torch.rand(tokens, top_k, generator=gen).to(DEV)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]).int().to(DEV)
    return act, w2, topk_w, ids


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("hf_layout", [True, False], ids=["hf-layout", "ikh"])
def test_down_combine_matches_reference(top_k, hf_layout):
    gen = torch.Generator().manual_seed(top_k)
    tokens, experts, inter, hidden = (3, 10, 40, 36) if not CUDA else (4, 128, 768, 2048)
    act, w2, topk_w, ids = _problem(tokens, top_k, experts, inter, hidden, gen, hf_layout)
    out = torch.full((tokens, hidden), float("nan"), device=DEV, dtype=DTYPE)
    blocks = dict(block_n=16, block_k=16, num_stages=2) if not CUDA else {}
    down_combine(act, w2, topk_w, ids, out, **blocks)
    _close(out, reference(act, w2, topk_w, ids))


def test_down_combine_expert_map_bias_and_unweighted():
    gen = torch.Generator().manual_seed(3)
    act, w2, topk_w, ids = _problem(4, 3, 8, 24, 20, gen)
    w2 = w2[:4]  # 4 local experts of 8
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32, device=DEV)
    bias = (torch.randn(4, 20, generator=gen) * 0.1).to(DEV, DTYPE)
    for weighted in (True, False):
        out = down_combine(act, w2, topk_w, ids, torch.empty(4, 20, device=DEV, dtype=DTYPE), expert_map=expert_map,
                           bias=bias, weighted=weighted, block_n=16, block_k=16, num_stages=2)
        _close(out, reference(act, w2, topk_w, ids, expert_map, bias, weighted))


def test_fused_experts_pairs_plan_with_fused_combine_matches_unfused():
    gen = torch.Generator().manual_seed(9)
    tokens, hidden, inter, experts, top_k = (2, 32, 24, 16, 4) if not CUDA else (1, 2048, 768, 128, 8)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(DEV, DTYPE).transpose(1, 2)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEV, DTYPE).transpose(1, 2)
    weights = ExpertWeights(w13, w2)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    topk_w, ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k)
    topk_w, ids = topk_w.to(DEV), ids.int().to(DEV)
    tiny = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=2)
    cfg = tiny if not CUDA else GemmConfig(block_m=16, block_n=32, block_k=256, group_m=1)
    fused = fused_experts(x, topk_w, ids, weights, plan=Plan(ExpertsPath.PAIRS, cfg, cfg, fused_combine=True))
    plain = fused_experts(x, topk_w, ids, weights, plan=Plan(ExpertsPath.PAIRS, cfg, cfg))
    tol = 1e-5 if DTYPE == torch.float32 else 1e-2
    torch.testing.assert_close(fused.float(), plain.float(), rtol=tol, atol=tol)


def test_plan_round_trips_the_fused_combine_flag():
    plan = Plan(ExpertsPath.PAIRS, GemmConfig(), GemmConfig(block_n=32, block_k=256), fused_combine=True)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "fused_combine" not in Plan(ExpertsPath.PAIRS, GemmConfig(), GemmConfig()).to_dict()


def test_down_combine_rejects_bad_input():
    gen = torch.Generator().manual_seed(1)
    act, w2, topk_w, ids = _problem(2, 2, 4, 16, 16, gen)
    out = torch.empty(2, 16, device=DEV, dtype=DTYPE)
    with pytest.raises(TypeError, match="topk_ids"):
        down_combine(act, w2, topk_w, ids.long(), out)
    with pytest.raises(TypeError, match="topk_weights"):
        down_combine(act, w2, topk_w.double(), ids, out)
    with pytest.raises(ValueError, match="act must be"):
        down_combine(act[:3], w2, topk_w, ids, out)
    with pytest.raises(ValueError, match="out must be"):
        down_combine(act, w2, topk_w, ids, out[:, :8])
    with pytest.raises(ValueError, match="bias"):
        down_combine(act, w2, topk_w, ids, out, bias=torch.zeros(4, 8, device=DEV, dtype=DTYPE))
