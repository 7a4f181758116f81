"""More MoE families of transformers 5.24 (``hf_moe_families.md`` §6-§7) that build in tiny form.

Every layer is made an MoE layer where the family allows it (``mlp_layer_types=["sparse"]`` and the
like); nemotron_h keeps its hybrid pattern (4 layers, 2 of them MoE).
"""
from __future__ import annotations

from moe_compile.testing.zoo_spec import (
    DECORATED, TINY_MLA, FamilySpec, RouterKind, SharedExperts, capture_map, tiny,
)

_MOE = dict(num_experts_per_tok=2)
_GM = capture_map()
_SPARSE = dict(mlp_layer_types=["sparse"])
_R4 = ("fp32 linear -> sigmoid -> +e_score_correction_bias (selection) -> group top2-sum -> topk_group "
       "-> masked_fill(-inf) -> topk -> gather -> [/(sum+1e-20)] -> x routed_scaling_factor")


def _fam(name, config_class, model_class, block, kind, router, kwargs, *, model_type=None,
         shared=SharedExperts.NONE, per_layer=(), **extra):
    return FamilySpec(
        name=name, model_type=model_type or name, config_class=config_class, model_class=model_class,
        config_kwargs=kwargs, block_classes=(block,), num_moe_layers=extra.pop("num_moe_layers", 2),
        experts_impls=DECORATED, router_kind=kind, router=router, shared_experts=shared, capture=_GM,
        per_layer_keys=per_layer, **extra,
    )


def _r4(name, config_class, model_class, block, *, shared=SharedExperts.UNGATED, mla=False, **kwargs):
    overlay = TINY_MLA if mla else {}
    kw = tiny(_MOE, overlay, _SPARSE, moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
              **kwargs)
    per_layer = tuple(k for k in ("layer_types", "mlp_layer_types") if isinstance(kw.get(k), list))
    return _fam(name, config_class, model_class, block, RouterKind.R4, _R4, kw, shared=shared, per_layer=per_layer)


def _v4(name, mlp_layer_type, **extra):
    """DeepSeek-V4 with every layer of one MLP type: top-k routed ("moe") or hash routed ("hash_moe")."""
    return FamilySpec(
        name=name, model_type="deepseek_v4", config_class="DeepseekV4Config", model_class="DeepseekV4ForCausalLM",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, layer_types=None,
                           mlp_layer_types=[mlp_layer_type], sliding_window=16),
        block_classes=("DeepseekV4SparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R7, activation="silu_clamped", shared_experts=SharedExperts.UNGATED, capture=_GM,
        per_layer_keys=("mlp_layer_types",), **extra,
    )


EXTRA_FAMILIES = (
    FamilySpec(
        name="nemotron_h", model_type="nemotron_h", config_class="NemotronHConfig", model_class="NemotronHForCausalLM",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, n_group=4,
                           topk_group=2, num_hidden_layers=4,
                           layers_block_type=["linear_attention", "moe", "full_attention", "moe"]),
        block_classes=("NemotronHMoE",), num_moe_layers=2, default_layers=4, experts_impls=DECORATED,
        router_kind=RouterKind.R4, router=_R4, activation="relu2_no_mul", shared_experts=SharedExperts.UNGATED,
        capture=_GM, per_layer_keys=("layers_block_type",),
        notes="non-gated experts: up_proj [E,I,H] + down_proj, relu^2; hybrid mamba/attention/moe layers",
    ),
    _v4("deepseek_v4", "moe", router="linear -> sqrt(softplus) -> topk(+bias) -> gather -> /(sum+1e-20) -> x scale",
        notes="routing_method='sqrtsoftplus'; experts silu(clamp(g, max=L)) * clamp(u, -L, L)"),
    _v4("deepseek_v4_hash", "hash_moe",
        router="hash layers: ids = tid2eid[input_ids]; weights sqrt(softplus(logits)) at those ids, /(sum+1e-20)",
        expressible=False, skip_reason="hash routing: the expert ids come from input_ids through a lookup table "
                                       "(no top-k over router scores)", experts_only=True),
    _fam("minimax_m2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM", "MiniMaxM2SparseMoeBlock", RouterKind.R3,
         "linear -> float sigmoid -> topk(scores + e_score_correction_bias) -> gather -> /= sum (no eps, no scale)",
         tiny(_MOE, intermediate_size=32, num_local_experts=8)),
    _fam("aria_text", "AriaTextConfig", "AriaTextForCausalLM", "AriaTextMoELayer", RouterKind.R2,
         "F.linear -> topk(logits) -> softmax over the k", tiny(moe_num_experts=8, moe_topk=2, intermediate_size=32),
         shared=SharedExperts.UNGATED, notes="experts is_transposed=True: gate_up_proj [E,H,2I]"),
    _fam("cohere2_moe", "Cohere2MoeConfig", "Cohere2MoeForCausalLM", "Cohere2MoeSparseMoeBlock", RouterKind.R2,
         "F.linear -> topk(logits) -> softmax(fp32) over the k -> to(dtype)",
         tiny(_MOE, num_experts=8, num_shared_experts=1, intermediate_size=32, layer_types=None,
              mlp_layer_types=None, sliding_window=16),
         shared=SharedExperts.UNGATED),
    _fam("flint", "FlintConfig", "FlintForCausalLM", "FlintSparseMoeBlock", RouterKind.R3,
         "fp32 linear -> sigmoid -> topk (no bias) -> / sum -> experts; + ungated shared expert",
         tiny(_MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32, layer_types=None,
              sliding_window=16, decoder_sparse_step=1, mlp_only_layers=[-1]),  # default [0, 1]: dense
         shared=SharedExperts.UNGATED),
    _fam("granitemoe_swa", "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", "GraniteMoeSWAMoE", RouterKind.R2,
         "F.linear -> float -> topk(logits) -> softmax over the k -> type_as",
         tiny(_MOE, num_local_experts=8, intermediate_size=32, layer_types=None, sliding_window=16)),
    _fam("hy_v3", "HYV3Config", "HYV3ForCausalLM", "HYV3MoE", RouterKind.R3,
         "fp32 linear -> sigmoid -> topk(scores + bias) -> gather -> /(sum+1e-20) -> x router_scaling_factor",
         tiny(_MOE, _SPARSE, num_experts=8, moe_intermediate_size=32, num_shared_experts=1),
         shared=SharedExperts.UNGATED, per_layer=("mlp_layer_types",)),
    _fam("laguna", "LagunaConfig", "LagunaForCausalLM", "LagunaSparseMoeBlock", RouterKind.R3,
         "linear -> float -> [tanh softcap] -> sigmoid -> topk(scores + bias) -> gather -> / sum -> to(dtype); "
         "routed_scaling_factor multiplies the experts OUTPUT",
         tiny(_MOE, _SPARSE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              layer_types=None, sliding_window=16, moe_routed_scaling_factor=1.5),
         shared=SharedExperts.UNGATED, per_layer=("mlp_layer_types",)),
    _fam("lara_mini", "LaraMiniConfig", "LaraMiniForCausalLM", "LaraMiniSparseMoeBlock", RouterKind.R1,
         "fp32 linear -> softmax -> topk -> [renorm] -> to(dtype); + ungated shared expert",
         tiny(_MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32, layer_types=None,
              sliding_window=16),
         shared=SharedExperts.UNGATED),
    _fam("mellum", "MellumConfig", "MellumForCausalLM", "MellumSparseMoeBlock", RouterKind.R1,
         "linear -> softmax(fp32) -> topk -> [/= sum] -> to(logits dtype)",
         tiny(_MOE, num_experts=8, moe_intermediate_size=32, layer_types=None, mlp_layer_types=None,
              sliding_window=16)),
    _fam("mistral4", "Mistral4Config", "Mistral4ForCausalLM", "Mistral4MoE", RouterKind.R5,
         "linear -> softmax -> group top2-sum -> topk_group -> masked_fill(0.0) -> topk -> gather "
         "-> [/(sum+1e-20)] -> x routed_scaling_factor",
         tiny(_MOE, TINY_MLA, n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1,
              first_k_dense_replace=0, n_group=4, topk_group=2),
         shared=SharedExperts.UNGATED),
    _fam("qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", "Qwen4ExpTextSparseMoeBlock", RouterKind.R1,
         "linear -> softmax(fp32) -> topk -> [/= sum] -> to(dtype)",
         tiny(_MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32, layer_types=None),
         model_type="qwen4_exp_text", shared=SharedExperts.SIGMOID_GATED),
    _fam("kolibri1", "Kolibri1Config", "Kolibri1ForCausalLM", "Kolibri1SparseMoeBlock", RouterKind.R7,
         "fp32 linear -> topk(logits + e_score_correction_bias) -> gather(logits) -> sigmoid -> [/ sum]; "
         "CUDA bf16 inference uses torch.mm(out_dtype=fp32)",
         tiny(_MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32, layer_types=None,
              sliding_window=16),
         shared=SharedExperts.UNGATED, expressible=False,
         skip_reason="selection bias is added to the raw logits before top-k and sigmoid scores the picked "
                     "logits; the op adds its correction bias to the scores", experts_only=True),
    _r4("deepseek_v32", "DeepseekV32Config", "DeepseekV32ForCausalLM", "DeepseekV32MoE", mla=True,
        n_shared_experts=1, first_k_dense_replace=0, layer_types=None),
    _r4("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteMoE", mla=True,
        n_shared_experts=1),
    _r4("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "GlmMoeDsaMoE", mla=True, n_shared_experts=1,
        first_k_dense_replace=0, layer_types=None),
    # first_k_dense_replace=0: transformers 5.17's AXK1Config has no mlp_layer_types (layer 0 dense)
    _r4("axk1", "AXK1Config", "AXK1ForCausalLM", "AXK1MoE", mla=True, n_shared_experts=1, first_k_dense_replace=0),
    _r4("beam", "BeamConfig", "BeamForCausalLM", "BeamMoE", shared=SharedExperts.NONE, num_experts=8,
        layer_types=None, sliding_window=16),
)
