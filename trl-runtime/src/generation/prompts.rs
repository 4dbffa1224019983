//! Prompts to generate from, as TRL's datasets hold them: a `prompt` column (text, or a
//! conversation's messages), or a `messages` conversation (its last assistant turn, the
//! reference answer, left out), or language-modeling `text`. Conversations go through the
//! tokenizer's chat template with the generation prompt, as TRL's trainers render them.

use crate::data::dataset::{load_rows, Content, OnBadRow};
use crate::data::local_dir::Split;
use crate::data::{Message, TextTokenizer};
use crate::error::Result;
use serde_json::Value;
use std::path::Path;

/// A prompt: text, or the messages of a conversation so far.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Messages(Vec<Message>),
}

impl Prompt {
    /// Its tokens: text as the tokenizer encodes it (its special tokens added, as
    /// `tokenizer(text)`), a conversation rendered by the chat template with the generation
    /// prompt (whose text holds the special tokens already).
    pub fn ids(&self, tok: &TextTokenizer) -> Result<Vec<u32>> {
        match self {
            Prompt::Text(t) => tok.encode(t, true),
            Prompt::Messages(m) => {
                let chat = tok.apply_chat_template(m, None, true)?;
                tok.encode(&chat.text, false)
            }
        }
    }

    /// The row a generation writes: TRL's prompt-completion format, the completion as the
    /// prompt is (text, or one assistant message).
    pub fn with_completion(&self, completion: &str) -> Value {
        match self {
            Prompt::Text(t) => serde_json::json!({"prompt": t, "completion": completion}),
            Prompt::Messages(m) => serde_json::json!({
                "prompt": m.iter().map(Message::for_template).collect::<Vec<_>>(),
                "completion": [{"role": "assistant", "content": completion}],
            }),
        }
    }
}

/// One row's prompt (see the module docs).
fn parse(v: &Value) -> std::result::Result<Prompt, String> {
    let row = crate::data::dataset::columns(v)?;
    if let Some(p) = row.get("prompt") {
        return Ok(match crate::data::dataset::content(p, "prompt")? {
            Content::Text(t) => Prompt::Text(t),
            Content::Messages(m) => Prompt::Messages(m),
        });
    }
    if let Some(m) = row.get("messages") {
        let Content::Messages(mut m) = crate::data::dataset::content(m, "messages")? else {
            return Err("`messages` must be a list of messages".into());
        };
        if m.last().is_some_and(|x| x.role == "assistant") {
            m.pop();
        }
        if m.is_empty() {
            return Err("`messages` has no turn before its answer".into());
        }
        return Ok(Prompt::Messages(m));
    }
    match row.get("text") {
        Some(Value::String(t)) => Ok(Prompt::Text(t.clone())),
        _ => Err("no `prompt`, `messages` or `text` column to generate from".into()),
    }
}

/// The prompts of a dataset file (`.jsonl`, `.json`, `.parquet`) or directory (its train
/// split); a row without one is an error naming its file and line.
pub fn load_prompts(path: &Path) -> Result<Vec<Prompt>> {
    Ok(load_rows(path, Split::TRAIN, OnBadRow::Fail, &parse)?.records)
}
