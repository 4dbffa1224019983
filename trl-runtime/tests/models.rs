//! The decoder models train: every parameter gets a gradient, autograd agrees with finite
//! differences, packed documents do not see each other, and checkpoints round-trip.

mod common;

use candle_core::{DType, Device, Tensor};
use common::max_abs_diff;
use trl_runtime::models::{
    AutoModelForCausalLM, AutoModelForSequenceClassification, CausalModel, ModelConfig, Params,
};
use trl_runtime::nn::{causal_lm_loss, AttentionImpl};
use trl_runtime::parallel::CausalLm;

fn tiny_config(model_type: &str, tied: bool) -> ModelConfig {
    let json = serde_json::json!({
        "model_type": model_type,
        "architectures": [match model_type { "qwen2" => "Qwen2ForCausalLM", "qwen3" => "Qwen3ForCausalLM", _ => "LlamaForCausalLM" }],
        "vocab_size": 37,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "attention_bias": model_type == "llama",
        "initializer_range": 0.2,
    });
    ModelConfig::from_json(&json.to_string(), "tiny").unwrap()
}

fn model(model_type: &str, tied: bool, dtype: DType) -> CausalLm {
    let cfg = tiny_config(model_type, tied);
    let params = Params::init(&cfg, 7, dtype, &Device::Cpu).unwrap();
    CausalLm::new(cfg, params).unwrap()
}

fn batch() -> (Tensor, Tensor, Tensor) {
    // Row 0: two packed documents (positions restart); row 1: one document.
    let ids = Tensor::new(
        &[[3u32, 9, 12, 5, 1, 30, 2, 8], [4, 4, 17, 22, 36, 0, 11, 6]],
        &Device::Cpu,
    )
    .unwrap();
    let pos = Tensor::new(
        &[[0i64, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]],
        &Device::Cpu,
    )
    .unwrap();
    let labels = Tensor::new(
        &[
            [3i64, 9, 12, -100, 1, 30, 2, 8],
            [-100, -100, 17, 22, 36, 0, 11, 6],
        ],
        &Device::Cpu,
    )
    .unwrap();
    (ids, pos, labels)
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for (ty, tied) in [
        ("qwen2", true),
        ("qwen2", false),
        ("llama", false),
        ("llama", true),
        ("qwen3", true),
    ] {
        let m = model(ty, tied, DType::F32);
        let (ids, pos, labels) = batch();
        let loss = causal_lm_loss(&m.forward(&ids, &pos).unwrap(), &labels).unwrap();
        let grads = loss.mean().unwrap().backward().unwrap();
        assert!(m.params.len() > 10);
        for (name, var) in m.params.iter() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{ty}: no gradient for {name}"));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{ty}: gradient of {name} is {norm}"
            );
        }
    }
}

/// The loss path the trainer takes (`forward_targets`: the fused LM head and loss, whose
/// weight gradient the tied embedding's lookup adds its rows into in place; `eval_targets`
/// for its value alone) gives the value and gradients of the plain path (logits, then the loss; Candle's lookup and head): f32 (the
/// fused loss), f64 and bf16 (the tiled loss, which recomputes in backward), tied or not.
#[test]
fn the_training_loss_path_gives_the_plain_gradients() {
    for (ty, tied, dtype, bound) in [
        ("qwen2", true, DType::F32, 1e-5),
        ("llama", false, DType::F32, 1e-5),
        ("qwen2", true, DType::F64, 1e-12),
        ("qwen2", true, DType::BF16, 2e-2),
    ] {
        let mut m = model(ty, tied, dtype);
        m.tiled_loss = dtype != DType::F32;
        let (ids, pos, labels) = batch();
        let plain = causal_lm_loss(&m.forward(&ids, &pos).unwrap(), &labels)
            .unwrap()
            .mean()
            .unwrap();
        let want = plain.backward().unwrap();
        let targets = trl_runtime::nn::loss::shift_labels(&labels).unwrap();
        let ls = m.forward_targets(&ids, &pos, &targets).unwrap();
        // Evaluation's path (no gradients computed) gives the same value.
        let eval = m.eval_targets(&ids, &pos, &targets).unwrap();
        let value = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        assert_eq!(
            value(&eval.sum),
            value(&ls.sum),
            "{ty} {dtype:?}: eval loss"
        );
        let loss = (ls.sum.to_dtype(DType::F64).unwrap() / ls.count as f64).unwrap();
        let got = m.backward(&loss).unwrap();
        let close = (loss.to_scalar::<f64>().unwrap()
            - plain
                .to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap())
        .abs();
        assert!(close < 1e-3, "{ty} {dtype:?}: loss differs by {close}");
        for (name, var) in m.params.iter() {
            let (g, w) = (got.get(var.as_tensor()), want.get(var.as_tensor()));
            let (g, w) = (
                g.unwrap_or_else(|| panic!("{ty} {dtype:?}: no gradient for {name}")),
                w.unwrap(),
            );
            let (g, w) = (
                g.to_dtype(DType::F64).unwrap(),
                w.to_dtype(DType::F64).unwrap(),
            );
            let norm = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().sqrt().unwrap();
            let rel = (norm(&(&g - &w).unwrap()) / norm(&w))
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert!(rel < bound, "{ty} {dtype:?}: {name} differs by {rel:e}");
        }
    }
}

#[test]
fn autograd_matches_finite_differences() {
    for (ty, tied) in [("qwen2", true), ("llama", false)] {
        let m = model(ty, tied, DType::F64);
        let (ids, pos, labels) = batch();
        let loss_of = |m: &CausalLm| -> f64 {
            causal_lm_loss(&m.forward(&ids, &pos).unwrap(), &labels)
                .unwrap()
                .mean()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        let loss = causal_lm_loss(&m.forward(&ids, &pos).unwrap(), &labels).unwrap();
        let grads = loss.mean().unwrap().backward().unwrap();
        let eps = 1e-5;
        let mut checked = 0;
        for (name, var) in m.params.iter() {
            let g: Vec<f64> = grads
                .get(var.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let original = var.as_tensor().copy().unwrap();
            let flat: Vec<f64> = original.flatten_all().unwrap().to_vec1().unwrap();
            // Three elements of every parameter, spread over the tensor.
            for k in [0, flat.len() / 2, flat.len() - 1] {
                let mut f = [0.0; 2];
                for (i, sign) in [1.0, -1.0].iter().enumerate() {
                    let mut p = flat.clone();
                    p[k] += sign * eps;
                    var.set(&Tensor::from_vec(p, original.shape(), &Device::Cpu).unwrap())
                        .unwrap();
                    f[i] = loss_of(&m);
                }
                var.set(&original).unwrap();
                let numeric = (f[0] - f[1]) / (2.0 * eps);
                assert!(
                    (numeric - g[k]).abs() <= 1e-6 + 1e-4 * numeric.abs(),
                    "{ty}: {name}[{k}]: autograd {} vs finite difference {numeric}",
                    g[k]
                );
                checked += 1;
            }
        }
        assert!(checked >= 3 * 20);
    }
}

#[test]
fn packed_documents_do_not_attend_to_each_other() {
    let m = model("qwen2", true, DType::F32);
    // [doc A | doc B] packed, against doc B alone: B's logits must be identical.
    let packed_ids = Tensor::new(&[[5u32, 6, 7, 20, 21, 22, 23]], &Device::Cpu).unwrap();
    let packed_pos = Tensor::new(&[[0i64, 1, 2, 0, 1, 2, 3]], &Device::Cpu).unwrap();
    let alone_ids = Tensor::new(&[[20u32, 21, 22, 23]], &Device::Cpu).unwrap();
    let alone_pos = Tensor::new(&[[0i64, 1, 2, 3]], &Device::Cpu).unwrap();
    let packed = m
        .forward(&packed_ids, &packed_pos)
        .unwrap()
        .narrow(1, 3, 4)
        .unwrap();
    let alone = m.forward(&alone_ids, &alone_pos).unwrap();
    let diff = max_abs_diff(&packed, &alone);
    assert!(diff < 1e-5, "document B saw document A: max diff {diff}");
    // And a continued position (no restart) does change them: the mask is not vacuous.
    let joined_pos = Tensor::new(&[[0i64, 1, 2, 3, 4, 5, 6]], &Device::Cpu).unwrap();
    let joined = m
        .forward(&packed_ids, &joined_pos)
        .unwrap()
        .narrow(1, 3, 4)
        .unwrap();
    let alone = m.forward(&alone_ids, &alone_pos).unwrap();
    let diff = max_abs_diff(&joined, &alone);
    assert!(diff > 1e-3);
}

#[test]
fn checkpoints_round_trip_single_and_sharded() {
    let m = model("llama", false, DType::F32);
    let (ids, pos, _) = batch();
    let want = m.forward(&ids, &pos).unwrap();
    for shard in [None, Some(4096)] {
        let dir = tempfile::tempdir().unwrap();
        m.save_pretrained(dir.path(), shard).unwrap();
        let sharded = dir.path().join("model.safetensors.index.json").exists();
        assert_eq!(sharded, shard.is_some());
        let loaded = CausalLm::from_pretrained(dir.path(), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(loaded.config, m.config);
        let got = loaded.forward(&ids, &pos).unwrap();
        let diff = max_abs_diff(&got, &want);
        assert_eq!(diff, 0.0);
    }
}

#[test]
fn mismatched_weights_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    model("qwen2", true, DType::F32)
        .save_pretrained(dir.path(), None)
        .unwrap();
    // A config that wants a larger MLP than the weights have.
    let mut cfg = tiny_config("qwen2", true);
    cfg.intermediate_size = 32;
    let e = Params::load(dir.path(), &cfg, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.layers.0.mlp.down_proj.weight")
            && e.contains("[16, 24]")
            && e.contains("[16, 32]"),
        "{e}"
    );
    // An untied config misses lm_head.
    let cfg = tiny_config("qwen2", false);
    let e = Params::load(dir.path(), &cfg, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("lm_head.weight") && e.contains("missing"), "{e}");
    // A directory without weights.
    let empty = tempfile::tempdir().unwrap();
    let e = Params::load(empty.path(), &cfg, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    // Through the loaders a user calls (AutoModelForCausalLM, the trainer's CausalLm): a
    // config.json beside weights of another shape names the tensor and both shapes.
    let path = dir.path().join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["intermediate_size"] = 32.into();
    std::fs::write(&path, json.to_string()).unwrap();
    let auto = AutoModelForCausalLM::from_pretrained(dir.path(), DType::F32, &Device::Cpu);
    let causal = CausalLm::from_pretrained(dir.path(), DType::F32, &Device::Cpu);
    for e in [
        auto.err().unwrap().to_string(),
        causal.err().unwrap().to_string(),
    ] {
        assert!(
            e.contains("mlp.gate_proj.weight")
                && e.contains("[24, 16]")
                && e.contains("[32, 16]")
                && e.contains("config.json"),
            "{e}"
        );
    }
    // Bad config values name the key.
    let e = ModelConfig::from_json(r#"{"model_type":"gpt2","vocab_size":1,"hidden_size":4,"intermediate_size":4,"num_hidden_layers":1,"num_attention_heads":1}"#, "config.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model_type") && e.contains("gpt2") && e.contains("mistral"),
        "{e}"
    );
    let e = ModelConfig::from_json(r#"{"model_type":"llama","vocab_size":1,"hidden_size":4,"intermediate_size":4,"num_hidden_layers":1,"num_attention_heads":1,"rope_scaling":{"rope_type":"mrope","factor":2.0}}"#, "config.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("rope_scaling") && e.contains("yarn"), "{e}");
}

/// Logits and loss of the fixture written by scripts/make_parity_fixture.py with transformers.
#[test]
fn matches_transformers_fixture() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/parity");
    for name in ["qwen2", "llama"] {
        let dir = root.join(name);
        let m = CausalLm::from_pretrained(&dir, DType::F32, &Device::Cpu).unwrap();
        let batch =
            candle_core::safetensors::load(dir.join("batch.safetensors"), &Device::Cpu).unwrap();
        let ids = batch["input_ids"].to_dtype(DType::U32).unwrap();
        let logits = m.forward(&ids, &batch["position_ids"]).unwrap();
        let want = &batch["logits"];
        assert_eq!(logits.dims(), want.dims());
        let diff = max_abs_diff(&logits, want);
        eprintln!("{name}: max |logits - transformers| = {diff:e}");
        assert!(
            diff < 1e-4,
            "{name}: logits differ from transformers by {diff}"
        );
        let loss = causal_lm_loss(&logits, &batch["labels"])
            .unwrap()
            .mean()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let want_loss = batch["loss"].to_vec1::<f32>().unwrap()[0];
        assert!(
            (loss - want_loss).abs() < 1e-4,
            "{name}: loss {loss} vs transformers {want_loss}"
        );
    }
}

/// Positions 0..s on each of `b` rows.
fn positions(b: usize, s: usize) -> Tensor {
    Tensor::arange(0i64, s as i64, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((b, 1))
        .unwrap()
}

/// The built-in Qwen3 (per-head q/k RMSNorm, tied embeddings), Mistral (a sliding window of 6
/// tokens over 24-token rows) and Qwen2 with a sliding second layer (layer_types) against
/// transformers on assets/tiny-qwen3, tiny-mistral, tiny-qwen2-sliding, tiny-gemma3,
/// tiny-gemma2 (attention scores and logits soft-capped), tiny-smollm3, tiny-olmo2, tiny-olmo3 (sliding layers with their own rotary base), tiny-llama-longrope, tiny-phi3, tiny-qwen3-moe, tiny-mixtral
/// tiny-gpt-oss (sinks, fused experts, YaRN), tiny-glm4-moe, tiny-deepseek-v3 and
/// tiny-llama4 (scripts/make_decoder_fixture.py).
#[test]
fn every_built_in_model_type_matches_transformers() {
    for (kind, param) in [
        ("qwen3", "model.layers.1.self_attn.k_norm.weight"),
        ("mistral", "lm_head.weight"),
        ("qwen2-sliding", "model.layers.1.self_attn.q_proj.bias"),
        ("gemma3", "model.layers.2.post_feedforward_layernorm.weight"),
        ("gemma2", "model.layers.2.pre_feedforward_layernorm.weight"),
        // Qwen3VLForConditionalGeneration: its Qwen3 language model, read from the files'
        // `model.language_model.` (multimodal RoPE on text positions: plain RoPE).
        ("qwen3-vl", "model.layers.1.self_attn.k_norm.weight"),
        // Gemma3ForConditionalGeneration: its language model, read through `language_model.`.
        (
            "gemma3-vision",
            "model.layers.2.post_feedforward_layernorm.weight",
        ),
        ("smollm3", "model.layers.3.self_attn.q_proj.weight"),
        ("olmo2", "model.layers.1.self_attn.k_norm.weight"),
        // Sliding layers with their own rotary base, YaRN on the full one.
        ("olmo3", "model.layers.2.self_attn.q_norm.weight"),
        ("llama-longrope", "lm_head.weight"),
        ("phi3", "model.layers.1.self_attn.qkv_proj.weight"),
        ("qwen3-moe", "model.layers.0.mlp.experts.3.down_proj.weight"),
        (
            "mixtral",
            "model.layers.1.block_sparse_moe.experts.2.w3.weight",
        ),
        ("gpt-oss", "model.layers.2.self_attn.sinks"),
        // Sigmoid, group-limited routing with a load-balancing bias; partial rotary.
        (
            "glm4-moe",
            "model.layers.1.mlp.gate.e_score_correction_bias",
        ),
        // Latent attention, interleaved rotary with YaRN's mscale.
        ("deepseek-v3", "model.layers.1.self_attn.kv_b_proj.weight"),
        // Latent attention with queries projected directly; a sparse then a dense layer.
        ("glm4-moe-lite", "model.layers.0.self_attn.q_proj.weight"),
        // Its experts stored MXFP4, as the hub's (read dequantized).
        ("gpt-oss-mxfp4", "model.layers.1.mlp.experts.down_proj"),
        // Chunked rotary layers (interleaved pairs, L2 q/k norms), NoPE layers with the
        // query temperature, top-1 sigmoid routing of fused experts and a shared expert.
        ("llama4", "model.layers.2.feed_forward.experts.gate_up_proj"),
        // Llama4ForConditionalGeneration (the hub's llama4): its language model, read through
        // `language_model.`.
        ("llama4-vision", "model.layers.1.feed_forward.router.weight"),
        // Latent attention with the position query scale, softmax group-limited routing of
        // fused [experts, out, in] experts.
        ("mistral4", "model.layers.1.mlp.experts.gate_up_proj"),
        // Gated DeltaNet and gated full-attention layers, experts with a gated shared one.
        ("qwen3-next", "model.layers.0.linear_attn.A_log"),
        // Qwen3.5: the Gated DeltaNet's projections apart, dense MLPs.
        ("qwen3.5", "model.layers.0.linear_attn.in_proj_qkv.weight"),
        // Qwen3_5MoeForConditionalGeneration (the hub's qwen3_5_moe): every MLP a mixture,
        // read through `model.language_model.`.
        (
            "qwen3.5-moe-vision",
            "model.layers.2.mlp.shared_expert_gate.weight",
        ),
        // Gemma 4 (E2B-like): per-layer inputs, the last two layers reusing earlier keys
        // and values, proportional rotary on the full layers.
        ("gemma4", "model.layers.4.per_layer_projection.weight"),
        // Gemma4ForConditionalGeneration (26B-A4B-like): experts beside every MLP, keys as
        // values on the full layers.
        (
            "gemma4-moe-vision",
            "model.layers.3.router.per_expert_scale",
        ),
    ] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets")
            .join(format!("tiny-{kind}"));
        let want =
            candle_core::safetensors::load(dir.join("parity.safetensors"), &Device::Cpu).unwrap();
        let ids = want["input_ids"].to_dtype(DType::U32).unwrap();
        let (b, s) = ids.dims2().unwrap();
        let pos = positions(b, s);
        // Every CPU path: the fused kernel (f32, under either name), and in f64 the whole
        // score matrix (eager) and the blockwise one (flash_attention_2); windows are row
        // starts for all of them.
        for (dtype, how) in [
            (DType::F32, AttentionImpl::Eager),
            (DType::F64, AttentionImpl::Eager),
            (DType::F64, AttentionImpl::Flash),
        ] {
            let mut m = CausalLm::from_pretrained(dir.join("model"), dtype, &Device::Cpu).unwrap();
            assert!(m.params.get(param).is_some(), "{kind}: {param}");
            m.attention = how;
            let logits = m.forward(&ids, &pos).unwrap().to_dtype(DType::F32).unwrap();
            let diff = max_abs_diff(&logits, &want["logits"]);
            eprintln!("{kind} {dtype:?} {how:?}: max |logits - transformers| = {diff:e}");
            assert!(
                diff < 1e-4,
                "{kind} {dtype:?} {how:?}: logits differ from transformers by {diff}"
            );
        }
        // The evaluation entry point, on one process.
        let auto =
            AutoModelForCausalLM::from_pretrained(dir.join("model"), DType::F32, &Device::Cpu)
                .unwrap();
        let diff = max_abs_diff(&auto.forward(&ids, &pos).unwrap(), &want["logits"]);
        eprintln!("{kind} AutoModelForCausalLM: max |logits - transformers| = {diff:e}");
        assert!(
            diff < 1e-4,
            "{kind}: AutoModelForCausalLM's logits differ by {diff}"
        );
    }
}

/// A reward model of each built-in model file (transformers' `...ForSequenceClassification`,
/// num_labels 1, scripts/make_reward_fixture.py) scores right-padded rows as transformers
/// does, each read at its last token that is not the pad; and a causal LM or a missing
/// score head is refused by name.
#[test]
fn reward_models_score_as_transformers_sequence_classifiers() {
    let assets = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets");
    for kind in [
        "qwen3",
        "mistral",
        "gemma2",
        "olmo3",
        "phi3",
        "qwen3-moe",
        "mixtral",
        "gpt-oss",
    ] {
        let dir = assets.join(format!("tiny-{kind}"));
        let want =
            candle_core::safetensors::load(dir.join("reward_parity.safetensors"), &Device::Cpu)
                .unwrap();
        let ids = want["input_ids"].to_dtype(DType::U32).unwrap();
        let mask = want["attention_mask"].to_dtype(DType::U32).unwrap();
        let m = AutoModelForSequenceClassification::from_pretrained(
            dir.join("reward"),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(m.num_labels(), 1);
        let logits = m.forward(&ids, &mask).unwrap();
        let diff = max_abs_diff(&logits, &want["logits"]);
        eprintln!("{kind} reward model: max |logits - transformers| = {diff:e}");
        assert!(
            diff < 1e-4,
            "{kind}: reward logits differ from transformers by {diff}"
        );
        // One row alone reads the same as in the batch.
        let one = m
            .forward(
                &ids.narrow(0, 1, 1).unwrap(),
                &mask.narrow(0, 1, 1).unwrap(),
            )
            .unwrap();
        let diff = max_abs_diff(&one, &want["logits"].narrow(0, 1, 1).unwrap());
        assert!(diff < 1e-4, "{kind}: one row differs by {diff}");
    }
    let err = |dir: std::path::PathBuf| {
        AutoModelForSequenceClassification::from_pretrained(dir, DType::F32, &Device::Cpu)
            .err()
            .expect("refused")
            .to_string()
    };
    let causal = err(assets.join("tiny-qwen3/model"));
    assert!(
        causal.contains("architectures") && causal.contains("not a sequence classifier"),
        "{causal}"
    );
    // A classifier's config over a causal LM's weights: the score head is named missing.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        assets.join("tiny-qwen3/reward/config.json"),
        tmp.path().join("config.json"),
    )
    .unwrap();
    std::fs::copy(
        assets.join("tiny-qwen3/model/model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    let missing = err(tmp.path().to_path_buf());
    assert!(missing.contains("score.weight"), "{missing}");
    // Left padding is refused by row.
    let m = AutoModelForSequenceClassification::from_pretrained(
        assets.join("tiny-qwen3/reward"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let ids = Tensor::new(&[[0u32, 5, 6]], &Device::Cpu).unwrap();
    let mask = Tensor::new(&[[0u32, 1, 1]], &Device::Cpu).unwrap();
    let left = m.forward(&ids, &mask).unwrap_err().to_string();
    assert!(left.contains("row 0") && left.contains("right"), "{left}");
}

/// The gradients keep no larger buffers alive than themselves: the step holds every gradient
/// until the optimizer runs, so a gradient that is a view of an op's output (RMSNorm's weight
/// gradient was one row of its [tokens + 1, h] backward buffer) would keep that whole buffer,
/// per parameter, until the update. Gradients may share one buffer that they fill together
/// (the gated MLP's gate and up, `nn::gated`: the halves of one GEMM's output): each buffer is
/// counted once. Every built-in model type, the trainer's loss path.
#[test]
fn no_gradient_holds_more_than_itself() {
    for kind in [
        "qwen3",
        "mistral",
        "qwen2-sliding",
        "gemma3",
        "gemma2",
        "smollm3",
        "olmo2",
        "olmo3",
        "llama-longrope",
        "phi3",
        "qwen3-moe",
        "mixtral",
        "gpt-oss",
    ] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets")
            .join(format!("tiny-{kind}/model"));
        let m = CausalLm::from_pretrained(dir, DType::F32, &Device::Cpu).unwrap();
        let (ids, pos, labels) = batch();
        let targets = trl_runtime::nn::loss::shift_labels(&labels).unwrap();
        let ls = m.forward_targets(&ids, &pos, &targets).unwrap();
        let grads = m.backward(&ls.sum).unwrap();
        let (mut held, mut own, mut larger) =
            (trl_runtime::alloc::StorageBytes::default(), 0, Vec::new());
        for (name, var) in m.params.iter() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let bytes = g.elem_count() * g.dtype().size_in_bytes();
            let mut alone = trl_runtime::alloc::StorageBytes::default();
            alone.add(g);
            if alone.total > bytes {
                larger.push(format!("{name} ({bytes} bytes in {})", alone.total));
            }
            held.add(g);
            own += bytes;
        }
        assert!(
            held.total <= own,
            "{kind}: the gradients ({own} bytes) keep {} bytes alive; views of larger buffers: {larger:?}",
            held.total
        );
    }
}

/// An unknown model type, and Gemma values that cannot be honoured (a cap of 0 or below, a
/// layer type other than full or sliding attention), are errors naming the key, the value and
/// what is supported.
#[test]
fn unsupported_model_types_and_values_are_named() {
    // The error of tiny-`kind`'s config.json after `edit`.
    let refused = |kind: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../../assets/tiny-{kind}/model/config.json"));
        let mut j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir).unwrap()).unwrap();
        edit(&mut j);
        <AutoModelForCausalLM as CausalModel>::parse_config(&j.to_string(), "config.json")
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let parse = |edit: &dyn Fn(&mut serde_json::Value)| refused("gemma3", edit);
    let e = parse(&|j| j["model_type"] = "falcon".into());
    assert!(
        e.contains("model_type") && e.contains("'falcon'") && e.contains("gemma3_text"),
        "{e}"
    );
    let e = parse(&|j| j["attn_logit_softcapping"] = (-1.0).into());
    assert!(
        e.contains("attn_logit_softcapping") && e.contains("positive"),
        "{e}"
    );
    let e = parse(&|j| j["layer_types"][1] = "chunked_attention".into());
    assert!(
        e.contains("layer_types") && e.contains("chunked_attention"),
        "{e}"
    );
    // A quantization other than MXFP4 (read dequantized) is refused with what to do; gpt-oss's
    // SwiGLU constants must be positive.
    let gpt_oss = |edit: &dyn Fn(&mut serde_json::Value)| refused("gpt-oss", edit);
    let e = gpt_oss(&|j| {
        j["quantization_config"] = serde_json::json!({"quant_method": "bitsandbytes"})
    });
    assert!(
        e.contains("quantization_config") && e.contains("bitsandbytes") && e.contains("dense"),
        "{e}"
    );
    let e = gpt_oss(&|j| j["swiglu_limit"] = (-7.0).into());
    assert!(e.contains("swiglu_limit") && e.contains("positive"), "{e}");
    let e = gpt_oss(&|j| j["attention_dropout"] = 0.1.into());
    assert!(e.contains("attention_dropout") && e.contains("0.1"), "{e}");
    // Every model type refuses them: no model here implements dropout or quantized weights.
    let qwen3 = |edit: &dyn Fn(&mut serde_json::Value)| refused("qwen3", edit);
    let e = qwen3(&|j| j["attention_dropout"] = 0.1.into());
    assert!(e.contains("attention_dropout") && e.contains("0.1"), "{e}");
    let e = qwen3(&|j| j["quantization_config"] = serde_json::json!({"quant_method": "gptq"}));
    assert!(
        e.contains("quantization_config") && e.contains("'gptq'"),
        "{e}"
    );
    let e = refused("phi3", &|j| j["resid_pdrop"] = 0.1.into());
    assert!(e.contains("resid_pdrop") && e.contains("0.1"), "{e}");
    // DeepSeek's keys: the hub's FP8 weights, routings transformers does not implement,
    // groups that cannot be scored, latent attention's head counts.
    let deepseek = |edit: &dyn Fn(&mut serde_json::Value)| refused("deepseek-v3", edit);
    let e = deepseek(&|j| j["quantization_config"] = serde_json::json!({"quant_method": "fp8"}));
    assert!(
        e.contains("quantization_config") && e.contains("'fp8'"),
        "{e}"
    );
    let e = deepseek(&|j| j["topk_method"] = "group_limited_greedy".into());
    assert!(e.contains("topk_method") && e.contains("noaux_tc"), "{e}");
    let e = deepseek(&|j| j["n_group"] = 8.into());
    assert!(e.contains("n_group") && e.contains("at least 2"), "{e}");
    let e = deepseek(&|j| j["num_key_value_heads"] = 2.into());
    assert!(
        e.contains("num_key_value_heads") && e.contains("equal"),
        "{e}"
    );
    let e = deepseek(&|j| j["kv_lora_rank"] = serde_json::Value::Null);
    assert!(e.contains("kv_lora_rank") && e.contains("missing"), "{e}");
    let e = refused("glm4-moe", &|j| j["topk_group"] = 5.into());
    assert!(e.contains("topk_group"), "{e}");
}

/// DeepSeek-V3's and GLM-4 MoE's checkpoints carry multi-token prediction layers after the
/// last one (`num_nextn_predict_layers`), which transformers' models neither build nor read:
/// they are left unread here too, while a layer beyond the model without them is refused.
#[test]
fn multi_token_prediction_layers_are_left_unread() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/tiny-deepseek-v3/model");
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
    }
    let mut tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let extra = tensors["model.layers.1.input_layernorm.weight"].clone();
    tensors.insert("model.layers.2.enorm.weight".into(), extra);
    candle_core::safetensors::save(&tensors, tmp.path().join("model.safetensors")).unwrap();
    AutoModelForCausalLM::from_pretrained(tmp.path(), DType::F32, &Device::Cpu).unwrap();
    let config = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace(
            "\"num_nextn_predict_layers\": 1",
            "\"num_nextn_predict_layers\": 0",
        ),
    )
    .unwrap();
    let err = AutoModelForCausalLM::from_pretrained(tmp.path(), DType::F32, &Device::Cpu)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.layers.2.enorm.weight"), "{err}");
}

/// The window shows: Mistral's logits over rows longer than its window differ from full
/// attention's beyond the window, and equal them within it.
#[test]
fn a_sliding_window_limits_what_a_token_sees() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-mistral/model");
    let windowed = CausalLm::from_pretrained(&dir, DType::F32, &Device::Cpu).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(windowed.config_json()).unwrap();
    json["sliding_window"] = serde_json::Value::Null;
    let full = CausalLm::with_params(json.to_string(), windowed.params.clone()).unwrap();
    let ids = Tensor::arange(1u32, 17, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let pos = Tensor::arange(0i64, 16, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let (a, b) = (
        windowed.forward(&ids, &pos).unwrap(),
        full.forward(&ids, &pos).unwrap(),
    );
    // Window 6: the first 6 positions see the same keys either way.
    assert!(max_abs_diff(&a.narrow(1, 0, 6).unwrap(), &b.narrow(1, 0, 6).unwrap()) < 1e-5);
    assert!(max_abs_diff(&a.narrow(1, 6, 10).unwrap(), &b.narrow(1, 6, 10).unwrap()) > 1e-3);
}

/// A mixture of experts tells the trainer's first-step check that its routed experts may get
/// no gradient (a step can route no token to one), and nothing else; dense models say none.
#[test]
fn routed_experts_and_only_they_may_skip_a_gradient() {
    for (kind, expert) in [
        ("qwen3-moe", "model.layers.0.mlp.experts.1.up_proj.weight"),
        (
            "mixtral",
            "model.layers.0.block_sparse_moe.experts.3.w2.weight",
        ),
    ] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../../assets/tiny-{kind}/model"));
        let m = AutoModelForCausalLM::from_pretrained(dir, DType::F32, &Device::Cpu).unwrap();
        assert!(m.may_skip_grad(expert), "{kind}");
        for dense in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.embed_tokens.weight",
        ] {
            assert!(!m.may_skip_grad(dense), "{kind}: {dense}");
        }
    }
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3/model");
    let m = AutoModelForCausalLM::from_pretrained(dir, DType::F32, &Device::Cpu).unwrap();
    assert!(!m.may_skip_grad("model.layers.0.mlp.up_proj.weight"));
}

/// Final-logit soft-capping (Gemma's `final_logit_softcapping`): the logits are
/// `cap * tanh(logits / cap)`, and the training loss (which otherwise takes the fused LM-head
/// loss on a CPU) is the cross-entropy of the capped logits; `AutoModelForCausalLM` caps too.
#[test]
fn final_logit_softcapping_caps_logits_and_the_loss() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-gemma3/model");
    let plain = CausalLm::from_pretrained(&dir, DType::F32, &Device::Cpu).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(plain.config_json()).unwrap();
    let cap = 0.5;
    json["final_logit_softcapping"] = cap.into();
    let capped = CausalLm::with_params(json.to_string(), plain.params.clone()).unwrap();
    let (ids, pos, labels) = {
        let (ids, pos, labels) = batch();
        let vocab = plain.config.vocab_size() as u32;
        (
            ids.affine(1.0, 0.0)
                .unwrap()
                .clamp(0u32, vocab - 1)
                .unwrap(),
            pos,
            labels,
        )
    };
    let raw = plain.forward(&ids, &pos).unwrap();
    let want = ((&raw / cap).unwrap().tanh().unwrap() * cap).unwrap();
    let got = capped.forward(&ids, &pos).unwrap();
    assert!(max_abs_diff(&got, &want) < 1e-6);
    assert!(max_abs_diff(&raw, &want) > 1e-2, "the cap must show");
    let loss = |m: &CausalLm| {
        let ls = m.forward_loss(&ids, &pos, &labels).unwrap();
        (ls.sum.to_scalar::<f32>().unwrap(), ls.count)
    };
    let reference = causal_lm_loss(&want, &labels).unwrap();
    let (sum, count) = loss(&capped);
    assert_eq!(count, reference.count);
    assert!((sum - reference.sum.to_scalar::<f32>().unwrap()).abs() < 1e-4);
    assert!(
        (sum - loss(&plain).0).abs() > 1e-2,
        "the loss must see the cap"
    );
    // The one-process entry point, from a checkpoint whose config caps.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        dir.join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(tmp.path().join("config.json"), json.to_string()).unwrap();
    let auto = AutoModelForCausalLM::from_pretrained(tmp.path(), DType::F32, &Device::Cpu).unwrap();
    assert!(max_abs_diff(&auto.forward(&ids, &pos).unwrap(), &want) < 1e-6);
}

/// The router load-balancing loss equals transformers' (`output_router_logits`,
/// `router_aux_loss_coef` 0.1, scripts/make_router_loss_fixture.py) on a batch with a padded
/// row: the loss and aux_loss values, and the gradients of the routers, of the embedding and of
/// layer 0's q_proj (the loss reaches the hidden states through the routers' inputs), with and
/// without activation checkpointing (a recomputed layer adds the gradient once).
#[test]
fn the_router_loss_matches_transformers() {
    use trl_runtime::models::router_loss::{with_router_loss, RouterLoss};
    for (kind, router) in [
        ("qwen3-moe", "mlp.gate"),
        ("mixtral", "block_sparse_moe.gate"),
        ("gpt-oss", "mlp.router"),
    ] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets")
            .join(format!("tiny-{kind}"));
        let want =
            candle_core::safetensors::load(dir.join("router_loss.safetensors"), &Device::Cpu)
                .unwrap();
        let ids = want["input_ids"].to_dtype(DType::U32).unwrap();
        let (b, s) = ids.dims2().unwrap();
        let pos = positions(b, s);
        let mask: Vec<bool> = want["attention_mask"]
            .flatten_all()
            .unwrap()
            .to_vec1::<u8>()
            .unwrap()
            .iter()
            .map(|&m| m == 1)
            .collect();
        let scalar = |t: &Tensor| t.to_vec1::<f32>().unwrap()[0] as f64;
        for checkpointing in [false, true] {
            let mut m =
                CausalLm::from_pretrained(dir.join("model"), DType::F32, &Device::Cpu).unwrap();
            if checkpointing {
                m.checkpointing = Some(trl_runtime::parallel::checkpointing::Checkpointing::new(
                    false,
                ));
            }
            let aux = RouterLoss::new(Some(mask.clone()), 0.1);
            let ls =
                with_router_loss(&aux, || m.forward_loss(&ids, &pos, &want["labels"])).unwrap();
            let ce = (ls.sum / ls.count as f64).unwrap();
            let grads = m.backward(&ce).unwrap();
            let value = aux.value().unwrap();
            let loss = scalar(&ce.reshape(1).unwrap()) + 0.1 * value;
            let what = format!("{kind} (checkpointing {checkpointing})");
            let d = (value - scalar(&want["aux_loss"])).abs();
            eprintln!("{what}: aux_loss {value} (transformers' within {d:.1e})");
            assert!(d < 1e-5, "{what}: aux_loss {value}");
            let d = (loss - scalar(&want["loss"])).abs();
            assert!(d < 1e-5, "{what}: loss {loss} differs by {d}");
            let mut checked = 0;
            for (key, w) in &want {
                let name = match key.split_once('.') {
                    Some(("router", l)) => format!("model.layers.{l}.{router}.weight"),
                    Some(("q_proj", l)) => format!("model.layers.{l}.self_attn.q_proj.weight"),
                    Some(("sinks", l)) => format!("model.layers.{l}.self_attn.sinks"),
                    Some(("experts", l)) => format!("model.layers.{l}.mlp.experts.gate_up_proj"),
                    _ if key == "embed" => "model.embed_tokens.weight".into(),
                    _ => continue,
                };
                assert_gradient(&what, &m, &grads, &name, w);
                checked += 1;
            }
            assert!(checked >= 3, "{what}: {checked} gradients checked");
        }
    }
}

/// Parameter `name`'s gradient in `grads` within 1e-4 of the largest of transformers' `want`.
fn assert_gradient(
    what: &str,
    m: &CausalLm,
    grads: &candle_core::backprop::GradStore,
    name: &str,
    want: &Tensor,
) {
    let var = m.params.get(name).unwrap_or_else(|| panic!("{name}"));
    let g = grads.get(var.as_tensor()).unwrap();
    let (d, rel) = (max_abs_diff(g, want), common::rel_diff(g, want));
    eprintln!("{what}: {name} gradient within {d:.1e} ({rel:.1e} of the largest)");
    assert!(rel < 1e-4, "{what}: {name} gradient differs by {d}");
}

/// Gemma 4's gradients equal transformers' (scripts/make_gradient_fixture.py), in f64, with
/// activation checkpointing off and on: where what crosses layers shows. (Within 4e-5 of
/// the largest: the fused norms compute in f32 whatever the dtype, while transformers' own
/// f32 gradients are 1.6e-4 off its f64 ones here; a gradient lost between layers would be
/// off by its whole size.) On tiny-gemma4 the layers
/// storing keys and values get the gradient of the later layers that attend over them
/// (passed on with the hidden state, so a recomputed layer still sends it back), and the
/// per-layer inputs' tables and projection theirs from every layer; on the wrapped mixture,
/// the router, its scales and the experts, and keys serving as values.
#[test]
fn gemma4_gradients_match_transformers() {
    for kind in ["gemma4", "gemma4-moe-vision"] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets")
            .join(format!("tiny-{kind}"));
        let want = candle_core::safetensors::load(dir.join("gradients.safetensors"), &Device::Cpu)
            .unwrap();
        let ids = want["input_ids"].to_dtype(DType::U32).unwrap();
        let (b, s) = ids.dims2().unwrap();
        let pos = positions(b, s);
        for checkpointing in [false, true] {
            let mut m =
                CausalLm::from_pretrained(dir.join("model"), DType::F64, &Device::Cpu).unwrap();
            if checkpointing {
                m.checkpointing = Some(trl_runtime::parallel::checkpointing::Checkpointing::new(
                    false,
                ));
            }
            // The plain path (logits, then the loss), f64 throughout.
            let logits = m.forward(&ids, &pos).unwrap();
            let ls = causal_lm_loss(&logits, &want["labels"]).unwrap();
            let loss = (ls.sum / ls.count as f64).unwrap();
            let grads = m.backward(&loss).unwrap();
            let what = format!("{kind} (checkpointing {checkpointing})");
            let scalar = |t: &Tensor| t.to_dtype(DType::F64).unwrap().reshape(1).unwrap();
            let (got, loss_want) = (scalar(&loss), scalar(&want["loss"]));
            let (got, loss_want) = (
                got.to_vec1::<f64>().unwrap()[0],
                loss_want.to_vec1::<f64>().unwrap()[0],
            );
            let d = (got - loss_want).abs();
            assert!(d < 1e-7, "{what}: loss {got} differs by {d}");
            let mut checked = 0;
            for (name, w) in want.iter().filter(|(k, _)| k.starts_with("model.")) {
                assert_gradient(&what, &m, &grads, name, w);
                checked += 1;
            }
            assert!(checked >= 8, "{what}: {checked} gradients checked");
        }
    }
}

/// docs/models.md's "Adding a model type", step 1, followed from outside the crate: a
/// Llama-order layer written from the public blocks as a `blocks::Layer`, annotated for every
/// strategy, its model `Decoder<MyLayer>`.
mod added {
    use candle_core::Tensor;
    use candle_nn::VarBuilder;
    use trl_runtime::models::blocks::{Activation, Decoder, GatedMlp, Layer, PreNormAttention};
    use trl_runtime::models::{LayerInputs, ModelConfig};
    use trl_runtime::Parallelize;

    #[derive(Debug, Clone, Parallelize)]
    #[parallel(fsdp_unit)]
    pub struct MyLayer {
        #[parallel(name = "")]
        attention: PreNormAttention,
        mlp: GatedMlp,
    }

    impl Layer for MyLayer {
        type Config = ModelConfig;

        fn parse_config(text: &str, source: &str) -> trl_runtime::Result<ModelConfig> {
            ModelConfig::from_json_for(text, source, &["qwen2"])
        }

        fn build(config: &ModelConfig, vb: VarBuilder) -> candle_core::Result<Decoder<Self>> {
            let parts = config.layer_parts()?;
            let (h, i) = (config.hidden_size, config.intermediate_size);
            Decoder::from_layers(parts.body, vb, |l, vb| {
                Ok(MyLayer {
                    attention: parts.pre_norm_attention(l, &vb)?,
                    mlp: GatedMlp::new((h, i), config.mlp_bias, Activation::Silu, vb.pp("mlp"))?,
                })
            })
        }

        fn forward(&self, x: &Tensor, cx: &LayerInputs) -> trl_runtime::Result<Tensor> {
            let (h, x) = self.attention.forward(x, cx)?;
            self.mlp.forward_add(cx, &h, &x)
        }

        fn attention_heads(&self) -> (usize, usize) {
            self.attention.heads()
        }
    }
}

/// The model type added as docs/models.md says loads the bundled Qwen2 checkpoint with the
/// built-in model's logits.
#[test]
fn a_model_type_added_as_the_docs_say_matches_the_built_in() {
    use trl_runtime::parallel::Model;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny/model");
    let ours = Model::<trl_runtime::models::blocks::Decoder<added::MyLayer>>::from_pretrained(
        &dir,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let builtin =
        Model::<AutoModelForCausalLM>::from_pretrained(&dir, DType::F32, &Device::Cpu).unwrap();
    let (ids, pos, _) = batch();
    let a = ours.forward(&ids, &pos).unwrap();
    let b = builtin.forward(&ids, &pos).unwrap();
    assert!(max_abs_diff(&a, &b) < 1e-6);
    // It generates, with the KV cache, as the built-in does: on its own and under parallel::Model.
    use trl_runtime::models::Generate;
    let prompt = Tensor::new(&[[0u32, 0, 15, 16, 17], [21, 22, 23, 24, 25]], &Device::Cpu).unwrap();
    let mask = Tensor::new(&[[0u32, 0, 1, 1, 1], [1, 1, 1, 1, 1]], &Device::Cpu).unwrap();
    let cfg = trl_runtime::generation::GenerationConfig {
        max_new_tokens: 10,
        pad_token_id: Some(0),
        ..Default::default()
    };
    let want = AutoModelForCausalLM::from_pretrained(&dir, DType::F32, &Device::Cpu)
        .unwrap()
        .generate(&prompt, &mask, &cfg)
        .unwrap()
        .to_vec2::<u32>()
        .unwrap();
    let got = ours
        .net()
        .generate(&prompt, &mask, &cfg)
        .unwrap()
        .to_vec2::<u32>()
        .unwrap();
    assert_eq!(got, want);
    let under = ours
        .generate(
            &prompt,
            &mask,
            &cfg,
            trl_runtime::parallel::GatherMode::Auto,
        )
        .unwrap()
        .to_vec2::<u32>()
        .unwrap();
    assert_eq!(under, want);
}

/// A reward model's start from a causal LM checkpoint that also holds an optimizer's state (a
/// `checkpoint-N` of an SFT run): the classifier's config as transformers writes it, its
/// weights the model's alone (no LM head, no optimizer tensors) with a fresh score; made once
/// (a second call finds it), another one for another seed.
#[test]
fn a_reward_model_starts_from_a_causal_checkpoint() {
    use trl_runtime::models::sequence_classification::{classifier_start, RewardModel};
    let tiny = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny/model");
    let src = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&tiny).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, src.path().join(f.file_name().unwrap())).unwrap();
    }
    std::fs::copy(
        tiny.join("model.safetensors"),
        src.path().join("optimizer.safetensors"),
    )
    .unwrap();
    let out = tempfile::tempdir().unwrap();
    let start = classifier_start(src.path(), out.path(), 3, 0).unwrap();
    assert_eq!(
        classifier_start(src.path(), out.path(), 3, 0).unwrap(),
        start
    );
    assert_ne!(
        classifier_start(src.path(), out.path(), 4, 0).unwrap(),
        start
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(start.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "Qwen2ForSequenceClassification");
    assert_eq!(config["pad_token_id"], 0);
    assert!(!start.join("optimizer.safetensors").exists());
    let model = trl_runtime::parallel::Model::<RewardModel>::from_pretrained(
        &start,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let score = model.params.tensor("score.weight").unwrap();
    assert_eq!(score.dims(), &[1, 64]);
    // A classifier with this pad token is its own start.
    assert_eq!(classifier_start(&start, out.path(), 3, 0).unwrap(), start);
}

/// Packed rows of the mixtures with DeepSeek's routing (GLM-4 MoE, DeepSeek-V3's latent
/// attention with its shared rotary key), Llama 4's chunks, Mistral 4, and Qwen3-Next's and
/// Qwen3.5's Gated DeltaNet (a zero state and a fresh convolution at each document start),
/// Gemma 4 (its reused keys and values, per-layer inputs and experts): the
/// second document of a packed row, its positions
/// restarting, has the logits it has alone, on every CPU attention path.
#[test]
fn packed_rows_of_deepseek_style_models_keep_documents_apart() {
    for kind in [
        "glm4-moe",
        "deepseek-v3",
        "glm4-moe-lite",
        "llama4",
        "mistral4",
        "qwen3-next",
        "qwen3.5",
        "qwen3.5-moe-vision",
        "gemma4",
        "gemma4-moe-vision",
    ] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../../assets/tiny-{kind}/model"));
        let want = candle_core::safetensors::load(dir.join("../parity.safetensors"), &Device::Cpu)
            .unwrap();
        let ids = want["input_ids"].to_dtype(DType::U32).unwrap();
        // Row 0's first 10 tokens, then row 1's 24, packed into one row.
        let (a, b) = (
            ids.get(0).unwrap().narrow(0, 0, 10).unwrap(),
            ids.get(1).unwrap(),
        );
        let packed = Tensor::cat(&[&a, &b], 0).unwrap().unsqueeze(0).unwrap();
        let pos: Vec<i64> = (0..10).chain(0..24).collect();
        let pos = Tensor::new(pos.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        for how in [AttentionImpl::Eager, AttentionImpl::Flash] {
            let mut m = CausalLm::from_pretrained(&dir, DType::F32, &Device::Cpu).unwrap();
            m.attention = how;
            let logits = m.forward(&packed, &pos).unwrap().narrow(1, 10, 24).unwrap();
            let diff = max_abs_diff(
                &logits,
                &want["logits"].get(1).unwrap().unsqueeze(0).unwrap(),
            );
            eprintln!("{kind} {how:?}: packed second document vs transformers alone: {diff:e}");
            assert!(diff < 1e-4, "{kind} {how:?}: {diff}");
        }
    }
}
