"""The families named by issue 3 (the pass must rewrite or skip each of them).

Tiny shapes: hidden 64, expert intermediate 32, 2 layers (every layer MoE), 8 experts, top-k 2
(Llama 4: 1), vocab 128, 4 query heads of 16. Build bugs of transformers 5.24 worked around here
are named where they are fixed.
"""
from __future__ import annotations

from moe_compile.testing.zoo_spec import (
    DECORATED, NATIVE, TINY_MLA, Capture, FamilySpec, RouterKind, SharedExperts, capture_map, tiny,
)

_MOE = dict(num_experts_per_tok=2)

CORE_FAMILIES = (
    FamilySpec(
        name="mixtral", model_type="mixtral", config_class="MixtralConfig", model_class="MixtralForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_local_experts=8),
        block_classes=("MixtralSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="linear -> float -> softmax -> topk -> /= sum (weights stay fp32)",
        capture=capture_map(),
    ),
    FamilySpec(
        name="qwen2_moe", model_type="qwen2_moe", config_class="Qwen2MoeConfig", model_class="Qwen2MoeForCausalLM",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                           norm_topk_prob=False, layer_types=None),
        block_classes=("Qwen2MoeSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="linear -> softmax(fp32) -> topk -> [renorm if norm_topk_prob] -> to(dtype)",
        shared_experts=SharedExperts.SIGMOID_GATED, capture=capture_map(),
    ),
    FamilySpec(
        name="qwen3_moe", model_type="qwen3_moe", config_class="Qwen3MoeConfig", model_class="Qwen3MoeForCausalLM",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, num_local_experts=8, norm_topk_prob=True),
        block_classes=("Qwen3MoeSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="linear -> softmax(fp32) -> topk -> renorm -> to(dtype)",
        capture=capture_map(),
    ),
    FamilySpec(
        name="qwen3_next", model_type="qwen3_next", config_class="Qwen3NextConfig", model_class="Qwen3NextForCausalLM",
        config_kwargs=tiny(_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                           layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                           linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
        block_classes=("Qwen3NextSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="linear -> softmax(fp32) -> topk -> renorm -> to(dtype)",
        shared_experts=SharedExperts.SIGMOID_GATED, capture=capture_map(), per_layer_keys=("layer_types",),
        notes="hybrid: layer 0 is GatedDeltaNet (torch fallback on CPU), layer 1 full attention",
    ),
    FamilySpec(
        name="olmoe", model_type="olmoe", config_class="OlmoeConfig", model_class="OlmoeForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_experts=8),
        block_classes=("OlmoeSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R1, router="linear -> softmax(fp32) -> topk -> [renorm if norm_topk_prob] -> to(dtype)",
        capture=capture_map(),
    ),
    FamilySpec(
        name="deepseek_v3", model_type="deepseek_v3", config_class="DeepseekV3Config",
        model_class="DeepseekV3ForCausalLM",
        config_kwargs=tiny(_MOE, TINY_MLA, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                           first_k_dense_replace=0, n_group=4, topk_group=2, routed_scaling_factor=2.5),
        block_classes=("DeepseekV3MoE",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R4,
        router="fp32 linear -> sigmoid -> +e_score_correction_bias (selection) -> group top2-sum -> topk_group "
               "-> masked_fill(-inf) -> topk -> gather -> /(sum+1e-20) -> x routed_scaling_factor",
        shared_experts=SharedExperts.UNGATED, capture=capture_map(),
    ),
    FamilySpec(
        name="gpt_oss", model_type="gpt_oss", config_class="GptOssConfig", model_class="GptOssForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_local_experts=8, layer_types=None, sliding_window=16,
                           max_position_embeddings=131072),  # YaRN: factor 32 over original 4096
        block_classes=("GptOssMLP",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R2, router="linear(+bias) -> topk(logits) -> softmax over the k",
        activation="swigluoai", capture=capture_map(),
        notes="gate_up_proj [E,H,2I] transposed + interleaved, biases [E,2I]/[E,H]; block returns (out, scores)",
    ),
    FamilySpec(
        name="granitemoe", model_type="granitemoe", config_class="GraniteMoeConfig",
        model_class="GraniteMoeForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_local_experts=8),
        block_classes=("GraniteMoeMoE",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R2, router="linear -> float -> topk(logits) -> softmax over the k -> type_as",
        capture=capture_map(),
    ),
    FamilySpec(
        name="jetmoe", model_type="jetmoe", config_class="JetMoeConfig", model_class="JetMoeForCausalLM",
        config_kwargs=tiny(_MOE, intermediate_size=32, num_local_experts=8, kv_channels=16),
        block_classes=("JetMoeMoE",), num_moe_layers=2, experts_impls=NATIVE,
        router_kind=RouterKind.R2,
        router="linear -> float -> topk(logits) -> softmax(k) -> scatter -> .tolist() sizes -> sort dispatch",
        capture=capture_map(decorated=False, native=Capture.NEEDS_FLAGS),
        notes="not decorated; ParallelExperts [E,2I,H]/[E,H,I], split + per-expert F.linear loop, output bias; "
              "JetMoeMoA (mixture of attention) uses the same gate and is not an MoE FFN block",
    ),
    FamilySpec(
        name="llama4", model_type="llama4_text", config_class="Llama4TextConfig", model_class="Llama4ForCausalLM",
        config_kwargs=tiny(num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=64,
                           num_local_experts=8, moe_layers=None, interleave_moe_layer_step=1, layer_types=None,
                           no_rope_layers=None, attention_chunk_size=16),
        block_classes=("Llama4TextMoe",), num_moe_layers=2, experts_impls=NATIVE,
        router_kind=RouterKind.R7,
        router="linear -> topk(logits) -> full(-inf).scatter_ -> sigmoid: dense [T,E] scores, weight on the INPUT",
        shared_experts=SharedExperts.UNGATED, capture=capture_map(decorated=False, native=Capture.ONE_GRAPH),
        notes="dense bmm over all E experts on x*score; gate_up_proj [E,H,2I] transposed; top-k 1",
    ),
    FamilySpec(
        name="phimoe", model_type="phimoe", config_class="PhimoeConfig", model_class="PhimoeForCausalLM",
        # jitter_eps 0.01 (the default) masks all but the top logit at this weight scale: every weight 1.0
        config_kwargs=tiny(_MOE, intermediate_size=32, num_local_experts=8, router_jitter_noise=0.3),
        block_classes=("PhimoeSparseMoeBlock",), num_moe_layers=2, experts_impls=DECORATED,
        router_kind=RouterKind.R7,
        router="SparseMixer top-2: two sequential masked-softmax argmax picks (no topk op), no renorm",
        expressible=False,
        skip_reason="SparseMixer router (two sequential masked-softmax argmax picks, no top-k, weights not "
                    "renormalised) is not a routing method of the fused op",
        experts_only=True,
        capture=capture_map(),
    ),
)
