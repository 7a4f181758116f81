"""The other MoE families of transformers 5.24 surveyed in ``hf_moe_families.md`` §2.

Same tiny shapes as ``zoo_families``; build bugs of transformers 5.24 are fixed where marked FIX.
"""
from __future__ import annotations

from moe_compile.testing.zoo_spec import (
    DECORATED, NATIVE, TINY_MLA, Capture, FamilySpec, RouterKind, SharedExperts, capture_map, tiny,
)

_MOE = dict(num_experts_per_tok=2)
_GM = capture_map()
_DSV3_ROUTER = ("fp32 linear -> sigmoid -> +e_score_correction_bias (selection) -> group top2-sum -> topk_group "
                "-> masked_fill(-inf) -> topk -> gather -> [/(sum+1e-20)] -> x routed_scaling_factor")
_QWEN_ROUTER = "linear -> softmax(fp32) -> topk -> [renorm] -> to(dtype)"
_HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4)
_CAPACITY_DROP = ("{} argmax routing with expert capacity (token dropping: over-capacity tokens get no expert "
                  "output); the fused op routes every token to its top-k experts")


def _ds3_like(name, config_class, model_class, block, shared=SharedExperts.UNGATED, **kwargs):
    """A family whose router is DeepSeek-V3's text (R4)."""
    per_layer = tuple(key for key in ("layer_types", "mlp_layer_types") if isinstance(kwargs.get(key), list))
    return FamilySpec(
        name=name, model_type=name, config_class=config_class, model_class=model_class,
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, **kwargs), block_classes=(block,), num_moe_layers=2,
        experts_impls=DECORATED, router_kind=RouterKind.R4, router=_DSV3_ROUTER, shared_experts=shared,
        capture=_GM, per_layer_keys=per_layer,
    )


MORE_FAMILIES = (
    FamilySpec(
        name="flex_olmo", model_type="flex_olmo", config_class="FlexOlmoConfig", model_class="FlexOlmoForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_experts=8),  # FIX: default pad/eos ids > vocab
        block_classes=("FlexOlmoSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router=_QWEN_ROUTER, capture=_GM,
    ),
    FamilySpec(
        name="deepseek_v2", model_type="deepseek_v2", config_class="DeepseekV2Config",
        model_class="DeepseekV2ForCausalLM",
        config_kwargs=tiny(_MOE, TINY_MLA, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                           first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=4, topk_group=1,
                           routed_scaling_factor=2.0),
        block_classes=("DeepseekV2Moe",), num_moe_layers=2, experts_impls=DECORATED, router_kind=RouterKind.R5,
        router="fp32 linear -> softmax -> group max -> topk_group -> masked_fill(0.0) -> topk -> x scale (no renorm)",
        shared_experts=SharedExperts.UNGATED, capture=_GM,
        notes="groups masked with 0.0 (not -inf): same picks as -inf because softmax scores are > 0; topk_group=1: "
              "with groups scored by their max, the top-2 experts always lie in the top-2 groups, so keeping 2 "
              "groups would pick as greedy does and the group choice would go untested",
    ),
    FamilySpec(
        name="deepseek_v2_greedy", model_type="deepseek_v2", config_class="DeepseekV2Config",
        model_class="DeepseekV2ForCausalLM",
        config_kwargs=tiny(_MOE, TINY_MLA, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                           first_k_dense_replace=0, topk_method="greedy", routed_scaling_factor=2.0),
        block_classes=("DeepseekV2Moe",), num_moe_layers=2, experts_impls=DECORATED, router_kind=RouterKind.R5,
        router="fp32 linear -> softmax -> topk(sorted=False) -> x scale (no renorm)",
        shared_experts=SharedExperts.UNGATED, capture=_GM,
    ),
    _ds3_like("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", "Glm4MoeMoE", n_routed_experts=8,
              n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1),
    _ds3_like("dots1", "Dots1Config", "Dots1ForCausalLM", "Dots1MoE", n_routed_experts=8, n_shared_experts=1,
              first_k_dense_replace=0, n_group=1, topk_group=1, layer_types=None),
    _ds3_like("solar_open", "SolarOpenConfig", "SolarOpenForCausalLM", "SolarOpenMoE", n_routed_experts=8,
              n_shared_experts=1, n_group=1, topk_group=1),
    _ds3_like("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeForCausalLM", "ExaoneMoeSparseMoEBlock", num_experts=8,
              num_shared_experts=1, first_k_dense_replace=0, layer_types=None, mlp_layer_types=["sparse"],
              n_group=1, topk_group=1, sliding_window=16),
    _ds3_like("mimo_v2_flash", "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", "MiMoV2FlashMoE",
              shared=SharedExperts.NONE, n_routed_experts=8, layer_types=None, mlp_layer_types=["sparse"],
              v_head_dim=16, sliding_window=16),
    FamilySpec(
        name="bailing_hybrid", model_type="bailing_hybrid", config_class="BailingHybridConfig",
        model_class="BailingHybridForCausalLM",
        # FIX: default pad/eos ids > vocab (TINY_BASE sets small ones)
        config_kwargs=tiny(TINY_MLA, moe_intermediate_size=32, num_experts=8, num_experts_per_token=2,
                           num_shared_experts=1, first_k_dense_replace=0, num_expert_group=4, topk_group=2,
                           layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse"],
                           layer_group_size=2, linear_head_dim=16, linear_num_heads=4, q_lora_rank=None),
        block_classes=("BailingHybridMoE",), num_moe_layers=2, experts_impls=DECORATED, router_kind=RouterKind.R4,
        router=_DSV3_ROUTER, shared_experts=SharedExperts.UNGATED, capture=_GM,
        per_layer_keys=("layer_types", "mlp_layer_types"),
    ),
    FamilySpec(
        name="granitemoeshared", model_type="granitemoeshared", config_class="GraniteMoeSharedConfig",
        model_class="GraniteMoeSharedForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_local_experts=8, shared_intermediate_size=32),
        block_classes=("GraniteMoeSharedMoE",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R2, router="linear -> float -> topk(logits) -> softmax over the k -> type_as",
        shared_experts=SharedExperts.OUTSIDE_BLOCK, capture=_GM,
    ),
    FamilySpec(
        name="granitemoehybrid", model_type="granitemoehybrid", config_class="GraniteMoeHybridConfig",
        model_class="GraniteMoeHybridForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_local_experts=8, shared_intermediate_size=32,
                           layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=16, mamba_d_head=32,
                           mamba_chunk_size=16, mamba_expand=2),
        block_classes=("GraniteMoeHybridMoE",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R2, router="linear -> float -> topk(logits) -> softmax over the k -> type_as",
        shared_experts=SharedExperts.OUTSIDE_BLOCK, capture=_GM, per_layer_keys=("layer_types",),
    ),
    FamilySpec(
        name="minimax", model_type="minimax", config_class="MiniMaxConfig", model_class="MiniMaxForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_local_experts=8,
                           layer_types=["linear_attention", "full_attention"], block_size=16),
        block_classes=("MiniMaxSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="= mixtral: linear -> float -> softmax -> topk -> /= sum",
        capture=_GM, per_layer_keys=("layer_types",),
    ),
    FamilySpec(
        name="hunyuan_v1_moe", model_type="hunyuan_v1_moe", config_class="HunYuanMoEV1Config",
        model_class="HunYuanMoEV1ForCausalLM",
        config_kwargs=tiny(intermediate_size=32, num_experts=8, moe_topk=2),
        block_classes=("HunYuanMoEV1Moe",), num_moe_layers=2, experts_impls=DECORATED, router_kind=RouterKind.R1,
        router="fp32 wg linear -> softmax -> topk -> renorm -> to(dtype)", shared_experts=SharedExperts.UNGATED,
        capture=_GM,
    ),
    FamilySpec(
        name="ernie4_5_moe", model_type="ernie4_5_moe", config_class="Ernie4_5_MoeConfig",
        model_class="Ernie4_5_MoeForCausalLM",
        config_kwargs=tiny(moe_intermediate_size=32, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
                           moe_layer_start_index=0, moe_layer_end_index=-1, moe_layer_interval=1),
        block_classes=("Ernie4_5_MoeSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R6,
        router="fp32 linear -> softmax -> topk(probs + e_score_correction_bias) -> gather -> /clamp(sum, 1e-12)",
        shared_experts=SharedExperts.UNGATED, capture=_GM,
    ),
    FamilySpec(
        name="lfm2_moe", model_type="lfm2_moe", config_class="Lfm2MoeConfig", model_class="Lfm2MoeForCausalLM",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, num_experts=8, num_dense_layers=0,
                           layer_types=["conv", "full_attention"], routed_scaling_factor=1.5),
        block_classes=("Lfm2MoeSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R3,
        router="linear -> sigmoid -> topk(scores + expert_bias) -> gather -> /(sum+1e-6) -> x routed_scaling_factor",
        capture=_GM, per_layer_keys=("layer_types",),
    ),
    FamilySpec(
        name="jamba", model_type="jamba", config_class="JambaConfig", model_class="JambaForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_experts=8, expert_layer_period=1, expert_layer_offset=0,
                           attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8,
                           mamba_dt_rank=8),
        block_classes=("JambaSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="linear -> softmax(fp32) -> topk (no renorm) -> to(dtype)", capture=_GM,
        notes="layer 0 mamba (slow torch path), layer 1 attention",
    ),
    FamilySpec(
        name="afmoe", model_type="afmoe", config_class="AfmoeConfig", model_class="AfmoeForCausalLM",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, num_experts=8, num_shared_experts=1, num_dense_layers=0,
                           layer_types=None, global_attn_every_n_layers=2, sliding_window=16, route_scale=1.5),
        block_classes=("AfmoeSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R3,
        router="linear -> fp32 sigmoid -> topk(scores + expert_bias) -> gather -> /(sum+1e-20) -> x route_scale",
        shared_experts=SharedExperts.UNGATED, capture=_GM,
    ),
    FamilySpec(
        name="qwen3_5_moe", model_type="qwen3_5_moe_text", config_class="Qwen3_5MoeTextConfig",
        model_class="Qwen3_5MoeForCausalLM",
        config_kwargs=tiny(_MOE, _HYBRID, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                           num_experts=8),
        block_classes=("Qwen3_5MoeSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="linear -> softmax(fp32) -> topk -> renorm -> to(dtype)",
        shared_experts=SharedExperts.SIGMOID_GATED, capture=_GM, per_layer_keys=("layer_types",),
    ),
    FamilySpec(
        name="dbrx", model_type="dbrx", config_class="DbrxConfig", model_class="DbrxForCausalLM",
        # FIX: default DbrxAttentionConfig has no rope_theta, and clip_qkv=None makes clamp() raise.
        config_kwargs=tiny(d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                           attn_config={"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
                           ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2,
                                       "hidden_size": 64}),
        block_classes=("DbrxFFN",), num_moe_layers=2, experts_impls=NATIVE, router_kind=RouterKind.R7,
        router="linear -> softmax -> topk -> / p-norm (p=1: / sum)", layers_key="n_layers",
        capture=capture_map(decorated=False, native=Capture.BREAKS),
        notes="w1, v1, w2 each [E*I, H] 2D, w2 used untransposed; w13 for the op needs torch.cat(w1, v1) (a copy)",
    ),
    FamilySpec(
        name="longcat_flash", model_type="longcat_flash", config_class="LongcatFlashConfig",
        model_class="LongcatFlashForCausalLM",
        config_kwargs=tiny(TINY_MLA, num_layers=1, ffn_hidden_size=64, expert_ffn_hidden_size=32, n_routed_experts=8,
                           zero_expert_num=2, moe_topk=2, routed_scaling_factor=1.5),
        block_classes=("LongcatFlashMoE",), num_moe_layers=1, default_layers=1, layers_key="num_layers",
        experts_impls=NATIVE, router_kind=RouterKind.R6,
        router="fp32 F.linear (bias ignored) over E+Z -> softmax -> topk(probs + bias) -> gather -> x scale",
        expressible=False,
        skip_reason="zero-compute (identity) experts share the index space with the real experts (ids >= E add "
                    "w * x); the fused op has no identity-expert slots",
        capture=capture_map(decorated=False, native=Capture.BREAKS),
    ),
    FamilySpec(
        name="switch_transformers", model_type="switch_transformers", config_class="SwitchTransformersConfig",
        model_class="SwitchTransformersModel",
        config_kwargs=tiny(d_model=64, d_kv=16, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
                           num_experts=8, num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, expert_capacity=2,
                           relative_attention_num_buckets=8),
        block_classes=("SwitchTransformersSparseMLP",), num_moe_layers=4, experts_impls=NATIVE,
        router_kind=RouterKind.R7, router="fp32 linear -> softmax -> argmax -> one_hot -> cumsum <= capacity",
        activation="relu_no_mul", expressible=False, skip_reason=_CAPACITY_DROP.format("top-1"),
        capture=capture_map(decorated=False, native=Capture.BREAKS), layers_key="num_layers", seq2seq=True,
        notes="encoder-decoder: 2 encoder + 2 decoder sparse layers; needs decoder_input_ids",
    ),
    FamilySpec(
        name="nllb_moe", model_type="nllb-moe", config_class="NllbMoeConfig", model_class="NllbMoeModel",
        config_kwargs=tiny(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, num_experts=8,
                           encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=2),
        block_classes=("NllbMoeSparseMLP",), num_moe_layers=4, experts_impls=NATIVE, router_kind=RouterKind.R7,
        router="fp32 linear -> softmax -> top1 argmax, top2 argmax -> capacity (cumsum) -> pair renorm",
        activation="relu_no_mul", expressible=False,
        skip_reason=_CAPACITY_DROP.format("top-2") + "; transformers 5.24 also dispatches on mask values (bug)",
        capture=capture_map(decorated=False, native=Capture.BREAKS), layers_key="encoder_layers", seq2seq=True,
        notes="encoder-decoder: 2 encoder + 2 decoder sparse layers; needs decoder_input_ids",
    ),
)
