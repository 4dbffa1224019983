//! LoRA on the built-in models: the adapted layer equals its merged weight, the base gets no
//! gradient, and adapters travel both ways between us and peft (PyPI's, when a Python with
//! torch, transformers and peft is there: TRL_PYTHON or python3; skipped with a message
//! otherwise): our saved adapter loads in `PeftModel.from_pretrained` with our logits, and an
//! adapter peft wrote gives us peft's logits, within 1e-4 (f32).

mod common;

use candle_core::{DType, Device, Tensor};
use common::max_abs_diff as max_diff;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use trl_runtime::models::{peft, AutoModelForCausalLM};
use trl_runtime::nn::lora::{LoraConfig, Targets};
use trl_runtime::parallel::CausalLm;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny/model")
}

/// Llama 4's projections by name: peft's all-linear also wraps transformers' router (an
/// nn.Linear returning a pair), whose forward then fails in peft.
fn llama4_targets() -> Targets {
    let names = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ];
    Targets::Names(names.map(String::from).to_vec())
}

fn config(targets: Targets) -> LoraConfig {
    LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets,
        modules_to_save: Vec::new(),
        rslora: false,
        seed: 3,
        dora: false,
        target_parameters: Vec::new(),
        ensure_weight_tying: false,
        trainable_token_indices: Vec::new(),
        sequence_classification: false,
    }
}

fn ids() -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..48u32).map(|i| (i * 7919 + 13) % 284).collect();
    let ids = Tensor::from_vec(ids, (2, 24), &Device::Cpu).unwrap();
    let pos = Tensor::arange(0i64, 24, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .repeat((2, 1))
        .unwrap();
    (ids, pos)
}

/// [`ids`]' input ids written for the Python scripts (`input_ids`, i64) into `dir`.
fn ids_file(dir: &Path) -> PathBuf {
    let file = dir.join("ids.safetensors");
    let ids = ids().0.to_dtype(DType::I64).unwrap();
    let tensors = std::collections::HashMap::from([("input_ids".to_string(), ids)]);
    candle_core::safetensors::save(&tensors, &file).unwrap();
    file
}

/// Gives every adapter a nonzero `B` (peft starts it at zero, which would hide the path)
/// and moves DoRA's magnitudes off their initial norms, the same values on every call.
fn randomize(model: &CausalLm) {
    for (name, var) in model.params.iter() {
        if name.contains("lora_magnitude_vector") {
            let n = var.elem_count();
            let factors: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.05).collect();
            let factors = Tensor::from_vec(factors, var.shape(), &Device::Cpu).unwrap();
            var.set(&(var.as_tensor() * factors).unwrap()).unwrap();
        }
        if name.contains("lora_B") {
            let n = var.elem_count();
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 101) as f32 / 101.0 - 0.5) * 0.1)
                .collect();
            var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
}

/// Only the adapters train (and DoRA's magnitudes with them), and the adapted model equals
/// the base with each adapted weight replaced by `W + s B A` (DoRA: each row of that rescaled
/// to `m / ||W + s B A||`).
#[test]
fn adapters_train_alone_and_equal_the_merged_weights() {
    for dora in [false, true] {
        train_alone_and_equal_the_merged_weights(dora);
    }
}

fn train_alone_and_equal_the_merged_weights(dora: bool) {
    let mut model = CausalLm::from_pretrained(tiny(), DType::F32, &Device::Cpu).unwrap();
    let base = CausalLm::from_pretrained(tiny(), DType::F32, &Device::Cpu).unwrap();
    model
        .add_adapters(&LoraConfig {
            dora,
            ..config(Targets::Names(vec!["q_proj".into(), "down_proj".into()]))
        })
        .unwrap();
    // Two layers x two projections x (A, B, and DoRA's m).
    let names: Vec<&String> = model.params.iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), if dora { 12 } else { 8 }, "{names:?}");
    assert!(names.iter().all(|n| n.contains(".lora_")), "{names:?}");
    randomize(&model);
    let (ids, pos) = ids();
    let logits = model.forward(&ids, &pos).unwrap();
    let scale = 2.0;
    let mut merged = BTreeMap::new();
    for (name, var) in base.params.iter() {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let get = |part: &str| model.params.get(&format!("{module}.{part}"));
        let w = var.as_tensor().clone();
        let w = match (get("lora_A.weight"), get("lora_B.weight")) {
            (Some(a), Some(b)) => {
                (w + (b.as_tensor().matmul(a.as_tensor()).unwrap() * scale).unwrap()).unwrap()
            }
            _ => w,
        };
        let w = match get("lora_magnitude_vector") {
            Some(m) => {
                let norm = w.sqr().unwrap().sum_keepdim(1).unwrap().sqrt().unwrap();
                let g = m.as_tensor().unsqueeze(1).unwrap().broadcast_div(&norm);
                w.broadcast_mul(&g.unwrap()).unwrap()
            }
            None => w,
        };
        merged.insert(name.clone(), w);
    }
    let merged = CausalLm::with_params(
        base.config_json().to_string(),
        trl_runtime::models::Params::from_tensors(merged).unwrap(),
    )
    .unwrap();
    let want = merged.forward(&ids, &pos).unwrap();
    let d = max_diff(&logits, &want);
    assert!(
        d < 1e-4,
        "dora {dora}: adapted vs merged logits differ by {d}"
    );
    // The backward reaches the adapters and nothing else.
    let targets = ids.to_dtype(DType::I64).unwrap();
    let loss = model.forward_loss(&ids, &pos, &targets).unwrap();
    let grads = model.backward(&loss.sum).unwrap();
    for (name, var) in model.params.iter() {
        let g = grads.get(var.as_tensor()).expect(name);
        let n = g
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(n > 0.0, "dora {dora}: {name} got a zero gradient");
    }
}

/// A Python with peft (None: the test skips, with a message).
fn peft_python() -> Option<PathBuf> {
    common::python_with(&["torch", "transformers", "peft", "safetensors"])
}

fn peft_script(python: &Path, args: &[&Path]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/peft_logits.py");
    let out = Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "peft_logits.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `model`'s adapters (base `base`) saved in peft's format into `tmp`/adapter.
fn save_adapter(model: &CausalLm, lora: &LoraConfig, base: &Path, tmp: &Path) -> PathBuf {
    let adapter = tmp.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let mut tensors = model
        .params
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    peft::add_aliases(model.net(), &mut tensors);
    let order = peft::parameter_order(model.net());
    peft::save(&adapter, &tensors, lora, base, &order).unwrap();
    adapter
}

/// peft's logits for the tiny model with the adapter in `adapter`.
fn peft_logits(python: &Path, adapter: &Path, tmp: &Path) -> Tensor {
    peft_logits_of(python, &tiny(), adapter, tmp)
}

/// peft's logits for the model in `base` with the adapter in `adapter`.
fn peft_logits_of(python: &Path, base: &Path, adapter: &Path, tmp: &Path) -> Tensor {
    let (ids_file, out_file) = (ids_file(tmp), tmp.join("out.safetensors"));
    peft_script(
        python,
        &[Path::new("logits"), base, adapter, &ids_file, &out_file],
    );
    candle_core::safetensors::load(&out_file, &Device::Cpu).unwrap()["logits"].clone()
}

#[test]
fn our_adapter_loads_in_peft_with_our_logits() {
    let Some(python) = peft_python() else {
        return;
    };
    for dora in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let mut model = CausalLm::from_pretrained(tiny(), DType::F32, &Device::Cpu).unwrap();
        let mut lora = config(Targets::AllLinear);
        lora.modules_to_save = vec!["lm_head".into()];
        lora.dora = dora;
        model.add_adapters(&lora).unwrap();
        randomize(&model);
        let (ids, pos) = ids();
        let ours = model.forward(&ids, &pos).unwrap();
        let adapter = save_adapter(&model, &lora, &tiny(), tmp.path());
        let theirs = peft_logits(&python, &adapter, tmp.path());
        let d = max_diff(&ours, &theirs);
        eprintln!("our adapter (dora {dora}) in peft: logits within {d:.1e}");
        assert!(
            d < 1e-4,
            "dora {dora}: peft's logits with our adapter differ by {d}"
        );
    }
}

/// Mixtures of experts, as peft (0.17+) adapts transformers 5's fused experts
/// (`target_parameters`): each expert's gate and up share one A of rank 2r, the router is
/// adapted too, and a dense MLP beside experts (Qwen3-MoE's `mlp_only_layers`) gets no
/// adapter. Our all-linear adapters are that layout (the same tensors, after [`peft::save`]
/// fuses them), both ways: ours in peft and peft's here give the same logits, for Qwen3-MoE,
/// Mixtral, gpt-oss, GLM-4 MoE and DeepSeek-V3.
#[test]
fn moe_adapters_travel_between_us_and_peft() {
    let Some(python) = peft_python() else {
        return;
    };
    // Per sparse layer of 4 experts: one shared A and two Bs (gate, up), A and B (down);
    // the router A and B; attention's 4 x 2 in every layer; nothing on a dense MLP. gpt-oss:
    // attention alone (its router and fused experts are not `nn.Linear`s to peft).
    for (name, adapters) in [
        ("tiny-qwen3-moe", 4 * 5 + 2 + 2 * 8),
        ("tiny-mixtral", 2 * (4 * 5 + 2) + 2 * 8),
        ("tiny-gpt-oss", 3 * 8),
        // 8 experts and a router on layer 1; the shared expert and layer 0's dense MLP get
        // none (peft maps their projections' names onto the experts). GLM-4's attention 4
        // projections, DeepSeek-V3's latent attention 5.
        ("tiny-glm4-moe", 8 * 5 + 2 + 2 * 8),
        ("tiny-deepseek-v3", 8 * 5 + 2 + 2 * 10),
        // Queries projected directly: 4 attention projections; layer 1's dense MLP none.
        ("tiny-glm4-moe-lite", 8 * 5 + 2 + 2 * 8),
        // Attention's 4 projections in each of 4 layers, the dense MLPs' 3 on layers 0 and 3,
        // the shared expert's 3 on layers 1 and 2; the fused experts are parameters. Named:
        // peft's own all-linear also wraps transformers' router, whose forward then fails in
        // peft (it returns a pair); ours leaves it out.
        ("tiny-llama4", 2 * (4 * 4 + 2 * 3 + 2 * 3)),
        // Latent attention's 5 projections in both layers, layer 0's dense MLP and layer 1's
        // shared expert; the router and the fused experts are parameters.
        ("tiny-mistral4", 2 * (2 * 5 + 3 + 3)),
        // Qwen3-Next: Gated DeltaNet's 3 projections in layers 0 and 2, the gated attention's
        // 4 in layers 1 and 3; 4 experts (one shared A and two Bs, A and B) and the router on
        // the sparse layers 0, 1 and 3, with the shared expert's gate; layer 2's dense MLP
        // and the shared experts none (peft maps their names onto the experts).
        ("tiny-qwen3-next", 2 * (2 * 3 + 2 * 4) + 3 * (4 * 5 + 2 + 2)),
        // Qwen3.5, the same hybrid dense: Gated DeltaNet's 5 projections apart in layers 0 and
        // 2, the gated attention's 4 in layers 1 and 3, every layer's MLP 3.
        ("tiny-qwen3.5", 2 * 2 * (5 + 4 + 2 * 3)),
        // Gemma 4 (dense, E2B-like): layers 0-3 their 4 attention projections, the MLP's 3
        // and the per-layer input's gate and projection; layers 4 and 5, which reuse earlier
        // keys and values, no k_proj or v_proj; and the model's per_layer_model_projection.
        ("tiny-gemma4", 2 * (4 * 9 + 2 * 7 + 1)),
    ] {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../assets/{name}/model"));
        let tmp = tempfile::tempdir().unwrap();
        let targets = match name {
            "tiny-llama4" => llama4_targets(),
            _ => Targets::AllLinear,
        };
        round_trip(&python, &base, &config(targets), adapters, tmp.path());
    }
}

/// Gemma 3's, Qwen3-VL's, Llama 4's and Qwen3.5-MoE's vision-language checkpoints: adapters on the language
/// model, under peft's names for its PyTorch tree (`model.language_model.layers...`; Llama
/// 4's `language_model.model.layers...`), both ways with peft. peft's own adapter adapts the
/// vision tower too, which text rows never reach: read here without it, the same logits.
#[test]
fn vision_language_adapters_travel_between_us_and_peft() {
    let Some(python) = peft_python() else {
        return;
    };
    let llama4 = llama4_targets();
    let (tree, nested) = (
        "base_model.model.model.language_model.layers.",
        "base_model.model.language_model.model.layers.",
    );
    // Every linear layer (7 a layer), A and B: Gemma 3's 3 layers, Qwen3-VL's 2. Llama 4's
    // attention in its 4 layers, the dense MLPs or shared experts' 3 (named: see
    // moe_adapters_travel_between_us_and_peft).
    for (kind, adapters, targets, prefix) in [
        ("gemma3-vision", 3 * 7 * 2, Targets::AllLinear, tree),
        ("qwen3-vl", 2 * 7 * 2, Targets::AllLinear, tree),
        ("llama4-vision", 4 * 7 * 2, llama4, nested),
        // Qwen3.5-MoE's: Gated DeltaNet's 5 projections in layers 0 and 2, the gated
        // attention's 4 in layers 1 and 3, on every layer the shared expert's 3 and its gate.
        // Not the routed experts nor the router: peft converts no targets onto Qwen3.5-MoE's
        // fused experts (transformers maps no conversion for qwen3_5_moe), and its router is
        // no nn.Linear.
        (
            "qwen3.5-moe-vision",
            2 * (2 * (5 + 4) + 4 * (3 + 1)),
            Targets::AllLinear,
            tree,
        ),
        // Gemma 4's mixture (26B-A4B-like): attention (no v_proj on the full layers 1 and
        // 3, whose keys serve as values), the dense MLP's 3 and the router's proj; not the
        // fused experts beside the MLP (peft converts no targets onto them).
        (
            "gemma4-moe-vision",
            2 * (2 * (4 + 3 + 1) + 2 * (3 + 3 + 1)),
            Targets::AllLinear,
            tree,
        ),
    ] {
        let base = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets")
            .join(format!("tiny-{kind}/model"));
        let tmp = tempfile::tempdir().unwrap();
        let lora = config(targets);
        let (adapter, _) = round_trip(&python, &base, &lora, adapters, tmp.path());
        let file = adapter.join(peft::ADAPTER_WEIGHTS);
        let saved = candle_core::safetensors::load(file, &Device::Cpu).unwrap();
        assert!(saved.keys().all(|k| k.starts_with(prefix)), "{kind}");
    }
}

/// `base` with `lora`'s adapters (`adapters` tensors, nonzero `B`s) both ways with peft: our
/// adapter in peft gives our logits, read back here gives ours, and peft's own adapter on the
/// same targets gives peft's logits here. Returns the adapter directory and our logits.
fn round_trip(
    python: &Path,
    base: &Path,
    lora: &LoraConfig,
    adapters: usize,
    tmp: &Path,
) -> (PathBuf, Tensor) {
    let what = format!("{} {:?}", base.display(), lora.target_parameters);
    let mut model = CausalLm::from_pretrained(base, DType::F32, &Device::Cpu).unwrap();
    model.add_adapters(lora).unwrap();
    randomize(&model);
    let names: Vec<String> = model.params.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(names.len(), adapters, "{what}: {names:?}");
    let (ids, pos) = ids();
    let ours = model.forward(&ids, &pos).unwrap();
    let adapter = save_adapter(&model, lora, base, tmp);
    // Parameters adapted directly are peft's target_parameters, not target_modules.
    let text = std::fs::read_to_string(adapter.join(peft::ADAPTER_CONFIG)).unwrap();
    let saved: serde_json::Value = serde_json::from_str(&text).unwrap();
    let modules: Vec<&str> = saved["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m.as_str())
        .collect();
    for p in &lora.target_parameters {
        assert!(
            !modules.iter().any(|m| m.ends_with(p.as_str())),
            "{what}: target_modules names {p}: {modules:?}"
        );
        assert!(saved["target_parameters"]
            .as_array()
            .unwrap()
            .contains(&p.as_str().into()));
    }
    let theirs = peft_logits_of(python, base, &adapter, tmp);
    let d = max_diff(&ours, &theirs);
    eprintln!("{what}: our adapter in peft: logits within {d:.1e}");
    assert!(
        d < 1e-4,
        "{what}: peft's logits with our adapter differ by {d}"
    );
    // Read back here: the same model.
    let mut back = CausalLm::from_pretrained(base, DType::F32, &Device::Cpu).unwrap();
    back.load_adapter(&adapter).unwrap();
    let d = max_diff(&back.forward(&ids, &pos).unwrap(), &ours);
    assert!(d < 1e-6, "{what}: our adapter read back differs by {d}");
    // peft's own adapter, on the same targets (all-linear or the names, and the parameters).
    let theirs_dir = tmp.join("peft-adapter");
    let parameters = lora.target_parameters.join(",");
    match &lora.targets {
        Targets::AllLinear => {
            let mut args = vec![Path::new("write"), base, &theirs_dir];
            if !parameters.is_empty() {
                args.push(Path::new(&parameters));
            }
            peft_script(python, &args);
        }
        Targets::Names(names) => {
            let json = serde_json::json!({
                "target_modules": names, "target_parameters": lora.target_parameters,
            })
            .to_string();
            peft_script(
                python,
                &[Path::new("write-json"), base, &theirs_dir, Path::new(&json)],
            );
        }
    }
    let mut model = CausalLm::from_pretrained(base, DType::F32, &Device::Cpu).unwrap();
    model.load_adapter(&theirs_dir).unwrap();
    let d = max_diff(
        &model.forward(&ids, &pos).unwrap(),
        &peft_logits_of(python, base, &theirs_dir, tmp),
    );
    eprintln!("{what}: peft's adapter here: logits within {d:.1e}");
    assert!(
        d < 1e-4,
        "{what}: our logits with peft's adapter differ by {d}"
    );
    (adapter, ours)
}

/// gpt-oss's fused experts and router adapted as parameters (peft's `target_parameters`, as
/// the gpt-oss fine-tuning recipe does; `lora_target_parameters` here): every layer's three,
/// and one layer's down projection alone (`1.mlp.experts.down_proj`); Llama 4's fused
/// experts (gate and up as halves, which peft reads [experts, out, in]: the adapter runs B
/// then A) and Mistral 4's (held [experts, out, in]). Each expert's adapter
/// runs as two grouped GEMMs of rank r. Both ways with peft (our adapter in peft, peft's
/// here: the same logits), read back here, and merged into the base (`cargo trl merge`'s
/// path): the merged model's logits are the adapted one's.
#[test]
fn parameter_adapters_travel_between_us_and_peft() {
    let Some(python) = peft_python() else {
        return;
    };
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets");
    let (ids, pos) = ids();
    // gpt-oss: attention's 4 x 2 in each of 3 layers, and 2 per adapted parameter. Llama 4:
    // its named projections' 56 (moe_adapters_travel_between_us_and_peft), and its fused
    // experts held [experts, hidden, 2 x inter] with the gate and up halves, on layers 1 and 2.
    for (model, targets, parameters, adapters) in [
        (
            "tiny-gpt-oss",
            Targets::AllLinear,
            "mlp.experts.gate_up_proj,mlp.experts.down_proj,mlp.router.weight",
            3 * 8 + 3 * 3 * 2,
        ),
        (
            "tiny-gpt-oss",
            Targets::AllLinear,
            "1.mlp.experts.down_proj",
            3 * 8 + 2,
        ),
        (
            "tiny-llama4",
            llama4_targets(),
            "feed_forward.experts.gate_up_proj,feed_forward.experts.down_proj",
            56 + 2 * 2 * 2,
        ),
        // Mistral 4: all-linear (5 attention projections in 2 layers, a dense MLP and a
        // shared expert) and its experts held [experts, out, in] on layer 1.
        (
            "tiny-mistral4",
            Targets::AllLinear,
            "mlp.experts.gate_up_proj,mlp.experts.down_proj",
            2 * (2 * 5 + 3 + 3) + 2 * 2,
        ),
    ] {
        let base = assets.join(model).join("model");
        let tmp = tempfile::tempdir().unwrap();
        let lora = LoraConfig {
            target_parameters: parameters.split(',').map(String::from).collect(),
            ..config(targets)
        };
        let (adapter, ours) = round_trip(&python, &base, &lora, adapters, tmp.path());
        let plain = CausalLm::from_pretrained(&base, DType::F32, &Device::Cpu).unwrap();
        let moved = max_diff(&ours, &plain.forward(&ids, &pos).unwrap());
        assert!(
            moved > 1e-3,
            "{parameters}: the adapters change nothing ({moved})"
        );
        // Merged into the base's weights.
        let merged = tmp.path().join("merged");
        let sites = &CausalLm::parameter_sites_of;
        trl_runtime::models::merge::merge_adapter(&adapter, Some(&base), &merged, 1 << 30, sites)
            .unwrap();
        let m = CausalLm::from_pretrained(&merged, DType::F32, &Device::Cpu).unwrap();
        let d = max_diff(&m.forward(&ids, &pos).unwrap(), &ours);
        eprintln!("{parameters}: merged: logits within {d:.1e}");
        assert!(
            d < 1e-4,
            "{parameters}: the merged model's logits differ by {d}"
        );
    }
}

#[test]
fn a_peft_adapter_gives_peft_logits_here() {
    let Some(python) = peft_python() else {
        return;
    };
    for dora in [false, true] {
        a_peft_adapter_gives_peft_logits(&python, dora);
    }
}

fn a_peft_adapter_gives_peft_logits(python: &Path, dora: bool) {
    let python = python.to_path_buf();
    let tmp = tempfile::tempdir().unwrap();
    let adapter = tmp.path().join("peft-adapter");
    let mode = if dora { "write-dora" } else { "write" };
    peft_script(&python, &[Path::new(mode), &tiny(), &adapter]);
    let mut model = CausalLm::from_pretrained(tiny(), DType::F32, &Device::Cpu).unwrap();
    model.load_adapter(&adapter).unwrap();
    let (ids, pos) = ids();
    let ours = model.forward(&ids, &pos).unwrap();
    let theirs = peft_logits(&python, &adapter, tmp.path());
    let d = max_diff(&ours, &theirs);
    eprintln!("peft's adapter (dora {dora}) here: logits within {d:.1e}");
    assert!(d < 1e-4, "our logits with peft's adapter differ by {d}");
    // The plain model takes it too, for evaluation.
    let mut plain =
        AutoModelForCausalLM::from_pretrained(tiny(), DType::F32, &Device::Cpu).unwrap();
    plain.load_adapter(&adapter).unwrap();
    let d = max_diff(&plain.forward(&ids, &pos).unwrap(), &theirs);
    assert!(
        d < 1e-4,
        "AutoModelForCausalLM::load_adapter: logits differ by {d}"
    );
}

/// With dropout on and activation checkpointing, each recomputed layer draws the masks its
/// forward drew: loss and every adapter gradient equal those of the same forward kept whole
/// (the trainer's order: forward under the micro-batch's key, backward after it).
#[test]
fn checkpointed_layers_replay_the_dropout_masks() {
    for dora in [false, true] {
        replay_dropout_masks(dora);
    }
}

fn replay_dropout_masks(dora: bool) {
    use trl_runtime::nn::lora::with_dropout;
    use trl_runtime::parallel::Checkpointing;
    let (ids, pos) = ids();
    let targets = ids.to_dtype(DType::I64).unwrap();
    let run = |dropout: f64, checkpointing: bool| {
        let mut model = CausalLm::from_pretrained(tiny(), DType::F32, &Device::Cpu).unwrap();
        model
            .add_adapters(&LoraConfig {
                dropout,
                dora,
                ..config(Targets::AllLinear)
            })
            .unwrap();
        randomize(&model);
        if checkpointing {
            model.checkpointing = Some(Checkpointing::new(false));
        }
        let loss = with_dropout(7, || model.forward_loss(&ids, &pos, &targets)).unwrap();
        let grads = model.backward(&loss.sum).unwrap();
        let grads: Vec<(String, Tensor)> = model
            .params
            .iter()
            .map(|(n, v)| (n.clone(), grads.get(v.as_tensor()).unwrap().clone()))
            .collect();
        (loss.sum.to_scalar::<f32>().unwrap(), grads)
    };
    let (whole, whole_grads) = run(0.3, false);
    let (recomputed, recomputed_grads) = run(0.3, true);
    let (without, _) = run(0.0, false);
    assert!(
        (whole - without).abs() > 1e-3,
        "dora {dora}: dropout had no effect: {whole} vs {without}"
    );
    assert!(
        (whole - recomputed).abs() < 1e-4,
        "dora {dora}: loss {whole} vs {recomputed}"
    );
    for ((name, g), (_, h)) in whole_grads.iter().zip(&recomputed_grads) {
        let d = max_diff(g, h);
        assert!(
            d < 1e-5,
            "dora {dora}: {name}: recomputed gradient differs by {d}"
        );
    }
}

/// Moves every trained tensor but a linear layer's `A` (random from the start) off its start,
/// each by its own pattern, so that two copies that should differ do.
fn perturb_trained(model: &CausalLm) {
    for (name, var) in model.params.iter() {
        if name.ends_with(".lora_A.weight") {
            continue;
        }
        let salt = name.bytes().map(|b| b as usize).sum::<usize>();
        let n = var.elem_count();
        let values: Vec<f32> = (0..n)
            .map(|i| (((i + salt) * 7919 % 97) as f32 / 97.0 - 0.5) * 0.2)
            .collect();
        let noise = Tensor::from_vec(values, var.shape(), &Device::Cpu).unwrap();
        var.set(&(var.as_tensor() + noise).unwrap()).unwrap();
    }
}

/// Runs peft_logits.py's `batch` over `tasks` (each its command line) in one process.
fn peft_batch(python: &Path, tasks: &[Vec<String>], tmp: &Path) {
    let file = tmp.join("tasks.json");
    let json: Vec<serde_json::Value> = tasks
        .iter()
        .map(|t| serde_json::json!({ "args": t }))
        .collect();
    std::fs::write(&file, serde_json::to_string(&json).unwrap()).unwrap();
    peft_script(python, &[Path::new("batch"), &file]);
}

fn load_logits(file: &Path) -> Tensor {
    candle_core::safetensors::load(file, &Device::Cpu).unwrap()["logits"].clone()
}

/// What a tied-head case trains besides q_proj's adapters.
#[derive(Clone, Copy, Debug)]
enum Tied {
    /// `lora_modules_to_save`.
    Whole(&'static [&'static str]),
    /// `trainable_token_indices` (the embedding's rows 1, 2, 3).
    Tokens,
    /// LoRA on this module (`embed_tokens` or `lm_head`) as well.
    Lora(&'static str),
}

/// Every way peft adapts an embedding and an LM head, on every built-in model whose head is
/// tied to its embedding, with and without peft's `ensure_weight_tying`, and on an untied
/// model (Mistral): modules trained whole (the embedding, the head, both), trainable tokens,
/// LoRA on the embedding, LoRA on the head. Each setup: a named module trains as its own copy
/// (peft's default: a tied pair parts) or, with `ensure_weight_tying`, the tied pair as one
/// tensor (trainable tokens always tie, as in peft); our adapter loads in peft with our
/// logits, reads back here, and merges (`cargo trl merge`'s path) into a checkpoint
/// transformers opens with our logits, tied exactly when the change is one for both; peft's
/// own adapter of each setup gives peft's logits here. Logits within 1e-4.
#[test]
fn tied_heads_travel_between_us_peft_and_transformers() {
    let python = peft_python();
    let tmp = tempfile::tempdir().unwrap();
    let (ids, pos) = ids();
    let ids_file = ids_file(tmp.path());
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets");
    let setups = [
        Tied::Whole(&["embed_tokens"]),
        Tied::Whole(&["lm_head"]),
        Tied::Whole(&["embed_tokens", "lm_head"]),
        Tied::Tokens,
        Tied::Lora("embed_tokens"),
        Tied::Lora("lm_head"),
    ];
    let mut cases = Vec::new();
    for model in [
        "tiny",
        "tiny-qwen3",
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-smollm3",
        "tiny-mistral",
    ] {
        for setup in setups {
            for ewt in [false, true] {
                cases.push((model, setup, ewt));
            }
        }
    }
    let mut checks = Vec::new();
    let mut tasks: Vec<Vec<String>> = Vec::new();
    let s = |p: &Path| p.display().to_string();
    for (i, &(name, setup, ewt)) in cases.iter().enumerate() {
        let what = format!("{name} {setup:?} ensure_weight_tying {ewt}");
        let base = assets.join(name).join("model");
        let tied = name != "tiny-mistral";
        let dir = tmp.path().join(format!("case{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut lora = LoraConfig {
            ensure_weight_tying: ewt,
            ..config(Targets::Names(vec!["q_proj".into()]))
        };
        let mut kwargs = serde_json::json!({});
        match setup {
            Tied::Whole(modules) => {
                lora.modules_to_save = modules.iter().map(|m| m.to_string()).collect();
                kwargs["modules_to_save"] = serde_json::json!(modules);
            }
            Tied::Tokens => {
                lora.trainable_token_indices = vec![("embed_tokens".into(), vec![1, 2, 3])];
                kwargs["trainable_token_indices"] = serde_json::json!([1, 2, 3]);
            }
            Tied::Lora(module) => {
                lora.targets = Targets::Names(vec!["q_proj".into(), module.into()]);
                kwargs["target_modules"] = serde_json::json!(["q_proj", module]);
            }
        }
        if ewt {
            kwargs["ensure_weight_tying"] = true.into();
        }
        let mut model = CausalLm::from_pretrained(&base, DType::F32, &Device::Cpu).unwrap();
        model.add_adapters(&lora).unwrap();
        if let Tied::Whole(modules) = setup {
            let whole: Vec<&String> = model
                .params
                .iter()
                .map(|(n, _)| n)
                .filter(|n| !n.contains("lora_"))
                .collect();
            let copies = if tied && ewt { 1 } else { modules.len() };
            assert_eq!(whole.len(), copies, "{what}: trained whole {whole:?}");
        }
        perturb_trained(&model);
        let ours = model.forward(&ids, &pos).unwrap();
        let plain = CausalLm::from_pretrained(&base, DType::F32, &Device::Cpu).unwrap();
        let moved = max_diff(&ours, &plain.forward(&ids, &pos).unwrap());
        assert!(
            moved > 1e-3,
            "{what}: the adapter changes nothing ({moved})"
        );
        let adapter = save_adapter(&model, &lora, &base, &dir);
        // Read back here.
        let mut back = CausalLm::from_pretrained(&base, DType::F32, &Device::Cpu).unwrap();
        back.load_adapter(&adapter).unwrap();
        let d = max_diff(&back.forward(&ids, &pos).unwrap(), &ours);
        assert!(d < 1e-6, "{what}: our adapter read back differs by {d}");
        // Merged: tied exactly when the change is one for both.
        let merged = dir.join("merged");
        let sites = &CausalLm::parameter_sites_of;
        trl_runtime::models::merge::merge_adapter(&adapter, Some(&base), &merged, 1 << 30, sites)
            .unwrap();
        let m = CausalLm::from_pretrained(&merged, DType::F32, &Device::Cpu).unwrap();
        let d = max_diff(&m.forward(&ids, &pos).unwrap(), &ours);
        assert!(d < 1e-4, "{what}: the merged model's logits differ by {d}");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(merged.join("config.json")).unwrap())
                .unwrap();
        let still_tied = config["tie_word_embeddings"].as_bool().unwrap_or(true);
        let one_change = ewt || matches!(setup, Tied::Tokens);
        assert_eq!(
            still_tied,
            tied && one_change,
            "{what}: merged tie_word_embeddings"
        );
        let (peft_dir, out) = (dir.join("peft-adapter"), |n: &str| s(&dir.join(n)));
        tasks.push(vec![
            "logits".into(),
            s(&base),
            s(&adapter),
            s(&ids_file),
            out("ours-in-peft.safetensors"),
        ]);
        tasks.push(vec![
            "model-logits".into(),
            s(&merged),
            s(&ids_file),
            out("merged.safetensors"),
        ]);
        tasks.push(vec![
            "write-json".into(),
            s(&base),
            s(&peft_dir),
            kwargs.to_string(),
        ]);
        tasks.push(vec![
            "logits".into(),
            s(&base),
            s(&peft_dir),
            s(&ids_file),
            out("peft.safetensors"),
        ]);
        checks.push((what, base, dir, ours));
    }
    let Some(python) = python else {
        return;
    };
    peft_batch(&python, &tasks, tmp.path());
    let mut worst: f64 = 0.0;
    for (what, base, dir, ours) in checks {
        let d = max_diff(&ours, &load_logits(&dir.join("ours-in-peft.safetensors")));
        assert!(
            d < 1e-4,
            "{what}: peft's logits with our adapter differ by {d}"
        );
        let m = max_diff(&ours, &load_logits(&dir.join("merged.safetensors")));
        assert!(
            m < 1e-4,
            "{what}: transformers' logits of our merge differ by {m}"
        );
        let mut model = CausalLm::from_pretrained(&base, DType::F32, &Device::Cpu).unwrap();
        model.load_adapter(dir.join("peft-adapter")).unwrap();
        let p = max_diff(
            &model.forward(&ids, &pos).unwrap(),
            &load_logits(&dir.join("peft.safetensors")),
        );
        assert!(
            p < 1e-4,
            "{what}: our logits with peft's adapter differ by {p}"
        );
        eprintln!("{what}: in peft {d:.1e}, merged in transformers {m:.1e}, peft's here {p:.1e}");
        worst = worst.max(d).max(m).max(p);
    }
    eprintln!("tied heads: every setup within {worst:.1e}");
}

/// What peft 0.21 refuses on an embedding and a tied head is refused here before training,
/// naming the key; what it accepts but leaves out (LoRA on a module trained whole) is left
/// out the same way.
#[test]
fn what_peft_refuses_on_embeddings_is_refused_here() {
    let refused = |lora: LoraConfig| {
        let mut model = CausalLm::from_pretrained(tiny(), DType::F32, &Device::Cpu).unwrap();
        model.add_adapters(&lora).unwrap_err().to_string()
    };
    let tokens = |m: &str, ids: &[u32]| (m.to_string(), ids.to_vec());
    let names = |n: &[&str]| Targets::Names(n.iter().map(|s| s.to_string()).collect());
    // Trainable tokens on an embedding with LoRA (peft: "cannot be applied to modules of
    // type lora.Embedding").
    let e = refused(LoraConfig {
        trainable_token_indices: vec![tokens("embed_tokens", &[1, 2])],
        ..config(names(&["q_proj", "embed_tokens"]))
    });
    assert!(e.contains("trainable_token_indices"), "{e}");
    // Different rows for a tied pair with ensure_weight_tying.
    let e = refused(LoraConfig {
        trainable_token_indices: vec![tokens("embed_tokens", &[1, 2]), tokens("lm_head", &[3])],
        ensure_weight_tying: true,
        ..config(names(&["q_proj"]))
    });
    assert!(
        e.contains("ensure_weight_tying") && e.contains("[3]"),
        "{e}"
    );
    // Not implemented here (peft has it): DoRA on an embedding.
    let e = refused(LoraConfig {
        dora: true,
        ..config(names(&["q_proj", "embed_tokens"]))
    });
    assert!(e.contains("use_dora"), "{e}");
    // Without ensure_weight_tying, other rows for the head train apart (peft's default).
    let mut model = CausalLm::from_pretrained(tiny(), DType::F32, &Device::Cpu).unwrap();
    model
        .add_adapters(&LoraConfig {
            trainable_token_indices: vec![tokens("embed_tokens", &[1, 2]), tokens("lm_head", &[3])],
            ..config(names(&["q_proj"]))
        })
        .unwrap();
    let deltas: Vec<&String> = model
        .params
        .iter()
        .map(|(n, _)| n)
        .filter(|n| n.contains("trainable_tokens_delta"))
        .collect();
    assert_eq!(deltas.len(), 2, "{deltas:?}");
    // A module trained whole takes no LoRA: its copy trains.
    let mut model = CausalLm::from_pretrained(tiny(), DType::F32, &Device::Cpu).unwrap();
    model
        .add_adapters(&LoraConfig {
            modules_to_save: vec!["embed_tokens".into()],
            ..config(names(&["q_proj", "embed_tokens"]))
        })
        .unwrap();
    let names: Vec<&String> = model.params.iter().map(|(n, _)| n).collect();
    assert!(
        names.iter().any(|n| *n == "model.embed_tokens.weight"),
        "{names:?}"
    );
    assert!(
        !names.iter().any(|n| n.contains("lora_embedding")),
        "{names:?}"
    );
}
