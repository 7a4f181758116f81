"""MoE families of transformers 5.24 added in the twenty-first session: the language models of the
multimodal families (their text decoders, built alone; aria as the whole model) and the rest of
``hf_moe_families.md`` §6-§7 that the zoo lacked. Every one was built tiny and run through the pass
(aot_eager and Inductor, fp32 and bf16) before it was recorded here; the GPU machine's transformers
5.17 has few of them (``zoo.is_available``).

Rotary sections: ERNIE 4.5 VL (head_dim 16: 8 frequencies) needs mrope sections summing to 8 with
h == w; GLM-4.5V rotates half the head (sections sum to 4); HY-V4-VL's sum to qk_rope_head_dim // 2.
"""
from __future__ import annotations

import types

from moe_compile.testing.zoo_extra import _SPARSE, _fam, _r4
from moe_compile.testing.zoo_spec import (
    DECORATED, NATIVE, TINY_MLA, Capture, ExpertsImpl, FamilySpec, RouterKind, SharedExperts, capture_map, tiny,
)

_MOE = dict(num_experts_per_tok=2)
_GM = capture_map()
_R4 = ("fp32 linear -> sigmoid -> +e_score_correction_bias (selection) -> group top2-sum -> topk_group "
       "-> masked_fill(-inf) -> topk -> gather -> [/(sum+1e-20)] -> x routed_scaling_factor")
_R5 = ("fp32 linear -> softmax -> [group max -> topk_group -> masked_fill(0.0)] -> topk(sorted=False) -> x scale "
       "(no renorm)")

_GEMMA4_ROUTER = ("router on the block's residual (not the experts' input): unscaled RMSNorm -> x scale[H] "
                  "x H^-0.5 -> linear -> softmax(fp32) -> topk -> /= sum -> x per_expert_scale[idx]; "
                  "experts see pre_feedforward_layernorm_2(residual)")

_GEMMA4_NOTES = ("the experts read their own input and per_expert_scale is folded into down_proj "
                 "(passes/experts_input.py); "
                 "no MoE block module: the decoder layer calls router and experts inline and sums the experts' "
                 "post-normed output with a dense MLP branch; the zoo's redraw gives router.scale and "
                 "per_expert_scale (init ones) N(0, 0.1^2), so router logits are flat (std ~0.01)")
_R3_INKLING2 = ("fp32 linear -> score_fn = ACT2FN[config.scoring_func] (sigmoid) -> topk(scores + "
                "e_score_correction_bias, sorted=False) -> gather -> /(sum+1e-20) -> x route_scale")
_SOFTCAP_SKIP = ("experts use a softcapped SwiGLU, mlp_gate_softcap*tanh(g/mlp_gate_softcap) * sigmoid(g) * "
                 "mlp_up_softcap*tanh(u/mlp_up_softcap) (4.0, 25.0): not one of the op's activations")


def _ocr(name: str, prefix: str, **kwargs) -> FamilySpec:
    """The DeepSeek-V2-style text decoders of the OCR families (R5 routers, an ungated shared expert)."""
    model_type = {"DeepseekOcr2": "deepseek_ocr2_text", "UnlimitedOcr": "unlimited_ocr_text"}[prefix]
    return FamilySpec(
        name=name, model_type=model_type, config_class=prefix + "TextConfig", model_class=prefix + "TextModel",
        config_kwargs=tiny(_MOE, n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1,
                           mlp_layer_types=["sparse"], routed_scaling_factor=2.0, **kwargs),
        block_classes=(prefix + "TextMoe",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R5, router=_R5, shared_experts=SharedExperts.UNGATED, capture=_GM,
        per_layer_keys=("mlp_layer_types",),
    )


_INKLING2 = tiny(num_experts_per_tok=2, n_routed_experts=8, intermediate_size=32,
                 layer_types=["hybrid_sliding", "hybrid"], sliding_window_size=16, swa_num_attention_heads=4,
                 swa_num_key_value_heads=2, swa_head_dim=16, d_rel=4, rel_extent=16,
                 n_layers_per_attn_res_block=1, unpadded_vocab_size=128)

MULTIMODAL_FAMILIES = (
    FamilySpec(
        name="qwen3_vl_moe", model_type="qwen3_vl_moe_text", config_class="Qwen3VLMoeTextConfig",
        model_class="Qwen3VLMoeTextModel",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, num_experts=8),
        block_classes=("Qwen3VLMoeTextSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="linear -> softmax(fp32) -> topk -> /= sum (always) -> to(dtype)",
        capture=_GM, notes="text decoder of Qwen3-VL-MoE; forward(input_ids) works (M-RoPE positions from arange)",
    ),
    FamilySpec(
        name="qwen3_omni_moe", model_type="qwen3_omni_moe_text", config_class="Qwen3OmniMoeTextConfig",
        model_class="Qwen3OmniMoeThinkerTextModel",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, num_experts=8),  # norm_topk_prob default True
        block_classes=("Qwen3OmniMoeThinkerTextSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="linear -> softmax(fp32) -> topk -> [/= sum if norm_topk_prob] -> to(dtype)",
        capture=_GM, notes="thinker text decoder of Qwen3-Omni-MoE (the talker has its own MoE, not covered)",
    ),
    FamilySpec(
        name="glm4v_moe", model_type="glm4v_moe_text", config_class="Glm4vMoeTextConfig",
        model_class="Glm4vMoeTextModel",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                           first_k_dense_replace=0, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                                partial_rotary_factor=0.5)),
        block_classes=("Glm4vMoeTextMoE",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R4, router=_R4, shared_experts=SharedExperts.UNGATED, capture=_GM,
    ),
    FamilySpec(
        name="ernie4_5_vl_moe", model_type="ernie4_5_vl_moe_text", config_class="Ernie4_5_VLMoeTextConfig",
        model_class="Ernie4_5_VLMoeTextModel",
        config_kwargs=tiny(moe_intermediate_size=[32, 32], moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
                           mlp_layer_types=["sparse"],
                           rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2])),
        block_classes=("Ernie4_5_VLMoeMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R6,
        router="fp32 linear -> softmax -> topk(probs + e_score_correction_bias) -> gather -> /clamp(sum, moe_norm_min)",
        capture=_GM, per_layer_keys=("mlp_layer_types",),
        notes="Ernie4_5_VLMoeMoeBlock holds text_moe + vision_moe (each an Ernie4_5_VLMoeSparseMoeBlock with its own "
              "router and experts) and an ungated shared MLP added outside them; without moe_mm_token_type_ids "
              "(text only) only text_moe runs",
    ),
    FamilySpec(
        name="minimax_m3_vl", model_type="minimax_m3_vl_text", config_class="MiniMaxM3VLTextConfig",
        model_class="MiniMaxM3VLTextModel",
        config_kwargs=tiny(_MOE, num_local_experts=8, intermediate_size=32, shared_intermediate_size=32,
                           dense_intermediate_size=64, rotary_dim=8, routed_scaling_factor=2.0),
        block_classes=("MiniMaxM3VLSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R3,
        router="linear -> float sigmoid -> topk(scores + e_score_correction_bias) -> gather -> /= sum (no eps); "
               "block multiplies the experts OUTPUT by routed_scaling_factor",
        activation="swigluoai", shared_experts=SharedExperts.UNGATED, capture=_GM,
        notes="experts: gpt-oss clamped SwiGLU (alpha 1.702, limit 7) on a concatenated (not interleaved) "
              "gate_up_proj [E,2I,H]; shared MLP uses the same clamped SwiGLU",
    ),
    FamilySpec(
        name="hy_v4_vl", model_type="hy_v4_vl_text", config_class="HYV4VLTextConfig", model_class="HYV4VLTextModel",
        config_kwargs=tiny(_MOE, n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
                           topk_group=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=16, index_topk=4, index_head_dim=16, index_n_heads=2,
                           mlp_layer_types=["sparse"],
                           rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])),
        block_classes=("HYV4VLMoE",), num_moe_layers=2, experts_impls=DECORATED, router_kind=RouterKind.R4,
        router=_R4, activation="silu_clamped", shared_experts=SharedExperts.UNGATED, capture=_GM, per_layer_keys=("mlp_layer_types",),
        notes="indexed (DSA-style) attention with an indexer top-k over keys (index_topk=4 < T exercises it); "
              "hyper-connections around attention and MoE",
    ),
    _ocr("deepseek_ocr2", "DeepseekOcr2", topk_method="greedy"),
    _ocr("deepseek_ocr2_grouped", "DeepseekOcr2", topk_method="group_limited_greedy", n_group=4, topk_group=1),
    _ocr("unlimited_ocr", "UnlimitedOcr", topk_method="greedy", sliding_window=16),  # MoE code = deepseek_ocr2's
    FamilySpec(
        name="aria", model_type="aria", config_class="AriaConfig", model_class="AriaForConditionalGeneration",
        config_kwargs=types.MappingProxyType(dict(
            text_config=dict(tiny(moe_num_experts=8, moe_topk=2, intermediate_size=32)),
            vision_config=dict(model_type="idefics3_vision", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
            projector_patch_to_query_dict={4: 2}, image_token_index=9, tie_word_embeddings=False,
            vocab_size=128,  # not an AriaConfig field: build_inputs reads it
        )),
        block_classes=("AriaTextMoELayer",), num_moe_layers=2, experts_impls=DECORATED, router_kind=RouterKind.R2,
        router="F.linear -> topk(logits) -> softmax over the k", shared_experts=SharedExperts.UNGATED, capture=_GM,
        notes="whole VL model, input_ids only (no pixel_values); the text decoder is model.language_model "
              "(AriaTextModel, the aria_text classes); experts is_transposed=True",
    ),
)

RECENT_FAMILIES = (
    FamilySpec(
        name="step3p7", model_type="step3p5", config_class="Step3p7TextConfig", model_class="Step3p7TextModel",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, n_routed_experts=8, share_expert_dim=32,
                           mlp_layer_types=["sparse"], layer_types=["full_attention"], sliding_window=16,
                           moe_router_scaling_factor=1.5),
        block_classes=("Step3p7SparseMoeBlock",), num_moe_layers=2, experts_impls=NATIVE,
        router_kind=RouterKind.R3,
        router="linear -> float sigmoid -> topk(scores + e_score_correction_bias) -> gather -> /= sum (no eps); "
               "moe_router_scaling_factor multiplies the experts OUTPUT",
        shared_experts=SharedExperts.UNGATED, capture=capture_map(decorated=False, native=Capture.BREAKS),
        per_layer_keys=("mlp_layer_types", "layer_types"),
        notes="experts not @use_experts_implementation-decorated (one_hot(E+1) + nonzero loop); "
              "_apply_gate = silu(g).clamp(max=L) * clamp(u, -L, L), L = inf without swiglu_limits; "
              "text-only base model (Step3p7ForConditionalGeneration needs a vision tower)",
    ),
    FamilySpec(
        name="muse_spark", model_type="muse_spark_text", config_class="MuseSparkTextConfig",
        model_class="MuseSparkTextModel",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, num_local_experts=8, moe_hidden_size=32,
                           sliding_window=16, routed_scaling_factor=1.5, mlp_layer_types=["sparse"]),
        block_classes=("MuseSparkMoE",), num_moe_layers=2, experts_impls=DECORATED, router_kind=RouterKind.R3,
        router="fp32 linear on the block input -> x output_multiplier -> sigmoid -> topk(scores + "
               "e_score_correction_bias) -> gather -> /(sum+1e-15) -> x routed_scaling_factor",
        expressible=False,
        skip_reason="each expert's output goes through its own RMSNorm (post_expert_norm, scale then normalise) "
                    "before the routing weight; the fused op has no per-expert output norm",
        capture=_GM, per_layer_keys=("mlp_layer_types",),
        notes="experts run at moe_hidden_size between pre_expert_proj+CenteredRMSNorm and post_expert_proj; "
              "the router reads the block input (hidden_size)",
    ),
    FamilySpec(
        name="openai_privacy_filter", model_type="openai_privacy_filter", config_class="OpenAIPrivacyFilterConfig",
        model_class="OpenAIPrivacyFilterModel",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_local_experts=8, sliding_window=16,
                           max_position_embeddings=131072),  # YaRN: factor 32 over original 4096
        block_classes=("OpenAIPrivacyFilterMLP",), num_moe_layers=2,
        # transformers' default (eager) first
        experts_impls=(ExpertsImpl.EAGER, ExpertsImpl.GROUPED_MM, ExpertsImpl.BATCHED_MM),
        router_kind=RouterKind.R2,
        router="fp32 linear(+bias) -> topk(logits) -> softmax over the k -> / top_k; block output x top_k",
        activation="swigluoai", capture=_GM,
        notes="encoder (bidirectional sliding window), base model; gate_up_proj [E,H,2I] transposed, "
              "CONCATENATED (not interleaved) gate/up, biases [E,2I]/[E,H]; transformers' default experts "
              "implementation is 'eager' for this model (get_correct_experts_implementation)",
    ),
    FamilySpec(
        name="doge", model_type="doge", config_class="DogeConfig", model_class="DogeForCausalLM",
        config_kwargs=tiny(_MOE, is_moe=True, num_experts=16, intermediate_size=32),
        block_classes=("DogeCDMoE",), num_moe_layers=2, experts_impls=NATIVE, router_kind=RouterKind.R7,
        router="product keys: linear(H -> 2*sqrt(E)) -> view(2, T, sqrt(E)) -> topk(sqrt(E)) on each half -> "
               "outer sum -> topk(k) -> softmax over the k",
        shared_experts=SharedExperts.UNGATED, activation="silu_no_mul", expressible=False,
        skip_reason="CDMoE product-key retrieval: the expert top-k runs over outer sums of two sqrt(E)-wide key "
                    "scores (no [T, E] router matmul) and each routed 'expert' is one row of two Embedding tables "
                    "(silu(down_embed[i] . x) * up_embed[i]), not [E, H, I] expert weights",
        capture=capture_map(decorated=False, native=Capture.ONE_GRAPH),
        notes="num_experts must be a square (16: 4 keys); the view(2, T, -1) mixes router rows across tokens",
    ),
    FamilySpec(
        name="sarvam_moe", model_type="sarvam_moe", config_class="SarvamMoEConfig", model_class="Glm4MoeForCausalLM",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                           first_k_dense_replace=0, n_group=4, topk_group=2),
        block_classes=("Glm4MoeMoE",), num_moe_layers=2, experts_impls=DECORATED, router_kind=RouterKind.R4,
        router=_R4, shared_experts=SharedExperts.UNGATED, capture=_GM,
        notes="config only: transformers maps sarvam_moe to Glm4MoeForCausalLM (GLM-4-MoE code); "
              "routed_scaling_factor 2.5, qk-norm, full rotary",
    ),
    FamilySpec(
        name="gemma4", model_type="gemma4_text", config_class="Gemma4TextConfig", model_class="Gemma4ForCausalLM",
        config_kwargs=tiny(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                           hidden_size_per_layer_input=0, vocab_size_per_layer_input=128,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                           global_head_dim=16),
        block_classes=("Gemma4TextDecoderLayer",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R7, router=_GEMMA4_ROUTER, activation="gelu_tanh",
        shared_experts=SharedExperts.NONE, capture=_GM, per_layer_keys=("layer_types",), notes=_GEMMA4_NOTES,
    ),
    FamilySpec(
        name="diffusion_gemma", model_type="diffusion_gemma_text", config_class="DiffusionGemmaTextConfig",
        model_class="DiffusionGemmaEncoderTextModel",
        config_kwargs=tiny(num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                           global_head_dim=16),
        block_classes=("DiffusionGemmaEncoderTextLayer",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R7, router=_GEMMA4_ROUTER, activation="gelu_tanh",
        capture=_GM, per_layer_keys=("layer_types",),
        notes="Gemma-4's MoE layer (same router/experts code); every layer is MoE; text encoder model, "
              "no LM head (last_hidden_state). " + _GEMMA4_NOTES,
    ),
    FamilySpec(
        name="zaya", model_type="zaya", config_class="ZayaConfig", model_class="ZayaForCausalLM",
        config_kwargs=tiny(num_experts=8, num_experts_per_tok=1, moe_intermediate_size=32, router_hidden_size=32),
        block_classes=("ZayaSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R7,
        router=("MLP router: down_proj(H->R) [+ prev layer's router state x scale] -> RMSNorm -> gelu(fc1) -> "
                "gelu(fc2) -> out_proj(R->E+1) -> softmax over E+1 (an extra 'skip' class) -> "
                "topk(probs + balancing_biases) -> gather -> skip pick: weight 0; top-1 only"),
        expressible=False,
        skip_reason=("the router scores E+1 classes (an extra 'skip' class whose pick outputs zero) with an MLP on "
                     "its own hidden state: the op routes over exactly the E experts from logits of the experts' "
                     "input (expressible only with a padded all-zero expert E+1)"),
        capture=_GM,
        notes="ZaYA1: num_experts_per_tok must be 1; router state carried across layers (EDA); balancing_biases "
              "is a buffer [0,..,0,-1] the redraw keeps, so the skip class is never picked in the tiny model",
    ),
    FamilySpec(
        name="inkling", model_type="inkling_text", config_class="InklingTextConfig", model_class="InklingForCausalLM",
        config_kwargs=tiny(num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                           mlp_layer_types=["sparse"], layer_types=["hybrid_sliding", "hybrid"],
                           sliding_window_size=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                           swa_head_dim=16, d_rel=4, rel_extent=16),
        block_classes=("InklingMoE",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R7,
        router=("fp32 linear with E + n_shared outputs -> sigmoid -> topk(routed scores + e_score_correction_bias) "
                "-> weights = softmax(logsigmoid([picked routed logits, shared logits])) x route_scale x "
                "global_scale; the shared part ('gammas') weights the shared experts"),
        shared_experts=SharedExperts.UNGATED, expressible=False,
        skip_reason=("the routed weights are normalised together with the shared experts' sigmoid scores "
                     "(sigmoid(l_j) / (sum over the k picks + sum over the shared logits)) and the router matmul "
                     "has E + n_shared outputs: no routing of the op gives these weights"), experts_only=True,
        capture=_GM, per_layer_keys=("mlp_layer_types", "layer_types"),
        notes="shared experts [S, I, H] bmm, each scaled by its router gamma (not ungated in fact: router-gated); "
              "n_shared_experts=0 breaks the router (scores[..., :-0] is empty)",
    ),
    FamilySpec(
        name="inkling2", model_type="inkling2_text", config_class="Inkling2TextConfig",
        model_class="Inkling2ForCausalLM",
        config_kwargs=_INKLING2,
        block_classes=("Inkling2SparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R3, router=_R3_INKLING2, activation="softcapped_swiglu",
        expressible=False, skip_reason=_SOFTCAP_SKIP, capture=_GM, per_layer_keys=("layer_types",),
        notes="intermediate_size is an alias of moe_intermediate_size; every layer is MoE; experts accumulate in "
              "fp32; n_layers_per_attn_res_block=1 for 2 layers",
    ),
    FamilySpec(
        name="inkling2_loop", model_type="inkling2_loop_text", config_class="Inkling2LoopTextConfig",
        model_class="Inkling2LoopForCausalLM",
        config_kwargs=tiny(_INKLING2, loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2,
                           loop_gate_rank=8),
        block_classes=("Inkling2LoopSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R3, router=_R3_INKLING2, activation="softcapped_swiglu",
        expressible=False, skip_reason=_SOFTCAP_SKIP, capture=_GM, per_layer_keys=("layer_types",),
        notes="as inkling2; layer 1 is a loop layer run loop_num_passes=2 times, so the graph holds 3 MoE "
              "calls for 2 block modules (the moe_compile 'skipped' counter says 3, the report 2 rows)",
    ),
)

# the DSA attention indexer shrunk to the tiny shapes (hy_v4, glm5_next, axk2, dots3_note, mistral_large4)
_DSA = dict(index_head_dim=16, index_n_heads=2, index_topk=8)
_AXK2 = tiny(_MOE, TINY_MLA, _SPARSE, _DSA, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
             gated_norm_rank=4)

DEEPSEEK_LIKE_FAMILIES = (
    _r4("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", "KimiLinearMoE", mla=True,
        num_local_experts=8, n_shared_experts=1, layer_types=["linear_attention", "full_attention"],
        linear_head_dim=16, linear_num_heads=4),  # its KDA layers run their torch fallback on the CPU
    _fam("glm5_next", "Glm5NextTextConfig", "Glm5NextTextModel", "Glm5NextTextMoE", RouterKind.R4, _R4,
         tiny(_MOE, TINY_MLA, _SPARSE, _DSA, moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
              n_shared_experts=1, qk_rope_head_dim=0,  # DSA layers must be NoPE
              layer_types=["linear_attention", "indexed_attention"], linear_head_dim=16, linear_num_heads=4,
              index_kpool=4, hc_mult=2),
         model_type="glm5_next_text", shared=SharedExperts.UNGATED, per_layer=("layer_types", "mlp_layer_types"),
         activation="silu_clamped",
         notes="text model only (last_hidden_state); KDA + DSA-indexed MLA layers, 2 hyper-connection streams; "
               "the indexer's top-k has a data-dependent last dim (it used to stop the whole pass)"),
    _fam("hy_v4", "HYV4Config", "HYV4ForCausalLM", "HYV4MoE", RouterKind.R4, _R4,
         tiny(_MOE, TINY_MLA, _SPARSE, _DSA, moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
              n_shared_experts=1, hc_mult=2),
         shared=SharedExperts.UNGATED, per_layer=("mlp_layer_types",), activation="silu_clamped",
         notes="n_group=1 in the release (global top-k); 4 here to exercise the group path"),
    _fam("axk2", "AXK2Config", "AXK2ForCausalLM", "AXK2MoE", RouterKind.R3,
         "fp32 linear -> sigmoid -> topk(scores + e_score_correction_bias) -> gather -> /(sum+1e-20) "
         "-> x routed_scaling_factor", _AXK2,
         shared=SharedExperts.UNGATED, per_layer=("mlp_layer_types",),
         notes="A.X-K2's config default: n_group=None, no group step"),
    _fam("axk2_grouped", "AXK2Config", "AXK2ForCausalLM", "AXK2MoE", RouterKind.R4,
         "as deepseek_v3, but the dropped groups' biased scores are masked with 0.0, not -inf",
         tiny(_AXK2, n_group=4, topk_group=2),
         model_type="axk2", shared=SharedExperts.UNGATED, per_layer=("mlp_layer_types",), expressible=False,
         skip_reason="the dropped groups are masked with 0.0, not -inf: when a bias makes the kept experts' "
                     "scores negative, a dropped expert is picked, which the op's group-limited routing never does",
         experts_only=True,
         notes="rewritten as DeepSeek-V3 routing until the twenty-first session (0.95 off eager once the bias "
               "made scores negative); the routing probes now include scores below zero"),
    _r4("dots3_note", "Dots3NoteTextConfig", "Dots3NoteForCausalLM", "Dots3NoteTextMoE", mla=True,
        n_shared_experts=1, shared_experts_intermediate_size=32, routed_scaling_factor=2.5,
        layer_types=["indexed_attention"], **_DSA),  # the default layer_types adds sliding layers from layer 2
    _fam("mistral_large4", "MistralLarge4TextConfig", "MistralLarge4TextModel", "MistralLarge4TextMoE", RouterKind.R5,
         "fp32 linear -> softmax -> group top2-sum -> topk_group -> masked_fill(0.0) -> topk -> gather "
         "-> /(sum+1e-20) (always) -> x routed_scaling_factor",
         tiny(_MOE, TINY_MLA, _SPARSE, _DSA, n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1,
              n_group=4, topk_group=2, routed_scaling_factor=1.5),
         model_type="mistral_large4_text", shared=SharedExperts.UNGATED, per_layer=("mlp_layer_types",),
         notes="text model only (last_hidden_state); 0.0 mask is harmless: softmax scores are > 0"),
)
