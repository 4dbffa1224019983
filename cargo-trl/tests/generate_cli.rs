//! `cargo trl generate` and `cargo trl chat` through the binary: docs/generation.md's commands
//! as written; completions equal to the library's `generate` on the same prompts (itself
//! equal to transformers', trl-runtime/tests/generation.rs); a LoRA checkpoint applied
//! unmerged gives the merged model's tokens; a chat's second reply is the generation from the
//! whole conversation; bad input named.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use trl_runtime::candle_core::{DType, Device, Tensor};
use trl_runtime::data::{Message, TextTokenizer};
use trl_runtime::generation::{GenerationConfig, Prompt};
use trl_runtime::models::AutoModelForCausalLM;

const BIN: &str = env!("CARGO_BIN_EXE_cargo-trl");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A tiny random Mistral (varied tokens, the bundled tokenizer and its chat template).
fn mistral() -> PathBuf {
    repo().join("assets/tiny-mistral/model")
}

fn cargo_trl(args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    let out = common::output_with_stdin(
        Command::new(BIN).current_dir(repo()).arg("trl").args(args),
        stdin.unwrap_or(""),
    );
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn rows(jsonl: &str) -> Vec<serde_json::Value> {
    jsonl
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The completion text of a conversational row.
fn completion(row: &serde_json::Value) -> String {
    row["completion"][0]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// What the library generates greedily for `prompt` with `max_new` tokens, decoded.
fn library(dir: &Path, prompt: &Prompt, max_new: usize) -> String {
    let model = AutoModelForCausalLM::from_pretrained(dir, DType::F32, &Device::Cpu).unwrap();
    let tok = TextTokenizer::from_dir(dir).unwrap();
    let ids = prompt.ids(&tok).unwrap();
    let n = ids.len();
    let input = Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
    let mut cfg = GenerationConfig::from_pretrained(dir).unwrap();
    cfg.max_new_tokens = max_new;
    cfg.eos_token_id = tok.eos_token_id.into_iter().collect();
    let out = model.generate(&input, &mask, &cfg).unwrap();
    let new = out.to_vec2::<u32>().unwrap()[0][n..].to_vec();
    let end = new
        .iter()
        .position(|t| Some(*t) == tok.eos_token_id)
        .unwrap_or(new.len());
    tok.decode(&new[..end], true).unwrap()
}

/// docs/generation.md's commands, as written, from the repository root (`cargo` finding
/// this `cargo-trl` first on PATH).
#[test]
fn the_docs_commands_run_as_written() {
    let doc = std::fs::read_to_string(repo().join("docs/generation.md")).unwrap();
    let lines: Vec<&str> = doc
        .lines()
        .filter(|l| l.contains("cargo trl generate") || l.contains("cargo trl chat"))
        .filter(|l| !l.starts_with('|') && !l.contains('`'))
        .collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap());
    let _ = std::fs::remove_file(repo().join("output/answers.jsonl"));
    for line in lines {
        let out = Command::new("sh")
            .args(["-c", line])
            .current_dir(repo())
            .env("PATH", &path)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{line}: {stderr}");
        if line.contains("--prompt") {
            let r = rows(&stdout);
            assert_eq!(r.len(), 1, "{stdout}");
            assert_eq!(r[0]["prompt"][0]["content"], "What is 2 + 3?");
        } else if line.contains("chat") {
            assert_eq!(stderr.matches(">>> ").count(), 3, "{stderr}");
        } else {
            let written = std::fs::read_to_string(repo().join("output/answers.jsonl")).unwrap();
            let r = rows(&written);
            assert_eq!(r.len(), 200, "one row per eval prompt");
            // The reference answer is left out of the prompt.
            assert_eq!(r[0]["prompt"].as_array().unwrap().len(), 1);
            assert!(
                stdout.contains("200 completions in output/answers.jsonl"),
                "{stdout}"
            );
        }
    }
    let _ = std::fs::remove_file(repo().join("output/answers.jsonl"));
}

/// Completions from prompts and from a dataset (batched, left-padded) equal the library's,
/// one prompt at a time.
#[test]
fn completions_are_the_librarys() {
    let dir = mistral();
    let (ok, out, err) = cargo_trl(
        &[
            "generate",
            dir.to_str().unwrap(),
            "--prompt",
            "What is 2 + 3?",
            "--prompt",
            "What is 10 + 77?",
            "--max_new_tokens",
            "10",
        ],
        None,
    );
    assert!(ok, "{err}");
    let r = rows(&out);
    for (row, p) in r.iter().zip(["What is 2 + 3?", "What is 10 + 77?"]) {
        let want = library(&dir, &Prompt::Messages(vec![Message::new("user", p)]), 10);
        assert_eq!(completion(row), want, "{p}");
        assert!(!want.trim().is_empty());
    }
    // Plain text, with --no_chat_template.
    let (ok, out, err) = cargo_trl(
        &[
            "generate",
            dir.to_str().unwrap(),
            "--prompt",
            "12 + 5 =",
            "--no_chat_template",
            "--max_new_tokens",
            "6",
        ],
        None,
    );
    assert!(ok, "{err}");
    let r = rows(&out);
    assert_eq!(r[0]["prompt"], "12 + 5 =");
    assert_eq!(
        r[0]["completion"].as_str().unwrap(),
        library(&dir, &Prompt::Text("12 + 5 =".into()), 6)
    );
}

/// A LoRA checkpoint generates with its adapter applied (unmerged): the merged model's
/// tokens, not the base's.
#[test]
fn a_lora_checkpoint_generates_as_its_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("lora");
    let base = mistral();
    let cmd = common::sft_launch(
        &["--num_processes", "1"],
        &[
            "--model_name_or_path",
            base.to_str().unwrap(),
            "--use_peft",
            "--lora_target_modules",
            "all-linear",
            "--learning_rate",
            "0.05",
        ],
    );
    common::run_launch(cmd, 3, 4, &out);
    let ckpt = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("adapter_config.json").is_file())
        .unwrap_or_else(|| out.clone());
    let merged = tmp.path().join("merged");
    let (ok, _, err) = cargo_trl(
        &[
            "merge",
            ckpt.to_str().unwrap(),
            "--output_dir",
            merged.to_str().unwrap(),
        ],
        None,
    );
    assert!(ok, "{err}");
    let ask = |dir: &Path| {
        let (ok, out, err) = cargo_trl(
            &[
                "generate",
                dir.to_str().unwrap(),
                "--prompt",
                "What is 31 + 4?",
                "--max_new_tokens",
                "12",
            ],
            None,
        );
        assert!(ok, "{err}");
        completion(&rows(&out)[0])
    };
    let (adapted, via_merge, plain) = (ask(&ckpt), ask(&merged), ask(&base));
    assert_eq!(adapted, via_merge, "the adapter applied is the merge");
    assert_ne!(adapted, plain, "the adapter changes what the base says");
}

/// Two chat turns: the second reply is what `generate` gives for the conversation so far
/// (the first reply included); `/clear` starts over.
#[test]
fn a_chat_goes_on_turn_by_turn() {
    let dir = mistral();
    let d = dir.to_str().unwrap();
    let (ok, out, err) = cargo_trl(
        &["chat", d, "--max_new_tokens", "8"],
        Some("What is 2 + 3?\nAnd 4 + 4?\n/clear\nAnd 4 + 4?\n"),
    );
    assert!(ok, "{err}");
    // Each reply streamed, then a newline.
    let user = |t: &str| Message::new("user", t);
    let first = library(&dir, &Prompt::Messages(vec![user("What is 2 + 3?")]), 8);
    let second = library(
        &dir,
        &Prompt::Messages(vec![
            user("What is 2 + 3?"),
            Message::new("assistant", first.as_str()),
            user("And 4 + 4?"),
        ]),
        8,
    );
    let fresh = library(&dir, &Prompt::Messages(vec![user("And 4 + 4?")]), 8);
    assert_ne!(first, second);
    assert_eq!(out, format!("{first}\n{second}\n{fresh}\n"));
}

/// Bad input is named: a checkpoint that is not there, no prompt, a right-sized but bad
/// setting.
#[test]
fn bad_input_is_named() {
    let (ok, _, err) = cargo_trl(&["generate", "no/such/dir", "--prompt", "hi"], None);
    assert!(!ok && err.contains("no/such/dir"), "{err}");
    let d = mistral();
    let (ok, _, err) = cargo_trl(&["generate", d.to_str().unwrap()], None);
    assert!(!ok && err.contains("--prompt"), "{err}");
    let (ok, _, err) = cargo_trl(
        &[
            "generate",
            d.to_str().unwrap(),
            "--prompt",
            "x",
            "--do_sample",
            "true",
            "--top_p",
            "1.5",
        ],
        None,
    );
    assert!(!ok && err.contains("top_p"), "{err}");
}

/// Without a generation_config.json the checkpoint's config.json names the EOS, as
/// transformers' `model.generation_config` takes it: a row stops at that token.
#[test]
fn config_json_names_the_eos_without_a_generation_config() {
    let tmp = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(mistral().join(f), tmp.path().join(f)).unwrap();
    }
    let prompt = "What is 10 + 77?";
    let generate = || {
        let args = [
            "generate",
            tmp.path().to_str().unwrap(),
            "--prompt",
            prompt,
            "--max_new_tokens",
            "10",
        ];
        let (ok, out, err) = cargo_trl(&args, None);
        assert!(ok, "{err}");
        completion(&rows(&out)[0])
    };
    let free = generate();
    // The first new token after the first that differs from those before it, as EOS.
    let model =
        AutoModelForCausalLM::from_pretrained(tmp.path(), DType::F32, &Device::Cpu).unwrap();
    let tok = TextTokenizer::from_dir(tmp.path()).unwrap();
    let ids = Prompt::Messages(vec![Message::new("user", prompt)]);
    let ids = ids.ids(&tok).unwrap();
    let n = ids.len();
    let input = Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
    let cfg = GenerationConfig {
        max_new_tokens: 10,
        ..GenerationConfig::default()
    };
    let out = model
        .generate(&input, &mask, &cfg)
        .unwrap()
        .to_vec2::<u32>()
        .unwrap();
    let new = &out[0][n..];
    let j = (1..new.len())
        .find(|&j| !new[..j].contains(&new[j]))
        .expect("a new token unlike those before it");
    let eos = new[j];
    let path = tmp.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["eos_token_id"] = eos.into();
    std::fs::write(&path, config.to_string()).unwrap();
    let stopped = generate();
    assert!(stopped.len() < free.len(), "{stopped:?} vs {free:?}");
    assert!(free.starts_with(&stopped), "{stopped:?} vs {free:?}");
}
