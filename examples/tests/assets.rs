//! The shipped assets are what `make_assets` writes, and they fit together: the model loads,
//! its vocabulary is the tokenizer's, every row tokenizes with the answer as the only target,
//! and held-out questions never occur in training.

use candle_core::{DType, Device};
use trl_examples::assets;
use trl_runtime::data::{load_jsonl, to_example, OnBadRow, TextTokenizer, TokenizeOptions};
use trl_runtime::parallel::CausalLm;

#[test]
fn shipped_assets_are_reproducible() {
    let fresh = tempfile::tempdir().unwrap();
    assets::write_all(fresh.path()).unwrap();
    for file in [
        "data/train.jsonl",
        "data/eval.jsonl",
        "model/tokenizer.json",
        "model/tokenizer_config.json",
        "model/config.json",
        "model/model.safetensors",
    ] {
        let shipped = std::fs::read(assets::default_dir().join(file)).unwrap();
        let again = std::fs::read(fresh.path().join(file)).unwrap();
        assert!(
            shipped == again,
            "{file} differs from what make_assets writes: rerun it and commit"
        );
    }
}

#[test]
fn shipped_assets_fit_together() {
    let dir = assets::default_dir();
    let tok = TextTokenizer::from_dir(dir.join("model")).unwrap();
    let model = CausalLm::from_pretrained(dir.join("model"), DType::F32, &Device::Cpu).unwrap();
    let config: serde_json::Value = serde_json::from_str(model.config_json()).unwrap();
    assert_eq!(config["vocab_size"], serde_json::json!(tok.vocab_size()));
    assert_eq!(
        config["eos_token_id"],
        serde_json::json!(tok.eos_token_id.unwrap())
    );
    let train = load_jsonl(dir.join("data/train.jsonl"), OnBadRow::Fail).unwrap();
    let eval = load_jsonl(dir.join("data/eval.jsonl"), OnBadRow::Fail).unwrap();
    assert_eq!(
        (train.records.len(), eval.records.len()),
        (assets::TRAIN_ROWS, assets::EVAL_ROWS)
    );
    let opts = TokenizeOptions {
        completion_only_loss: true,
        assistant_only_loss: true,
    };
    let question = |r: &trl_runtime::data::Record| match r {
        trl_runtime::data::Record::Messages { messages: m, .. } => m[0].text(),
        _ => panic!("rows are conversations"),
    };
    let train_questions: std::collections::HashSet<String> =
        train.records.iter().map(question).collect();
    for r in &eval.records {
        assert!(!train_questions.contains(&question(r)));
    }
    for r in train.records.iter().take(200) {
        let ex = to_example(r, &tok, opts).unwrap();
        let target = ex.target_ids();
        let answer = match r {
            trl_runtime::data::Record::Messages { messages: m, .. } => m[1].text(),
            _ => unreachable!(),
        };
        assert_eq!(
            tok.decode(&target, false).unwrap(),
            format!("{answer}<|im_end|>")
        );
        assert!(ex.len() < 32, "rows stay short: {}", ex.len());
    }
}

/// The bundled jobs' settings (assets/tiny/sft.yaml, dpo.yaml) read as TRL configs, their
/// model and data found whatever the working directory.
#[test]
fn bundled_jobs_name_the_shipped_files() {
    let sft = trl_examples::sft::embedded_defaults().unwrap();
    let dpo = trl_examples::dpo::embedded_defaults().unwrap();
    assert!(sft.assistant_only_loss);
    assert_eq!(sft.training.max_length, 64);
    assert_eq!(dpo.training.learning_rate, 5e-4);
    for t in [&sft.training, &dpo.training] {
        let eval = t.eval_dataset_name.as_ref().unwrap();
        for path in [&t.model_name_or_path, &t.dataset_name, eval] {
            assert!(path.is_absolute() && path.exists(), "{}", path.display());
        }
    }
}
