"""Inductor's compile caches serve graphs the pass rewrote (``moe_compile/compile_cache.py``).

Each test compiles in a cache folder of its own (the session keeps the caches off, see conftest).
A second compile of the same graph after ``torch._dynamo.reset()`` stands for a second process: the
in-process state (the stacked-weight registry, Dynamo's caches) is gone, only the disk cache is left.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

import moe_compile
from moe_compile import compile_cache
from moe_compile.report import collecting
from moe_compile.testing.logs import captured_logs
from moe_compile.testing.zoo_blocks import build_block_model

from .helpers import TOL, first_tensor, max_rel_diff

pytestmark = pytest.mark.slow


@pytest.fixture
def caches_on(tmp_path):
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True), temporary_cache_dir(str(tmp_path)):
        yield tmp_path


def _compile_and_run(model, kwargs, **options):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        fast = torch.compile(model, backend="moe_npu", options={"inner_compiler": "inductor", **options})
        out = first_tensor(fast(**kwargs))
        ref = first_tensor(model(**kwargs))
    counters = torch._dynamo.utils.counters
    return max_rel_diff(out, ref), dict(counters["moe_compile"]), dict(counters["inductor"])


def test_a_cached_graph_is_served_with_the_new_models_weights(caches_on):
    """The second model has other weights: served from the cache (the pass does not run), it must
    compute with its own weights, its stacked gate/up copies included (``ModuleList`` experts), and
    report the decisions the first compile made."""
    # five tokens, top-2 of 8 experts: the rewritten block's experts compile as CPU-decode gather-GEMVs
    # (lowering/cpu_decode.py), so the cached graph holds them and reads the second model's weights there
    first, kwargs = build_block_model("v4_mixtral", num_layers=1, seed=0)
    diff, ours, inductor = _compile_and_run(first, kwargs)
    assert diff <= TOL[torch.float32] and ours == {"rewritten": 1, "cpu_decode": 1}, (diff, ours)
    assert inductor.get("fxgraph_cache_miss") == 1 and not inductor.get("fxgraph_cache_hit"), inductor
    assert list((caches_on / "moe_compile").glob("*.json")), "the decisions were not stored"

    second, kwargs = build_block_model("v4_mixtral", num_layers=1, seed=1)
    with torch.no_grad():
        assert max_rel_diff(first_tensor(second(**kwargs)), first_tensor(first(**kwargs))) > 0.1
    with captured_logs(logging.INFO) as messages:  # not caplog: torch's log registry may stop propagation
        diff, ours, inductor = _compile_and_run(second, kwargs)
    assert inductor.get("fxgraph_cache_hit") == 1, inductor
    assert diff <= TOL[torch.float32], diff
    assert ours == {"rewritten": 1, "from_cache": 1}, ours
    text = "\n".join(messages)
    assert "came from Inductor's compile cache" in text and "rewrote layers.0" in text, text


def test_options_and_exclusions_key_the_cache(caches_on):
    """A graph compiled with other options, or with a block excluded, is not served the first one's
    rewrite; ``verify`` and ``explain()`` always run the pass."""
    model, kwargs = build_block_model("gptfast", num_layers=1)
    _, ours, _ = _compile_and_run(model, kwargs)
    assert ours == {"rewritten": 1, "cpu_decode": 1}, ours

    _, ours, inductor = _compile_and_run(model, kwargs, exclude="layers.0.*")
    assert ours == {"skipped": 1} and not inductor.get("fxgraph_cache_hit"), (ours, inductor)

    moe_compile.exclude(model.layers[0])
    try:
        _, ours, inductor = _compile_and_run(model, kwargs)
        assert ours == {"skipped": 1} and not inductor.get("fxgraph_cache_hit"), (ours, inductor)
    finally:
        moe_compile.report._EXCLUDED.discard(model.layers[0])

    diff, ours, inductor = _compile_and_run(model, kwargs, verify=True)
    assert ours == {"rewritten": 1, "cpu_decode": 1} and not inductor.get("fxgraph_cache_hit"), (ours, inductor)
    with collecting() as report:
        _compile_and_run(model, kwargs)
    assert report.rewritten and report.graphs_after, str(report)

    _, ours, inductor = _compile_and_run(model, kwargs)  # the plain compile again: served
    assert ours == {"rewritten": 1, "from_cache": 1} and inductor.get("fxgraph_cache_hit") == 1, (ours, inductor)


def test_uncached_reasons_and_the_uuid():
    config = moe_compile.options.parse_options({})
    assert compile_cache.uncached_reason(config) is None
    assert "verify" in compile_cache.uncached_reason(moe_compile.options.parse_options({"verify": True}))
    assert "dump_dir" in compile_cache.uncached_reason(moe_compile.options.parse_options({"dump_dir": "x"}))
    with collecting():
        assert "explain" in compile_cache.uncached_reason(config)
    inputs = [torch.zeros(2), torch.zeros(3)]
    gm = torch.fx.symbolic_trace(lambda a, b: a.sum() + b.sum())
    base = compile_cache.pass_uuid(config, {}, gm, inputs)
    assert base == compile_cache.pass_uuid(config, {}, gm, [torch.ones(2), torch.ones(3)])  # values do not count
    other = moe_compile.options.parse_options({"exclude": "model.layers.1.*"})
    assert compile_cache.pass_uuid(other, {}, gm, inputs) != base
    assert compile_cache.pass_uuid(config, {"lowering": "cpu"}, gm, inputs) != base
    assert compile_cache.pass_uuid(config, {}, torch.fx.symbolic_trace(lambda a, b: a.sum() - b.sum()), inputs) != base
    assert compile_cache.pass_uuid(config, {}, gm, [torch.zeros(2), torch.zeros(4)]) != base
    module = torch.nn.Linear(2, 2)
    moe_compile.exclude(module)
    try:
        assert compile_cache.pass_uuid(config, {}, gm, [module.weight, inputs[1]]) != base
    finally:
        moe_compile.report._EXCLUDED.discard(module)


def test_stored_decisions_round_trip(tmp_path):
    from moe_compile.report import BlockDecision

    weight = torch.zeros(4)
    decisions = [BlockDecision(path="layers.0.mlp", router="softmax→topk", experts="grouped_mm", num_experts=8,
                               top_k=2, activation="silu", rewritten=True, router_weight_id=id(weight)),
                 BlockDecision(path="layers.1.mlp", reason="excluded")]
    with temporary_cache_dir(str(tmp_path)):
        compile_cache.save("k", decisions, [torch.zeros(1), weight])
        other = torch.ones(4)
        loaded = compile_cache.load("k", [torch.zeros(1), other])
        assert compile_cache.load("missing", []) is None
        (tmp_path / "moe_compile" / "bad.json").write_text("{not json")
        assert compile_cache.load("bad", []) is None
    assert loaded == decisions  # router_weight_id is not compared; it is resolved in the new inputs
    assert loaded[0].router_weight_id == id(other) and loaded[1].router_weight_id is None


def test_a_cached_graph_reads_the_new_models_routing_scale(caches_on):
    """``dynamic=True``: the routing scale is a graph input, not part of any cache key; another model of
    the same class with another scale is served the first one's compiled graph and must compute with
    its own scale (dots3_note then glm4_moe_lite in one process were 0.89 off before)."""
    from .test_router_probes import _deepseek_v3_scaled

    for scale, hits in ((2.5, 0), (1.0, 1)):
        model, kwargs = _deepseek_v3_scaled(scale)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        with torch.no_grad():
            fast = torch.compile(model, backend="moe_npu", dynamic=True, options={"inner_compiler": "inductor"})
            diff = max_rel_diff(first_tensor(fast(**kwargs)), first_tensor(model(**kwargs)))
        assert diff <= TOL[torch.float32], (scale, diff)
        assert torch._dynamo.utils.counters["inductor"].get("fxgraph_cache_hit", 0) == hits
        assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 1
