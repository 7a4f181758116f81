"""Training graphs (moe_compile/training.py): blocks rewritten in graphs that record autograd, gradients as eager's.

Each case runs one forward and backward of the compiled model and of the eager model, with the loss
``sum(out * R)`` for a fixed random ``R`` (a loss whose gradients are not all cancelled by a final norm), and
checks: every MoE layer rewritten, the output within the dtype's tolerance, the same parameters given a gradient,
each gradient within fp32 1e-4 of eager relative to its largest entry, and the fused ops' backward run once per
rewritten block.
"""
from __future__ import annotations

import copy

import pytest
import torch

import moe_compile
from moe_compile.ops import autograd as ag
from moe_compile.report import collecting
from moe_compile.testing import zoo
from moe_compile.testing.zoo_blocks import build_block_model

from .helpers import TOL, first_tensor, max_rel_diff

HF = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma4", "deepseek_v4_hash"]
BLOCKS = ["v4_mixtral", "gptfast", "titan_loop", "v4_grouped_sigmoid"]


def _model(name: str):
    if name in BLOCKS:
        return build_block_model(name, num_layers=2, num_tokens=7, batch=2)
    ok, why = zoo.is_available(name)
    if not ok:
        pytest.skip(why)
    model, _ = zoo.build_model(name)
    return model, zoo.build_inputs(name, num_tokens=7, batch=2)


def _step(model, kwargs, forward=None):
    """One forward and backward; (output, {parameter name: gradient})."""
    model.zero_grad(set_to_none=True)
    out = first_tensor((model if forward is None else forward)(**kwargs))
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out.float() * proj).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_match(got: dict, want: dict, tol: float) -> None:
    assert set(got) == set(want)
    worst = max((max_rel_diff(got[n], want[n]), n) for n in want)
    assert worst[0] <= tol, worst


@pytest.fixture
def backward_calls(monkeypatch):
    calls = []
    real = ag.experts_backward

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ag, "experts_backward", counted)
    return calls


@pytest.mark.parametrize("name", HF + BLOCKS)
def test_training_step_matches_eager(name, backward_calls):
    model, kwargs = _model(name)
    ref_out, ref_grads = _step(model, kwargs)
    report = moe_compile.explain(model, options={"inner_compiler": "aot_eager"}, training=True, **kwargs)
    layers = len(zoo.moe_block_paths(model, name)) if name in HF else 2
    assert len(report.rewritten) == layers, str(report)
    out = first_tensor(report.output)
    assert max_rel_diff(out, ref_out) <= TOL[torch.float32]
    assert not backward_calls
    model.zero_grad(set_to_none=True)
    (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _assert_grads_match(grads, ref_grads, TOL[torch.float32])
    assert len(backward_calls) == layers


def test_inductor_training_step_matches_eager(backward_calls):
    model, kwargs = _model("qwen3_moe")
    ref_out, ref_grads = _step(model, kwargs)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", options={"inner_compiler": "inductor"})
    with collecting() as report:
        out, grads = _step(model, kwargs, compiled)
    assert len(report.rewritten) == 2, str(report)
    assert max_rel_diff(out, ref_out) <= TOL[torch.float32]
    _assert_grads_match(grads, ref_grads, TOL[torch.float32])
    assert len(backward_calls) == 2


def test_inductor_compiles_the_bf16_backward_traced_into_the_graph(backward_calls):
    """bf16 under Inductor: the grouped GEMMs of the backward are graph nodes Inductor lowers (traced once while
    compiling; the opaque backward op never runs), with gradients as eager's within bf16's tolerance."""
    model, kwargs = build_block_model("v4_mixtral", num_layers=1, num_tokens=7, batch=2, dtype=torch.bfloat16)
    ref_out, ref_grads = _step(model, kwargs)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", options={"inner_compiler": "inductor"})
    with collecting() as report:
        out, grads = _step(model, kwargs, compiled)
    assert report.rewritten == ["layers.0.moe"], str(report)
    assert max_rel_diff(out, ref_out) <= TOL[torch.bfloat16]
    _assert_grads_match(grads, ref_grads, TOL[torch.bfloat16])
    assert len(backward_calls) == 1  # the trace; a second step runs the compiled graphs alone
    _step(model, kwargs, compiled)
    assert len(backward_calls) == 1


@pytest.mark.parametrize("name", ["v4_mixtral", "gptfast"])
def test_autocast_training_step_matches_eager_autocast(name):
    """fp32 parameters under ``torch.autocast`` (bf16 matmuls): the op is given the graph's casts of the stacked
    weights, so it computes in bf16 as the block does, and the gradients reach the fp32 parameters. Held to fp32
    eager: on the whole no further from it than eager autocast is (both round, differently)."""
    model, kwargs = build_block_model(name, num_layers=2, num_tokens=7, batch=2)

    def step(forward, autocast=True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = first_tensor(forward(**kwargs))
        (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    exact_out, exact = step(model, autocast=False)
    ref_out, ref_grads = step(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    with collecting() as report:
        out, grads = step(compiled)
    assert report.rewritten == ["layers.0.moe", "layers.1.moe"], str(report)
    assert all(g.dtype == torch.float32 for g in grads.values()) and set(grads) == set(exact)
    assert max_rel_diff(out, exact_out) <= 1.5 * max_rel_diff(ref_out, exact_out)
    ours = [max_rel_diff(grads[n], exact[n]) for n in exact]
    eager = [max_rel_diff(ref_grads[n], exact[n]) for n in exact]
    # per parameter the two trade places; over all of them ours is as close (measured: mean 0.95-0.97 of eager's;
    # the activation's derivative in bf16 steps, before this session, was 1.16 of it for v4_mixtral)
    assert sum(ours) <= 1.1 * sum(eager) and max(ours) <= 1.5 * max(eager), (sum(ours), sum(eager))


def test_optimizer_steps_follow_the_updated_weights():
    """Stacked ModuleList weights are made in the graph, so after an optimizer step the compiled model reads the
    new weights (the inference rewrite's cached copy would be re-made instead); three SGD steps as eager's."""
    model, kwargs = build_block_model("v4_mixtral", num_layers=2, num_tokens=7, batch=2)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin)]
    for _ in range(3):
        out, _ = _step(model, kwargs, compiled)
        ref, _ = _step(twin, kwargs)
        assert max_rel_diff(out, ref) <= TOL[torch.float32]
        for opt in opts:
            opt.step()
    assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 2  # compiled once
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert max_rel_diff(p, q) <= TOL[torch.float32], name


def _skip_reasons(model, kwargs, options=None, **compile_kwargs):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager", **(options or {})},
                             **compile_kwargs)
    with collecting() as report:
        out = first_tensor(compiled(**kwargs))
    out.sum().backward()  # the plain graph trains as before
    assert not report.rewritten, str(report)
    return [reason for _, reason in report.skipped]


def test_training_false_compiles_training_graphs_without_the_pass():
    model, kwargs = build_block_model("gptfast", num_layers=1)
    reasons = _skip_reasons(model, kwargs, {"training": False})
    assert any("options['training'] is False" in r for r in reasons), reasons


class _Detaching(torch.nn.Module):
    def __init__(self, inner, detach: bool):
        super().__init__()
        self.inner, self.detach = inner, detach

    def forward(self, hidden_states):
        if self.detach:
            shift = hidden_states.pow(2).mean(-1, keepdim=True).detach()
        else:
            with torch.no_grad():
                shift = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.inner(hidden_states=hidden_states * shift)


@pytest.mark.parametrize("detach", [False, True], ids=["no_grad", "detach"])
def test_no_grad_regions_and_detaches_keep_their_meaning(detach):
    """A value computed under ``torch.no_grad()`` (or detached) in the compiled graph gets no gradient after the
    rewrite either: the input's gradient is eager's, not the one through the shift."""
    model, kwargs = build_block_model("gptfast", num_layers=1)
    wrapped = _Detaching(model, detach)
    x = kwargs["hidden_states"].clone().requires_grad_()
    ref_out, ref_grads = _step(wrapped, {"hidden_states": x})
    ref_dx, x.grad = x.grad.clone(), None
    torch._dynamo.reset()
    compiled = torch.compile(wrapped, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    with collecting() as report:
        out, grads = _step(wrapped, {"hidden_states": x}, compiled)
    assert report.rewritten == ["inner.layers.0.moe"], str(report)
    assert max_rel_diff(out, ref_out) <= TOL[torch.float32]
    assert max_rel_diff(x.grad, ref_dx) <= TOL[torch.float32]
    _assert_grads_match(grads, ref_grads, TOL[torch.float32])


@pytest.mark.parametrize("in_graph", [True, False], ids=["in_graph", "opaque_op"])
def test_bf16_training_step_within_bf16_tolerance(in_graph, backward_calls, monkeypatch):
    """bf16: the backward's grouped GEMMs and the routing's autograd are traced into the graph (AOTAutograd calls
    ``experts_backward`` and ``_routing_grad`` once, while compiling; the step then runs the graph's ops alone), or,
    when that is off, run by the opaque ``fused_moe_backward`` op during the step (``options['training_backward'] =
    'op'``)."""
    routing_calls = []
    real_routing = ag._routing_grad
    monkeypatch.setattr(ag, "_routing_grad", lambda *a: routing_calls.append(1) or real_routing(*a))
    model, kwargs = build_block_model("v4_mixtral", num_layers=1, num_tokens=7, batch=2, dtype=torch.bfloat16)
    ref_out, ref_grads = _step(model, kwargs)
    options = {"inner_compiler": "aot_eager", "training_backward": "auto" if in_graph else "op"}
    report = moe_compile.explain(model, options=options, training=True, **kwargs)
    assert report.rewritten == ["layers.0.moe"], str(report)
    out = first_tensor(report.output)
    assert max_rel_diff(out, ref_out) <= TOL[torch.bfloat16]
    assert len(backward_calls) == len(routing_calls) == (1 if in_graph else 0)
    model.zero_grad(set_to_none=True)
    (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
    assert len(backward_calls) == 1 and len(routing_calls) == 1
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _assert_grads_match(grads, ref_grads, TOL[torch.bfloat16])


def test_the_load_balancing_loss_trains_through_the_rewritten_blocks():
    """``output_router_logits=True`` with labels: the loss holds the auxiliary load-balancing loss, whose top-k over
    the router logits is reported as no block of its own; loss, auxiliary loss and gradients as eager's."""
    model, _ = _model("mixtral")
    model.config.router_aux_loss_coef = 0.1
    kwargs = zoo.build_inputs("mixtral", num_tokens=7, batch=2)
    kwargs.update(labels=kwargs["input_ids"], output_router_logits=True)

    def step(forward):
        model.zero_grad(set_to_none=True)
        out = forward(**kwargs)
        out.loss.backward()
        return out.loss.item(), out.aux_loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, aux, ref_grads = step(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})
    with collecting() as report:
        got_loss, got_aux, grads = step(compiled)
    assert len(report.rewritten) == 2 and not report.skipped, str(report)
    assert any("load-balancing" in why for _, why in report.other_topk), str(report)
    assert got_loss == pytest.approx(loss, rel=1e-5) and got_aux == pytest.approx(aux, rel=1e-5)
    _assert_grads_match(grads, ref_grads, TOL[torch.float32])


def test_bad_training_arguments_are_refused_by_name():
    model, kwargs = build_block_model("gptfast", num_layers=1)
    # Dynamo wraps the backend's TypeError; the message is the option's
    wrapped = torch._dynamo.exc.BackendCompilerFailed
    with pytest.raises(wrapped, match=r"options\['training'\] must be a bool, but got 'yes'"):
        moe_compile.explain(model, options={"training": "yes"}, **kwargs)
    with pytest.raises(TypeError, match="explain: training must be a bool, but got 1"):
        moe_compile.explain(model, training=1, **kwargs)
    with pytest.raises(wrapped, match=r"options\['training_backward'\] must be 'auto' or 'op', but got 'graph'"):
        moe_compile.explain(model, options={"training_backward": "graph"}, **kwargs)
