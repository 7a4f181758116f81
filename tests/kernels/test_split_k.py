"""Split-K second GEMM (``GemmConfig.split_k``): K slices whose partial products the combine sums.

CPU: fp32 under Triton's interpreter, tiny shapes (tolerance 1e-4 absolute, outputs of order 1).
CUDA: bf16 at model-like shapes (2e-2 relative Frobenius error; each slice is rounded to bf16
before the fp32 sum, one rounding more than the unsplit GEMM).
"""
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from moe_compile.kernels.triton.align import align  # noqa: E402
from moe_compile.kernels.triton.combine import combine, combine_reference  # noqa: E402
from moe_compile.kernels.triton.configs import ExpertsPath, Plan  # noqa: E402
from moe_compile.kernels.triton.experts import fused_experts  # noqa: E402
from moe_compile.kernels.triton.gemm import GemmConfig, moe_gemm  # noqa: E402
from moe_compile.ops.config import Activation, ExpertsConfig  # noqa: E402
from tests.kernels.test_triton_experts import (  # noqa: E402
    CUDA, DEV, DTYPE, TINY, _assert_close, _reference, _routing, _weights,
)

# CPU: K = 40 is 3 K-steps of 16, so 2 slices are 32 + 8 columns, 3 are 16 + 16 + 8 and the
# fourth of 4 slices is empty (it writes zeros, and the bias is in slice 0 only)
SHAPE = (80, 24, 40, 5, 2) if not CUDA else (1500, 512, 1000, 16, 4)  # tokens, hidden (N), K, experts, top_k
BASE = replace(TINY, block_m=32) if not CUDA else GemmConfig(128, 128, 64, 8, 8, 3, tma=1)

LAYOUTS = {
    "grid": {}, "persistent-flat": dict(persistent=2), "by-expert": dict(expert_order=1, persistent=2),
    "tails": dict(tail_m=BASE.block_m // 2), "merged": dict(merge_m=16 if not CUDA else 64),
    "merged-2nd-launch": dict(merge_m=16 if not CUDA else 64, merge_launch=1),
}


def _problem(seed):
    tokens, n, k_dim, num_experts, top_k = SHAPE
    gen = torch.Generator().manual_seed(seed)
    topk_w, topk_ids = _routing(tokens, num_experts, top_k, gen)
    a = torch.randn(tokens * top_k, k_dim, generator=gen).to(DEV, DTYPE)
    w = (torch.randn(num_experts, n, k_dim, generator=gen) * k_dim ** -0.5).transpose(1, 2).to(DEV, DTYPE)
    bias = (torch.randn(num_experts, n, generator=gen) * 0.1).to(DEV, DTYPE)
    return topk_w, topk_ids, a, w, bias


@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_k_slices_sum_to_the_unsplit_gemm(split, layout):
    """Sorted blocks: the ``split`` slices written by the split-K GEMM add up to the plain-torch
    product plus bias, every row of every slice is written, and the bias is in slice 0 alone."""
    topk_w, topk_ids, a, w, bias = _problem(split)
    num_experts = w.shape[0]
    al = align(topk_ids, num_experts)
    cfg = replace(BASE, split_k=split, **LAYOUTS[layout])
    pairs, n = a.shape[0], w.shape[2]
    out = torch.full((split, pairs, n), float("nan"), device=DEV, dtype=DTYPE)
    moe_gemm(a, w, out, topk_ids=topk_ids, top_k=topk_ids.shape[1], counts=al.counts, sorted_pair=al.sorted_pair,
             bias=bias, gather_a=False, config=cfg)
    assert not torch.isnan(out).any()
    counts = al.counts.long().cpu()
    if cfg.merge_m:  # the routing has a merged last block (one block plus at most merge_m rows)
        assert ((counts > cfg.block_m) & (counts % cfg.block_m > 0) & (counts % cfg.block_m <= cfg.merge_m)).any()
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts), counts)
    ref = torch.einsum("rk,rkn->rn", a.float().cpu(), w.float().cpu()[expert_of_row]) + bias.float().cpu()[expert_of_row]
    _assert_close(out.float().sum(0).to(DTYPE), ref.to(DEV))
    if not CUDA:  # an empty slice (K ran out) holds zeros, not the bias
        k_steps = -(-w.shape[1] // cfg.block_k)
        per = -(-k_steps // split)
        for s in range(split):
            if s * per >= k_steps:
                assert (out[s] == 0).all()


def test_pair_blocks_split_k():
    """Pair blocks (decode: one pair per block, no sorting) split over K too."""
    topk_w, topk_ids, _, w, bias = _problem(5)
    a = torch.randn(6 * topk_ids.shape[1], w.shape[1]).to(DEV, DTYPE)
    ids = topk_ids[:6].contiguous()
    out = torch.full((2, a.shape[0], w.shape[2]), float("nan"), device=DEV, dtype=DTYPE)
    moe_gemm(a, w, out, topk_ids=ids, top_k=ids.shape[1], counts=None, sorted_pair=None, bias=bias,
             gather_a=False, config=replace(BASE, split_k=2))
    e = ids.reshape(-1).long().cpu()
    ref = torch.einsum("rk,rkn->rn", a.float().cpu(), w.float().cpu()[e]) + bias.float().cpu()[e]
    _assert_close(out.float().sum(0).to(DTYPE), ref.to(DEV))


def test_combine_sums_the_k_slices():
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(3, 12, 20, generator=gen).to(DEV, DTYPE)
    topk_w = torch.rand(4, 3, generator=gen).to(DEV)
    pos = torch.tensor([3, -1, 0, 5, 6, 7, 1, 2, -1, 4, 8, 9], dtype=torch.int32, device=DEV)
    out = combine(y, topk_w, torch.empty(4, 20, device=DEV, dtype=DTYPE), pos=pos)
    tol = 1e-5 if DTYPE == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), combine_reference(y.float().sum(0), topk_w, pos), rtol=tol, atol=tol)


@pytest.mark.parametrize("path", [ExpertsPath.PAIRS, ExpertsPath.SORTED], ids=lambda p: p.value)
@pytest.mark.parametrize("split", [2, 3])
def test_fused_experts_with_a_split_k_second_gemm(path, split):
    """A plan whose second GEMM splits K: the whole op against the reference, with bias and an
    expert map (rows of experts not on this rank contribute nothing)."""
    tokens, hidden, inter, num_experts, top_k = (30, 32, 40, 4, 2) if not CUDA else (1024, 512, 1024, 16, 4)
    gen = torch.Generator().manual_seed(split)
    weights = _weights(num_experts, hidden, inter, Activation.SILU, hf_layout=True, bias=True, gen=gen)
    num_global = num_experts + 2
    topk_w, topk_ids = _routing(tokens, num_global, top_k, gen)
    expert_map = torch.tensor(list(range(num_experts)) + [-1, -1], dtype=torch.int32, device=DEV)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    plan = Plan(path, BASE, replace(BASE, split_k=split))
    out = fused_experts(x, topk_w, topk_ids, weights, expert_map=expert_map, plan=plan)
    _assert_close(out, _reference(x, topk_w, topk_ids, weights, ExpertsConfig(), expert_map, num_global))
    assert Plan.from_dict(plan.to_dict()) == plan


def test_bad_split_k_raises():
    a = torch.zeros(4, 32, device=DEV, dtype=DTYPE)
    w = torch.zeros(2, 32, 16, device=DEV, dtype=DTYPE)
    counts = torch.tensor([4, 0], dtype=torch.int32, device=DEV)
    common = dict(topk_ids=counts, top_k=1, counts=counts, sorted_pair=None, gather_a=False)
    with pytest.raises(ValueError, match="split_k=0 "):
        moe_gemm(a, w, torch.zeros(4, 16, device=DEV, dtype=DTYPE), config=replace(TINY, split_k=0), **common)
    with pytest.raises(ValueError, match=r"needs out of shape \[2, P, N\]"):
        moe_gemm(a, w, torch.zeros(4, 16, device=DEV, dtype=DTYPE), config=replace(TINY, split_k=2), **common)
    with pytest.raises(ValueError, match="second GEMM"):
        moe_gemm(a, torch.zeros(2, 32, 32, device=DEV, dtype=DTYPE), torch.zeros(2, 4, 16, device=DEV, dtype=DTYPE),
                 experts=ExpertsConfig(), config=replace(TINY, split_k=2), **common)


def test_batched_experts_run_a_split_plan_unsplit(monkeypatch):
    """The batched format writes its second GEMM straight into the finalize step's workspace, so
    a tuned plan's ``split_k`` is dropped there (one slice) and the result is unchanged."""
    from moe_compile.kernels.triton import experts as triton_experts
    from moe_compile.modular import BatchedExperts, BatchedPrepareAndFinalize
    from moe_compile.modular.kernel import ModularKernel

    split_plan = Plan(ExpertsPath.SORTED, BASE, replace(BASE, split_k=2))
    monkeypatch.setattr(triton_experts, "choose_plan", lambda **kw: split_plan)
    gen = torch.Generator().manual_seed(9)
    tokens, hidden, inter, num_experts, top_k = (12, 32, 16, 4, 2) if not CUDA else (96, 256, 128, 16, 4)
    weights = _weights(num_experts, hidden, inter, Activation.SILU, hf_layout=True, bias=True, gen=gen)
    topk_w, topk_ids = _routing(tokens, num_experts, top_k, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    cfg = ExpertsConfig()
    runs = {}
    for name, experts in (("triton", triton_experts.TritonBatchedExperts(cfg)), ("torch", BatchedExperts(cfg))):
        runs[name] = ModularKernel(BatchedPrepareAndFinalize(num_experts), experts)(
            x, topk_w, topk_ids, weights, global_num_experts=num_experts)
    _assert_close(runs["triton"], runs["torch"].float())
