"""CUDA graphs of the op itself (``moe_compile/lowering/op_graphs.py``).

On a GPU: a graphed call gives what the same call gives without a graph, for new inputs every call,
with weights changed in place or replaced, under inference mode, inside an outer capture and through
``torch.compile``. On the CPU: the bookkeeping (warm-up counts, eviction, failures, settings) with the
capture and replay replaced, and the reasons a call runs without a graph.
"""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import moe_compile.ops.custom_op  # noqa: F401  (registers torch.ops.moe_compile.*)
from moe_compile.lowering import MoEInputs, op_graphs
from moe_compile.modular import ExpertWeights
from moe_compile.ops.custom_op import make_config
from tests.kernels.test_triton_cuda_lowering import _op  # noqa: E402  (the op with a routing spec)

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

SOFTMAX = dict(num_experts=16, top_k=4, routing_method="softmax", renormalize=True, routed_scaling_factor=1.0,
               k_group=1, group_count=1, group_select_mode=0)
GROUPED = dict(num_experts=32, top_k=4, routing_method="sigmoid", renormalize=True, routed_scaling_factor=2.5,
               k_group=2, group_count=4, group_select_mode=1)


@pytest.fixture(autouse=True)
def fresh_graphs():
    saved = op_graphs.configure()
    op_graphs.clear()
    yield
    op_graphs.clear()
    op_graphs.configure(**dataclasses.asdict(saved))


def _weights(num_experts, hidden=128, inter=64, seed=0, device="cuda", dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen).transpose(1, 2) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen).transpose(1, 2) * inter ** -0.5
    bias = torch.randn(num_experts, generator=gen) * 0.05
    return w13.to(device, dtype), w2.to(device, dtype), bias.to(device)


def _inputs(tokens, num_experts, hidden=128, seed=1, device="cuda", dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    return x, torch.randn(tokens, num_experts, generator=gen).to(device)


def _plain(fn):
    """``fn()`` with op graphs off (the reference every graphed call is held to)."""
    op_graphs.configure(enabled=False)
    try:
        return fn()
    finally:
        op_graphs.configure(enabled=True)


# Graphed and plain calls run the same kernels with the same plan, so they agree bit for bit except on
# the one-kernel decode path, whose rows are summed by fp32 atomics in any order (bf16 output).
def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-5)


@gpu
@pytest.mark.parametrize("tokens", [1, 3, 32, 200])
@pytest.mark.parametrize("spec", [SOFTMAX, GROUPED], ids=["softmax", "grouped_sigmoid"])
def test_replays_give_the_plain_result_for_new_inputs_every_call(spec, tokens):
    e = spec["num_experts"]
    w13, w2, bias = _weights(e)
    outs = []
    for seed in range(5):  # call 1 plain, call 2 captures and replays, calls 3-5 replay
        x, logits = _inputs(tokens, e, seed=seed)
        outs.append((_op(x, logits, w13, w2, bias, spec), x, logits))
    assert op_graphs.STATS["captured"] == 1 and op_graphs.STATS["replayed"] == 4
    for out, x, logits in outs:  # earlier outputs are copies: later replays did not overwrite them
        _same(out, _plain(lambda: _op(x, logits, w13, w2, bias, spec)))


@gpu
def test_weights_changed_in_place_are_seen_and_new_weights_make_a_new_graph():
    e = SOFTMAX["num_experts"]
    w13, w2, _ = _weights(e)
    x, logits = _inputs(8, e)
    for _ in range(2):
        _op(x, logits, w13, w2, None, SOFTMAX)
    w2.mul_(-0.5)  # the graph reads the weights where they are
    _same(_op(x, logits, w13, w2, None, SOFTMAX), _plain(lambda: _op(x, logits, w13, w2, None, SOFTMAX)))
    other13, other2, _ = _weights(e, seed=7)
    for _ in range(2):
        out = _op(x, logits, other13, other2, None, SOFTMAX)
    _same(out, _plain(lambda: _op(x, logits, other13, other2, None, SOFTMAX)))
    assert op_graphs.graphs() == 2


@gpu
def test_precomputed_routing_and_three_dim_inputs_are_graphed():
    e, k = 16, 4
    w13, w2, _ = _weights(e)
    gen = torch.Generator(device="cuda").manual_seed(3)

    def call():
        x = torch.randn(2, 5, 128, device="cuda", generator=gen).bfloat16()
        ids = torch.randint(0, e, (10, k), device="cuda", generator=gen, dtype=torch.int32)
        weights = torch.rand(10, k, device="cuda", generator=gen)
        out = torch.ops.moe_compile.fused_experts(
            x, weights, ids, w13, w2, None, None, num_experts=e, activation="silu", swiglu_alpha=1.702,
            swiglu_limit=7.0, gate_up_interleaved=False, apply_router_weight_on_input=False, tp_group_name=None,
            ep_group_name=None, dispatcher_type=None, tokens_full=True, reduce_results=True, lowering="auto")
        return out, (x, weights, ids)

    results = [call() for _ in range(4)]
    assert op_graphs.STATS["replayed"] == 3
    for out, (x, weights, ids) in results:
        assert out.shape == (2, 5, 128)
        ref = _plain(lambda: torch.ops.moe_compile.fused_experts(
            x, weights, ids, w13, w2, None, None, num_experts=e, activation="silu", swiglu_alpha=1.702,
            swiglu_limit=7.0, gate_up_interleaved=False, apply_router_weight_on_input=False, tp_group_name=None,
            ep_group_name=None, dispatcher_type=None, tokens_full=True, reduce_results=True, lowering="auto"))
        _same(out, ref)


@gpu
def test_inference_mode_no_grad_and_an_outer_capture():
    e = SOFTMAX["num_experts"]
    w13, w2, _ = _weights(e)
    x, logits = _inputs(4, e)
    ref = _plain(lambda: _op(x, logits, w13, w2, None, SOFTMAX))
    with torch.inference_mode():
        first = [_op(x, logits, w13, w2, None, SOFTMAX) for _ in range(3)]
    with torch.no_grad():
        second = _op(x, logits, w13, w2, None, SOFTMAX)
    for out in first + [second]:
        _same(out, ref)
    assert first[-1].is_inference() and not second.is_inference()
    # an outer graph records the op's kernels itself: no graph of ours inside it
    replayed = op_graphs.STATS["replayed"]
    static_x = x.clone()
    outer = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(outer, stream=side):
        out = _op(static_x, logits, w13, w2, None, SOFTMAX)
    assert op_graphs.STATS["replayed"] == replayed
    x2, _ = _inputs(4, e, seed=9)
    static_x.copy_(x2)
    outer.replay()
    _same(out, _plain(lambda: _op(x2, logits, w13, w2, None, SOFTMAX)))


@gpu
def test_token_limit_warm_calls_eviction_and_off():
    e = SOFTMAX["num_experts"]
    w13, w2, _ = _weights(e)
    op_graphs.configure(max_tokens=16, max_graphs=2, warm_calls=3)
    for tokens in (17, 17, 17):
        x, logits = _inputs(tokens, e)
        _op(x, logits, w13, w2, None, SOFTMAX)
    assert op_graphs.graphs() == 0
    for tokens in (1, 1, 2, 2, 3, 3, 1):  # warm_calls=3: nothing yet
        x, logits = _inputs(tokens, e)
        _op(x, logits, w13, w2, None, SOFTMAX)
    assert op_graphs.graphs() == 1 and op_graphs.STATS["captured"] == 1  # tokens=1 on its third call
    for tokens in (2, 3):
        x, logits = _inputs(tokens, e)
        _same(_op(x, logits, w13, w2, None, SOFTMAX), _plain(lambda: _op(x, logits, w13, w2, None, SOFTMAX)))
    assert op_graphs.graphs() == 2 and op_graphs.STATS["evicted"] == 1
    replayed = op_graphs.STATS["replayed"]
    op_graphs.configure(max_expert_bytes=op_graphs.expert_bytes(MoEInputs(x, logits, ExpertWeights(w13, w2)),
                                                                _cfg(SOFTMAX), 3) - 1)
    _op(x, logits, w13, w2, None, SOFTMAX)  # tokens=3 may now read too many expert bytes
    assert op_graphs.STATS["replayed"] == replayed
    op_graphs.configure(max_expert_bytes=10**12, enabled=False)
    _op(x, logits, w13, w2, None, SOFTMAX)
    assert op_graphs.STATS["replayed"] == replayed


@gpu
def test_a_compiled_block_replays_op_graphs_and_matches_eager():
    from moe_compile.testing.blocks import MoEBlockConfig, V4MoEBlock

    torch.manual_seed(0)
    block = V4MoEBlock(MoEBlockConfig(hidden_size=128, intermediate_size=64)).cuda().bfloat16().eval()
    compiled = torch.compile(block, backend="moe_npu")
    xs = [torch.randn(1, 6, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    with torch.no_grad():
        outs = [compiled(x) for x in xs]
        refs = [_plain(lambda: compiled(x)) for x in xs]
    assert op_graphs.STATS["replayed"] >= 2
    for out, ref, x in zip(outs, refs, xs):
        _same(out, ref)
        torch.testing.assert_close(out, block(x), rtol=2e-2, atol=2e-2)


def _cfg(spec):
    return make_config(spec["num_experts"], spec["top_k"], spec["routing_method"], spec["renormalize"],
                       spec["routed_scaling_factor"], spec["k_group"], spec["group_count"], spec["group_select_mode"],
                       True, False, False, "silu", 1.702, 7.0, False, False, None, None, None, True, True, "auto")


# -- CPU: the bookkeeping, the capture and replay replaced -----------------------------------------------------

def _cpu_call(tokens=2, e=8, hidden=16):
    x, logits = torch.randn(tokens, hidden), torch.randn(tokens, e)
    w13, w2 = torch.randn(e, hidden, 8), torch.randn(e, 4, hidden)
    cfg = make_config(e, 2, "softmax", True, 1.0, 1, 1, 0, True, False, False, "silu", 1.702, 7.0, False, False,
                      None, None, None, True, True, "auto")
    return MoEInputs(x, logits, ExpertWeights(w13, w2)), cfg


def test_cpu_calls_name_why_they_run_without_a_graph():
    inputs, cfg = _cpu_call()
    assert op_graphs.skip_reason(inputs, cfg) == "not cuda"
    assert op_graphs.run(inputs, cfg, lambda i, c: pytest.fail("run plainly by the caller")) is None
    op_graphs.configure(enabled=False)
    assert op_graphs.skip_reason(inputs, cfg) == "off"


def test_expert_bytes_count_the_experts_a_call_can_hit():
    inputs, cfg = _cpu_call(tokens=2, e=8, hidden=16)  # top-2; w13 [8, 16, 8], w2 [8, 4, 16], fp32
    per_expert = (16 * 8 + 4 * 16) * 4
    assert op_graphs.expert_bytes(inputs, cfg, 2) == 4 * per_expert
    assert op_graphs.expert_bytes(inputs, cfg, 100) == 8 * per_expert  # at most every expert


def test_calls_without_a_graph_are_counted_by_reason():
    inputs, cfg = _cpu_call()
    op_graphs.run(inputs, cfg, lambda i, c: pytest.fail("run plainly by the caller"))
    op_graphs.configure(enabled=False)
    op_graphs.run(inputs, cfg, lambda i, c: pytest.fail("run plainly by the caller"))
    assert op_graphs.STATS["skipped: not cuda"] == 1 and op_graphs.STATS["skipped: off"] == 1


@pytest.mark.parametrize("value", ["lots", "0", "-3"])
def test_a_bad_environment_limit_names_the_variable(value):
    env = dict(os.environ, MOE_COMPILE_OP_GRAPHS_MAX_TOKENS=value)
    proc = subprocess.run([sys.executable, "-c", "import moe_compile.lowering.op_graphs"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"MOE_COMPILE_OP_GRAPHS_MAX_TOKENS={value!r}; expected an int >= 1 (unset: 1024)" in proc.stderr


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_tokens=0"):
        op_graphs.configure(max_tokens=0)
    with pytest.raises(ValueError, match="max_graphs=True"):
        op_graphs.configure(max_graphs=True)
    with pytest.raises(TypeError, match="enabled='yes'"):
        op_graphs.configure(enabled="yes")


def test_bookkeeping_counts_captures_evicts_and_remembers_failures(monkeypatch):
    captured, failing = [], set()

    def capture(inputs, cfg, body, key):
        if inputs.hidden_states.shape[0] in failing:
            op_graphs._FAILED.add(key)
            return None
        captured.append(key)
        entry = op_graphs._GRAPHS[key] = op_graphs._Entry(None, (), inputs.hidden_states)
        op_graphs._evict()
        return entry

    monkeypatch.setattr(op_graphs, "skip_reason", lambda inputs, cfg: "")
    monkeypatch.setattr(op_graphs, "_capture", capture)
    monkeypatch.setattr(op_graphs, "_replay", lambda entry, inputs: "replayed")
    monkeypatch.setattr(op_graphs, "_stream", lambda device: 0)
    op_graphs.configure(max_graphs=2, warm_calls=2)
    calls = {t: _cpu_call(tokens=t) for t in (1, 2, 3, 4)}
    body = lambda i, c: pytest.fail("the body runs inside capture only")  # noqa: E731
    assert op_graphs.run(*calls[1], body) is None  # first call: plain
    assert op_graphs.run(*calls[1], body) == "replayed" and len(captured) == 1
    assert op_graphs.run(*calls[1], body) == "replayed" and len(captured) == 1
    for t in (2, 2, 3, 3):
        op_graphs.run(*calls[t], body)
    assert op_graphs.graphs() == 2 and op_graphs.STATS["evicted"] == 1  # tokens=1 went first
    failing.add(4)
    assert [op_graphs.run(*calls[4], body) for _ in range(4)] == [None] * 4
    assert len(captured) == 3  # a failed key is not captured again
    inputs, cfg = calls[2]
    moved = MoEInputs(inputs.hidden_states, inputs.router_logits,
                      ExpertWeights(inputs.weights.w13.clone(), inputs.weights.w2))
    assert op_graphs.call_key(moved, cfg, 0, 0) != op_graphs.call_key(inputs, cfg, 0, 0)
    fresh = MoEInputs(inputs.hidden_states.clone(), inputs.router_logits.clone(), inputs.weights)
    assert op_graphs.call_key(fresh, cfg, 0, 0) == op_graphs.call_key(inputs, cfg, 0, 0)


def test_a_kept_graph_replays_straight_and_newer_limits_drop_it(monkeypatch):
    calls = {t: _cpu_call(tokens=t) for t in (1, 2)}
    for t, (inputs, cfg) in calls.items():
        key = op_graphs.call_key(inputs, cfg, 0, 0)
        op_graphs._GRAPHS[key] = op_graphs._Entry(None, (), inputs.hidden_states, t, op_graphs.expert_bytes(
            inputs, cfg, t))
    capturing = []
    monkeypatch.setattr(op_graphs, "_cuda_index", lambda x: 0)
    monkeypatch.setattr(op_graphs, "_stream", lambda device: 0)
    monkeypatch.setattr(op_graphs, "_capturing", lambda: bool(capturing))
    monkeypatch.setattr(op_graphs, "_replay", lambda entry, inputs: ("replayed", entry.tokens))
    monkeypatch.setattr(op_graphs, "skip_reason", lambda inputs, cfg: pytest.fail("a hit skips the static rules"))
    assert op_graphs.replay_hit(*calls[2]) == ("replayed", 2)
    assert list(op_graphs._GRAPHS.values())[-1].tokens == 2  # most recently used last
    assert op_graphs.replay_hit(*calls[1]) == ("replayed", 1)
    other = _cpu_call(tokens=1)  # other weights: another key, nothing kept for it
    assert op_graphs.replay_hit(*other) is None
    capturing.append(True)
    assert op_graphs.replay_hit(*calls[1]) is None  # an outer capture records the kernels itself
    capturing.clear()
    with op_graphs.suspended():
        assert op_graphs.replay_hit(*calls[1]) is None
    op_graphs.configure(enabled=False)
    assert op_graphs.replay_hit(*calls[1]) is None
    op_graphs.configure(enabled=True, max_tokens=1)  # the 2-token graph is no longer allowed
    assert op_graphs.graphs() == 1 and op_graphs.replay_hit(*calls[2]) is None
    op_graphs.configure(max_expert_bytes=1)
    assert op_graphs.graphs() == 0 and op_graphs.replay_hit(*calls[1]) is None


def test_the_backend_suspends_op_graphs_in_graphs_it_compiled_for_cuda_graphs():
    from moe_compile import backend
    from moe_compile.options import InnerCompiler, parse_options

    depth = []
    compiled = lambda *args: depth.append(getattr(op_graphs._LOCAL, "depth", 0)) or "out"  # noqa: E731
    compiled._boxed_call = True
    graphs = dataclasses.replace(parse_options(None), compile_mode="reduce-overhead")
    wrapped = backend._without_op_graphs(compiled, graphs, InnerCompiler.INDUCTOR, "cuda")
    assert wrapped("x") == "out" and depth == [1] and wrapped._boxed_call
    assert getattr(op_graphs._LOCAL, "depth", 0) == 0
    autotune = dataclasses.replace(graphs, compile_mode="max-autotune")  # CUDA graphs too
    assert backend._without_op_graphs(compiled, autotune, InnerCompiler.INDUCTOR, "cuda") is not compiled
    no_graphs = dataclasses.replace(graphs, compile_mode="max-autotune-no-cudagraphs")
    for args in ((parse_options(None), InnerCompiler.INDUCTOR, "cuda"), (graphs, InnerCompiler.INDUCTOR, "cpu"),
                 (no_graphs, InnerCompiler.INDUCTOR, "cuda")):
        assert backend._without_op_graphs(compiled, *args) is compiled


@gpu
def test_reduce_overhead_compiles_capture_no_op_graphs():
    from moe_compile.testing.blocks import MoEBlockConfig, V4MoEBlock

    torch.manual_seed(0)
    block = V4MoEBlock(MoEBlockConfig(hidden_size=128, intermediate_size=64)).cuda().bfloat16().eval()
    compiled = torch.compile(block, backend="moe_npu", mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 6, 128, device="cuda", dtype=torch.bfloat16)
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x).clone()
            torch.testing.assert_close(out, block(x), rtol=2e-2, atol=2e-2)
    assert op_graphs.STATS["captured"] == 0
