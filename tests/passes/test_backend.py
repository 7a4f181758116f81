"""The backend: registration by name, options parsing, fallbacks, training graphs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import moe_compile
from moe_compile.options import InnerCompiler, parse_options
from moe_compile.ops.config import Lowering
from moe_compile.testing.zoo_blocks import build_block_model

from .helpers import first_tensor


def test_backend_reachable_by_name_without_importing_moe_compile():
    import importlib.metadata

    try:  # the entry point comes with the installed distribution, not with a bare checkout
        importlib.metadata.distribution("moe-compile")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("moe-compile is not installed (pip install -e .): no entry points to find")
    code = ("import torch, importlib.metadata as m\n"
            "assert 'moe_npu' in [e.name for e in m.entry_points(group='torch_dynamo_backends')]\n"
            "f = torch.compile(lambda x: x * 2, backend='moe_npu', options={'inner_compiler': 'eager'})\n"
            "print(float(f(torch.ones(2)).sum()))\n")
    env = dict(os.environ, TORCHDYNAMO_VERBOSE="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("4.0")


def test_registered_on_import():
    from torch._dynamo.backends.registry import lookup_backend

    from moe_compile.backend import moe_npu_backend

    assert "moe_npu" in torch._dynamo.list_backends(exclude_tags=())
    assert lookup_backend("moe_npu") is moe_npu_backend


def test_options_parse_once_into_frozen_config():
    cfg = parse_options({"inner_compiler": "aot_eager", "lowering": "npu", "exclude": ["a.*", torch.nn.Linear],
                         "verify": True})
    assert cfg.inner_compiler is InnerCompiler.AOT_EAGER and cfg.lowering is Lowering.NPU
    assert cfg.exclude_paths == ("a.*",) and cfg.exclude_classes == (torch.nn.Linear,)
    with pytest.raises(Exception):
        cfg.verify = False  # frozen
    assert parse_options(None).resolved_inner("cpu") is InnerCompiler.INDUCTOR
    assert parse_options({"lowering": "npu"}).resolved_inner("cpu") is InnerCompiler.TORCHAIR


@pytest.mark.parametrize("options,exc,words", [
    ({"inner": "eager"}, ValueError, ["unknown", "inner", "inner_compiler", "lowering", "exclude", "verify"]),
    ({"inner_compiler": "tvm"}, ValueError, ["inner_compiler", "tvm", "inductor", "aot_eager"]),
    ({"lowering": "tpu"}, ValueError, ["lowering", "tpu", "cuda", "npu"]),
    ({"verify": 1}, TypeError, ["verify", "bool"]),
    ({"exclude": [3]}, TypeError, ["exclude", "int"]),
    ({"ep_group": "g"}, TypeError, ["ep_group", "ProcessGroup"]),
    ("fast", TypeError, ["dict", "str"]),
])
def test_bad_options_raise_and_list_the_valid_ones(options, exc, words):
    with pytest.raises(exc) as info:
        parse_options(options)
    for word in words:
        assert word in str(info.value)


def test_bad_options_surface_through_torch_compile():
    model, kwargs = build_block_model("gptfast", num_layers=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_npu", options={"inner_compiler": "nope"})
    with pytest.raises(Exception, match="inner_compiler"):
        compiled(**kwargs)


@pytest.mark.expects_fallback
def test_exception_inside_the_pass_compiles_the_original_and_warns(monkeypatch):
    from moe_compile.passes import moe_pass

    def boom(self, graph):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(moe_pass.MoEFusionPass, "__call__", boom)
    monkeypatch.setattr("moe_compile.backend._warned", set())
    model, kwargs = build_block_model("gptfast", num_layers=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        ref = model(**kwargs)
        with pytest.warns(RuntimeWarning, match="synthetic failure"):
            out = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})(**kwargs)
    assert torch.equal(out, ref)
    assert torch._dynamo.utils.counters["moe_compile"]["pass_failed"] == 1


def test_training_graph_is_rewritten_and_trains():
    """A graph that records autograd is rewritten too (tests/passes/test_training.py checks its gradients)."""
    model, kwargs = build_block_model("gptfast", num_layers=1)
    kwargs = {k: v.requires_grad_(True) for k, v in kwargs.items()}
    torch._dynamo.reset()
    from moe_compile.report import collecting

    with collecting() as report:
        out = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})(**kwargs)
    out.sum().backward()
    assert report.rewritten == ["layers.0.moe"], str(report)
    assert kwargs["hidden_states"].grad is not None
    assert first_tensor(out).shape == kwargs["hidden_states"].shape


def test_compile_mode_is_accepted_and_checked():
    # torch.compile takes mode= or options=, not both: the mode can also travel as an option
    f = torch.compile(lambda x: x * 2, backend="moe_npu", mode="max-autotune-no-cudagraphs")
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    assert parse_options({"mode": "reduce-overhead"}).compile_mode == "reduce-overhead"
    with pytest.raises(ValueError, match="mode"):
        parse_options({"mode": "turbo"})
    torch._dynamo.reset()
    from moe_compile.backend import moe_npu_backend

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ValueError, match="mode"):
        moe_npu_backend(gm, [torch.ones(2)], mode="fastest")


@pytest.mark.expects_fallback
def test_failure_after_the_rewrite_takes_the_rewrite_back(monkeypatch):
    """The pass rewrote a block, then the inner compile failed: the original graph is compiled
    and the report and counters say the block was not rewritten, and why."""
    from moe_compile.report import collecting

    calls = []

    def late_failure(config, before, after):
        calls.append(1)
        raise RuntimeError("synthetic late failure")

    monkeypatch.setattr("moe_compile.backend._graphs_done", late_failure)
    monkeypatch.setattr("moe_compile.backend._warned", set())
    model, kwargs = build_block_model("gptfast", num_layers=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad(), collecting() as report:
        ref = model(**kwargs)
        with pytest.warns(RuntimeWarning, match="synthetic late failure"):
            out = torch.compile(model, backend="moe_npu", options={"inner_compiler": "aot_eager"})(**kwargs)
    assert calls and torch.equal(out, ref)
    counters = torch._dynamo.utils.counters["moe_compile"]
    assert counters["pass_failed"] == 1 and counters["rewritten"] == 0, dict(counters)
    assert report.rewritten == [], str(report)
    assert report.skipped and all("compile failed after the rewrite" in reason for _, reason in report.skipped)


def test_cuda_graph_compiles_of_graphs_with_data_dependent_shapes_get_no_partitions():
    """Inductor's graph partitions failed under CUDA graphs on a graph that keeps data-dependent
    shapes after the rewrite (jetmoe's attention experts, torch 2.11): such a graph is compiled
    without partitions, and Inductor then runs it without CUDA graphs. Other graphs keep them."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental.proxy_tensor import make_fx

    from moe_compile.backend import _no_partitions_for_data_dependent_graphs

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        dependent = make_fx(lambda x: x.nonzero() + 1, tracing_mode="symbolic")(torch.randn(4))
    plain = make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.randn(4))
    for graph, partitions, cudagraphs in ((dependent.graph, False, True), (plain.graph, True, True),
                                          (dependent.graph, True, False)):
        with inductor_config.patch({"graph_partition": True, "triton.cudagraphs": cudagraphs}):
            _no_partitions_for_data_dependent_graphs(graph)
            assert inductor_config.graph_partition is partitions


@pytest.mark.parametrize("key", ["ep_group", "tp_group"])
def test_a_group_this_rank_is_not_in_is_named_as_such(key):
    """``dist.new_group`` hands ranks outside the group ``GroupMember.NON_GROUP_MEMBER`` (an int);
    the error said only "must be a ProcessGroup, but got int"."""
    import torch.distributed as dist

    from moe_compile.options import parse_options

    with pytest.raises(ValueError, match=r"options\['%s'\] is GroupMember.NON_GROUP_MEMBER: this rank" % key):
        parse_options({key: dist.GroupMember.NON_GROUP_MEMBER})


@pytest.mark.expects_fallback
def test_an_unwritable_dump_dir_warns_and_keeps_the_rewrite(tmp_path, monkeypatch):
    """``dump_dir`` is a debug output: a path that cannot be written (here under a regular file)
    used to count as a failed pass and throw the rewrite away."""
    from moe_compile.testing import zoo

    monkeypatch.setattr("moe_compile.backend._warned", set())
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    model, _ = zoo.build_model("qwen3_moe")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options = {"inner_compiler": "aot_eager", "dump_dir": str(blocker / "sub")}
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="cannot write graphs to dump_dir"):
        torch.compile(model, backend="moe_npu", options=options)(**zoo.build_inputs("qwen3_moe", num_tokens=5))
    counters = torch._dynamo.utils.counters["moe_compile"]
    assert counters["rewritten"] == 2 and counters["pass_failed"] == 0, dict(counters)


def test_torchair_without_torch_npu_is_not_a_pass_failure():
    """The default inner compiler for lowering='npu' is TorchAir; without torch_npu its ImportError
    comes as it is, not after a "the MoE pass failed" warning and a pass_failed count."""
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    from moe_compile.testing import zoo

    model, _ = zoo.build_model("qwen3_moe")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="moe_npu", options={"lowering": "npu"})
    with torch.no_grad(), pytest.raises(Exception, match="needs torch_npu"):
        compiled(**zoo.build_inputs("qwen3_moe", num_tokens=5))
    assert torch._dynamo.utils.counters["moe_compile"]["pass_failed"] == 0


def test_cuda_graphs_hint_said_once_when_cuda_blocks_are_rewritten_without_graphs(monkeypatch, moe_log):
    import dataclasses

    from torch._inductor import config as inductor_config

    from moe_compile import backend
    from moe_compile.report import BlockDecision

    monkeypatch.setattr(backend, "_warned", set())
    rewritten, skipped = BlockDecision(path="layers.0.mlp", rewritten=True), BlockDecision(path="x", reason="no")
    cfg = parse_options(None)
    graphs = dataclasses.replace(cfg, compile_mode="reduce-overhead")
    with inductor_config.patch({"triton.cudagraphs": False}):
        for args in (([skipped], cfg, InnerCompiler.INDUCTOR, "cuda"),  # nothing rewritten
                     ([rewritten], cfg, InnerCompiler.INDUCTOR, "cpu"),
                     ([rewritten], cfg, InnerCompiler.AOT_EAGER, "cuda"),
                     ([rewritten], graphs, InnerCompiler.INDUCTOR, "cuda"),
                     ([rewritten], dataclasses.replace(cfg, compile_mode="max-autotune"), InnerCompiler.INDUCTOR,
                      "cuda")):  # max-autotune turns CUDA graphs on too
            backend._hint_cuda_graphs(*args)
        assert "reduce-overhead" not in moe_log.text
        backend._hint_cuda_graphs([rewritten, skipped], cfg, InnerCompiler.INDUCTOR, "cuda")
        backend._hint_cuda_graphs([rewritten], cfg, InnerCompiler.INDUCTOR, "cuda")
    hints = [r for r in moe_log.records if "reduce-overhead" in r.getMessage()]
    assert len(hints) == 1 and "1 MoE block(s)" in hints[0].getMessage()
