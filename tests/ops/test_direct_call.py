"""Plain eager inference calls the op's implementation directly (no custom-op dispatch); anything
that must see one op node (autograd recording, a dispatch mode, torch.compile) goes through
``torch.ops``. Both give the same output."""
from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_compile import fused_moe
from moe_compile.ops import custom_op
from moe_inputs import make_inputs, seed_custom_routing_function


def _args(**spec):
    t = make_inputs(seed=3, **spec)
    return (t["hidden_states"], t["router_logits"], 8, 2, t["w13_weight"], t["w2_weight"])


@pytest.fixture
def calls(monkeypatch):
    """Each run of the op's body, marked 'op' when the dispatcher called it (our op kernels or torch.library's)."""
    seen = []
    real = custom_op._run

    def spy(cfg, inputs):
        frame, inside = sys._getframe(1), False
        while frame is not None and not inside:
            name = frame.f_code.co_filename.replace("\\", "/")
            inside = "torch/_library" in name or name.endswith("moe_compile/ops/registration.py")
            frame = frame.f_back
        seen.append("op" if inside else "direct")
        return real(cfg, inputs)

    monkeypatch.setattr(custom_op, "_run", spy)
    return seen


def test_plain_eager_inference_calls_the_implementation_directly(calls):
    args = _args()
    with torch.no_grad():
        direct = fused_moe(*args, renormalize=True)
    assert calls == ["direct"]
    via_op = torch.ops.moe_compile.fused_moe(
        args[0], args[1], args[4], args[5], None, None, None, num_experts=8, top_k=2, routing_method="softmax",
        renormalize=True, routed_scaling_factor=1.0, k_group=1, group_count=1, group_select_mode=0,
        normalize_sigmoid=True, scoring_after_topk=False, activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0,
        gate_up_interleaved=False, apply_router_weight_on_input=False, tp_group_name=None, ep_group_name=None,
        dispatcher_type=None, tokens_full=True, reduce_results=True, lowering="auto")
    assert calls == ["direct", "op"]
    assert torch.equal(direct, via_op)


def test_custom_routing_function_takes_the_direct_call_too(calls):
    args = _args()
    with torch.no_grad():
        fused_moe(*args, custom_routing_function=seed_custom_routing_function)
    assert calls == ["direct"]


def test_weights_that_record_autograd_go_through_the_op(calls):
    x, logits, e, k, w13, w2 = _args()
    fused_moe(x, logits, e, k, w13.requires_grad_(), w2)
    assert calls == ["op"]
    with torch.no_grad():  # nothing records under no_grad
        fused_moe(x, logits, e, k, w13, w2)
    assert calls == ["op", "direct"]


def test_a_dispatch_mode_sees_the_op(calls):
    seen_ops = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen_ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    args = _args()
    with torch.no_grad(), Watch():
        fused_moe(*args)
    assert calls == ["op"] and "fused_moe" in seen_ops


def test_compiled_calls_go_through_the_op(calls):
    args = _args()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(x, logits, w13, w2):
        return fused_moe(x, logits, 8, 2, w13, w2)

    with torch.no_grad():
        f(args[0], args[1], args[4], args[5])
    assert "direct" not in calls and calls


def test_jit_trace_records_the_op(calls):
    args = _args()

    def f(x, logits, w13, w2):
        return fused_moe(x, logits, 8, 2, w13, w2)

    with torch.no_grad():
        traced = torch.jit.trace(f, (args[0], args[1], args[4], args[5]), check_trace=False)
    assert calls == ["op"]
    assert "moe_compile::fused_moe" in str(traced.graph)
