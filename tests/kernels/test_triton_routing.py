"""The fused Triton routing kernel against ``select_experts`` (the plain-torch reference).

On CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``); on CUDA it is compiled.
"""

import pytest
import torch

CUDA = torch.cuda.is_available()
# Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET, set for the whole
# session by tests/conftest.py before triton is first imported).
pytest.importorskip("triton")

from moe_compile.kernels.triton.routing import route, route_launch, route_reference  # noqa: E402
from moe_compile.ops.config import RoutingConfig, RoutingMethod  # noqa: E402


DEV = "cuda" if CUDA else "cpu"

CASES = {
    "mixtral": RoutingConfig(num_experts=8, top_k=2, renormalize=True),
    "qwen2_60": RoutingConfig(num_experts=60, top_k=4),
    "deepseek_v3": RoutingConfig(num_experts=256, top_k=8, method=RoutingMethod.SIGMOID, renormalize=True,
                                 routed_scaling_factor=2.5, k_group=4, group_count=8, group_select_mode=1,
                                 has_correction_bias=True),
    "deepseek_v2_max": RoutingConfig(num_experts=64, top_k=6, k_group=3, group_count=8, group_select_mode=0,
                                     routed_scaling_factor=16.0),
    "sigmoid_no_norm": RoutingConfig(num_experts=32, top_k=4, method=RoutingMethod.SIGMOID,
                                     normalize_sigmoid=False, has_correction_bias=True),
    "llama4_sigmoid": RoutingConfig(num_experts=16, top_k=1, method=RoutingMethod.SIGMOID,
                                    scoring_after_topk=True, normalize_sigmoid=False),
    "after_topk_softmax": RoutingConfig(num_experts=16, top_k=3, scoring_after_topk=True),
    "deepseek_v4": RoutingConfig(num_experts=64, top_k=6, method=RoutingMethod.SQRTSOFTPLUS,
                                 routed_scaling_factor=1.5, has_correction_bias=True),
    "sqrtsoftplus_groups": RoutingConfig(num_experts=32, top_k=4, method=RoutingMethod.SQRTSOFTPLUS,
                                         k_group=2, group_count=4, group_select_mode=1, normalize_sigmoid=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_route_matches_reference(name):
    cfg = CASES[name]
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    tokens = 300 if CUDA else 19
    logits = torch.randn(tokens, cfg.num_experts, generator=gen).to(DEV)
    bias = (torch.randn(cfg.num_experts, generator=gen) * 0.1).to(DEV) if cfg.has_correction_bias else None
    weights, ids = route(logits, cfg, bias)
    ref_w, ref_ids = route_reference(logits, cfg, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_w.cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("launch", [(1, 1), (2, 2), (4, 1), (8, 4)])
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2_60", "mixtral"])
def test_route_any_launch_matches_reference(name, launch):
    """Tokens per program (and warps, on CUDA) change the layout only: a partial last program too."""
    cfg = CASES[name]
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(13, cfg.num_experts, generator=gen).to(DEV)
    bias = (torch.randn(cfg.num_experts, generator=gen) * 0.1).to(DEV) if cfg.has_correction_bias else None
    weights, ids = route(logits, cfg, bias, launch=launch)
    ref_w, ref_ids = route_reference(logits, cfg, bias)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_w.cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [30.0, 60.0])
def test_sqrtsoftplus_far_from_zero(scale):
    """Logits of +-100: above torch's softplus threshold (20) the score is sqrt(x); far below it
    softplus is exp(x), below fp32's 1 + u rounding, and the picks must still follow its order."""
    cfg = CASES["deepseek_v4"]
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, cfg.num_experts, generator=gen) * scale).to(DEV)
    logits[0] = -torch.arange(cfg.num_experts, dtype=torch.float32, device=DEV) - 30.0  # all scores < 1e-6
    weights, ids = route(logits, cfg)
    ref_w, ref_ids = route_reference(logits, cfg)
    assert ids[0].cpu().tolist() == list(range(cfg.top_k))
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_w.cpu(), rtol=1e-5, atol=1e-6)


def test_route_rejects_a_bad_launch():
    logits = torch.randn(4, 8).to(DEV)
    for bad in [(3, 1), (1, 0), (2,), (1, 32)]:
        with pytest.raises(ValueError, match="launch must be"):
            route(logits, CASES["mixtral"], launch=bad)


def test_route_launch_choice():
    # the measured choices (sweep_route.py): one warp per token from 256 scores, 2 x 128 on 2 warps,
    # small rows packed ~128 scores per warp; never more tokens per program than the batch rounds to
    assert route_launch(2048, 256) == (1, 1)
    assert route_launch(256, 128) == (2, 2) and route_launch(1, 128) == (1, 1)
    assert route_launch(8192, 8) == (64, 4) and route_launch(32, 8) == (32, 2)
    for tile in (8, 16, 64, 128, 256, 1024):
        for tokens in (1, 3, 32, 5000):
            block_t, warps = route_launch(tokens, tile)
            assert 1 <= block_t <= max(1, 1 << (tokens - 1).bit_length()) and 1 <= warps <= 8
            assert block_t * tile <= 2048


def test_route_bf16_logits_and_strided_rows():
    cfg = CASES["qwen2_60"]
    base = torch.randn(11, 2 * cfg.num_experts).to(DEV).bfloat16()
    logits = base[:, : cfg.num_experts]  # row stride 120, contiguous experts
    weights, ids = route(logits, cfg)
    ref_w, ref_ids = route_reference(logits, cfg)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_w.cpu(), rtol=1e-5, atol=1e-6)


def test_route_ties_pick_lower_index():
    cfg = RoutingConfig(num_experts=8, top_k=3)
    logits = torch.zeros(2, 8, device=DEV)
    logits[1, 5] = 1.0
    _, ids = route(logits, cfg)
    assert ids.cpu().tolist() == [[0, 1, 2], [5, 0, 1]]


def test_route_empty_batch():
    weights, ids = route(torch.empty(0, 8, device=DEV), CASES["mixtral"])
    assert weights.shape == (0, 2) and ids.shape == (0, 2)


def test_route_rejects_bad_input():
    cfg = CASES["mixtral"]
    with pytest.raises(ValueError, match="num_experts=8"):
        route(torch.randn(4, 6, device=DEV), cfg)
    with pytest.raises(ValueError, match="2-D"):
        route(torch.randn(4, 2, 8, device=DEV), cfg)
    with pytest.raises(TypeError, match="floating"):
        route(torch.ones(4, 8, dtype=torch.int32, device=DEV), cfg)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        route(torch.randn(4, 8, device=DEV), cfg, torch.zeros(7, device=DEV))
