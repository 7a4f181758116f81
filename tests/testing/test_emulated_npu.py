"""emulated_npu(): registration, cleanup, refusal next to a real torch_npu, tracing and counting."""
import sys
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from moe_compile.testing import emulated_npu
from moe_compile.testing.npu_library import SCHEMAS


def _npu_ops_defined() -> list[str]:
    return [name for name in SCHEMAS if hasattr(torch.ops.npu, name)]


def test_ops_exist_only_inside_and_sys_modules_is_restored():
    assert "torch_npu" not in sys.modules and _npu_ops_defined() == []
    with emulated_npu() as npu:
        import torch_npu

        assert torch_npu.__version__ == "2.14.0"
        assert _npu_ops_defined() == list(SCHEMAS) == list(npu.op_names)
        assert torch_npu.npu_swiglu is torch.ops.npu.npu_swiglu
    assert "torch_npu" not in sys.modules and _npu_ops_defined() == []
    with pytest.raises(ImportError):
        import torch_npu  # noqa: F401,F811


def test_reentry_after_exit_and_cleanup_after_an_exception():
    with pytest.raises(ZeroDivisionError):
        with emulated_npu():
            1 / 0
    assert "torch_npu" not in sys.modules and _npu_ops_defined() == []
    with emulated_npu() as npu:
        torch.ops.npu.npu_swiglu(torch.randn(2, 4))
    assert npu.calls == {"npu_swiglu": 1}


def test_refuses_nesting_and_a_real_torch_npu(monkeypatch):
    with emulated_npu():
        with pytest.raises(RuntimeError, match="nested"):
            with emulated_npu():
                pass
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # a "real" one
    with pytest.raises(RuntimeError, match="already imported"):
        with emulated_npu():
            pass
    assert _npu_ops_defined() == []


def test_refuses_when_torch_npu_is_importable(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "torch_npu":
            return importlib.util.spec_from_loader("torch_npu", loader=None, origin="/opt/site-packages/torch_npu")
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(RuntimeError, match="importable from /opt/site-packages/torch_npu"):
        with emulated_npu():
            pass


def test_poison_must_be_a_bool():
    with pytest.raises(TypeError, match="poison must be a bool"):
        with emulated_npu(poison=1):
            pass


def _routing_chain(x, logits):
    import torch_npu

    w, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(logits, None, k=2)
    rows, row_idx, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x, ids, active_num=x.shape[0] * 2, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[0, 4])
    return rows, row_idx, counts, w


def test_ops_trace_as_opaque_nodes_with_documented_meta():
    with emulated_npu() as npu:
        gm = make_fx(_routing_chain, tracing_mode="fake")(torch.randn(5, 3), torch.randn(5, 4))
        assert sum(npu.calls.values()) == 0  # fake tracing runs the fake kernels only
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "npu.npu_moe_gating_top_k_softmax.default" in targets
    assert "npu.npu_moe_init_routing_v2.default" in targets
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    rows, row_idx, counts, w = (node.meta["val"] for node in out)
    assert rows.shape == (10, 3) and row_idx.dtype == torch.int32 and row_idx.shape == (10,)
    assert counts.shape == (4,) and counts.dtype == torch.int64 and w.shape == (5, 2)


def test_compiled_graph_calls_and_counts_the_ops():
    torch._dynamo.reset()
    x, logits = torch.randn(6, 3), torch.randn(6, 4)
    with emulated_npu() as npu:
        eager = _routing_chain(x, logits)
        compiled = torch.compile(_routing_chain, backend="aot_eager", fullgraph=True)(x, logits)
    torch._dynamo.reset()
    assert npu.calls == {"npu_moe_gating_top_k_softmax": 2, "npu_moe_init_routing_v2": 2}
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
