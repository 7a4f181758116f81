"""The CUDA lowering end to end: custom-op dispatch, no host sync, CUDA-graph capture, torch.compile.

GPU tests skip without CUDA; the CPU tests cover the fallback path and run the lowering under
Triton's interpreter.
"""

import pytest
import torch

CUDA = torch.cuda.is_available()
# Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET, set for the whole
# session by tests/conftest.py before triton is first imported).
pytest.importorskip("triton")

import moe_compile.kernels.triton.experts  # noqa: E402,F401  (decorate the kernels now, interpreted on CPU)
import moe_compile.kernels.triton.routing  # noqa: E402,F401
import moe_compile.ops.custom_op  # noqa: E402,F401  (registers torch.ops.moe_compile.*)
from moe_compile.lowering import MoEInputs, StagedLowering  # noqa: E402
from moe_compile.lowering.cuda import FALLBACKS, CudaLowering  # noqa: E402
from moe_compile.modular import ExpertWeights  # noqa: E402
from moe_compile.ops.custom_op import make_config  # noqa: E402


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

DEEPSEEK = dict(num_experts=32, top_k=4, routing_method="sigmoid", renormalize=True, routed_scaling_factor=2.5,
                k_group=2, group_count=4, group_select_mode=1)
DEEPSEEK_V4 = dict(num_experts=32, top_k=4, routing_method="sqrtsoftplus", renormalize=False,
                   routed_scaling_factor=1.5, k_group=1, group_count=1, group_select_mode=0)


def _layer(tokens, hidden, inter, num_experts, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, num_experts, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen).transpose(1, 2) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen).transpose(1, 2) * inter ** -0.5
    bias = torch.randn(num_experts, generator=gen) * 0.05
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), logits.to(device), to(w13), to(w2), bias.to(device)


def _op(x, logits, w13, w2, bias, spec, lowering="auto"):
    return torch.ops.moe_compile.fused_moe(
        x, logits, w13, w2, None, None, bias, num_experts=spec["num_experts"], top_k=spec["top_k"],
        routing_method=spec["routing_method"], renormalize=spec["renormalize"],
        routed_scaling_factor=spec["routed_scaling_factor"], k_group=spec["k_group"],
        group_count=spec["group_count"], group_select_mode=spec["group_select_mode"], normalize_sigmoid=True,
        scoring_after_topk=False, activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0,
        gate_up_interleaved=False, apply_router_weight_on_input=False, tp_group_name=None, ep_group_name=None,
        dispatcher_type=None, tokens_full=True, reduce_results=True, lowering=lowering)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _cfg(spec, has_bias=True):
    return make_config(spec["num_experts"], spec["top_k"], spec["routing_method"], spec["renormalize"],
                       spec["routed_scaling_factor"], spec["k_group"], spec["group_count"],
                       spec["group_select_mode"], True, False, has_bias, "silu", 1.702, 7.0, False, False,
                       None, None, None, True, True, "auto")


@pytest.mark.parametrize("spec", [DEEPSEEK, DEEPSEEK_V4], ids=["deepseek_v3", "deepseek_v4"])
def test_cuda_lowering_matches_torch_stages_on_interpreter_or_gpu(spec):
    device = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32
    x, logits, w13, w2, bias = _layer(40 if CUDA else 6, 64, 32, 32, device, dtype)
    inputs = MoEInputs(x, logits, ExpertWeights(w13, w2), bias)
    cfg = _cfg(spec)
    out = CudaLowering().run(inputs, cfg)
    ref = StagedLowering().run(MoEInputs(x.float(), logits, ExpertWeights(w13.float(), w2.float()), bias), cfg)
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel(out, ref) < (2e-2 if CUDA else 1e-5)


@pytest.mark.parametrize("tokens", [1, 40, 600] if CUDA else [1, 12])
def test_precomputed_routing_with_an_expert_picked_twice(tokens):
    """``fused_experts`` as the experts-only rewrite calls it, on a router that may send a token to one
    expert twice (an untrained hash table): each pick counts, as in the torch stages."""
    device = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32
    x, _, w13, w2, _ = _layer(tokens, 64, 32, 16, device, dtype, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, 16, generator=gen).argsort(dim=1)[:, :4]
    ids[::2, 1] = ids[::2, 0]  # every other token: its first expert twice
    weights = torch.rand(tokens, 4, generator=gen) + 0.25
    ids, weights = ids.to(device), weights.to(device)
    cfg = make_config(16, 4, "softmax", False, 1.0, 1, 1, 0, True, False, False, "silu", 1.702, 7.0, False, False,
                      None, None, None, True, True, "auto")
    out = CudaLowering().run(MoEInputs(x, None, ExpertWeights(w13, w2), None, weights, ids), cfg)
    ref = StagedLowering().run(MoEInputs(x.float(), None, ExpertWeights(w13.float(), w2.float()), None, weights,
                                         ids), cfg)
    assert out.shape == x.shape and _rel(out, ref) < (2e-2 if CUDA else 1e-5)


def test_fallback_is_logged_and_counted(moe_log, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, logits, w13, w2, bias = _layer(5, 32, 16, 32, "cpu", torch.float32)
    inputs = MoEInputs(x, logits, ExpertWeights(w13, w2), bias)
    FALLBACKS.clear()
    out = CudaLowering().run(inputs, _cfg(DEEPSEEK))
    ref = StagedLowering().run(inputs, _cfg(DEEPSEEK))
    torch.testing.assert_close(out, ref)
    assert FALLBACKS["experts: tensors are on cpu, the Triton experts need CUDA"] == 1
    assert FALLBACKS["select_experts: router_logits are on cpu"] == 1
    assert "falls back to the torch stage" in moe_log.text


@gpu
@pytest.mark.parametrize("spec", [DEEPSEEK, DEEPSEEK_V4], ids=["deepseek_v3", "deepseek_v4"])
def test_custom_op_dispatches_to_cuda_lowering_without_host_sync(spec):
    x, logits, w13, w2, bias = _layer(64, 256, 128, 32, "cuda", torch.bfloat16)
    _op(x, logits, w13, w2, bias, spec)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _op(x, logits, w13, w2, bias, spec)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = _op(x.cpu().float(), logits.cpu(), w13.cpu().float(), w2.cpu().float(), bias.cpu(), spec)
    assert _rel(out.cpu(), ref) < 2e-2


@gpu
@pytest.mark.parametrize("tokens", [1, 300])
def test_manual_cuda_graph_capture_and_replay(tokens):
    x, logits, w13, w2, bias = _layer(tokens, 256, 128, 32, "cuda", torch.bfloat16, seed=tokens)
    static = [x.clone(), logits.clone()]
    _op(static[0], static[1], w13, w2, bias, DEEPSEEK)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _op(static[0], static[1], w13, w2, bias, DEEPSEEK)
    for seed in (1, 2):
        x2, logits2, *_ = _layer(tokens, 256, 128, 32, "cuda", torch.bfloat16, seed=100 + seed)
        static[0].copy_(x2)
        static[1].copy_(logits2)
        graph.replay()
        torch.cuda.synchronize()
        eager = _op(x2, logits2, w13, w2, bias, DEEPSEEK)
        assert torch.equal(out, eager)  # same kernels, same inputs: bitwise equal


@gpu
def test_torch_compile_reduce_overhead():
    """The op inside an inductor graph with CUDA graphs (what the backend's rewrite produces)."""
    x, logits, w13, w2, bias = _layer(48, 256, 128, 32, "cuda", torch.bfloat16)

    def layer(x, logits):
        return _op(x, logits, w13, w2, bias, DEEPSEEK) * 2.0

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    eager = layer(x, logits)
    for _ in range(3):  # warm-up, record, replay
        got = compiled(x, logits)
    torch.cuda.synchronize()
    assert _rel(got, eager) < 1e-2
    x2, logits2, *_ = _layer(48, 256, 128, 32, "cuda", torch.bfloat16, seed=9)
    got2 = compiled(x2, logits2)  # a replay on new inputs follows them
    assert _rel(got2, layer(x2, logits2)) < 1e-2
