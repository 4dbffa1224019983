//! Chat templates render as transformers renders them: every template TRL ships (copied from
//! the trl wheel into tests/fixtures/chat_templates/templates), on conversations with a
//! system prompt, several turns, a generation prompt, odd whitespace and unicode, tool calls
//! with a `tools` schema, content blocks and reasoning. The fixture holds transformers' text,
//! token ids and assistant mask for each (or the error the template raised);
//! scripts/make_chat_template_fixture.py writes it.

use serde_json::Value;
use std::path::Path;
use trl_runtime::data::{Message, TextTokenizer};
use trl_runtime::nn::IGNORE_INDEX;

fn fixture() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/chat_templates"
    ))
}

/// The fixture's cases, with strftime_now pinned to the fixture's date.
fn expected() -> Value {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap())
            .unwrap();
    std::env::set_var(
        "SOURCE_DATE_EPOCH",
        expected["source_date_epoch"].to_string(),
    );
    expected
}

/// The fixture's tokenizer with one of the templates.
fn tokenizer_with(template: &str) -> TextTokenizer {
    let path = fixture().join("templates").join(template);
    TextTokenizer::from_dir(fixture().join("tokenizer"))
        .unwrap()
        .with_chat_template(std::fs::read_to_string(&path).unwrap(), path)
}

#[test]
fn every_trl_template_renders_like_transformers() {
    let expected = expected();
    let cases = expected["cases"].as_array().unwrap();
    let mut failures = Vec::new();
    let mut templates = std::collections::BTreeSet::new();
    for case in cases {
        let name = case["template"].as_str().unwrap();
        templates.insert(name);
        let label = format!("{name} / {}", case["conversation"].as_str().unwrap());
        let tok = tokenizer_with(name);
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let tools: Option<Vec<Value>> = serde_json::from_value(case["tools"].clone()).unwrap();
        let gen_prompt = case["add_generation_prompt"].as_bool().unwrap_or(false);
        let ours = tok.apply_chat_template(&messages, tools.as_deref(), gen_prompt);
        let chat = match (ours, case.get("error")) {
            (Err(_), Some(_)) => continue,
            (Ok(c), Some(e)) => {
                failures.push(format!(
                    "{label}: transformers raised {e}, we rendered {:?}",
                    c.text
                ));
                continue;
            }
            (Err(e), None) => {
                failures.push(format!("{label}: {e}"));
                continue;
            }
            (Ok(c), None) => c,
        };
        let text = case["text"].as_str().unwrap();
        if chat.text != text {
            failures.push(format!(
                "{label}: text differs\n  transformers: {text:?}\n  ours:         {:?}",
                chat.text
            ));
            continue;
        }
        let ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        if tok.encode(&chat.text, false).unwrap() != ids {
            failures.push(format!("{label}: token ids differ"));
            continue;
        }
        if let Some(mask) = case.get("assistant_masks") {
            let mask: Vec<u8> = serde_json::from_value(mask.clone()).unwrap();
            let ours: Vec<u8> = if mask.iter().all(|&m| m == 0) && chat.generation_spans.is_empty()
            {
                vec![0; ids.len()]
            } else {
                match tok.tokenize_chat(&messages, tools.as_deref(), true) {
                    Ok(ex) => ex
                        .labels
                        .iter()
                        .map(|&l| u8::from(l != IGNORE_INDEX))
                        .collect(),
                    Err(e) => {
                        failures.push(format!("{label}: {e}"));
                        continue;
                    }
                }
            };
            if ours != mask {
                failures.push(format!(
                    "{label}: assistant mask differs\n  transformers: {mask:?}\n  ours:         {ours:?}"
                ));
            }
        }
    }
    assert!(templates.len() >= 70, "{} templates", templates.len());
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from transformers:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn tools_and_tool_calls_come_through_the_dataset_loader() {
    use trl_runtime::data::dataset::{load_jsonl, to_example, OnBadRow, TokenizeOptions};
    let expected = expected();
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for case in expected["cases"].as_array().unwrap() {
        if case["conversation"] != "tools" || case.get("assistant_masks").is_none() {
            continue;
        }
        // One row as a dataset holds it: the tools column as JSON text (as HF datasets often
        // stores it), the messages with their tool calls and tool names.
        let row = serde_json::json!({
            "messages": case["messages"],
            "tools": case["tools"].to_string(),
        });
        let file = tmp.path().join("rows.jsonl");
        std::fs::write(&file, format!("{row}\n")).unwrap();
        let loaded = load_jsonl(&file, OnBadRow::Fail).unwrap();
        let name = case["template"].as_str().unwrap();
        let tok = tokenizer_with(name);
        let opts = TokenizeOptions {
            completion_only_loss: true,
            assistant_only_loss: true,
        };
        let ex = to_example(&loaded.records[0], &tok, opts).unwrap();
        let ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        let mask: Vec<u8> = serde_json::from_value(case["assistant_masks"].clone()).unwrap();
        assert_eq!(ex.input_ids, ids, "{name}");
        let ours: Vec<u8> = ex
            .labels
            .iter()
            .map(|&l| u8::from(l != IGNORE_INDEX))
            .collect();
        assert_eq!(ours, mask, "{name}");
        checked += 1;
    }
    assert!(checked >= 10, "{checked} training templates render tools");
}
