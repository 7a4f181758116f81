"""Inspect and opt out: the report, graphs on disk, counters, logging, exclusions, verify."""
from __future__ import annotations

import logging

import pytest
import torch

import moe_compile
from moe_compile.testing import zoo
from moe_compile.testing.logs import captured_logs
from moe_compile.testing.zoo_blocks import build_block_model

from .helpers import explain_and_compare


@pytest.fixture(scope="module")
def mixtral():
    return zoo.build_model("mixtral")


def test_report_table_and_graphs(mixtral, tmp_path):
    model, kwargs = mixtral
    report, diff = explain_and_compare(model, kwargs)
    assert diff <= 1e-4
    assert report.rewritten == ["model.layers.0.mlp", "model.layers.1.mlp"]
    table = str(report)
    for word in ("path", "router", "experts", "E", "top-k", "activation", "decision",
                 "softmax→topk→renorm", "grouped_mm", "silu", "rewritten"):
        assert word in table
    paths = report.write_graphs(str(tmp_path))
    assert paths and all(p.endswith(".txt") for p in paths)
    after = open([p for p in paths if p.endswith("after.txt")][0]).read()
    before = open([p for p in paths if p.endswith("before.txt")][0]).read()
    assert "moe_compile.fused_moe" in after and "moe_compile.fused_moe" not in before


def test_counters_and_logging_artifact(mixtral):
    model, kwargs = mixtral
    torch._dynamo.utils.counters.clear()
    with captured_logs(logging.INFO) as messages:
        moe_compile.explain(model, **kwargs, options={"inner_compiler": "aot_eager"})
    assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 2
    assert any("rewrote model.layers.0.mlp" in m for m in messages)
    from torch._logging._internal import log_registry

    assert "moe_compile" in log_registry.log_alias_to_log_qnames


@pytest.mark.parametrize("exclude,skipped", [
    (["model.layers.1.*"], ["model.layers.1.mlp"]),
    (["model.layers.*"], ["model.layers.0.mlp", "model.layers.1.mlp"]),
])
def test_exclude_by_path_glob(mixtral, exclude, skipped):
    model, kwargs = mixtral
    report, diff = explain_and_compare(model, kwargs, {"exclude": exclude})
    assert diff <= 1e-4
    assert [p for p, r in report.skipped if "excluded" in r] == skipped
    assert len(report.rewritten) == 2 - len(skipped)


def test_exclude_by_class(mixtral):
    model, kwargs = mixtral
    block_cls = type(model.model.layers[0].mlp)
    report, _ = explain_and_compare(model, kwargs, {"exclude": block_cls})
    assert not report.rewritten
    assert all("excluded" in r for _, r in report.skipped)


def test_exclude_instance():
    model, kwargs = zoo.build_model("mixtral")
    moe_compile.exclude(model.model.layers[0].mlp)
    report, diff = explain_and_compare(model, kwargs)
    assert diff <= 1e-4
    assert report.rewritten == ["model.layers.1.mlp"]
    assert report.skipped == [("model.layers.0.mlp", "excluded by moe_compile.exclude(module)")]
    with pytest.raises(TypeError, match="nn.Module"):
        moe_compile.exclude("model.layers.0")


def test_verify_rejects_a_wrong_rewrite(monkeypatch):
    """If a match stops agreeing with the original on fresh probes, verify leaves the block alone."""
    from moe_compile.passes import match as match_mod

    model, kwargs = build_block_model("gptfast", num_layers=1)
    real_confirm = match_mod.confirm
    calls = []

    def flaky(ctx, anchor, routing, output, choice, bias_value, trials):
        calls.append(trials)
        return real_confirm(ctx, anchor, routing, output, choice, bias_value, trials) if len(calls) == 1 else False

    monkeypatch.setattr(match_mod, "confirm", flaky)
    report, diff = explain_and_compare(model, kwargs, {"verify": True})
    assert diff <= 1e-4
    assert not report.rewritten
    assert any("verif" in reason for _, reason in report.skipped)


def test_dump_dir_option_writes_before_and_after(mixtral, tmp_path):
    model, kwargs = mixtral
    moe_compile.explain(model, **kwargs, options={"inner_compiler": "aot_eager", "dump_dir": str(tmp_path)})
    files = sorted(p.name for p in tmp_path.iterdir())
    assert any(f.endswith("_before.txt") for f in files) and any(f.endswith("_after.txt") for f in files)
    after = [p for p in tmp_path.iterdir() if p.name.endswith("_after.txt")][0].read_text()
    assert "moe_compile.fused_moe" in after


def test_moe_like_modules_go_by_the_class_name_ending():
    """A norm whose class name merely contains "MoeLayer" (cohere2_moe's ``Cohere2MoeLayerNorm``) is
    not reported as an MoE block no graph captured; blocks named ...SparseMoeBlock / ...MoE /
    ...MoeLayer, or holding ``experts``, are."""
    from moe_compile.explain import moe_like_modules

    def cls(name):
        return type(name, (torch.nn.Module,), {})

    model = torch.nn.Module()
    for i, name in enumerate(["Cohere2MoeLayerNorm", "MixtralSparseMoeBlock", "FooMoE", "BarMoeLayer",
                              "PlainMLP", "MoeRMSNorm"]):
        model.add_module("m%d" % i, cls(name)())
    with_experts = cls("Anything")()
    with_experts.experts = torch.nn.Linear(2, 2)
    model.add_module("m6", with_experts)
    assert moe_like_modules(model) == ["m1", "m2", "m3", "m6"]


def test_blocks_keep_their_model_paths_when_dynamo_compiles_an_inner_frame(mixtral):
    """``output_router_logits=True`` breaks the graph at the top of ``MixtralForCausalLM``, so Dynamo
    compiles ``MixtralModel``'s frame on its own and its paths start there (``layers.0.mlp``). The
    report names the blocks by their path in the model (through the router weights), does not list
    them a second time as "not captured", and says what the load-balancing loss's top-k is."""
    model, kwargs = mixtral
    report = moe_compile.explain(model, **kwargs, output_router_logits=True,
                                 options={"inner_compiler": "aot_eager"})
    assert report.rewritten == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    assert [path for path, _ in report.skipped] == [""], str(report)  # printed as <root>
    assert "load-balancing loss" in report.skipped[0][1]


def test_full_path_from_the_router_weights_owner():
    from moe_compile.explain import full_path

    assert full_path("layers.0.mlp", "model.layers.0.mlp.gate") == "model.layers.0.mlp"
    assert full_path("layers.0.mlp", "model.layers.0.mlp") == "model.layers.0.mlp"   # weight on the block
    assert full_path("model.layers.0.mlp", "model.layers.0.mlp.gate") == "model.layers.0.mlp"
    assert full_path("", "model.layers.3.mlp.gate") == "model.layers.3.mlp"          # the frame is the block
    assert full_path("layers.0.mlp", "shared.router") == "layers.0.mlp"               # not inside: unchanged


@pytest.mark.parametrize("first", ["torch", "moe_compile"])
def test_torch_logs_prints_each_line_once(first):
    """``TORCH_LOGS="+moe_compile"``: torch's own log set-up imports ``moe_compile`` while it runs (it
    imports the unknown names in ``TORCH_LOGS``). Re-running that set-up from inside it gave every torch
    log two handlers, so each line printed twice; now one handler each, whichever is imported first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import logging\nimport %s\nimport torch, moe_compile\n"
            "logging.getLogger('moe_compile').info('one line')\n"
            "logging.getLogger('torch._dynamo').warning('another line')\n"
            "print('handlers', len(logging.getLogger('moe_compile').handlers), "
            "len(logging.getLogger('torch').handlers), logging.getLogger('moe_compile').getEffectiveLevel())\n" % first)
    env = dict(os.environ, TORCH_LOGS="+moe_compile", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "handlers 1 1 10" in out.stdout, (out.stdout, out.stderr[-2000:])
    lines = [line.split("] ", 1)[-1] for line in out.stderr.splitlines() if "] " in line]
    assert lines.count("one line") == 1 and lines.count("another line") == 1, out.stderr[-2000:]


def test_attention_indexer_top_k_is_listed_apart_from_the_moe_blocks():
    """DeepSeek-V3.2's attention indexer picks keys with a top-k over q @ k scores: no MoE router, so it
    is no skipped block (the table and the ``skipped`` counter hold MoE blocks only)."""
    from moe_compile.testing import zoo

    model, kwargs = zoo.build_model("deepseek_v32", num_tokens=9)
    torch._dynamo.utils.counters.clear()
    report = moe_compile.explain(model, **kwargs, options={"inner_compiler": "aot_eager"})
    assert len(report.rewritten) == 2 and not report.skipped, str(report)
    assert [p for p, _ in report.other_topk] == ["model.layers.0.self_attn.indexer", "model.layers.1.self_attn.indexer"]
    assert all("two activations" in reason for _, reason in report.other_topk), str(report)
    counters = torch._dynamo.utils.counters["moe_compile"]
    assert counters["skipped"] == 0 and counters["other_topk"] == 2
    assert "self_attn.indexer" not in str(report).split("MoE block(s) rewritten")[0]
