"""The test-subject zoo: every family builds and runs, block counts match, hand-written blocks are real MoEs."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from moe_compile import fused_moe  # noqa: E402
from moe_compile.testing import zoo  # noqa: E402
from moe_compile.testing.zoo_blocks import BLOCK_STYLES, build_block_model, fused_reference_args  # noqa: E402
from moe_compile.testing.zoo_spec import Capture, ExpertsImpl  # noqa: E402

ISSUE3_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "deepseek_v3", "gpt_oss",
                   "granitemoe", "jetmoe", "llama4", "phimoe")


def _logits(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def test_registry_holds_the_issue_families_and_is_consistent():
    assert set(ISSUE3_FAMILIES) <= set(zoo.MOE_FAMILIES)
    assert set(zoo.CORE_FAMILY_NAMES) == set(ISSUE3_FAMILIES)
    for name, spec in zoo.MOE_FAMILIES.items():
        assert spec.name == name
        assert spec.expressible == (spec.skip_reason is None), name
        assert set(spec.capture) == set(spec.experts_impls), name
    skipped = {name for name in zoo.MOE_FAMILIES if not zoo.MOE_FAMILIES[name].expressible}
    assert {"phimoe", "switch_transformers", "nllb_moe", "longcat_flash"} <= skipped


def _require(name):
    available, why = zoo.is_available(name)
    if not available:
        pytest.skip(why)


@pytest.mark.parametrize("name", list(zoo.MOE_FAMILIES))
def test_family_builds_and_runs_fp32(name):
    _require(name)
    spec = zoo.MOE_FAMILIES[name]
    model, kwargs = zoo.build_model(name, num_tokens=6)
    assert not model.training
    with torch.no_grad():
        out = _logits(model(**kwargs))
    assert out.shape[:2] == (1, 6) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    paths = zoo.moe_block_paths(model, name)
    assert len(paths) == spec.num_moe_layers == zoo.expected_moe_layers(name)
    assert zoo.moe_block_paths(model) == paths  # the registry-wide lookup finds the same blocks
    if spec.decorated and zoo.experts_switchable(name):  # (transformers 5.17's aria_text is not yet)
        # transformers' default: grouped_mm, but eager for a few (openai_privacy_filter)
        assert model.config._experts_implementation == spec.default_impl.value


# The issue's decorated families plus one per remaining router kind (R3, R5, R6) keep this fast.
@pytest.mark.parametrize("name", [n for n in ISSUE3_FAMILIES if zoo.MOE_FAMILIES[n].decorated]
                         + ["lfm2_moe", "deepseek_v2", "ernie4_5_moe"])
def test_experts_implementations_agree(name):
    """Each implementation is really set (config) and all compute the same function (same weights)."""
    _require(name)
    outs = {}
    for impl in zoo.MOE_FAMILIES[name].experts_impls:
        model, kwargs = zoo.build_model(name, experts_implementation=impl.value)
        assert model.config._experts_implementation == impl.value
        with torch.no_grad():
            outs[impl] = _logits(model(**kwargs))
    ref = outs[ExpertsImpl.EAGER]
    for impl, out in outs.items():
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=f"{name} {impl.value}")


@pytest.mark.parametrize("name", ["qwen3_next", "mimo_v2_flash", "dbrx", "longcat_flash", "switch_transformers"])
def test_num_layers_scales_the_block_count(name):
    _require(name)
    model, kwargs = zoo.build_model(name, num_layers=3)
    assert len(zoo.moe_block_paths(model, name)) == zoo.expected_moe_layers(name, 3)
    with torch.no_grad():
        assert torch.isfinite(_logits(model(**kwargs))).all()


@pytest.mark.parametrize("name", [n for n in ISSUE3_FAMILIES if zoo.MOE_FAMILIES[n].decorated])
def test_routing_is_not_degenerate(name):
    """16 tokens reach at least 4 distinct experts in every layer, with weights that vary."""
    model, kwargs = zoo.build_model(name, num_tokens=16)
    seen = []
    for path in zoo.moe_block_paths(model, name):
        model.get_submodule(path).experts.register_forward_hook(
            lambda _mod, args, _out: seen.append((args[1].unique().numel(), args[2].float().std().item()))
        )
    with torch.no_grad():
        model(**kwargs)
    assert len(seen) == zoo.expected_moe_layers(name)
    for distinct, weight_std in seen:
        assert distinct >= 4 and weight_std > 1e-3, (name, seen)


def test_build_is_deterministic_and_dtype_consistent():
    m1, kw1 = zoo.build_model("qwen3_moe", seed=3)
    m2, kw2 = zoo.build_model("qwen3_moe", seed=3)
    m3, _ = zoo.build_model("qwen3_moe", seed=4)
    mb, _ = zoo.build_model("qwen3_moe", seed=3, dtype=torch.bfloat16)
    assert torch.equal(kw1["input_ids"], kw2["input_ids"])
    p1, p2, p3, pb = (dict(m.named_parameters()) for m in (m1, m2, m3, mb))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(p1[key], p2[key]) and not torch.equal(p1[key], p3[key])
    assert pb[key].dtype == torch.bfloat16 and torch.equal(pb[key], p1[key].to(torch.bfloat16))
    assert torch.equal(p1["model.norm.weight"], torch.ones(64))  # norms keep their init


def test_keep_in_fp32_router_survives_bf16():
    """The zoo's re-drawn weights keep the dtypes transformers itself gives DeepSeek-V3's router in
    a bf16 model; installs that keep the router weight in fp32 (5.2x) keep its bias in fp32 too."""
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    model, _ = zoo.build_model("deepseek_v3", dtype=torch.bfloat16)
    plain = transformers.DeepseekV3ForCausalLM._from_config(zoo.build_config("deepseek_v3"), dtype=torch.bfloat16)
    gate, plain_gate = (m.get_submodule("model.layers.0.mlp.gate") for m in (model, plain))
    for name in ("weight", "e_score_correction_bias"):
        assert getattr(gate, name).dtype == getattr(plain_gate, name).dtype, name
    if "gate.weight" in modeling_deepseek_v3.DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict:
        assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert gate.e_score_correction_bias.abs().max() > 0  # re-drawn, selection is really biased


def test_seq2seq_inputs_and_bad_arguments():
    assert set(zoo.build_inputs("nllb_moe", 4)) == {"input_ids", "decoder_input_ids"}
    assert zoo.build_inputs("mixtral", 7, batch=2)["input_ids"].shape == (2, 7)
    with pytest.raises(ValueError, match="model_type"):
        zoo.build_model("not_a_family")
    with pytest.raises(ValueError, match="experts_implementation"):
        zoo.build_model("jetmoe", experts_implementation="grouped_mm")
    with pytest.raises(ValueError, match="experts_implementation"):
        zoo.build_model("mixtral", experts_implementation="native")
    with pytest.raises(TypeError, match="dtype"):
        zoo.build_model("mixtral", dtype=torch.int64)
    with pytest.raises(ValueError, match="num_tokens"):
        zoo.build_inputs("mixtral", 0)
    with pytest.raises(ValueError, match="num_layers"):
        zoo.build_model("mixtral", num_layers=0)


@pytest.mark.parametrize("style", list(BLOCK_STYLES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hand_written_block_equals_fused_op(style, dtype):
    """Each hand-written block computes exactly what the fused op computes from the mapped weights."""
    model, kwargs = build_block_model(style, num_layers=3, dtype=dtype, num_tokens=9)
    assert zoo.moe_block_paths(model, style) == ["layers.0.moe", "layers.1.moe", "layers.2.moe"]
    block = model.layers[1].moe
    x_TD = kwargs["hidden_states"].view(-1, block.cfg.hidden_size)
    with torch.no_grad():
        got = block(kwargs["hidden_states"]).view_as(x_TD)
        want = fused_moe(**fused_reference_args(block, x_TD))
        if getattr(block, "shared_experts", None) is not None:
            want = want + block.shared_experts(x_TD)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("style,dtype", [("gptfast", torch.float32), ("titan_softmax_gmm", torch.bfloat16)])
def test_one_graph_styles_capture_as_one_graph(style, dtype):
    assert BLOCK_STYLES[style].capture is Capture.ONE_GRAPH
    model, kwargs = build_block_model(style, dtype=dtype)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(**kwargs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
