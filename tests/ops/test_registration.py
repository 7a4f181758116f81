"""``moe_compile.ops.registration``: a plain call runs the op's body straight from its autograd kernel; everything
that must see the op below autograd (grad recording, fake tensors, dispatch modes, functionalization, meta) still
does, and the op behaves as a ``custom_op`` would."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from moe_compile.ops import registration
from moe_compile.ops.registration import Op, op

_RUNS: list = []


@op("moe_compile::_test_scale")
def _scale(x: torch.Tensor, w: torch.Tensor, factor: float) -> torch.Tensor:
    # True: the dispatcher took us below autograd first (custom_op's path); False: called straight from the
    # autograd kernel
    _RUNS.append(torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality))
    return x * w * factor


@_scale.register_fake
def _scale_fake(x, w, factor):
    return torch.empty_like(x)


def _call(x, w, factor=2.0):
    _RUNS.clear()
    out = torch.ops.moe_compile._test_scale(x, w, factor)
    return out, list(_RUNS)


def test_a_plain_call_runs_the_body_straight_from_the_autograd_kernel():
    x, w = torch.randn(4), torch.randn(4)
    with torch.no_grad():
        out, runs = _call(x, w)
    assert runs == [False]
    torch.testing.assert_close(out, x * w * 2.0, rtol=0, atol=0)
    out, runs = _call(x, w)  # grad mode on, but nothing requires grad: still straight
    assert runs == [False] and out.grad_fn is None


def test_direct_off_takes_custom_ops_path(monkeypatch):
    monkeypatch.setattr(registration, "DIRECT", False)
    x, w = torch.randn(4), torch.randn(4)
    with torch.no_grad():
        out, runs = _call(x, w)
    assert runs == [True]
    torch.testing.assert_close(out, x * w * 2.0, rtol=0, atol=0)


def test_inference_mode_skips_autograd_altogether():
    x, w = torch.randn(4), torch.randn(4)
    with torch.inference_mode():
        out, runs = _call(x, w)
    assert len(runs) == 1
    torch.testing.assert_close(out, x * w * 2.0, rtol=0, atol=0)


def test_recording_autograd_goes_below_it_and_backward_says_the_op_has_no_formula():
    x, w = torch.randn(4, requires_grad=True), torch.randn(4)
    out, runs = _call(x, w)
    assert runs == [True]
    assert out.grad_fn is not None
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()
    with torch.no_grad():  # the same tensors without recording: straight
        assert _call(x, w)[1] == [False]


def test_fake_tensors_meta_and_dispatch_modes_see_the_op():
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.randn(4)), mode.from_tensor(torch.randn(4))
        out, runs = _call(x, w)
    assert runs == [] and out.shape == (4,)
    out, runs = _call(torch.randn(4, device="meta"), torch.randn(4, device="meta"))
    assert runs == [] and out.device.type == "meta"

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record():
        _call(torch.randn(4), torch.randn(4))
    assert torch.ops.moe_compile._test_scale.default in seen


def test_functionalization_and_make_fx_record_one_node():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return torch.ops.moe_compile._test_scale(x, w, 3.0) + 1

    gm = make_fx(torch.func.functionalize(f))(torch.randn(4), torch.randn(4))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.moe_compile._test_scale.default) == 1


def test_the_op_passes_opcheck_and_compiles():
    x, w = torch.randn(4), torch.randn(4)
    torch.library.opcheck(torch.ops.moe_compile._test_scale.default, (x, w, 2.0))
    compiled = torch.compile(lambda a, b: torch.ops.moe_compile._test_scale(a, b, 2.0) - a, backend="aot_eager",
                             fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w), x * w * 2.0 - x, rtol=0, atol=0)


def test_the_op_object_calls_through_the_dispatcher_and_keeps_the_body():
    assert isinstance(_scale, Op) and "moe_compile::_test_scale" in repr(_scale)
    x, w = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(_scale(x, w, 0.5), x * w * 0.5, rtol=0, atol=0)
    assert _scale._init_fn(x, w, 1.0).shape == (4,)
    assert torch.ops.moe_compile._test_scale.default.tags == [torch.Tag.pt2_compliant_tag]


@pytest.mark.parametrize("qualname", ["other::f", "moe_compile", "moe_compile::", "moe_compile::a::b"])
def test_a_name_outside_our_namespace_is_refused(qualname):
    with pytest.raises(ValueError, match=f"qualname={qualname!r}; expected 'moe_compile::<name>'"):
        op(qualname)(lambda x: x)
