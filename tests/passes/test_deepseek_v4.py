"""DeepSeek-V4 (transformers 5.24): sqrt(softplus) router scores become ``routing_method="sqrtsoftplus"``.

Its top-k layers score experts with ``sqrt(softplus(logits))``, pick with ``+ e_score_correction_bias``,
divide the picked scores by their sum + 1e-20 and scale them; the experts are a clamped SwiGLU
(``silu_clamped``). Its hash layers take the expert ids from ``input_ids`` through a table: their router
stays as written and their experts alone are fused. Tolerances: fp32 1e-4, bf16 2e-2 of the output's magnitude
(``helpers.TOL``).
"""
from __future__ import annotations

import pytest
import torch

from moe_compile.testing import zoo

from .helpers import TOL, explain_and_compare, first_tensor, max_rel_diff


def _require(name: str = "deepseek_v4") -> None:
    available, why = zoo.is_available(name, "grouped_mm")
    if not available:
        pytest.skip(why)


def _mixed_model(dtype=torch.float32):
    """A hash layer, then a top-k layer (the real model's first layers hash, the rest do not)."""
    import transformers

    config = zoo.build_config("deepseek_v4")
    config.mlp_layer_types = ["hash_moe", "moe"]
    model = transformers.DeepseekV4ForCausalLM._from_config(config, dtype=dtype)
    zoo.redraw_parameters(model, seed=1)
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():
        if hasattr(module, "tid2eid"):  # distinct experts per token, as a trained table has
            table = torch.stack([torch.randperm(config.n_routed_experts, generator=gen)[: config.num_experts_per_tok]
                                 for _ in range(module.tid2eid.shape[0])])
            module.tid2eid.copy_(table)
    return model.eval()


def test_topk_layers_are_rewritten_with_the_sqrtsoftplus_router():
    """bf16 (test_hf_families.py checks fp32)."""
    _require()
    dtype = torch.bfloat16
    model, kwargs = zoo.build_model("deepseek_v4", dtype=dtype)
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # the selection bias is exercised
    report, diff = explain_and_compare(model, kwargs)
    assert diff <= TOL[dtype], (diff, str(report))
    assert report.rewritten == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    for block in report.blocks:
        assert block.router.startswith("sqrtsoftplus+bias→topk→norm"), block.router
        assert block.activation.startswith("silu_clamped"), block.activation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hash_layers_experts_are_fused_and_the_topk_layer_whole(dtype):
    """The hash layer's router stays (the table lookup and the gathered scores); its experts become
    ``fused_experts`` (``experts_only.py``)."""
    _require()
    model = _mixed_model(dtype)
    kwargs = zoo.build_inputs("deepseek_v4", num_tokens=7, seed=3)
    report, diff = explain_and_compare(model, kwargs)
    assert diff <= TOL[dtype], (diff, str(report))
    assert sorted(report.rewritten) == ["model.layers.0.mlp", "model.layers.1.mlp"], str(report)
    routers = {b.path: b.router for b in report.blocks}
    assert routers["model.layers.0.mlp"] == "kept as written (ids from a table lookup) -> fused_experts", routers
    assert routers["model.layers.1.mlp"].startswith("sqrtsoftplus+bias→topk→norm"), routers
    assert all(b.activation.startswith("silu_clamped") for b in report.blocks), str(report)


def test_dynamic_token_counts_under_inductor_match_eager():
    """Under Inductor the pass sees softplus decomposed (where(x > 20, x, log1p(exp(x)))): found on the H200
    (check_zoo.py --inner inductor left both blocks alone) before the router hints looked for log1p."""
    _require()
    model, _ = zoo.build_model("deepseek_v4", num_layers=1)  # one layer: half the Inductor compile time
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="moe_npu", dynamic=True, options={"inner_compiler": "inductor"})
    with torch.no_grad():
        for tokens in (3, 11):
            kwargs = zoo.build_inputs("deepseek_v4", num_tokens=tokens, seed=tokens)
            diff = max_rel_diff(first_tensor(compiled(**kwargs)), first_tensor(model(**kwargs)))
            assert diff <= TOL[torch.float32], (tokens, diff)
    assert torch._dynamo.utils.counters["moe_compile"]["rewritten"] == 1
    assert torch._dynamo.utils.counters["moe_compile"]["skipped"] == 0
