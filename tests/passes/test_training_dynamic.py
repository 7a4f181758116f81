"""Training graphs with symbolic shapes: the aten graph the pass rewrites is traced at Dynamo's own fake inputs, in
its shape environment (``training.trace_to_aten``), so one compile serves every sequence length.

Each case runs forward and backward of the compiled model at several lengths and of the eager model at the same
inputs, with the loss ``sum(out * R)`` for a fixed random ``R``, and checks: the blocks rewritten at the compile,
the number of compiles, the output within the dtype's tolerance and each gradient within it relative to its largest
entry.
"""
from __future__ import annotations

import pytest
import torch

from moe_compile.ops import autograd as ag
from moe_compile.report import collecting
from moe_compile.testing import zoo
from moe_compile.testing.zoo_blocks import build_block_model

from .helpers import TOL, first_tensor, max_rel_diff

LENGTHS = (5, 9, 13)
HF = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "gemma4")


def _inputs(name: str, model, tokens: int, dtype=torch.float32) -> dict:
    if name in HF:
        return zoo.build_inputs(name, num_tokens=tokens, batch=2)
    hidden = next(model.parameters()).shape[-1]
    x = torch.randn(2, tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    return {"hidden_states": x.to(dtype)}


def _model(name: str, dtype=torch.float32):
    if name in HF:
        ok, why = zoo.is_available(name)
        if not ok:
            pytest.skip(why)
        return zoo.build_model(name)[0]
    return build_block_model(name, num_layers=2, num_tokens=7, batch=2, dtype=dtype)[0]


def _step(model, kwargs, forward=None):
    model.zero_grad(set_to_none=True)
    out = first_tensor((model if forward is None else forward)(**kwargs))
    (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(name: str, dynamic, inner: str = "aot_eager", dtype=torch.float32) -> list:
    """Per length: (blocks rewritten while it ran, output and gradient errors against eager)."""
    model = _model(name, dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", dynamic=dynamic, options={"inner_compiler": inner})
    rows = []
    for tokens in LENGTHS:
        kwargs = _inputs(name, model, tokens, dtype)
        ref_out, ref_grads = _step(model, kwargs)
        with collecting() as report:
            out, grads = _step(model, kwargs, compiled)
        assert set(grads) == set(ref_grads), tokens
        worst = max(max_rel_diff(grads[n], ref_grads[n]) for n in ref_grads)
        rows.append((list(report.rewritten), max_rel_diff(out, ref_out), worst))
    return rows


@pytest.mark.parametrize("name", list(HF) + ["gptfast", "v4_mixtral", "titan_loop"])
def test_one_symbolic_compile_trains_every_length(name):
    rows = _run(name, dynamic=True)
    assert len(rows[0][0]) == 2, rows  # both layers rewritten at the one compile, with symbolic shapes
    assert [r[0] for r in rows[1:]] == [[], []], rows  # no recompile for the other lengths
    for rewritten, out_err, grad_err in rows:
        assert out_err <= TOL[torch.float32] and grad_err <= TOL[torch.float32], rows


def test_automatic_dynamic_recompile_is_rewritten():
    """``dynamic=None`` (the default): the first length compiles static, the second recompiles with a symbolic
    length, which is rewritten too (it was compiled without the pass before), and the third reuses it."""
    rows = _run("qwen3_moe", dynamic=None)
    assert [len(r[0]) for r in rows] == [2, 2, 0], rows
    assert all(r[1] <= TOL[torch.float32] and r[2] <= TOL[torch.float32] for r in rows), rows


def test_inductor_symbolic_training_matches_eager():
    rows = _run("qwen3_moe", dynamic=True, inner="inductor")
    assert [len(r[0]) for r in rows] == [2, 0, 0], rows
    assert all(r[1] <= TOL[torch.float32] and r[2] <= TOL[torch.float32] for r in rows), rows


def test_bf16_backward_traced_with_a_symbolic_length(monkeypatch):
    """bf16, where the backward's grouped GEMMs are traced into the graph: with a symbolic token count the pair
    offsets stay tensors, so one compile's backward serves every length (and the opaque op never runs)."""
    from moe_compile.ops import experts_grad

    if not experts_grad.traceable(torch.bfloat16):
        pytest.skip("this torch's fake _grouped_mm does not take bf16")
    def loop(*args, **kwargs):
        raise AssertionError("the per-expert loop ran: the grouped backward was meant to")

    monkeypatch.setattr(ag, "_looped_backward", loop)
    rows = _run("v4_mixtral", dynamic=True, dtype=torch.bfloat16)
    assert [len(r[0]) for r in rows] == [2, 0, 0], rows
    assert all(r[1] <= TOL[torch.bfloat16] and r[2] <= TOL[torch.bfloat16] for r in rows), rows


def test_a_symbolic_size_without_a_symint_input_is_seen():
    """A graph whose inputs Dynamo traced with a symbolic size counts as symbolic even without a SymInt input, so it
    is never traced at the example's concrete sizes (which would bake one length into the graph)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from moe_compile import training

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(x)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    real = torch.randn(3, 4)
    x.meta["example_value"] = FakeTensorMode().from_tensor(real)
    assert not training._symbolic(gm, [real])
    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x.meta["example_value"] = mode.from_tensor(real, symbolic_context=context, source=ConstantSource("x"))
    assert training._symbolic(gm, [real])


class _MaskedPad(torch.nn.Module):
    """A prefix with a data-dependent size (boolean-mask indexing: an unbacked symbol) padded back to the length by
    that symbolic amount (``constant_pad_nd``, whose C++ meta takes only concrete pads), as GLM-5-Next's indexer
    does, in front of a MoE model."""

    def __init__(self, inner: torch.nn.Module, hidden: int):
        super().__init__()
        self.inner, self.proj = inner, torch.nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        keep = hidden_states[0, :, 0] > 0
        picked = hidden_states[:, keep]
        padded = torch.nn.functional.pad(picked, (0, 0, 0, hidden_states.shape[1] - picked.shape[1]))
        return self.inner(hidden_states=hidden_states + self.proj(padded))


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_data_dependent_size_is_traced_in_dynamos_shape_env(dynamic):
    """A training graph holding an unbacked size is traced at Dynamo's fakes in its shape environment, with the
    unbacked symbols rebound and the Python dispatcher on (as AOTAutograd traces), also at static shapes; before,
    it was left alone ("could not be traced to aten")."""
    inner = _model("v4_mixtral")
    model = _MaskedPad(inner, next(inner.parameters()).shape[-1])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", dynamic=dynamic, options={"inner_compiler": "aot_eager"})
    for tokens in (5, 9):
        kwargs = _inputs("v4_mixtral", model, tokens)
        ref_out, ref_grads = _step(model, kwargs)
        with collecting() as report:
            out, grads = _step(model, kwargs, compiled)
        assert not report.skipped and len(report.rewritten) == (2 if tokens == 5 or not dynamic else 0), report
        assert max_rel_diff(out, ref_out) <= TOL[torch.float32]
        assert max(max_rel_diff(grads[n], ref_grads[n]) for n in ref_grads) <= TOL[torch.float32]
