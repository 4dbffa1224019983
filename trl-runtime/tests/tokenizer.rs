//! Tokenizer files and chat templates: a BPE tokenizer trained here, a ChatML template with
//! `{% generation %}` markers giving assistant-only masks, Python string methods in templates,
//! and clear errors for missing or bad files.

use trl_runtime::data::tokenize::train_bpe;
use trl_runtime::data::{Message, TextTokenizer};
use trl_runtime::nn::IGNORE_INDEX;

const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{{ '<|im_end|>' }}{% endgeneration %}{% else %}{{ m['content'].strip() + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn model_dir(template: Option<&str>) -> tempfile::TempDir {
    let texts: Vec<String> = (0..200)
        .map(|i| format!("What is {i} plus {}? The answer is {}.", i * 3, i * 4))
        .collect();
    let tok = train_bpe(
        &texts,
        300,
        &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    tok.save(dir.path().join("tokenizer.json"), true).unwrap();
    let mut cfg = serde_json::json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"});
    if let Some(t) = template {
        cfg["chat_template"] = serde_json::Value::String(t.to_string());
    }
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    dir
}

fn conversation() -> Vec<Message> {
    vec![
        Message::new("user", "  What is 2 plus 3?  "),
        Message::new("assistant", "The answer is 5."),
    ]
}

#[test]
fn trained_tokenizer_round_trips_text() {
    let dir = model_dir(Some(CHATML));
    let tok = TextTokenizer::from_dir(dir.path()).unwrap();
    assert!(tok.vocab_size() <= 300 && tok.vocab_size() > 200);
    let ids = tok.encode("What is 12 plus 36?", false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), "What is 12 plus 36?");
    assert_eq!(tok.pad_token_id, 0);
    assert_eq!(tok.eos_token_id, Some(2));
    // Special tokens in text are single tokens.
    assert_eq!(tok.encode("<|im_start|>", false).unwrap(), vec![1]);
}

#[test]
fn chat_template_renders_with_generation_spans() {
    let dir = model_dir(Some(CHATML));
    let tok = TextTokenizer::from_dir(dir.path()).unwrap();
    let chat = tok
        .apply_chat_template(&conversation(), None, false)
        .unwrap();
    assert_eq!(
        chat.text,
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\nThe answer is 5.<|im_end|>\n"
    );
    assert_eq!(chat.generation_spans.len(), 1);
    assert_eq!(
        &chat.text[chat.generation_spans[0].clone()],
        "The answer is 5.<|im_end|>"
    );
    let prompt = tok
        .apply_chat_template(&conversation()[..1], None, true)
        .unwrap();
    assert!(prompt.text.ends_with("<|im_start|>assistant\n"));

    let ex = tok.tokenize_chat(&conversation(), None, true).unwrap();
    let targets = ex.target_ids();
    assert_eq!(
        tok.decode(&targets, false).unwrap(),
        "The answer is 5.<|im_end|>"
    );
    // Without assistant-only loss every token is a target.
    let all = tok.tokenize_chat(&conversation(), None, false).unwrap();
    assert!(all.labels.iter().all(|&l| l != IGNORE_INDEX));
}

/// TRL's SFTConfig.eos_token and chat_template_path: the end-of-sequence token (its id, the
/// templates' `eos_token`, the padding when none is named) and the template from a .jinja file
/// or another tokenizer's directory (its eos too, as clone_chat_template sets it), refused
/// with why when the token is unknown or the directory adds tokens; the copies a checkpoint
/// gets carry both.
#[test]
fn eos_token_and_chat_template_path_change_the_tokenizer_and_its_copies() {
    let dir = model_dir(Some(CHATML));
    let tok = TextTokenizer::from_dir(dir.path()).unwrap();
    let vocab = tok.inner().get_vocab(true);
    let id = |t: &str| vocab[t];
    let (eot, pad) = (id("<|endoftext|>"), tok.pad_token_id);
    let ends = "{{ messages[0]['content'] }}{{ eos_token }}";
    let tok = tok.with_eos_token("<|endoftext|>").unwrap();
    assert_eq!((tok.eos_token_id, tok.pad_token_id), (Some(eot), pad));
    let e = TextTokenizer::from_dir(dir.path())
        .unwrap()
        .with_eos_token("<|nope|>")
        .err()
        .unwrap();
    assert!(e.contains("<|nope|>") && e.contains("vocabulary"), "{e}");

    let jinja = dir.path().join("ends.jinja");
    std::fs::write(&jinja, ends).unwrap();
    let tok = tok.with_chat_template_from(&jinja).unwrap();
    let chat = tok
        .apply_chat_template(&conversation(), None, false)
        .unwrap();
    assert_eq!(chat.text, "  What is 2 plus 3?  <|endoftext|>");

    // The checkpoint's copies: the template and the eos, in tokenizer_config.json, or in
    // chat_template.jinja where the model directory has one.
    let out = tempfile::tempdir().unwrap();
    tok.copy_files(out.path()).unwrap();
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["chat_template"], ends);
    assert_eq!(
        (&cfg["eos_token"], &cfg["pad_token"]),
        (&"<|endoftext|>".into(), &"<|endoftext|>".into())
    );
    let copied = TextTokenizer::from_dir(out.path()).unwrap();
    assert_eq!(copied.eos_token_id, Some(eot));
    // The generation config travels along, the new eos first among its stop tokens.
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": 7, "temperature": 0.7}"#,
    )
    .unwrap();
    let out = tempfile::tempdir().unwrap();
    tok.copy_files(out.path()).unwrap();
    let generation: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(generation["eos_token_id"], serde_json::json!([eot, 7]));
    assert_eq!(generation["temperature"], 0.7);
    std::fs::remove_file(dir.path().join("generation_config.json")).unwrap();
    // A processor's files (a vision-language model's) travel along too; its own copy of the
    // template says the new one.
    let files = [
        ("chat_template.jinja", CHATML),
        ("chat_template.json", r#"{"chat_template": "old"}"#),
        ("preprocessor_config.json", r#"{"size": 28}"#),
    ];
    for (f, text) in files {
        std::fs::write(dir.path().join(f), text).unwrap();
    }
    let with_jinja = TextTokenizer::from_dir(dir.path())
        .unwrap()
        .with_chat_template_from(&jinja)
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    with_jinja.copy_files(out.path()).unwrap();
    let read = |f: &str| std::fs::read_to_string(out.path().join(f)).unwrap();
    assert_eq!(read("chat_template.jinja"), ends);
    let processor: serde_json::Value = serde_json::from_str(&read("chat_template.json")).unwrap();
    assert_eq!(processor["chat_template"], ends);
    assert_eq!(read("preprocessor_config.json"), r#"{"size": 28}"#);
    for (f, _) in files {
        std::fs::remove_file(dir.path().join(f)).unwrap();
    }

    // Another tokenizer's directory: its template and its eos.
    let other = model_dir(Some(ends));
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(other.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    cfg["eos_token"] = "<|im_start|>".into();
    std::fs::write(other.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let from = |path: &std::path::Path| {
        TextTokenizer::from_dir(dir.path())
            .unwrap()
            .with_chat_template_from(path)
    };
    let cloned = from(other.path()).unwrap();
    let chat = cloned
        .apply_chat_template(&conversation(), None, false)
        .unwrap();
    assert_eq!(chat.text, "  What is 2 plus 3?  <|im_start|>");
    assert_eq!(cloned.eos_token_id, Some(id("<|im_start|>")));

    // A directory whose tokenizer adds a token this one lacks, and a name that is neither.
    let texts = ["a b c".to_string()];
    let extra = train_bpe(&texts, 300, &["<|endoftext|>", "<|tool|>"]).unwrap();
    extra
        .save(other.path().join("tokenizer.json"), true)
        .unwrap();
    cfg["eos_token"] = "<|endoftext|>".into();
    std::fs::write(other.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let e = from(other.path()).err().unwrap();
    assert!(e.contains("<|tool|>") && e.contains("not supported"), "{e}");
    let e = from(std::path::Path::new("HuggingFaceTB/SmolLM3-3B"))
        .err()
        .unwrap();
    assert!(e.contains("neither") && e.contains("download"), "{e}");
}

#[test]
fn template_problems_are_clear_errors() {
    // No generation markers but assistant-only loss requested.
    let plain = CHATML
        .replace("{% generation %}", "")
        .replace("{% endgeneration %}", "");
    let dir = model_dir(Some(&plain));
    let tok = TextTokenizer::from_dir(dir.path()).unwrap();
    let e = tok
        .tokenize_chat(&conversation(), None, true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("{% generation %}"),
        "{e}"
    );

    // raise_exception in a template surfaces its message.
    let raising = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be a system message') }}{% endif %}";
    let dir = model_dir(Some(raising));
    let e = TextTokenizer::from_dir(dir.path())
        .unwrap()
        .apply_chat_template(&conversation(), None, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("first message must be a system message"), "{e}");

    // Syntax errors name the key.
    let dir = model_dir(Some("{% for m in messages %}"));
    let e = TextTokenizer::from_dir(dir.path())
        .unwrap()
        .apply_chat_template(&conversation(), None, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("chat_template") && e.contains("template error"),
        "{e}"
    );

    // No template at all.
    let dir = model_dir(None);
    let e = TextTokenizer::from_dir(dir.path())
        .unwrap()
        .apply_chat_template(&conversation(), None, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no chat template"), "{e}");

    // Missing and corrupt files name the file.
    let empty = tempfile::tempdir().unwrap();
    let e = TextTokenizer::from_dir(empty.path())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("tokenizer.json") && e.contains("not found"),
        "{e}"
    );
    let dir = model_dir(Some(CHATML));
    std::fs::write(dir.path().join("tokenizer_config.json"), "{ not json").unwrap();
    let e = TextTokenizer::from_dir(dir.path())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("not valid JSON"),
        "{e}"
    );
    let dir = model_dir(Some(CHATML));
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "<eos>"}"#,
    )
    .unwrap();
    let e = TextTokenizer::from_dir(dir.path())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("eos_token") && e.contains("<eos>"), "{e}");
}

mod datasets {
    use super::*;
    use trl_runtime::data::{load_jsonl, to_example, OnBadRow, Record, TokenizeOptions};

    const ROWS: &str = r#"{"text": "What is 1 plus 2?"}
{"prompt": "What is 2 plus 3? ", "completion": "The answer is 5."}

{"messages": [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "The answer is 5."}]}
{"prompt": [{"role": "user", "content": "What is 2 plus 3?"}], "completion": [{"role": "assistant", "content": "The answer is 5."}]}
{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]}
{"prompt": "only a prompt"}
not json at all
{"title": "no known keys"}
"#;

    fn targets(tok: &TextTokenizer, ex: &trl_runtime::data::Example) -> String {
        let ids = ex.target_ids();
        tok.decode(&ids, false).unwrap()
    }

    #[test]
    fn every_trl_format_loads_and_masks_like_trl() {
        let dir = model_dir(Some(CHATML));
        let tok = TextTokenizer::from_dir(dir.path()).unwrap();
        let path = dir.path().join("train.jsonl");
        std::fs::write(&path, ROWS).unwrap();

        let e = load_jsonl(&path, OnBadRow::Fail).unwrap_err().to_string();
        assert!(
            e.contains("train.jsonl") && e.contains("line 7") && e.contains("without `completion`"),
            "{e}"
        );

        let loaded = load_jsonl(&path, OnBadRow::Skip).unwrap();
        assert_eq!(loaded.records.len(), 5);
        let lines: Vec<usize> = loaded.skipped.iter().map(|(l, _)| *l).collect();
        assert_eq!(lines, vec![7, 8, 9]);
        assert!(loaded.skipped[2].1.contains("no known format"));

        let opts = TokenizeOptions {
            completion_only_loss: true,
            assistant_only_loss: true,
        };
        let ex: Vec<_> = loaded
            .records
            .iter()
            .map(|r| to_example(r, &tok, opts).unwrap())
            .collect();
        // text: everything is a target, EOS appended.
        assert_eq!(targets(&tok, &ex[0]), "What is 1 plus 2?<|im_end|>");
        // prompt-completion: only the completion (and EOS). The prompt's trailing space merges
        // into the completion's first token, which is therefore a target, as in TRL.
        assert_eq!(targets(&tok, &ex[1]), " The answer is 5.<|im_end|>");
        // messages with assistant-only loss.
        assert_eq!(targets(&tok, &ex[2]), "The answer is 5.<|im_end|>");
        // conversational prompt-completion: the assistant turn after the generation prompt.
        assert_eq!(targets(&tok, &ex[3]), "The answer is 5.<|im_end|>\n");
        // pre-tokenized with a completion mask.
        assert_eq!(ex[4].labels, vec![-100, -100, 7, 8]);
        assert!(matches!(loaded.records[4], Record::Tokens { .. }));

        // Without completion-only loss the prompt is trained on too.
        let all = to_example(
            &loaded.records[1],
            &tok,
            TokenizeOptions {
                completion_only_loss: false,
                assistant_only_loss: false,
            },
        )
        .unwrap();
        assert_eq!(
            targets(&tok, &all),
            "What is 2 plus 3? The answer is 5.<|im_end|>"
        );
    }

    #[test]
    fn parquet_files_read_like_jsonl() {
        use trl_runtime::data::{load, Split};
        let dir = model_dir(Some(CHATML));
        let tok = TextTokenizer::from_dir(dir.path()).unwrap();
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/parquet");
        // list<struct<role, content>> as HF datasets writes conversations (snappy).
        let chats = load(
            fixtures.join("messages.parquet"),
            Split::TRAIN,
            OnBadRow::Fail,
        )
        .unwrap();
        assert_eq!(chats.records.len(), 2);
        let opts = TokenizeOptions {
            completion_only_loss: true,
            assistant_only_loss: true,
        };
        let ex = to_example(&chats.records[1], &tok, opts).unwrap();
        assert_eq!(targets(&tok, &ex), "The answer is 2.<|im_end|>");
        // zstd, with a null completion in row 2.
        let path = fixtures.join("prompt_completion.parquet");
        let e = load(&path, Split::TRAIN, OnBadRow::Fail)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("prompt_completion.parquet")
                && e.contains("row 2")
                && e.contains("without `completion`"),
            "{e}"
        );
        let pc = load(&path, Split::TRAIN, OnBadRow::Skip).unwrap();
        assert_eq!(
            (pc.records.len(), pc.skipped.len(), pc.skipped[0].0),
            (2, 1, 2)
        );
        assert_eq!(
            targets(&tok, &to_example(&pc.records[1], &tok, opts).unwrap()),
            " The answer is 10.<|im_end|>"
        );
        // Unknown extensions are refused with the accepted ones.
        let e = load(fixtures.join("data.csv"), Split::TRAIN, OnBadRow::Fail)
            .unwrap_err()
            .to_string();
        assert!(e.contains(".jsonl") && e.contains(".parquet"), "{e}");
    }

    #[test]
    fn a_missing_dataset_names_the_file() {
        let e = load_jsonl("/no/such/train.jsonl", OnBadRow::Fail)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/no/such/train.jsonl"), "{e}");
    }
}
