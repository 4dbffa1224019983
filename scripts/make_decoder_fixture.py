"""Writes assets/tiny-<type>: a tiny random decoder of a built-in model type, in HF format,
sharing the bundled tokenizer, and parity.safetensors: input ids and the logits transformers
computes for them.

- qwen3: Qwen3ForCausalLM (per-head q/k RMSNorms, tied embeddings). The built-in Qwen3 and the
  port of candle-transformers' qwen3.rs (cargo-trl/tests/port.rs) are checked against it.
- mistral: MistralForCausalLM with a sliding window of 6 tokens, shorter than the 24-token
  inputs, so that the window shows in the logits.
- qwen2-sliding: Qwen2ForCausalLM with use_sliding_window (window 6) from layer 1 on
  (max_window_layers 1): one full-attention layer, one sliding.
- smollm3: SmolLM3ForCausalLM with 4 layers, every second one without rotary embeddings
  (no_rope_layer_interval 2).
- llama-longrope: LlamaForCausalLM with longrope scaling (Phi-3's) from 16 original positions:
  the 24-token inputs use the long factors and the attention factor.
- phi3: Phi3ForCausalLM (fused qkv_proj and gate_up_proj) with partial rotary embeddings
  (factor 0.5), longrope from 16 original positions and a 10-token sliding window.
- qwen3-moe: Qwen3MoeForCausalLM with 4 experts, top-2 renormalised, layer 1 dense
  (mlp_only_layers); random routers so that every expert gets tokens.
- mixtral: MixtralForCausalLM with 4 experts (w1/w2/w3), top 2, a sliding window of 8.
- olmo2: Olmo2ForCausalLM (norms after attention and MLP, q/k norms over the whole
  projections), untied.
- olmo3: Olmo3ForCausalLM: OLMo 2's blocks with sliding, global, sliding layers (window 6),
  YaRN from 16 original positions on the global layer only and another RoPE base on the
  sliding ones (rope_parameters by layer type, as transformers 5 writes OLMo 3's).
- gemma3: Gemma3ForCausalLM (gemma3_text): sliding, global, sliding layers (window 6), a
  linear RoPE scaling on the global layers, query_pre_attn_scalar 24 (not head_dim), random
  (1 + w) norms.
- gemma3-vision: Gemma3ForConditionalGeneration (gemma-3-4b and larger: model_type gemma3,
  the language model's config under text_config, its tensors under language_model., a
  one-layer SigLIP vision tower and the projector beside them), its language model the gemma3
  one's; the logits are of text alone.
- qwen3-vl: Qwen3VLForConditionalGeneration (model_type qwen3_vl): a Qwen3 language model
  (interleaved multimodal RoPE, which text positions make plain RoPE) under
  model.language_model., the head at lm_head, untied, a one-block vision tower beside them;
  the logits are of text alone.
- gemma2: Gemma2ForCausalLM: sliding, global, sliding layers (window 6, the default
  alternation), attention scores soft-capped at 2 and logits at 3 (q/k projections scaled up
  so that both caps bite), query_pre_attn_scalar 24, random (1 + w) norms.
- glm4-moe: Glm4MoeForCausalLM: a dense first layer (first_k_dense_replace 1), then 8 routed
  experts in 4 groups (top 2 groups, top 2 experts) by sigmoid scores plus a random
  e_score_correction_bias, renormalised and scaled by 1.5, a shared expert; per-head q/k norms,
  q/k/v biases, rotary on half of each head.
- deepseek-v3: DeepseekV3ForCausalLM: multi-head latent attention (q through a rank-24 latent,
  k/v through a rank-16 one, 16 + 8 rotary query/key features, 12 value features), interleaved
  rotary, YaRN from 16 original positions with mscale / mscale_all_dim (the softmax scale too),
  and glm4-moe's routing (scaled by 2.5) after a dense first layer.
- glm4-moe-lite: Glm4MoeLiteForCausalLM (GLM-4.7-Flash): deepseek-v3's layers with queries
  projected directly (q_lora_rank null), plain rotary, and the MLPs by mlp_layer_types:
  sparse, then dense.
- llama4: Llama4ForCausalLM (llama4_text): 4 layers, rotary ones (interleaved pairs, L2 q/k
  norms) with attention in chunks of 8 positions and NoPE ones with full attention and the
  query temperature (floor_scale 8, attn_scale 0.5, so that both bite on 24 tokens); dense
  MLPs on layers 0 and 3, a top-1 sigmoid-routed mixture of 4 fused experts plus a shared
  expert on layers 1 and 2.
- llama4-vision: Llama4ForConditionalGeneration (the hub's model_type llama4): the llama4
  language model under language_model. in the files and the module tree alike, a one-layer
  vision model and the projector beside it; the logits are of text alone.
- mistral4: Mistral4ForCausalLM: deepseek-v3's latent attention (YaRN from 16 original
  positions) with queries scaled by position (llama_4_scaling_beta 0.5, so that the scale bites
  from position 16), a dense first layer, then 8 fused experts ([experts, out, in]) in 4
  groups, top 2 of 2 groups by softmax scores, renormalised and scaled by 1.5, a shared expert.
- qwen3-next: Qwen3NextForCausalLM: Gated DeltaNet, full, Gated DeltaNet, full layers (2 key
  heads of 8 serving 4 value heads of 6, a convolution of 4), (1 + w) norms drawn around 0,
  gated full attention with partial rotary 0.25, 4 experts top 2 renormalised with a gated
  shared expert on layers 0, 1 and 3 (layer 2 dense: mlp_only_layers).
- qwen3.5: Qwen3_5ForCausalLM (qwen3_5_text): qwen3-next's hybrid layers with the linear
  attention's projections apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), a dense MLP on
  every layer, interleaved multimodal RoPE (plain on text).
- qwen3.5-moe-vision: Qwen3_5MoeForConditionalGeneration (the hub's model_type qwen3_5_moe):
  the qwen3.5 language model with 4 experts, top 2 always renormalised, and a gated shared
  expert on every layer, under model.language_model., a one-block vision tower beside it; the
  logits are of text alone.
- gemma4: Gemma4ForCausalLM (gemma4_text, as the hub's E2B / E4B): sliding and full layers
  alternating (window 6; the full ones 32 wide with proportional RoPE on a quarter of their
  frequencies), per-layer inputs of 8, the last two layers reusing the keys and values of
  layers 2 and 3 with double-wide MLPs, final-logit soft-capping 30, random layer_scalar.
- gemma4-moe-vision: Gemma4ForConditionalGeneration (model_type gemma4, as the hub's
  26B-A4B): 4 layers, a mixture of 4 experts (top 2) beside every MLP, the full layers' keys
  serving as values (attention_k_eq_v), no per-layer inputs, a one-layer vision tower beside
  it; the logits are of text alone.
- gpt-oss: GptOssForCausalLM (bf16-free, unquantized): 4 experts, top 2, sliding / full /
  sliding layers (window 6), YaRN from 16 original positions, attention sinks drawn large
  (std 1) so that they bite, random router weights and biases, a SwiGLU limit of 1.5 so that
  the clamps bite.

trl-runtime/tests/models.rs checks the logits; cargo-trl/tests/builtin_models.rs trains each
under every CPU profile.

Run by hand (needs torch and transformers from PyPI; nothing is downloaded):
    python scripts/make_decoder_fixture.py qwen3|mistral|qwen2-sliding|smollm3|olmo2|olmo3|gemma3|gemma3-vision|qwen3-vl|gemma2|llama-longrope|phi3|qwen3-moe|mixtral|gpt-oss|glm4-moe|deepseek-v3|glm4-moe-lite|llama4|llama4-vision|mistral4|qwen3-next|qwen3.5|qwen3.5-moe-vision|gemma4|gemma4-moe-vision
"""

import sys

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4Config,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Mistral4Config,
    Mistral4ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5TextConfig,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from tiny_fixture import VOCAB, write

kind = sys.argv[1] if len(sys.argv) > 1 else "qwen3"
# The hybrids of Gated DeltaNet and full attention.
QWEN_HYBRIDS = ("qwen3-next", "qwen3.5", "qwen3.5-moe-vision")


def longrope(frequencies, **extra):
    """longrope from 16 original positions (the 24-token inputs go beyond), with distinct short
    and long factors for each of `frequencies` rotary frequencies."""
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        **extra,
        "original_max_position_embeddings": 16,
        "short_factor": [1.0 + 0.1 * i for i in range(frequencies)],
        "long_factor": [1.0 + 0.7 * i for i in range(frequencies)],
    }


# The vision towers' sizes (one layer of them), beside the tiny language models.
tiny_vision = dict(hidden_size=32, intermediate_size=64, patch_size=14)


def qwen_vision(**extra):
    """A one-block vision tower of Qwen3-VL's kind (Qwen3.5's too), feeding the language
    model's width."""
    return dict(
        depth=1,
        num_heads=2,
        out_hidden_size=common["hidden_size"],
        num_position_embeddings=16,
        **extra,
        **tiny_vision,
    )


# The Qwen hybrids' layers: Gated DeltaNet, full, Gated DeltaNet, full (2 key heads of 8
# serving 4 value heads of 6, a convolution of 4), an untied head.
hybrid_layers = dict(
    tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
)

# Qwen3-VL's and Qwen3.5's wrappers: their special tokens in the tiny vocabulary, an untied head.
qwen_wrapper = dict(
    vision_start_token_id=VOCAB - 3,
    video_token_id=VOCAB - 2,
    image_token_id=VOCAB - 1,
    tie_word_embeddings=False,
)


def gemma3_text():
    """The gemma3 fixture's text config (also the vision-language one's language model):
    sliding, global, sliding layers, a linear RoPE scaling on the global one."""
    return Gemma3TextConfig(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=6,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        **{**common, "num_hidden_layers": 3},
    )


common = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    eos_token_id=2,
    bos_token_id=1,
)
if kind == "qwen3":
    config = Qwen3Config(tie_word_embeddings=True, attention_bias=False, **common)
    model_class = Qwen3ForCausalLM
elif kind == "qwen2-sliding":
    config = Qwen2Config(
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        **common,
    )
    model_class = Qwen2ForCausalLM
elif kind == "mistral":
    config = MistralConfig(tie_word_embeddings=False, sliding_window=6, **common)
    model_class = MistralForCausalLM
elif kind == "smollm3":
    config = SmolLM3Config(
        no_rope_layer_interval=2, pad_token_id=0, **{**common, "num_hidden_layers": 4}
    )
    model_class = SmolLM3ForCausalLM
elif kind == "llama-longrope":
    config = LlamaConfig(
        tie_word_embeddings=False,
        rope_parameters=longrope(common["head_dim"] // 2),
        **common,
    )
    model_class = LlamaForCausalLM
elif kind == "phi3":
    config = Phi3Config(
        tie_word_embeddings=False,
        pad_token_id=0,
        sliding_window=10,
        # Phi3Config writes its own original_max_position_embeddings into rope_parameters.
        original_max_position_embeddings=16,
        rope_parameters=longrope(common["head_dim"] // 4, partial_rotary_factor=0.5),
        **common,
    )
    model_class = Phi3ForCausalLM
elif kind == "qwen3-moe":
    config = Qwen3MoeConfig(
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        **common,
    )
    model_class = Qwen3MoeForCausalLM
elif kind == "mixtral":
    config = MixtralConfig(
        tie_word_embeddings=False,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        **{**common, "intermediate_size": 32},
    )
    model_class = MixtralForCausalLM
elif kind == "olmo2":
    config = Olmo2Config(tie_word_embeddings=False, pad_token_id=0, **common)
    model_class = Olmo2ForCausalLM
elif kind == "olmo3":
    config = Olmo3Config(
        tie_word_embeddings=False,
        pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=6,
        rope_parameters={
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 500000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "attention_factor": 1.2,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        **{**common, "num_hidden_layers": 3},
    )
    model_class = Olmo3ForCausalLM
elif kind == "gemma3":
    config = gemma3_text()
    model_class = Gemma3ForCausalLM
elif kind == "gemma3-vision":
    text = gemma3_text()
    vision = dict(num_hidden_layers=1, num_attention_heads=2, image_size=28, **tiny_vision)
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        image_token_index=VOCAB - 1,
    )
    model_class = Gemma3ForConditionalGeneration
elif kind in ("gemma4", "gemma4-moe-vision"):
    layer_types = ["sliding_attention", "full_attention"] * 3
    base = dict(
        sliding_window=6,
        global_head_dim=32,
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        **{**common, "num_hidden_layers": 6},
    )
    if kind == "gemma4":
        # The small (E2B / E4B) models' features: per-layer inputs, the last two layers
        # reusing the keys and values of the last layer of their type before them, their
        # MLPs double wide.
        config = Gemma4TextConfig(
            layer_types=layer_types,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            **base,
        )
        model_class = Gemma4ForCausalLM
    else:
        # The large (26B-A4B) model's: a mixture of experts beside each MLP, the full layers'
        # keys serving as values, no per-layer inputs; as the hub's vision-language wrapper.
        text = dict(
            layer_types=layer_types[:4],
            hidden_size_per_layer_input=0,
            attention_k_eq_v=True,
            num_global_key_value_heads=2,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
            **{**base, "num_hidden_layers": 4},
        )
        vision = dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            patch_size=4,
            position_embedding_size=64,
        )
        config = Gemma4Config(
            text_config=text,
            vision_config=vision,
            audio_config=None,
            # Beyond the tiny vocabulary: Gemma4Model reads these ids in text as places for
            # images and embeds them as pads, and the random parity rows would draw them.
            boi_token_id=VOCAB,
            eoi_token_id=VOCAB + 1,
            image_token_id=VOCAB + 2,
            video_token_id=VOCAB + 3,
            boa_token_id=None,
            eoa_token_index=None,
            audio_token_id=None,
        )
        model_class = Gemma4ForConditionalGeneration
elif kind == "qwen3-vl":
    text = dict(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 500000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
        **common,
    )
    config = Qwen3VLConfig(
        text_config=text, vision_config=qwen_vision(deepstack_visual_indexes=[0]), **qwen_wrapper
    )
    model_class = Qwen3VLForConditionalGeneration
elif kind == "gemma2":
    config = Gemma2Config(
        sliding_window=6,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        **{**common, "num_hidden_layers": 3},
    )
    model_class = Gemma2ForCausalLM
elif kind == "gpt-oss":
    config = GptOssConfig(
        tie_word_embeddings=False,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=6,
        swiglu_limit=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
        **{**common, "intermediate_size": 32, "num_hidden_layers": 3},
    )
    model_class = GptOssForCausalLM
elif kind in ("glm4-moe", "deepseek-v3", "glm4-moe-lite", "mistral4"):
    routing = dict(
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
    )
    if kind == "glm4-moe":
        config = Glm4MoeConfig(
            tie_word_embeddings=False,
            routed_scaling_factor=1.5,
            use_qk_norm=True,
            attention_bias=True,
            partial_rotary_factor=0.5,
            **routing,
            **common,
        )
        model_class = Glm4MoeForCausalLM
    elif kind == "glm4-moe-lite":
        del routing["first_k_dense_replace"]
        config = Glm4MoeLiteConfig(
            tie_word_embeddings=False,
            routed_scaling_factor=1.8,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            mlp_layer_types=["sparse", "dense"],
            **routing,
            **{**common, "num_key_value_heads": 4, "head_dim": 8},
        )
        model_class = Glm4MoeLiteForCausalLM
    else:
        # Latent attention: q through a rank-24 latent, k/v through a rank-16 one, YaRN from
        # 16 original positions with mscale / mscale_all_dim.
        latent = dict(
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_interleave=True,
        )
        yarn = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 16,
        }
        if kind == "mistral4":
            config = Mistral4Config(
                tie_word_embeddings=False,
                routed_scaling_factor=1.5,
                # 24 + 8: the rotary part a quarter of the head exactly (transformers
                # truncates head_dim x partial_rotary_factor, which 8 / 24 would round to 7).
                qk_nope_head_dim=24,
                rope_parameters={**yarn, "llama_4_scaling_beta": 0.5},
                **latent,
                **routing,
                **{**{k: v for k, v in common.items() if k != "head_dim"}, "num_key_value_heads": 4},
            )
            model_class = Mistral4ForCausalLM
        else:
            config = DeepseekV3Config(
                tie_word_embeddings=False,
                routed_scaling_factor=2.5,
                qk_nope_head_dim=16,
                rope_parameters=yarn,
                **latent,
                **routing,
                **{**common, "num_key_value_heads": 4, "head_dim": 8},
            )
            model_class = DeepseekV3ForCausalLM
elif kind == "qwen3-next":
    config = Qwen3NextConfig(
        **hybrid_layers,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[2],
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        **{**common, "num_hidden_layers": 4},
    )
    model_class = Qwen3NextForCausalLM
elif kind in ("qwen3.5", "qwen3.5-moe-vision"):
    # Qwen3-Next's layers with the linear attention's projections apart (in_proj_qkv, _z, _b,
    # _a) and interleaved multimodal RoPE (plain on text).
    hybrid = dict(
        **hybrid_layers,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
        **{**common, "num_hidden_layers": 4},
    )
    if kind == "qwen3.5":
        config = Qwen3_5TextConfig(**hybrid)
        model_class = Qwen3_5ForCausalLM
    else:
        text = dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            **{k: v for k, v in hybrid.items() if k != "intermediate_size"},
        )
        config = Qwen3_5MoeConfig(text_config=text, vision_config=qwen_vision(), **qwen_wrapper)
        model_class = Qwen3_5MoeForConditionalGeneration
elif kind in ("llama4", "llama4-vision"):
    config = Llama4TextConfig(
        tie_word_embeddings=False,
        num_local_experts=4,
        num_experts_per_tok=1,
        moe_layers=[1, 2],
        intermediate_size_mlp=96,
        no_rope_layer_interval=2,
        attention_chunk_size=8,
        floor_scale=8,
        attn_scale=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        **{**common, "intermediate_size": 32, "num_hidden_layers": 4},
    )
    model_class = Llama4ForCausalLM
    if kind == "llama4-vision":
        vision = dict(
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            vision_output_dim=32,
            projector_input_dim=32,
            projector_output_dim=32,
            pixel_shuffle_ratio=0.5,
            **{k: v for k, v in tiny_vision.items() if k not in ("image_size", "patch_size")},
        )
        config = Llama4Config(
            text_config=config.to_dict(),
            vision_config=vision,
            boi_token_index=VOCAB - 3,
            eoi_token_index=VOCAB - 2,
            image_token_index=VOCAB - 1,
        )
        model_class = Llama4ForConditionalGeneration
else:
    sys.exit(f"unknown kind {kind}: qwen3, mistral, qwen2-sliding, smollm3, olmo2, olmo3, gemma3, gemma3-vision, qwen3-vl, gemma2, llama-longrope, phi3, qwen3-moe, mixtral, gpt-oss, glm4-moe, deepseek-v3, glm4-moe-lite, llama4, llama4-vision, mistral4, qwen3-next, qwen3.5, qwen3.5-moe-vision, gemma4 or gemma4-moe-vision")
torch.manual_seed(0)
model = model_class(config).eval()
# Random norms, so that parity covers the per-head q/k norms too.
with torch.no_grad():
    for name, p in model.named_parameters():
        if kind in QWEN_HYBRIDS and ("A_log" in name or "dt_bias" in name or "linear_attn.norm" in name):
            # Decay rates spread over (0.01, 2); biases and the gated norm around 1.
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 2.0).log())
            else:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        elif kind in QWEN_HYBRIDS and "norm" in name and "visual" not in name:
            # (1 + w) norms: w around 0.
            p.copy_(0.1 * torch.randn_like(p))
        elif kind in QWEN_HYBRIDS and name.endswith("shared_expert_gate.weight"):
            p.copy_(torch.randn_like(p))
        elif "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
            # (Mistral 4's softmax router: logits spread so that the groups differ.)
            p.copy_(torch.randn_like(p))
        elif name.endswith("sinks") or ".router." in name:
            p.copy_(torch.randn_like(p))
        elif kind == "gpt-oss" and "experts" in name:
            p.copy_(0.3 * torch.randn_like(p))
        elif kind in ("glm4-moe", "deepseek-v3", "glm4-moe-lite", "llama4", "llama4-vision", "mistral4", "qwen3-next", "qwen3.5-moe-vision", "gemma4-moe-vision") and "experts" in name:
            # Experts far apart, so that the choice shows in the logits.
            p.copy_(0.3 * torch.randn_like(p))
        elif kind == "gemma2" and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            p.mul_(12.0)
    for name, b in model.named_buffers():
        # The routers' load-balancing bias moves the choice, not the weights.
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn_like(b))
        # Gemma 4's per-layer output scale, ones at initialisation, trained checkpoints' not.
        if name.endswith("layer_scalar"):
            b.copy_(torch.empty_like(b).uniform_(0.5, 1.5))
write(model, f"tiny-{kind}")
if kind in ("gemma3-vision", "qwen3-vl", "llama4-vision", "qwen3.5-moe-vision", "gemma4-moe-vision"):
    # A processor's image settings, which a checkpoint carries as it carries the tokenizer.
    from transformers import (
        Gemma3ImageProcessor,
        Gemma4ImageProcessor,
        Llama4ImageProcessor,
        Qwen2VLImageProcessor,
    )

    from tiny_fixture import ROOT

    image = {
        "gemma3-vision": lambda: Gemma3ImageProcessor(size={"height": 28, "width": 28}),
        "qwen3-vl": lambda: Qwen2VLImageProcessor(patch_size=14, merge_size=2),
        "qwen3.5-moe-vision": lambda: Qwen2VLImageProcessor(patch_size=14, merge_size=2),
        "llama4-vision": lambda: Llama4ImageProcessor(size={"height": 28, "width": 28}),
        "gemma4-moe-vision": lambda: Gemma4ImageProcessor(patch_size=4),
    }[kind]()
    image.save_pretrained(ROOT / f"assets/tiny-{kind}/model")
