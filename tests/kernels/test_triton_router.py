"""fp32 router logits from bf16 activations (``kernels/triton/router.py``) against fp64.

CPU: the GEMV kernel under Triton's interpreter (bf16 loads, fp32 FMA) and the GEMM kernel's
indexing on fp32 inputs (the interpreter's bf16 ``tl.dot`` is not usable). CUDA: every path at
model-like shapes, including the three-part split of fp32 weights on tensor cores.
Tolerance: 2e-6 of the largest logit; at the DeepSeek-V3 shape on CUDA, no worse than 2e-6 or
three times cuBLAS's own fp32 GEMM error on the same inputs, whichever is larger.
"""
import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from moe_compile.kernels.triton import router  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOL = 2e-6


def _inputs(tokens, hidden, experts, wdtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(experts, hidden, generator=gen) * hidden ** -0.5).to(DEV, wdtype)
    b = (torch.randn(experts, generator=gen) * 0.1).to(DEV) if bias else None
    return x, w, b


def _rel(got, x, w, b):
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == ref.shape
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w-fp32", "w-bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemv_few_tokens(tokens, wdtype, bias):
    x, w, b = _inputs(tokens, 300, 24, wdtype, bias, seed=tokens)
    assert router.kernels_take(x, w, b) and tokens <= router.GEMV_MAX_TOKENS
    assert _rel(router.router_logits(x, w, b), x, w, b) < TOL


@pytest.mark.parametrize("tokens,experts", [(17, 24), (130, 40)])
def test_gemm_kernel_indexing_fp32(tokens, experts):
    """The tensor-core kernel's tiling and masks (ragged tokens, experts and hidden), on fp32."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 200, generator=gen).to(DEV)
    w = torch.randn(experts, 200, generator=gen).to(DEV)
    b = torch.randn(experts, generator=gen).to(DEV)
    out = torch.empty(tokens, experts, device=DEV)
    got = router._gemm(x, w, b, out)
    assert _rel(got, x, w, b) < TOL


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemm_kernel_split_over_hidden(bias):
    """Few token tiles: the H axis is cut into ranges (ragged last one) whose partial sums are
    added in a fixed order; the bias is added once; repeated calls give the same bits."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 1100, generator=gen).to(DEV)
    w = torch.randn(24, 1100, generator=gen).to(DEV)
    b = torch.randn(24, generator=gen).to(DEV) if bias else None
    _, _, splits, h_per = router.h_splits(40, 24, 1100, 4)
    assert splits == 2 and h_per % 64 == 0 and h_per < 1100
    got = router._gemm(x, w, b, torch.empty(40, 24, device=DEV))
    assert _rel(got, x, w, b) < TOL
    again = router._gemm(x, w, b, torch.empty(40, 24, device=DEV))
    assert torch.equal(got, again)


def test_split_plan_fills_the_gpu():
    """At the DeepSeek-V3 router shape on 132 SMs: about one program per SM, ranges >= 8 steps."""
    for tokens in (32, 256, 1024, 2048, 8192):
        block_t, block_e, splits, h_per = router.h_splits(tokens, 256, 7168, 132)
        programs = -(-tokens // block_t) * -(-256 // block_e) * splits
        assert h_per % 64 == 0 and h_per >= 512 and splits * h_per >= 7168 > (splits - 1) * h_per
        assert programs >= 100 or splits == 7168 // 512, (tokens, programs)


def test_other_inputs_go_to_the_reference():
    x, w, _ = _inputs(5, 64, 8, torch.float32, False)
    for args in ((x.half(), w, None), (x, w.half(), None), (x.float(), w, None), (x, w.t().contiguous().t(), None)):
        assert not router.kernels_take(*args)
        torch.testing.assert_close(router.router_logits(*args), router.router_logits_reference(*args))
    empty = router.router_logits(x[:0], w)
    assert empty.shape == (0, 8) and empty.dtype == torch.float32


def test_bad_inputs_raise_naming_the_parameter():
    import moe_compile.ops.custom_op  # noqa: F401  (registers torch.ops.moe_compile.*)

    x, w, b = _inputs(4, 64, 8, torch.float32, True)
    cases = [((x, w[:, :32], None), ValueError, "weight"), ((x[0], w, None), ValueError, "hidden_states"),
             ((x, w, b[:3]), ValueError, "bias"), ((x, w.long(), None), TypeError, "weight"),
             ((x.tolist(), w, None), TypeError, "hidden_states")]
    for args, error, name in cases:
        with pytest.raises(error, match=name):
            router.router_logits(*args)
        if isinstance(args[0], torch.Tensor):
            with pytest.raises(error, match=name):
                torch.ops.moe_compile.router_logits(*args)


def test_custom_op_matches_the_formula_and_passes_opcheck():
    import moe_compile.ops.custom_op  # noqa: F401  (registers torch.ops.moe_compile.*)

    x, w, b = _inputs(6, 64, 8, torch.float32, True)
    got = torch.ops.moe_compile.router_logits(x, w, b)
    assert _rel(got, x, w, b) < TOL
    torch.library.opcheck(torch.ops.moe_compile.router_logits.default, (x, w, b))
    torch.library.opcheck(torch.ops.moe_compile.router_logits.default, (x, w.bfloat16(), None))


@gpu
@pytest.mark.parametrize("tokens", [1, 8, 16, 17, 300, 2048, 4096])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w-fp32-split", "w-bf16"])
def test_cuda_paths_at_deepseek_router_shape(tokens, wdtype):
    """Each kernel at the DeepSeek-V3 router shape (the GEMM split over H at the smaller token
    counts), against fp64 and beside cuBLAS's fp32 GEMM."""
    x, w, b = _inputs(tokens, 7168, 256, wdtype, bias=tokens == 300, seed=tokens)
    if tokens <= router.GEMV_MAX_TOKENS:
        got = router.router_logits(x, w, b)
    else:
        got = router._gemm(x, w, b, torch.empty(tokens, 256, device=DEV))
    ours = _rel(got, x, w, b)
    cublas = _rel(torch.nn.functional.linear(x.float(), w.float(), b), x, w, b)
    print(f"T={tokens} {wdtype}: ours {ours:.1e}, cuBLAS fp32 {cublas:.1e} (of the largest logit)")
    assert ours < max(TOL, 3 * cublas)


def test_more_than_gemv_tokens_take_the_gemm_kernel(monkeypatch):
    """Above the GEMV's 16 tokens bf16 inputs go to the tensor-core kernel (faster than the cast
    + cuBLAS fp32 GEMM from 17 tokens on the H200, ``benchmarks/bench_router.py``)."""
    calls = []
    monkeypatch.setattr(router, "_gemm", lambda x, w, b, out: calls.append(x.shape[0]) or out.zero_())
    x, w, b = _inputs(router.GEMV_MAX_TOKENS + 1, 64, 8, torch.float32, True)
    router.router_logits(x.bfloat16(), w, b)
    router.router_logits(x[:16].bfloat16(), w, b)  # the GEMV
    assert calls == [router.GEMV_MAX_TOKENS + 1]


def _within_one_rounding(got: torch.Tensor, other: torch.Tensor, exact: torch.Tensor) -> bool:
    """Two roundings of one fp32 sum computed in different orders: at most one ulp of the larger
    apart, plus the orders' difference (1e-5 of the largest logit: fp32 sums over H <= 7168)."""
    a, b = got.double(), other.double()
    _, exp = torch.frexp(torch.maximum(a.abs(), b.abs()))
    ulp = torch.ldexp(torch.ones_like(a), exp - 8)  # bf16: 8 significant bits
    return bool(((a - b).abs() <= ulp + 1e-5 * exact.abs().max()).all())


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gemv_low_precision_logits_are_the_fp32_sum_rounded_once(tokens, out_dtype):
    """bf16 routers (Mixtral, Qwen3: ``F.linear(x, w)`` in bf16): the same fp32 sum as the fp32
    output, rounded to nearest even once (exact equality: same kernel, same order)."""
    x, w, b = _inputs(tokens, 300, 24, torch.bfloat16, bias=tokens == 5, seed=tokens)
    got = router.router_logits(x, w, b, out_dtype)
    assert got.dtype == out_dtype and got.shape == (tokens, 24)
    assert torch.equal(got, router.router_logits(x, w, b).to(out_dtype))


@pytest.mark.parametrize("tokens,experts", [(17, 24), (130, 40)])
def test_gemm_kernel_low_precision_logits(tokens, experts):
    """The tensor-core kernel with bf16 logits (one H range; ragged tiles): within one bf16 ulp of
    the fp32 formula rounded once, and ``lowp_tiles``' tiles or any other give that result."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 200, generator=gen).to(DEV)
    w = torch.randn(experts, 200, generator=gen).to(DEV)
    b = torch.randn(experts, generator=gen).to(DEV)
    exact = router.router_logits_reference(x, w, b)
    for tiles in (None, (16, 16), (32, 64)):
        got = router._gemm(x, w, b, torch.empty(tokens, experts, device=DEV, dtype=torch.bfloat16), tiles)
        assert got.dtype == torch.bfloat16 and _within_one_rounding(got, exact.bfloat16(), exact)


def test_low_precision_tiles_fill_the_gpu():
    """One program per SM or more wherever the tokens allow it, tiles never below 16 x 16."""
    for tokens in (17, 32, 256, 2048, 8192):
        for experts in (8, 60, 128, 256):
            block_t, block_e = router.lowp_tiles(tokens, experts, 132)
            assert block_t >= 16 and block_e >= 16 and block_t <= 64 and block_e <= 128
            programs = -(-tokens // block_t) * -(-experts // block_e)
            assert programs >= 132 or (block_t, block_e) == (16, 16), (tokens, experts, block_t, block_e)


def test_out_dtype_is_checked_and_kept_by_the_op():
    import moe_compile.ops.custom_op  # noqa: F401  (registers torch.ops.moe_compile.*)

    x, w, b = _inputs(6, 64, 8, torch.bfloat16, True)
    for fn in (router.router_logits, torch.ops.moe_compile.router_logits):
        with pytest.raises(TypeError, match="out_dtype.*torch.int32"):
            fn(x, w, b, torch.int32)
    got = torch.ops.moe_compile.router_logits(x, w, b, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, router.router_logits_reference(x, w, b).bfloat16(), rtol=0, atol=0)
    assert router.router_logits(x.half(), w.half(), None, torch.float16).dtype == torch.float16  # the reference
    torch.library.opcheck(torch.ops.moe_compile.router_logits.default, (x, w, b, torch.bfloat16))


def test_bf16_logits_above_the_gemv_are_cublas_own():
    """Above 16 tokens bf16 logits from bf16 weights are ``F.linear``'s own (cuBLAS on a GPU,
    faster there than the one-range tensor-core kernel)."""
    x, w, b = _inputs(router.GEMV_MAX_TOKENS + 1, 64, 8, torch.bfloat16, True)
    b = b.bfloat16()
    assert torch.equal(router.router_logits(x, w, b, torch.bfloat16), torch.nn.functional.linear(x, w, b))


@gpu
@pytest.mark.parametrize("tokens", [1, 16, 17, 256, 2048, 8192])
@pytest.mark.parametrize("experts,hidden", [(8, 4096), (128, 2048)], ids=["mixtral", "qwen3"])
def test_cuda_bf16_logits_beside_cublas(tokens, experts, hidden):
    """At Mixtral's and Qwen3's bf16 router shapes, the GEMV (<= 16 tokens) and the tensor-core
    kernel with bf16 output (any count): one rounding of the fp32 sum away from cuBLAS's bf16
    ``F.linear``, and from fp64 within half a bf16 ulp of the largest logit (2^-8 of it at most)."""
    x, w, _ = _inputs(tokens, hidden, experts, torch.bfloat16, False, seed=tokens)
    cublas = torch.nn.functional.linear(x, w)
    exact = torch.nn.functional.linear(x.double(), w.double())
    outs = [router._gemm(x, w, None, torch.empty(tokens, experts, device=DEV, dtype=torch.bfloat16))]
    if tokens <= router.GEMV_MAX_TOKENS:
        outs.append(router.router_logits(x, w, None, torch.bfloat16))
    for got in outs:
        assert _within_one_rounding(got, cublas, exact)
        err = ((got.double() - exact).abs().max() / exact.abs().max()).item()
        assert err <= 2 ** -8 * 1.001
