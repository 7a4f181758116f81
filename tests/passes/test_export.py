"""``moe_compile.rewrite_exported``: the pass on ``torch.export`` programs. Each case exports a tiny model (random
weights), rewrites the program and runs it against the model eager: fp32, within 1e-4 of the output's magnitude
(``helpers.TOL``). Also: symbolic token counts, ``torch.export.save``/``load``, AOTInductor calling the fused op,
exclusion, and programs left as they were (nothing to rewrite, a pass failure, bad arguments)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_compile
from moe_compile.testing.zoo import build_model, first_tensor
from moe_compile.testing.zoo_blocks import build_block_model

from .helpers import TOL, max_rel_diff

pytest.importorskip("transformers")

FAMILIES = {  # family -> the router column of every rewritten block
    "mixtral": "softmax→topk→renorm",
    "deepseek_v3": "sigmoid+bias→group(4 keep 2, top2-sum)→topk→norm→×2.5",
    "gpt_oss": "softmax→topk→renorm",
    "deepseek_v4_hash": "kept as written (ids from a table lookup) -> fused_experts",
}


def _export(model, kwargs, **export_kwargs):
    with torch.no_grad():
        return torch.export.export(model, (), kwargs, **export_kwargs)


def _ops(ep) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "moe_compile" in str(n.target)]


def _run(ep, kwargs):
    with torch.no_grad():
        return first_tensor(ep.module()(**kwargs))


def _eager(model, kwargs):
    with torch.no_grad():
        return first_tensor(model(**kwargs))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_families_blocks_are_rewritten_in_the_exported_program(family):
    model, kwargs = build_model(family)
    ep = _export(model, kwargs)
    new, report = moe_compile.rewrite_exported(ep)
    assert report.rewritten == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    assert {b.router for b in report.blocks} == {FAMILIES[family]}, str(report)
    assert len(_ops(new)) >= 2 and _ops(ep) == []  # the given program is not changed
    # the replaced experts are gone, though export's metadata checks of their .to() casts would keep them
    assert not [n for n in new.graph.nodes if "grouped_mm" in str(n.target)], new.graph_module.code
    assert max_rel_diff(_run(new, kwargs), _eager(model, kwargs)) <= TOL[torch.float32]
    assert report.output is new and len(report.graphs_after) == 1


@pytest.mark.parametrize("style", ["v4_mixtral", "gptfast"])
def test_hand_written_blocks_with_separate_expert_weights(style):
    """A ModuleList loop over torch.where (export captures it with data-dependent sizes) and gpt-fast's w1/w3:
    the stacked copies come from ``moe_compile::stacked_weights`` in the program."""
    model, kwargs = build_block_model(style)
    new, report = moe_compile.rewrite_exported(_export(model, kwargs))
    assert report.rewritten == ["layers.0.moe", "layers.1.moe"], str(report)
    assert "moe_compile.stacked_weights.default" in _ops(new)
    assert max_rel_diff(_run(new, kwargs), _eager(model, kwargs)) <= TOL[torch.float32]


def test_symbolic_token_counts():
    model, kwargs = build_model("qwen3_moe")
    seq = torch.export.Dim("seq", min=2, max=64)
    try:
        ep = _export(model, kwargs, dynamic_shapes={"input_ids": {1: seq}})
    except torch._dynamo.exc.UserError as e:  # the plain model's export, before our pass runs
        if "Constraints violated" not in str(e) or torch.__version__ >= (2, 13):
            raise
        pytest.skip(f"torch {torch.__version__} cannot export transformers' Qwen3-MoE with a symbolic length: {e}")
    new, report = moe_compile.rewrite_exported(ep)
    assert len(report.rewritten) == 2, str(report)
    for tokens in (3, 17, 40):
        ids = {"input_ids": torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator())}
        assert max_rel_diff(_run(new, ids), _eager(model, ids)) <= TOL[torch.float32], tokens


def test_save_and_load(tmp_path):
    model, kwargs = build_model("mixtral")
    new, _ = moe_compile.rewrite_exported(_export(model, kwargs))
    torch.export.save(new, tmp_path / "moe.pt2")
    loaded = torch.export.load(tmp_path / "moe.pt2")
    assert len(_ops(loaded)) == 2
    assert max_rel_diff(_run(loaded, kwargs), _eager(model, kwargs)) <= TOL[torch.float32]


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_aot_inductor_calls_the_fused_op(tmp_path):
    """AOTInductor compiles the rewritten program to a package whose proxy executor calls the ops."""
    model, kwargs = build_block_model("v4_mixtral")
    new, _ = moe_compile.rewrite_exported(_export(model, kwargs))
    path = torch._inductor.aoti_compile_and_package(new, package_path=str(tmp_path / "moe_aoti.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad(), _Calls() as seen:
        out = first_tensor(runner(**kwargs))
    assert seen.calls["moe_compile.fused_moe.default"] == 2, dict(seen.calls)
    assert max_rel_diff(out, _eager(model, kwargs)) <= TOL[torch.float32]


def test_exclusion_by_path_and_by_module():
    model, kwargs = build_model("mixtral")
    ep = _export(model, kwargs)
    _, report = moe_compile.rewrite_exported(ep, options={"exclude": "model.layers.1.*"})
    assert report.rewritten == ["model.layers.0.mlp"], str(report)
    _, report = moe_compile.rewrite_exported(ep, options={"exclude": type(model.model.layers[0].mlp)})
    assert not report.rewritten and len(report.skipped) == 2, str(report)  # the class from the module stack's name
    moe_compile.exclude(model.model.layers[0].mlp)
    new, report = moe_compile.rewrite_exported(ep)
    assert report.rewritten == ["model.layers.1.mlp"], str(report)
    assert max_rel_diff(_run(new, kwargs), _eager(model, kwargs)) <= TOL[torch.float32]


def test_nothing_to_rewrite_returns_the_program_as_it_is():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    ep = _export(model, {"input": torch.randn(3, 8)})
    new, report = moe_compile.rewrite_exported(ep)
    assert new is ep and not report.blocks


@pytest.mark.expects_fallback
def test_a_pass_failure_keeps_the_program_and_says_why(monkeypatch, moe_log):
    from moe_compile.passes.moe_pass import MoEFusionPass

    def broken(self, graph):
        raise RuntimeError("boom")

    monkeypatch.setattr(MoEFusionPass, "__call__", broken)
    model, kwargs = build_model("mixtral")
    ep = _export(model, kwargs)
    new, report = moe_compile.rewrite_exported(ep)
    assert new is ep and not report.rewritten
    why = "the pass failed on the exported program (RuntimeError: boom); it is kept as it was"
    assert report.skipped == [("<exported program>", why)]
    assert why in moe_log.text  # a warning too: a caller need not read the report


def test_bad_arguments():
    model, kwargs = build_model("mixtral")
    with pytest.raises(TypeError, match="ep must be a torch.export.ExportedProgram .*but got Mixtral"):
        moe_compile.rewrite_exported(model)
    ep = _export(model, kwargs)
    with pytest.raises(ValueError, match="args/kwargs must have the structure ep was exported with"):
        moe_compile.rewrite_exported(ep, torch.zeros(1, 5, dtype=torch.long), torch.zeros(1))
    with pytest.raises(TypeError, match=r"options\['experts_only'\] must be a bool"):
        moe_compile.rewrite_exported(ep, options={"experts_only": "yes"})


def test_lowering_npu_runs_the_torch_npu_ops_on_the_emulation():
    """``options={"lowering": "npu"}``: the program's fused op runs as torch_npu ops (here the CPU emulation of
    them, poisoned: an op it does not emulate, or undefined rows read, would show)."""
    from moe_compile.testing import emulated_npu

    model, kwargs = build_model("mixtral")
    new, _ = moe_compile.rewrite_exported(_export(model, kwargs), options={"lowering": "npu"})
    with emulated_npu(poison=True) as npu:
        out = _run(new, kwargs)
    assert dict(npu.calls) == {"npu_moe_gating_top_k_softmax": 2, "npu_moe_init_routing_v2": 2,
                               "npu_grouped_matmul": 4, "npu_swiglu": 2}
    assert max_rel_diff(out, _eager(model, kwargs)) <= TOL[torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_in_bf16():
    """The rewritten program on the GPU (the CUDA lowering), at the bf16 tolerance against eager or against the
    program as exported (a near-tie of two router logits can flip under one rounding: see test_cuda_models.py)."""
    model, kwargs = build_model("qwen3_moe", dtype=torch.bfloat16)
    model, kwargs = model.cuda(), {k: v.cuda() for k, v in kwargs.items()}
    ep = _export(model, kwargs)
    new, report = moe_compile.rewrite_exported(ep)
    assert len(report.rewritten) == 2, str(report)
    out = _run(new, kwargs).float()
    to_eager, to_plain = max_rel_diff(out, _eager(model, kwargs).float()), max_rel_diff(out, _run(ep, kwargs).float())
    assert min(to_eager, to_plain) <= TOL[torch.bfloat16], (to_eager, to_plain)
