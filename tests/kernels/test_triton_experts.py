"""Triton experts (pairs / sorted / grouped_mm paths, GEMM, activation, combine) against plain torch.

CPU: fp32 under Triton's interpreter, tiny shapes. CUDA: bf16 at model-like shapes.
Tolerances: fp32 1e-4 (absolute, outputs of order 1), bf16 2e-2 relative Frobenius error.
"""
import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

CUDA = torch.cuda.is_available()
# Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET, set for the whole
# session by tests/conftest.py before triton is first imported).
pytest.importorskip("triton")

from moe_compile.kernels.triton.activation import activation, activation_reference  # noqa: E402
from moe_compile.kernels.triton.combine import combine, combine_reference  # noqa: E402
from moe_compile.kernels.triton.configs import ExpertsPath, Plan, choose_plan  # noqa: E402
from moe_compile.kernels.triton.experts import TritonExperts, fused_experts  # noqa: E402
from moe_compile.kernels.triton.gemm import GemmConfig, moe_gemm, moe_gemm_reference  # noqa: E402
from moe_compile.modular import ExpertWeights  # noqa: E402
from moe_compile.modular.experts import ReferenceExperts  # noqa: E402
from moe_compile.modular.kernel import ModularKernel  # noqa: E402
from moe_compile.modular.prepare_finalize import StandardPrepareAndFinalize  # noqa: E402
from moe_compile.ops.config import Activation, ExpertsConfig  # noqa: E402


DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TINY = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)
PATHS = [ExpertsPath.PAIRS, ExpertsPath.GEMV, ExpertsPath.SORTED] + ([ExpertsPath.GROUPED_MM] if CUDA else [])


def _weights(num_experts, hidden, inter, act, *, hf_layout, bias, gen):
    n13 = 2 * inter if act.is_gated else inter
    if hf_layout:  # HF stores [E, 2I, H] / [E, H, I]; the op gets transposed views
        w13 = torch.randn(num_experts, n13, hidden, generator=gen).transpose(1, 2)
        w2 = torch.randn(num_experts, hidden, inter, generator=gen).transpose(1, 2)
    else:
        w13 = torch.randn(num_experts, hidden, n13, generator=gen)
        w2 = torch.randn(num_experts, inter, hidden, generator=gen)
    w13, w2 = w13 * hidden ** -0.5, w2 * inter ** -0.5
    b13 = torch.randn(num_experts, n13, generator=gen) * 0.1 if bias else None
    b2 = torch.randn(num_experts, hidden, generator=gen) * 0.1 if bias else None
    to = lambda t: None if t is None else t.to(device=DEV, dtype=DTYPE)  # noqa: E731
    return ExpertWeights(to(w13), to(w2), to(b13), to(b2))


def _routing(tokens, num_experts, top_k, gen):
    weights, ids = torch.randn(tokens, num_experts, generator=gen).softmax(-1).topk(top_k)
    return weights.to(DEV), ids.int().to(DEV)


def _problem(num_experts, hidden, inter, tokens, top_k, *, seed, act=Activation.SILU, hf_layout=True, bias=False):
    """``(weights, x, topk_w, topk_ids)`` drawn in that order from one generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    weights = _weights(num_experts, hidden, inter, act, hf_layout=hf_layout, bias=bias, gen=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    return (weights, x, *_routing(tokens, num_experts, top_k, gen))


def _reference(x, topk_w, topk_ids, weights, cfg, expert_map=None, global_experts=None):
    up = lambda t: None if t is None else t.float()  # noqa: E731
    w32 = ExpertWeights(up(weights.w13), up(weights.w2), up(weights.w13_bias), up(weights.w2_bias))
    kernel = ModularKernel(StandardPrepareAndFinalize(), ReferenceExperts(cfg))
    return kernel(x.float(), topk_w, topk_ids, w32, global_num_experts=global_experts or weights.w13.shape[0],
                  expert_map=expert_map)


def _assert_close(out, ref):
    assert out.dtype == DTYPE and torch.isfinite(out).all()
    if DTYPE == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:
        # a token none of whose experts is local (expert maps) gets exact zeros; an all-zero reference
        # has no relative error (0 / 0 was NaN here, out being right)
        zero_rows = (ref == 0).all(-1)
        assert (out[zero_rows] == 0).all(), out[zero_rows]
        if zero_rows.all():
            return
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, err


ACTS = [(Activation.SILU, False), (Activation.GELU, False), (Activation.GELU_TANH, False),
        (Activation.SWIGLU_OAI, True), (Activation.SILU_NO_MUL, False), (Activation.RELU2_NO_MUL, False),
        (Activation.SILU_CLAMPED, False)]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
@pytest.mark.parametrize("act,interleaved", ACTS, ids=lambda a: getattr(a, "value", str(a)))
def test_fused_experts_activations(path, act, interleaved):
    gen = torch.Generator().manual_seed(7)
    tokens, hidden, inter, num_experts, top_k = (9, 32, 24, 6, 2) if not CUDA else (70, 256, 192, 16, 4)
    bias = act is Activation.SWIGLU_OAI or act is Activation.SILU_NO_MUL
    if path is ExpertsPath.GROUPED_MM and bias:
        pytest.skip("the grouped_mm path takes no biases (plan_for routes those to the sorted path)")
    cfg = ExpertsConfig(activation=act, gate_up_interleaved=interleaved, swiglu_limit=1.0)
    weights = _weights(num_experts, hidden, inter, act, hf_layout=True, bias=bias, gen=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    topk_w, topk_ids = _routing(tokens, num_experts, top_k, gen)
    plan = Plan(path, TINY, TINY) if not CUDA else Plan(path, GemmConfig(), GemmConfig())
    out = fused_experts(x, topk_w, topk_ids, weights, cfg, plan=plan)
    _assert_close(out, _reference(x, topk_w, topk_ids, weights, cfg))


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
def test_fused_experts_expert_map(path):
    gen = torch.Generator().manual_seed(11)
    tokens, hidden, inter = (13, 32, 16) if not CUDA else (100, 128, 64)
    weights = _weights(4, hidden, inter, Activation.SILU, hf_layout=False, bias=False, gen=gen)
    expert_map = torch.tensor([-1, -1, 0, 1, -1, 2, 3, -1], dtype=torch.int32, device=DEV)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    topk_w, topk_ids = _routing(tokens, 8, 2, gen)
    plan = Plan(path, TINY, TINY) if not CUDA else None
    out = fused_experts(x, topk_w, topk_ids, weights, expert_map=expert_map, plan=plan)
    ref = _reference(x, topk_w, topk_ids, weights, ExpertsConfig(), expert_map, 8)
    _assert_close(out, ref)


def test_triton_experts_in_modular_kernel_unweighted_input():
    """Llama-4 style: the weight scaled the input in prepare, so the experts sum unweighted."""
    weights, x, topk_w, topk_ids = _problem(4, 32, 16, 10, 1, seed=5, hf_layout=False)
    kernel = ModularKernel(StandardPrepareAndFinalize(), TritonExperts(ExpertsConfig()))
    out = kernel(x, topk_w, topk_ids, weights, global_num_experts=4, apply_router_weight_on_input=True)
    ref_kernel = ModularKernel(StandardPrepareAndFinalize(), ReferenceExperts(ExpertsConfig()))
    ref = ref_kernel(x, topk_w, topk_ids, weights, global_num_experts=4, apply_router_weight_on_input=True)
    _assert_close(out, ref.float())


def test_moe_gemm_pair_blocks_and_reference():
    gen = torch.Generator().manual_seed(3)
    weights = _weights(5, 32, 16, Activation.SILU, hf_layout=True, bias=True, gen=gen)
    x = torch.randn(6, 32, generator=gen).to(DEV, DTYPE)
    _, topk_ids = _routing(6, 5, 2, gen)
    act = torch.full((12, 16), float("nan"), device=DEV, dtype=DTYPE)
    moe_gemm(x, weights.w13, act, topk_ids=topk_ids, top_k=2, counts=None, sorted_pair=None,
             bias=weights.w13_bias, experts=ExpertsConfig(), gather_a=True, config=TINY)
    ref = moe_gemm_reference(x.cpu().repeat_interleave(2, 0), topk_ids.cpu().reshape(-1), weights.w13.cpu(),
                             weights.w13_bias.cpu(), ExpertsConfig())
    assert not torch.isnan(act).any()  # every row written
    tol = 1e-4 if DTYPE == torch.float32 else 3e-2
    torch.testing.assert_close(act.float().cpu(), ref, rtol=tol, atol=tol)


def test_activation_kernel_matches_reference():
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(7, 40, generator=gen).to(DEV, DTYPE)
    for act, inter in ((Activation.SILU, False), (Activation.SWIGLU_OAI, True), (Activation.GELU_NO_MUL, False),
                       (Activation.SILU_CLAMPED, True)):
        cfg = ExpertsConfig(activation=act, gate_up_interleaved=inter, swiglu_limit=0.75)
        tol = 1e-5 if DTYPE == torch.float32 else 2e-2
        torch.testing.assert_close(activation(h, cfg).float(), activation_reference(h.float(), cfg), rtol=tol, atol=tol)


def test_combine_matches_reference():
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(12, 20, generator=gen).to(DEV, DTYPE)
    topk_w = torch.rand(4, 3, generator=gen).to(DEV)
    pos = torch.tensor([3, -1, 0, 5, 6, 7, 1, 2, -1, 4, 8, 9], dtype=torch.int32, device=DEV)
    out = combine(y, topk_w, torch.empty(4, 20, device=DEV, dtype=DTYPE), pos=pos)
    tol = 1e-5 if DTYPE == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), combine_reference(y, topk_w, pos), rtol=tol, atol=tol)


def test_bad_inputs_raise():
    weights, x, topk_w, topk_ids = _problem(4, 32, 16, 3, 2, seed=1, hf_layout=False)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts(x, topk_w, topk_ids[:2], weights)
    with pytest.raises(ValueError, match="one of pos"):
        combine(torch.zeros(6, 32, device=DEV), topk_w, torch.empty(3, 32, device=DEV))
    with pytest.raises(ValueError, match="reduction dim"):
        moe_gemm(x[:, :16], weights.w13, torch.empty(6, 16, device=DEV, dtype=DTYPE), topk_ids=topk_ids, top_k=2,
                 counts=None, sorted_pair=None, experts=ExpertsConfig(), gather_a=True)
    if CUDA:
        return
    with pytest.raises(ValueError, match="CUDA"):  # outside the interpreter CPU tensors are refused
        os.environ["TRITON_INTERPRET"] = "0"
        try:
            fused_experts(x, topk_w, topk_ids, weights)
        finally:
            os.environ["TRITON_INTERPRET"] = "1"


def test_choose_plan_decode_uses_pairs_and_prefill_sorts():
    cpu = torch.device("cpu")
    decode = choose_plan(num_tokens=1, top_k=8, num_local=128, hidden=2048, inter=768, dtype=DTYPE, device=cpu)
    prefill = choose_plan(num_tokens=4096, top_k=8, num_local=128, hidden=2048, inter=768, dtype=DTYPE, device=cpu)
    assert decode.path is ExpertsPath.PAIRS
    assert prefill.path is not ExpertsPath.PAIRS


TMA_CASES = [(Activation.SILU, False, True), (Activation.GELU, False, False), (Activation.SILU_NO_MUL, False, True),
             (Activation.SWIGLU_OAI, True, False)]


@pytest.mark.parametrize("path", [ExpertsPath.PAIRS, ExpertsPath.SORTED], ids=lambda p: p.value)
@pytest.mark.parametrize("act,interleaved,bias", TMA_CASES, ids=lambda a: getattr(a, "value", str(a)))
def test_fused_experts_tma_loads(path, act, interleaved, bias, monkeypatch):
    """Weight tiles (and the second GEMM's A tiles) through TMA descriptors: same results; the
    descriptors are made for HF-layout weights and declined, saying why, where the layout does not
    allow them (interleaved gate/up, [E, K, N] storage)."""
    import logging

    from moe_compile.kernels.triton import gemm
    from moe_compile.kernels.triton.gemm import _tma_descriptors
    from moe_compile.testing.logs import captured_logs

    monkeypatch.setattr(gemm, "_DECLINED", set())

    gen = torch.Generator().manual_seed(5)
    tokens, hidden, inter, num_experts, top_k = (11, 32, 32, 6, 2) if not CUDA else (300, 256, 256, 16, 4)
    cfg = ExpertsConfig(activation=act, gate_up_interleaved=interleaved, swiglu_limit=1.0)
    weights = _weights(num_experts, hidden, inter, act, hf_layout=True, bias=bias, gen=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    topk_w, topk_ids = _routing(tokens, num_experts, top_k, gen)
    g = (GemmConfig(16, 16, 16, 2, 4, 2, tma=1) if not CUDA else GemmConfig(64, 64, 64, 8, 4, 3, tma=1))
    with captured_logs(logging.INFO) as messages:
        out = fused_experts(x, topk_w, topk_ids, weights, cfg, plan=Plan(path, g, g))
    _assert_close(out, _reference(x, topk_w, topk_ids, weights, cfg))
    assert any("TMA loads declined" in m for m in messages) == interleaved, messages
    n_cols = inter if act.is_gated else weights.w13.shape[2]
    w_desc, a_desc = _tma_descriptors(x, weights.w13, g, n_cols, interleaved=interleaved, gather_a=True,
                                      pair_blocks=False)
    assert (w_desc is None) == interleaved and a_desc is None
    act_rows = torch.empty(tokens * top_k, inter, device=DEV, dtype=DTYPE)
    w_desc, a_desc = _tma_descriptors(act_rows, weights.w2, g, hidden, interleaved=False, gather_a=False,
                                      pair_blocks=path is ExpertsPath.PAIRS)
    assert w_desc is not None and (a_desc is None) == (path is ExpertsPath.PAIRS)
    kn_layout = weights.w2.contiguous()  # [E, K, N] storage: N-major, no descriptor
    assert _tma_descriptors(act_rows, kn_layout, g, hidden, interleaved=False, gather_a=False,
                            pair_blocks=False) == (None, None)


@pytest.mark.parametrize("act,bias", [(Activation.SILU, False), (Activation.GELU, True),
                                      (Activation.RELU2_NO_MUL, True)], ids=lambda a: getattr(a, "value", str(a)))
@pytest.mark.parametrize("with_map", [False, True], ids=["all-local", "expert-map"])
def test_triton_batched_experts_match_the_torch_batched_experts(act, bias, with_map):
    """The batched-format Triton experts in a modular kernel equal the torch ``BatchedExperts`` and
    the standard reference; an expert that receives no rows is never read (its weights are NaN)."""
    from moe_compile.kernels.triton.experts import TritonBatchedExperts
    from moe_compile.modular import BatchedExperts, BatchedPrepareAndFinalize

    gen = torch.Generator().manual_seed(3)
    tokens, hidden, inter, num_global, top_k = (10, 32, 16, 8, 2) if not CUDA else (96, 256, 128, 16, 4)
    num_local = num_global // 2 if with_map else num_global
    cfg = ExpertsConfig(activation=act)
    weights = _weights(num_local, hidden, inter, act, hf_layout=True, bias=bias, gen=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    logits = torch.randn(tokens, num_global, generator=gen)
    logits[:, 1] = -1e4  # global expert 1 (local 1 in both layouts) never chosen
    topk_w, topk_ids = logits.softmax(-1).topk(top_k)
    topk_w, topk_ids = topk_w.to(DEV), topk_ids.int().to(DEV)
    expert_map = None
    if with_map:  # this rank owns global experts 0..3 as local 0..3
        expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1] + [-1] * (num_global - 8), dtype=torch.int32,
                                  device=DEV)
    w13 = weights.w13.clone()
    w13[1] = float("nan")
    poisoned = ExpertWeights(w13, weights.w2, weights.w13_bias, weights.w2_bias)
    runs = {}
    for name, experts in (("triton", TritonBatchedExperts(cfg)), ("torch", BatchedExperts(cfg))):
        kernel = ModularKernel(BatchedPrepareAndFinalize(num_local), experts)
        runs[name] = kernel(x, topk_w, topk_ids, poisoned if name == "triton" else weights,
                            global_num_experts=num_global, expert_map=expert_map)
    assert torch.isfinite(runs["triton"]).all()
    _assert_close(runs["triton"], runs["torch"].float())
    _assert_close(runs["triton"], _reference(x, topk_w, topk_ids, weights, cfg, expert_map, num_global))


@pytest.mark.parametrize("persistent", [0, 1, 2], ids=["grid", "persistent", "persistent-flat"])
@pytest.mark.parametrize("pre_gather", [False, True], ids=["gather-in-gemm", "pre-gather"])
@pytest.mark.parametrize("tma", [0, 1], ids=["ptr", "tma"])
@pytest.mark.parametrize("with_map", [False, True], ids=["all-local", "expert-map"])
def test_sorted_path_persistent_and_pre_gathered(persistent, pre_gather, tma, with_map):
    """The persistent GEMMs (a few programs walk the live tiles counted on the device) and the
    pre-gathered first GEMM (token rows gathered into expert order by the alignment pass, read by
    TMA where asked) give the reference's result; with an expert map the non-local pairs stay out."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(17)
    tokens, hidden, inter, num_experts, top_k = (23, 32, 32, 6, 2) if not CUDA else (700, 256, 256, 16, 4)
    base = TINY if not CUDA else GemmConfig(64, 64, 64, 8, 4, 3)
    g = replace(base, persistent=persistent, tma=tma)
    num_global = 2 * num_experts if with_map else num_experts
    weights = _weights(num_experts, hidden, inter, Activation.SILU, hf_layout=True, bias=False, gen=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    topk_w, topk_ids = _routing(tokens, num_global, top_k, gen)
    expert_map = None
    if with_map:  # this rank owns the odd global experts
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[1::2] = torch.arange(num_experts, dtype=torch.int32)
        expert_map = expert_map.to(DEV)
    plan = Plan(ExpertsPath.SORTED, g, g, pre_gather=pre_gather)
    out = fused_experts(x, topk_w, topk_ids, weights, expert_map=expert_map, plan=plan)
    _assert_close(out, _reference(x, topk_w, topk_ids, weights, ExpertsConfig(), expert_map, num_global))
    assert Plan.from_dict(plan.to_dict()) == plan


def test_persistent_batched_gemm_matches_the_grid_launch():
    """Batched rows (``row_stride``) under the persistent launch: each expert's valid rows only."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(9)
    num_experts, cap, hidden, n_out = 5, 12, 32, 16
    w = (torch.randn(num_experts, hidden, n_out, generator=gen) * hidden ** -0.5).to(DEV, DTYPE)
    a = torch.randn(num_experts * cap, hidden, generator=gen).to(DEV, DTYPE)
    counts = torch.tensor([3, 0, 12, 7, 1], dtype=torch.int32, device=DEV)
    outs = []
    for persistent, expert_order in ((0, 0), (2, 0), (0, 1), (2, 1)):
        out = torch.full((num_experts * cap, n_out), float("nan"), device=DEV, dtype=DTYPE)
        cfg = replace(TINY if not CUDA else GemmConfig(64, 64, 64, 8, 4, 3), persistent=persistent,
                      expert_order=expert_order)
        moe_gemm(a, w, out, topk_ids=counts, top_k=1, counts=counts, sorted_pair=None, gather_a=False,
                 config=cfg, row_stride=cap, max_rows=int(counts.sum()))
        outs.append(out)
    for e, c in enumerate(counts.tolist()):
        rows = slice(e * cap, e * cap + c)
        ref = a[rows].float() @ w[e].float()
        tol = 1e-4 if DTYPE == torch.float32 else 3e-2
        for out in outs:
            torch.testing.assert_close(out[rows].float(), ref, rtol=tol, atol=tol)
            torch.testing.assert_close(out[rows], outs[0][rows])
            assert torch.isnan(out[e * cap + c:(e + 1) * cap]).all()  # padding rows are never written


@pytest.mark.parametrize("persistent", [0, 1], ids=["grid", "persistent"])
@pytest.mark.parametrize("pre_gather", [False, True], ids=["gather-in-gemm", "pre-gather"])
@pytest.mark.parametrize("with_map", [False, True], ids=["all-local", "expert-map"])
def test_tail_blocks_run_as_smaller_tiles(persistent, pre_gather, with_map):
    """``tail_m``: an expert's last block with few rows runs as a smaller tile (pointer loads for
    A); experts here get full blocks, tails under and over ``tail_m`` rows, and no rows at all."""
    from dataclasses import replace

    tokens, hidden, inter, num_experts, top_k = (37, 32, 32, 5, 2) if not CUDA else (1500, 256, 256, 16, 4)
    base = TINY if not CUDA else GemmConfig(128, 64, 64, 8, 8, 3)
    g = replace(base, persistent=persistent, tma=1, tail_m=base.block_m // 2)
    num_global = num_experts + 2 if with_map else num_experts
    for seed in range(100):  # the first routing with every kind of block in it
        gen = torch.Generator().manual_seed(seed)
        topk_w, topk_ids = _routing(tokens, num_global, top_k, gen)
        counts = torch.bincount(topk_ids.flatten().long().cpu(), minlength=num_global)[:num_experts]
        rem = counts % g.block_m
        if ((rem > 0) & (rem <= g.tail_m)).any() and (rem > g.tail_m).any() and (counts > g.block_m).any():
            break
    else:
        raise AssertionError("no routing with short tails, long tails and full blocks")
    weights = _weights(num_experts, hidden, inter, Activation.SILU, hf_layout=True, bias=True, gen=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    _assert_sorted_plan_matches(g, pre_gather, with_map, num_global, x, topk_w, topk_ids, weights)



@pytest.mark.parametrize("persistent", [0, 2], ids=["grid", "persistent-flat"])
@pytest.mark.parametrize("pre_gather", [False, True], ids=["gather-in-gemm", "pre-gather"])
@pytest.mark.parametrize("order", ["grouped", "by-expert", "tails"])
@pytest.mark.parametrize("launch", [0, 1], ids=["in-place", "second-launch"])
def test_merged_last_blocks(persistent, pre_gather, order, launch):
    """``merge_m``: an expert's last block takes up to ``block_m + merge_m`` rows, the extra ones
    computed transposed on the same weight tiles. The routing has experts of exactly one block,
    one block plus a few rows (merged), plus more than ``merge_m`` (a block of their own), fewer
    than ``merge_m`` rows in all, and none; with bias, an expert map, and a K that is not a whole
    number of K-steps. ``merge_launch``: the merged blocks in a second launch."""
    from dataclasses import replace

    tokens, hidden, inter, num_experts, top_k = (70, 40, 32, 6, 2) if not CUDA else (1500, 288, 256, 16, 4)
    base = replace(TINY, block_m=32, merge_m=16) if not CUDA else GemmConfig(128, 64, 64, 8, 8, 3, merge_m=32)
    g = replace(base, persistent=persistent, tma=1, expert_order=int(order == "by-expert"),
                tail_m=base.block_m // 2 if order == "tails" else 0, merge_launch=launch)
    num_global = num_experts + 2
    for seed in range(200):  # the first routing with every kind of last block in it
        gen = torch.Generator().manual_seed(seed)
        skew = torch.linspace(2.0, -2.0, num_global)[torch.randperm(num_global, generator=gen)]
        topk_w, topk_ids = (torch.randn(tokens, num_global, generator=gen) + skew).softmax(-1).topk(top_k)
        topk_w, topk_ids = topk_w.to(DEV), topk_ids.int().to(DEV)
        counts = torch.bincount(topk_ids.flatten().long().cpu(), minlength=num_global)[:num_experts]
        rem = counts - g.block_m * torch.div(counts, g.block_m, rounding_mode="floor")
        big = counts > g.block_m
        if ((big & (rem > 0) & (rem <= g.merge_m)).any() and (big & (rem > g.merge_m)).any()
                and ((counts > 0) & (counts <= g.merge_m)).any()):
            break
    else:
        raise AssertionError("no routing with merged, unmerged and small last blocks")
    weights = _weights(num_experts, hidden, inter, Activation.SILU, hf_layout=True, bias=True, gen=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    plan = _assert_sorted_plan_matches(g, pre_gather, True, num_global, x, topk_w, topk_ids, weights)
    assert Plan.from_dict(plan.to_dict()) == plan


def test_merge_m_must_be_an_mma_side():
    from dataclasses import replace

    a = torch.zeros(4, 32, device=DEV, dtype=DTYPE)
    w = torch.zeros(2, 32, 16, device=DEV, dtype=DTYPE)
    counts = torch.tensor([4, 0], dtype=torch.int32, device=DEV)
    for merge in (24, 16):  # not a power of two; not below block_m (16)
        with pytest.raises(ValueError, match=f"merge_m={merge} "):
            moe_gemm(a, w, torch.zeros(4, 16, device=DEV, dtype=DTYPE), topk_ids=counts, top_k=1, counts=counts,
                     sorted_pair=None, gather_a=False, config=replace(TINY, merge_m=merge))

def _assert_sorted_plan_matches(g, pre_gather, with_map, num_global, x, topk_w, topk_ids, weights):
    """``fused_experts`` on the sorted path with GEMM config ``g`` against the reference; with
    ``with_map`` the experts past the local ones are not this rank's."""
    num_experts = weights.w13.shape[0]
    expert_map = None
    if with_map:
        expert_map = torch.tensor(list(range(num_experts)) + [-1] * (num_global - num_experts), dtype=torch.int32,
                                  device=DEV)
    plan = Plan(ExpertsPath.SORTED, g, g, pre_gather=pre_gather)
    out = fused_experts(x, topk_w, topk_ids, weights, expert_map=expert_map, plan=plan)
    _assert_close(out, _reference(x, topk_w, topk_ids, weights, ExpertsConfig(), expert_map, num_global))
    return plan


@pytest.mark.parametrize("persistent", [0, 2], ids=["grid", "persistent-flat"])
@pytest.mark.parametrize("group_m", [1, 2, 1024])
@pytest.mark.parametrize("with_map", [False, True], ids=["all-local", "expert-map"])
def test_expert_ordered_tiles(persistent, group_m, with_map):
    """``expert_order``: the tiles go expert by expert (``group_m`` M-blocks of one expert per
    N-block in turn); every tile is still computed once, with tails and empty experts."""
    from dataclasses import replace

    tokens, hidden, inter, num_experts, top_k = (60, 32, 48, 5, 2) if not CUDA else (1500, 256, 384, 16, 4)
    base = TINY if not CUDA else GemmConfig(64, 64, 64, 8, 4, 3)
    g = replace(base, persistent=persistent, group_m=group_m, expert_order=1, tail_m=base.block_m // 2)
    num_global = num_experts + 2 if with_map else num_experts
    gen = torch.Generator().manual_seed(group_m)
    topk_w, topk_ids = _routing(tokens, num_global, top_k, gen)
    counts = torch.bincount(topk_ids.flatten().long().cpu(), minlength=num_global)[:num_experts]
    assert (counts > g.block_m).any()  # experts of several M-blocks
    weights = _weights(num_experts, hidden, inter, Activation.SILU, hf_layout=True, bias=False, gen=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    plan = _assert_sorted_plan_matches(g, True, with_map, num_global, x, topk_w, topk_ids, weights)
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.skipif(CUDA, reason="a property test of the block layout, run under the interpreter")
@settings(max_examples=12, deadline=None)
@given(counts=st.lists(st.sampled_from([0, 1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 80, 96, 97, 111]),
                       min_size=1, max_size=5),
       merge=st.sampled_from([16]), launch=st.sampled_from([0, 1]), batched=st.booleans())
@example(counts=[48, 96, 97, 0, 33], merge=16, launch=0, batched=False)
@example(counts=[48, 96, 97, 0, 33], merge=16, launch=1, batched=False)
@example(counts=[40, 0, 80, 111], merge=16, launch=1, batched=True)
def test_merged_blocks_cover_every_row(counts, merge, launch, batched):
    """Whatever the counts (empty experts, exactly one block, one block + ``merge_m``, one row
    more, several blocks), the blocks of a merged layout cover every row, with the plain-torch
    product, packed or batched, in place or with the merged blocks in a second launch (rows never
    written stay NaN and fail the comparison)."""
    from dataclasses import replace

    k_dim, n = 24, 16
    cfg = replace(TINY, block_m=32, merge_m=merge, merge_launch=launch)
    c = torch.tensor(counts, dtype=torch.int32)
    num = len(counts)
    gen = torch.Generator().manual_seed(sum(counts) + 7 * num)
    w = torch.randn(num, k_dim, n, generator=gen)
    cap = max(max(counts), 1)
    rows = num * cap if batched else max(int(c.sum()), 1)
    a = torch.randn(rows, k_dim, generator=gen)
    out = torch.full((rows, n), float("nan"))
    starts = [e * cap for e in range(num)] if batched else (torch.cumsum(c, 0) - c).tolist()
    ids = torch.zeros(int(c.sum()), 1, dtype=torch.int32)  # only its size is read: the pairs (rows)
    moe_gemm(a, w, out, topk_ids=ids, top_k=1, counts=c, sorted_pair=None, gather_a=False, config=cfg,
             row_stride=cap if batched else 0, max_rows=int(c.sum()) if batched else None)
    for e, (s, cnt) in enumerate(zip(starts, counts)):
        torch.testing.assert_close(out[s:s + cnt], a[s:s + cnt] @ w[e], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("persistent", [0, 2], ids=["grid", "persistent-flat"])
@pytest.mark.parametrize("merge", [0, 32])
@pytest.mark.parametrize("pre_gather", [False, True], ids=["gather-in-gemm", "pre-gather"])
def test_256_row_blocks(persistent, merge, pre_gather):
    """256-row M-blocks (``sweep_gemm.py --variants bigm``): experts of one partial block, of two
    whole blocks plus a few rows (merged, or a third block), and of none; TMA loads on a GPU."""
    from dataclasses import replace

    tokens, hidden, inter, num_experts, top_k = (700, 32, 16, 4, 2) if not CUDA else (2100, 256, 256, 8, 2)
    base = replace(TINY, block_m=256, block_n=16) if not CUDA else GemmConfig(256, 64, 64, 8, 8, 3)
    g = replace(base, persistent=persistent, tma=1, merge_m=merge)
    gen = torch.Generator().manual_seed(3)
    skew = torch.tensor([3.0, 3.0, 0.0, -9.0] + [0.0] * (num_experts - 4))
    topk_w, topk_ids = (torch.randn(tokens, num_experts, generator=gen) + skew).softmax(-1).topk(top_k)
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    assert (counts > 512).any() and (counts < 256).any()
    weights = _weights(num_experts, hidden, inter, Activation.SILU, hf_layout=True, bias=True, gen=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, DTYPE)
    _assert_sorted_plan_matches(g, pre_gather, False, num_experts, x, topk_w.to(DEV), topk_ids.int().to(DEV), weights)
