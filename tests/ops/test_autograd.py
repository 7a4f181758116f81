"""The fused ops' backward (ops/autograd.py) against autograd through an independent dense reference.

The reference runs every expert on every token and weights them with a dense [T, E] combine matrix built from
``select_experts`` (the routing semantics, tested against the per-token oracle elsewhere); the op's backward
sorts the pairs by expert and runs only the experts hit. fp32 within 1e-5 (relative to each gradient's scale),
bf16 within 2e-2.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import moe_compile
from moe_compile.ops import autograd as ag
from moe_compile.ops.config import RoutingConfig, RoutingMethod
from moe_compile.ops.routing import select_experts

T, H, I, E = 9, 16, 8, 6


@pytest.fixture(params=["grouped", "loop"])
def path(request, monkeypatch):
    """Runs a test through each experts backward: the grouped GEMMs (``experts_grad``) and the per-expert loop;
    fails if the grouped one was meant to run and did not."""
    calls = []
    if request.param == "loop":
        monkeypatch.setattr(ag.experts_grad, "usable", lambda *a: False)
    else:
        real = ag.experts_grad.grouped_backward
        monkeypatch.setattr(ag.experts_grad, "grouped_backward", lambda *a: calls.append(1) or real(*a))
    yield request.param
    assert bool(calls) == (request.param == "grouped")


def _act(h, activation, interleaved, alpha=1.702, limit=7.0):
    if activation.endswith("_no_mul"):
        return {"silu_no_mul": F.silu, "gelu_no_mul": F.gelu, "relu2_no_mul": lambda v: F.relu(v) ** 2}[activation](h)
    gate, up = (h[:, 0::2], h[:, 1::2]) if interleaved else h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "silu_clamped":
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    assert activation == "swigluoai"
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def _dense(x, weights, ids, w13, w2, b13, b2, activation, interleaved=False, on_input=False):
    combine = torch.zeros(x.shape[0], w13.shape[0], dtype=weights.dtype).scatter_add(1, ids.long(), weights)
    out = 0
    for e in range(w13.shape[0]):
        col = combine[:, e:e + 1].to(x.dtype)
        xin = x * col if on_input else x
        h = xin @ w13[e] + (0 if b13 is None else b13[e])
        y = _act(h, activation, interleaved) @ w2[e] + (0 if b2 is None else b2[e])
        out = out + (y * (col != 0) if on_input else col * y)
    return out


def _tensors(dtype, activation, biases, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = I if activation.endswith("_no_mul") else 2 * I

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()

    x, logits = rand(T, H), rand(T, E)
    w13, w2 = rand(E, H, width, scale=H ** -0.5), rand(E, I, H, scale=I ** -0.5)
    b13, b2 = (rand(E, width, scale=0.1), rand(E, H, scale=0.1)) if biases else (None, None)
    return x, logits, w13, w2, b13, b2


def _check(got, want, dtype, what):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = max(1.0, float(want.detach().abs().max()))
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}")


ROUTINGS = {
    "softmax_renorm": dict(routing_method="softmax", renormalize=True),
    "softmax_scaled": dict(routing_method="softmax", routed_scaling_factor=2.5),
    "sigmoid_groups_bias": dict(routing_method="sigmoid", k_group=2, group_count=3, group_select_mode=1,
                                routed_scaling_factor=1.5, bias=True),
    "sqrtsoftplus": dict(routing_method="sqrtsoftplus"),
    "llama4": dict(routing_method="sigmoid", scoring_after_topk=True, normalize_sigmoid=False,
                   apply_router_weight_on_input=True, top_k=1),
}
ACTIVATIONS = [("silu", False, False), ("silu", True, True), ("swigluoai", True, True), ("gelu_tanh", False, True),
               ("silu_clamped", False, False), ("relu2_no_mul", False, False)]


def _routing_config(kw, top_k):
    return RoutingConfig(num_experts=E, top_k=top_k, method=RoutingMethod(kw.get("routing_method", "softmax")),
                         renormalize=kw.get("renormalize", False),
                         routed_scaling_factor=kw.get("routed_scaling_factor", 1.0), k_group=kw.get("k_group", 1),
                         group_count=kw.get("group_count", 1), group_select_mode=kw.get("group_select_mode", 0),
                         has_correction_bias=kw.get("bias", False), normalize_sigmoid=kw.get("normalize_sigmoid", True),
                         scoring_after_topk=kw.get("scoring_after_topk", False))


def _fused_moe_case(routing, act, dtype, seed=0):
    kw = dict(ROUTINGS[routing])
    activation, interleaved, biases = act
    top_k = kw.pop("top_k", 2)
    x, logits, w13, w2, b13, b2 = _tensors(dtype, activation, biases, seed)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(7)) * 0.1 if kw.pop("bias", False) else None
    out = moe_compile.fused_moe(x, logits, E, top_k, w13, w2, w13_bias=b13, w2_bias=b2, e_score_correction_bias=bias,
                                activation=activation, gate_up_interleaved=interleaved, **kw)
    weights, ids = select_experts(logits, _routing_config({**kw, "bias": bias is not None}, top_k), bias)
    ref = _dense(x, weights, ids, w13, w2, b13, b2, activation, interleaved,
                 kw.get("apply_router_weight_on_input", False))
    return out, ref, [t for t in (x, logits, w13, w2, b13, b2) if t is not None]


CASES = [(r, a) for r in ROUTINGS for a in ACTIVATIONS if r != "llama4" or a == ACTIVATIONS[0]]  # Llama-4: its own


@pytest.mark.parametrize("routing,act", CASES, ids=["%s-%s%s" % (r, a[0], "-interleaved" * a[1]) for r, a in CASES])
def test_fused_moe_gradients_match_the_dense_reference(routing, act, path):
    out, ref, inputs = _fused_moe_case(routing, act, torch.float32)
    _check(out, ref, torch.float32, "forward")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ref, inputs, g)
    names = ["x", "logits", "w13", "w2", "w13_bias", "w2_bias"]
    for name, a, b in zip(names, got, want):
        _check(a, b, torch.float32, name)


def test_bf16_gradients_within_bf16_tolerance(path):
    out, ref, inputs = _fused_moe_case("softmax_renorm", ACTIVATIONS[0], torch.bfloat16)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for a, b in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref.float(), inputs, g.float())):
        assert a.dtype == torch.bfloat16
        _check(a, b, torch.bfloat16, "bf16")


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_bf16_backward_traced_into_the_graph_for_every_routing(routing, monkeypatch):
    """bf16 under AOTAutograd: the experts' grouped GEMMs and the routing's autograd are traced into the backward
    graph (``_routing_grad`` runs while the graph is traced, not when it runs), with gradients as the dense
    reference's within bf16's tolerance, for every routing method."""
    if not ag.experts_grad.traceable(torch.bfloat16):
        pytest.skip("this torch's fake _grouped_mm does not take bf16")
    calls = []
    real = ag._routing_grad
    monkeypatch.setattr(ag, "_routing_grad", lambda *a: calls.append(1) or real(*a))
    kw = dict(ROUTINGS[routing])
    top_k, has_bias = kw.pop("top_k", 2), kw.pop("bias", False)
    x, logits, w13, w2, _, _ = _tensors(torch.bfloat16, "silu", False, seed=2)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(7)) * 0.1 if has_bias else None

    def block(x, logits, w13, w2):
        return moe_compile.fused_moe(x, logits, E, top_k, w13, w2, e_score_correction_bias=bias, **kw)

    torch._dynamo.reset()  # each routing its own compile (the closure differs)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    weights, ids = select_experts(logits, _routing_config({**kw, "bias": has_bias}, top_k), bias)
    ref = _dense(x, weights, ids, w13, w2, None, None, "silu", on_input=kw.get("apply_router_weight_on_input", False))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    inputs = [x, logits, w13, w2]
    want = torch.autograd.grad(ref.float(), inputs, g.float())
    for step in range(2):
        got = torch.autograd.grad(compiled(*inputs), inputs, g)
        for name, a, b in zip(["x", "logits", "w13", "w2"], got, want):
            _check(a, b, torch.bfloat16, f"{name}, step {step}")
    assert len(calls) == 1  # at the trace; the second step ran the graph's own ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_experts_gradients_reach_the_routing_weights(path, dtype):
    """bf16 runs the backward's ops directly (the form traced into a graph), fp32 the opaque op."""
    x, logits, w13, w2, _, _ = _tensors(dtype, "silu", False, seed=1)
    weights, ids = torch.softmax(logits.float(), -1).topk(2, dim=-1)
    weights = weights.to(dtype)
    out = torch.ops.moe_compile.fused_experts(x, weights, ids.int(), w13, w2, None, None, E, "silu", 1.702, 7.0,
                                              False, False, None, None, None, True, True, "auto")
    ref = _dense(x, weights, ids, w13, w2, None, None, "silu")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    inputs = [x, logits, w13, w2]
    for name, a, b in zip(["x", "logits", "w13", "w2"], torch.autograd.grad(out, inputs, g, retain_graph=True),
                          torch.autograd.grad(ref.float(), inputs, g.float())):
        _check(a, b, dtype, name)


def test_only_the_inputs_that_need_a_gradient_get_one(monkeypatch):
    x, logits, w13, w2, _, _ = _tensors(torch.float32, "silu", False)
    w13 = w13.detach()  # frozen experts (e.g. adapters trained elsewhere)
    seen = []
    real = ag.experts_backward

    def spy(*args):
        seen.append(list(args[9]))  # needs
        return real(*args)

    monkeypatch.setattr(ag, "experts_backward", spy)
    out = moe_compile.fused_moe(x, logits, E, 2, w13, w2)
    gx, gw2 = torch.autograd.grad(out.sum(), [x, w2])
    assert seen == [[True, True, False, True, False, False]]
    assert gx.shape == x.shape and gw2.shape == w2.shape


def test_the_backward_refuses_parallel_groups_by_name():
    x, logits, w13, w2, _, _ = _tensors(torch.float32, "silu", False)
    scalars = [E, 2, "softmax", False, 1.0, 1, 1, 0, True, False, "silu", 1.702, 7.0, False, False, None, "ep0",
               None, True, True, "auto"]
    with pytest.raises(NotImplementedError, match="ep_group_name='ep0'"):
        torch.ops.moe_compile.fused_moe_backward(torch.ones(T, H), x, logits, w13, w2, None, None, None,
                                                 [True] * 6, [False, False], json.dumps(scalars))


def test_experts_nobody_picked_get_zero_gradient(path):
    x, logits, w13, w2, _, _ = _tensors(torch.float32, "silu", False)
    logits = logits.detach().clone()
    logits[:, 4:] = -30.0  # experts 4 and 5 never picked
    out = moe_compile.fused_moe(x, logits, E, 2, w13, w2)
    gw13, = torch.autograd.grad(out.sum(), [w13])
    assert torch.count_nonzero(gw13[4:]) == 0 and torch.count_nonzero(gw13[:4]) > 0


def test_the_backward_ops_are_kept_out_of_cuda_graphs():
    """They read expert counts on the host; Inductor's CUDA graphs skip or partition around ops with this tag."""
    for name in ("fused_moe_backward", "fused_experts_backward"):
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.moe_compile, name).default.tags
    assert torch.Tag.cudagraph_unsafe not in torch.ops.moe_compile.fused_moe.default.tags


def test_gradients_are_laid_out_as_the_fake_says_for_permuted_weights(path):
    """HF stores gate_up_proj as [E, 2I, H]; the op reads a permuted view. Inductor holds the op's outputs to the
    fake kernel's strides: the activations' gradients contiguous, the weights' laid out as the weights (so the
    parameter's own gradient is dense and autograd accumulates it without a copy)."""
    x, logits, w13, w2, _, _ = _tensors(torch.float32, "silu", False)
    w13_t = w13.detach().transpose(1, 2).contiguous().requires_grad_()  # stored [E, 2I, H]
    scalars = json.dumps([E, 2, "softmax", True, 1.0, 1, 1, 0, True, False, "silu", 1.702, 7.0, False, False, None,
                          None, None, True, True, "auto"])
    args = (torch.ones(T, H), x, logits, w13_t.transpose(1, 2), w2, None, None, None, [True] * 6, [True, False],
            scalars)
    with torch.no_grad():  # as the backward runs (no double backward)
        real = torch.ops.moe_compile.fused_moe_backward(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.moe_compile.fused_moe_backward(*args)
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.stride() == f.stride()
    with torch.no_grad():  # the layout follows the flag, not the strides the real call is handed
        again = torch.ops.moe_compile.fused_moe_backward(*args[:3], w13_t.transpose(1, 2).contiguous(), *args[4:])
    assert [g.stride() for g in again] == [g.stride() for g in real]
    assert real[0].is_contiguous() and real[1].is_contiguous() and real[2].transpose(1, 2).is_contiguous()
    out = moe_compile.fused_moe(x, logits, E, 2, w13_t.transpose(1, 2), w2, renormalize=True)
    grad, = torch.autograd.grad(out.sum(), [w13_t])
    assert grad.is_contiguous()


def test_double_backward_is_refused_by_name():
    x, logits, w13, w2, _, _ = _tensors(torch.float32, "silu", False)
    out = moe_compile.fused_moe(x, logits, E, 2, w13, w2)
    with pytest.raises(NotImplementedError, match="double backward through moe_compile::fused_moe"):
        torch.autograd.grad(out.sum(), [x], create_graph=True)


def test_sizes_grouped_gemms_cannot_take_loop_over_the_experts(monkeypatch):
    """fp32 rows of 6 elements are 24 bytes, not a multiple of 16: ``torch._grouped_mm`` refuses them, so the
    backward loops over the experts, with the same gradients."""
    assert ag.experts_grad.usable(torch.ones(4, 16), torch.ones(E, 16, 16), torch.ones(E, 8, 16))
    assert not ag.experts_grad.usable(torch.ones(4, 6), torch.ones(E, 6, 16), torch.ones(E, 8, 6))
    assert not ag.experts_grad.usable(torch.ones(4, 16), torch.ones(E, 16, 16).double(), torch.ones(E, 8, 16))
    monkeypatch.setattr(ag.experts_grad, "grouped_backward", None)  # would fail if called
    gen = torch.Generator().manual_seed(5)
    x, logits = torch.randn(T, 6, generator=gen, requires_grad=True), torch.randn(T, E, generator=gen)
    w13 = (torch.randn(E, 6, 16, generator=gen) * 0.4).requires_grad_()
    w2 = (torch.randn(E, 8, 6, generator=gen) * 0.3).requires_grad_()
    out = moe_compile.fused_moe(x, logits, E, 2, w13, w2, renormalize=True)
    weights, ids = torch.softmax(logits, -1).topk(2, dim=-1)
    ref = _dense(x, weights / weights.sum(-1, keepdim=True), ids, w13, w2, None, None, "silu")
    for name, a, b in zip(["x", "w13", "w2"], torch.autograd.grad(out.sum(), [x, w13, w2]),
                          torch.autograd.grad(ref.sum(), [x, w13, w2])):
        _check(a, b, torch.float32, name)


gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                         reason="needs a CUDA GPU of sm90 or later (torch._grouped_mm's sync-free bf16 path)")


@gpu
def test_cuda_bf16_backward_is_grouped_sync_free_and_zeroes_unpicked_experts(monkeypatch):
    """On the GPU: the grouped GEMMs run, nothing is read on the host (sync debug mode 'error'), the gradients
    match the dense fp32 reference within bf16's tolerance, and experts nobody picked get exact zeros even when
    the allocator hands out memory full of NaNs."""
    tokens, hidden, inter, experts = 64, 256, 128, 16
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 12:] = -30.0  # experts 12-15 never picked
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5  # HF's layout, read permuted
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    cpu = [t.clone().requires_grad_() for t in (x, logits, w13, w2)]
    dev = [t.to("cuda", torch.bfloat16 if i != 1 else torch.float32).requires_grad_() for i, t in enumerate(cpu)]
    calls = []
    real = ag.experts_grad.grouped_backward
    monkeypatch.setattr(ag.experts_grad, "grouped_backward", lambda *a: calls.append(1) or real(*a))
    g = torch.randn(tokens, hidden, generator=gen)
    g_dev = g.to("cuda", torch.bfloat16)  # a copy from pageable host memory syncs: made before the check

    def grads(t, gout):
        out = moe_compile.fused_moe(t[0], t[1], experts, 2, t[2].transpose(1, 2), t[3].transpose(1, 2),
                                    renormalize=True)
        return torch.autograd.grad(out, t, gout)

    grads(dev, g_dev)  # compile the forward's kernels
    torch.empty(1 << 26, device="cuda").fill_(float("nan"))  # freed: the next allocations reuse NaN-filled memory
    out = moe_compile.fused_moe(dev[0], dev[1], experts, 2, dev[2].transpose(1, 2), dev[3].transpose(1, 2),
                                renormalize=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = torch.autograd.grad(out, dev, g_dev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert calls
    weights, ids = torch.softmax(cpu[1], -1).topk(2, dim=-1)
    ref = _dense(cpu[0], weights / weights.sum(-1, keepdim=True), ids, cpu[2].transpose(1, 2),
                 cpu[3].transpose(1, 2), None, None, "silu")
    want = torch.autograd.grad(ref, cpu, g)
    for name, a, b in zip(["x", "logits", "w13", "w2"], got, want):
        assert torch.isfinite(a).all(), name
        _check(a.cpu(), b, torch.bfloat16, name)
    assert torch.count_nonzero(got[2][12:]) == 0 and torch.count_nonzero(got[3][12:]) == 0
    assert got[2].is_contiguous() and got[3].is_contiguous()  # the parameters' own layout
