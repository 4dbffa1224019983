//! SFT datasets in TRL's formats, from JSONL or Parquet files (as HF datasets ships them):
//! `{"text"}` (language modeling), `{"prompt", "completion"}` (strings, or message lists for the
//! conversational form), `{"messages": [{"role", "content", ...}]}` (with a `tools` column of
//! function schemas, and messages keeping `tool_calls`, `name`, `reasoning_content` and any
//! other key for the chat template), and pre-tokenized `{"input_ids"}` (optionally with
//! `completion_mask`). A malformed row is reported with its
//! line number; [`OnBadRow`] decides between failing and skipping with a count.

use super::tokenize::{Message, TextTokenizer};
use super::Example;
use crate::error::{Error, Result};
use crate::nn::IGNORE_INDEX;
use serde_json::Value;
use std::io::BufRead;
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    Text(String),
    Messages(Vec<Message>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Text(String),
    PromptCompletion {
        prompt: Content,
        completion: Content,
        tools: Option<Vec<Value>>,
    },
    Messages {
        messages: Vec<Message>,
        tools: Option<Vec<Value>>,
    },
    Tokens {
        input_ids: Vec<u32>,
        completion_mask: Option<Vec<bool>>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnBadRow {
    Fail,
    Skip,
}

#[derive(Debug, Clone)]
pub struct Loaded<R = Record> {
    pub records: Vec<R>,
    /// (line number, what was wrong) of every skipped row.
    pub skipped: Vec<(usize, String)>,
}

fn messages(v: &Value, key: &str) -> std::result::Result<Vec<Message>, String> {
    let list = v
        .as_array()
        .ok_or_else(|| format!("`{key}` must be a list of {{\"role\", \"content\"}} objects"))?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let obj = m
                .as_object()
                .ok_or_else(|| format!("`{key}[{i}]` must be an object with role and content"))?;
            let role = obj
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("`{key}[{i}].role` is missing or not a string"))?;
            let content = match obj.get("content") {
                None | Some(Value::Null) if obj.contains_key("tool_calls") => None,
                Some(c @ (Value::String(_) | Value::Array(_))) => Some(c.clone()),
                _ => {
                    return Err(format!(
                        "`{key}[{i}].content` must be a string or a list of content blocks (it may be left out only beside tool_calls)"
                    ))
                }
            };
            // Columnar files carry every key in every message, null where unused.
            let fields = obj
                .iter()
                .filter(|(k, v)| *k != "role" && *k != "content" && !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            Ok(Message {
                role: role.to_string(),
                content,
                fields,
            })
        })
        .collect()
}

/// TRL's `tools` column: a list of function schemas (JSON objects, or JSON text of one).
pub(crate) fn tools(
    obj: &serde_json::Map<String, Value>,
) -> std::result::Result<Option<Vec<Value>>, String> {
    let Some(t) = obj.get("tools") else {
        return Ok(None);
    };
    let list = match t {
        Value::String(s) => serde_json::from_str::<Value>(s)
            .map_err(|e| format!("`tools` is text but not JSON: {e}"))?,
        other => other.clone(),
    };
    match list {
        Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => serde_json::from_str(&s)
                    .map_err(|e| format!("`tools[{i}]` is text but not JSON: {e}")),
                Value::Object(_) => Ok(item),
                _ => Err(format!("`tools[{i}]` must be a function schema object")),
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Some),
        _ => Err("`tools` must be a list of function schemas".into()),
    }
}

pub(crate) fn content(v: &Value, key: &str) -> std::result::Result<Content, String> {
    match v {
        Value::String(s) => Ok(Content::Text(s.clone())),
        Value::Array(_) => Ok(Content::Messages(messages(v, key)?)),
        _ => Err(format!("`{key}` must be a string or a list of messages")),
    }
}

/// A row's columns that hold a value: columnar files (Parquet) carry every column in every
/// row, null where unused.
pub(crate) fn columns(v: &Value) -> std::result::Result<serde_json::Map<String, Value>, String> {
    let obj = v.as_object().ok_or("a row must be a JSON object")?;
    Ok(obj
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect())
}

/// Recognises one row's format, language-modeling text in the `text` column.
pub fn parse_record(v: &Value) -> std::result::Result<Record, String> {
    parse_record_in(v, "text")
}

/// [`parse_record`] with language-modeling text in the column `text_field`. As TRL's SFT
/// tokenizes, pre-tokenized rows, messages and prompt-completion pairs come first; the text
/// column is read only from rows in none of those formats.
pub fn parse_record_in(v: &Value, text_field: &str) -> std::result::Result<Record, String> {
    let obj = columns(v)?;
    if let Some(ids) = obj.get("input_ids") {
        let input_ids = ids
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|x| x.as_u64().map(|n| n as u32))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or("`input_ids` must be a list of non-negative integers")?;
        let completion_mask = match obj.get("completion_mask") {
            None => None,
            Some(m) => {
                let mask = m
                    .as_array()
                    .and_then(|a| {
                        a.iter()
                            .map(|x| x.as_u64().map(|n| n != 0).or(x.as_bool()))
                            .collect::<Option<Vec<_>>>()
                    })
                    .ok_or("`completion_mask` must be a list of 0/1")?;
                if mask.len() != input_ids.len() {
                    return Err(format!(
                        "`completion_mask` has {} entries for {} input_ids",
                        mask.len(),
                        input_ids.len()
                    ));
                }
                Some(mask)
            }
        };
        return Ok(Record::Tokens {
            input_ids,
            completion_mask,
        });
    }
    if let Some(m) = obj.get("messages") {
        return Ok(Record::Messages {
            messages: messages(m, "messages")?,
            tools: tools(&obj)?,
        });
    }
    match (obj.get("prompt"), obj.get("completion")) {
        (Some(p), Some(c)) => {
            let (prompt, completion) = (content(p, "prompt")?, content(c, "completion")?);
            if matches!(prompt, Content::Text(_)) != matches!(completion, Content::Text(_)) {
                return Err(
                    "`prompt` and `completion` must both be strings or both message lists".into(),
                );
            }
            let tools = tools(&obj)?;
            return Ok(Record::PromptCompletion {
                prompt,
                completion,
                tools,
            });
        }
        (Some(_), None) => return Err("`prompt` without `completion`".into()),
        (None, Some(_)) => return Err("`completion` without `prompt`".into()),
        _ => {}
    }
    if let Some(t) = obj.get(text_field) {
        return t
            .as_str()
            .map(|s| Record::Text(s.to_string()))
            .ok_or_else(|| format!("`{text_field}` must be a string"));
    }
    let keys: Vec<&String> = obj.keys().collect();
    let text = match text_field {
        "text" => "text".to_string(),
        other => format!("{other} (dataset_text_field)"),
    };
    Err(format!(
        "no known format (keys {keys:?}): use {text}, prompt + completion, messages, or input_ids"
    ))
}

impl<R> Default for Loaded<R> {
    fn default() -> Self {
        Loaded {
            records: Vec::new(),
            skipped: Vec::new(),
        }
    }
}

/// Collects parsed rows under the bad-row policy; `unit` is "line" or "row" for messages.
struct Collector<'a, R> {
    path: &'a Path,
    unit: &'static str,
    on_bad: OnBadRow,
    out: Loaded<R>,
}

impl<R> Collector<'_, R> {
    fn add(&mut self, at: usize, parsed: std::result::Result<R, String>) -> Result<()> {
        match (parsed, self.on_bad) {
            (Ok(r), _) => self.out.records.push(r),
            (Err(why), OnBadRow::Skip) => self.out.skipped.push((at, why)),
            (Err(why), OnBadRow::Fail) => {
                return Err(Error::Config {
                    file: self.path.display().to_string(),
                    key: format!("{} {at}", self.unit),
                    message: format!("{why} (--skip_bad_rows true skips such rows, with a count)"),
                })
            }
        }
        Ok(())
    }

    fn finish(self) -> Loaded<R> {
        if let Some((first, why)) = self.out.skipped.first() {
            tracing::warn!(
                "{}: skipped {} bad row(s) (malformed, or nothing to train on), first at {} {first}: {why}",
                self.path.display(),
                self.out.skipped.len(),
                self.unit
            );
        }
        self.out
    }
}

fn open(path: &Path) -> Result<std::fs::File> {
    std::fs::File::open(path)
        .map_err(|e| Error::io(format!("cannot open dataset {}", path.display()), e))
}

/// Reads a JSONL file (one object per line; blank lines ignored).
pub fn load_jsonl(path: impl AsRef<Path>, on_bad: OnBadRow) -> Result<Loaded> {
    jsonl_rows(path.as_ref(), on_bad, &parse_record)
}

/// A JSONL file's rows, each read by `parse`.
fn jsonl_rows<R>(path: &Path, on_bad: OnBadRow, parse: RowParser<'_, R>) -> Result<Loaded<R>> {
    let mut rows = Collector {
        path,
        unit: "line",
        on_bad,
        out: Loaded::default(),
    };
    for (i, line) in std::io::BufReader::new(open(path)?).lines().enumerate() {
        let line = line.map_err(|e| Error::io(format!("{}: line {}", path.display(), i + 1), e))?;
        if line.trim().is_empty() {
            continue;
        }
        // serde_json places its error within the line it was given ("at line 1 column
        // 93"): the column is what is left to say.
        let parsed = serde_json::from_str::<Value>(&line)
            .map_err(|e| {
                format!(
                    "not valid JSON at column {}: {}",
                    e.column(),
                    json_reason(&e)
                )
            })
            .and_then(|v| parse(&v));
        rows.add(i + 1, parsed)?;
    }
    Ok(rows.finish())
}

/// serde_json's message without its position.
fn json_reason(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

/// Reads a Parquet file row by row; each row becomes the same JSON object a JSONL line would
/// be, so formats and errors are the same (rows are numbered from 1).
pub fn load_parquet(path: impl AsRef<Path>, on_bad: OnBadRow) -> Result<Loaded> {
    parquet_rows(path.as_ref(), on_bad, &parse_record)
}

/// A Parquet file's rows, each read by `parse`.
fn parquet_rows<R>(path: &Path, on_bad: OnBadRow, parse: RowParser<'_, R>) -> Result<Loaded<R>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let bad_file = |e: String| Error::Config {
        file: path.display().to_string(),
        key: "<parquet>".into(),
        message: e,
    };
    let reader = SerializedFileReader::new(open(path)?)
        .map_err(|e| bad_file(format!("not a readable Parquet file: {e}")))?;
    let mut rows = Collector {
        path,
        unit: "row",
        on_bad,
        out: Loaded::default(),
    };
    for (i, row) in reader
        .get_row_iter(None)
        .map_err(|e| bad_file(e.to_string()))?
        .enumerate()
    {
        let parsed = row
            .map_err(|e| format!("unreadable row: {e}"))
            .and_then(|r| parse(&r.to_json_value()));
        rows.add(i + 1, parsed)?;
    }
    Ok(rows.finish())
}

/// Reads one row of a dataset (a JSON object, or a Parquet row as one) into a record.
pub type RowParser<'a, R> = &'a dyn Fn(&Value) -> std::result::Result<R, String>;

pub use super::local_dir::Split;

/// Reads a dataset: a `.jsonl`/`.json` or `.parquet` file, or `split` of a local dataset
/// directory (as `datasets.load_dataset(DIR)` finds it, see [`super::local_dir`]).
pub fn load(path: impl AsRef<Path>, split: Split, on_bad: OnBadRow) -> Result<Loaded> {
    load_in(path, split, on_bad, "text")
}

/// [`load`] with language-modeling rows' text in the column `text_field` (TRL's
/// dataset_text_field).
pub fn load_in(
    path: impl AsRef<Path>,
    split: Split,
    on_bad: OnBadRow,
    text_field: &str,
) -> Result<Loaded> {
    load_rows(path.as_ref(), split, on_bad, &|v| {
        parse_record_in(v, text_field)
    })
}

/// A dataset's rows read by `parse` (another trainer's format): a file by its extension, or a
/// directory's split, its files in order.
pub fn load_rows<R>(
    path: &Path,
    split: Split,
    on_bad: OnBadRow,
    parse: RowParser<'_, R>,
) -> Result<Loaded<R>> {
    if !path.is_dir() {
        return file_rows(path, on_bad, parse);
    }
    let mut all = Loaded::default();
    for file in super::local_dir::split_files(path, split)? {
        let part = file_rows(&file, on_bad, parse)?;
        all.records.extend(part.records);
        all.skipped.extend(part.skipped);
    }
    Ok(all)
}

fn file_rows<R>(path: &Path, on_bad: OnBadRow, parse: RowParser<'_, R>) -> Result<Loaded<R>> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("parquet") => parquet_rows(path, on_bad, parse),
        Some("jsonl") | Some("json") => jsonl_rows(path, on_bad, parse),
        _ => Err(Error::Config {
            file: path.display().to_string(),
            key: "<file>".into(),
            message: "unknown dataset format: use a .jsonl (one JSON object per line) or \
                      .parquet file, or a dataset directory holding them"
                .into(),
        }),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizeOptions {
    /// Loss on the completion only (TRL's default for prompt-completion data).
    pub completion_only_loss: bool,
    /// Loss on `{% generation %}` spans only (conversational data).
    pub assistant_only_loss: bool,
}

impl TokenizeOptions {
    /// Why `record` would give no token to train on under these options (None: it gives
    /// some), known from its structure: no conversation, no assistant turn under
    /// assistant_only_loss, an empty completion, a completion mask with nothing in it. Row
    /// parsers check it so that such a row is named by its file and line, and skipped with
    /// the others under skip_bad_rows.
    pub fn untrainable(&self, record: &Record) -> Option<String> {
        let empty = |c: &Content| match c {
            Content::Text(t) => t.is_empty(),
            Content::Messages(m) => m.is_empty(),
        };
        match record {
            Record::Text(t) if t.is_empty() => Some("empty text: nothing to train on".into()),
            Record::Messages { messages, .. } if messages.is_empty() => {
                Some("`messages` is empty: nothing to train on".into())
            }
            Record::Messages { messages, .. }
                if self.assistant_only_loss && !messages.iter().any(|m| m.role == "assistant") =>
            {
                Some("no assistant message: assistant_only_loss trains on assistant turns only, so this row has nothing to train on".into())
            }
            Record::PromptCompletion { completion, .. } if empty(completion) => {
                Some("the completion is empty: nothing to train on".into())
            }
            Record::Tokens {
                completion_mask: Some(mask),
                ..
            } if !mask.iter().any(|&m| m) => {
                Some("`completion_mask` marks no token: nothing to train on".into())
            }
            Record::Tokens { input_ids, .. } if input_ids.is_empty() => {
                Some("`input_ids` is empty: nothing to train on".into())
            }
            _ => None,
        }
    }
}

impl Default for TokenizeOptions {
    fn default() -> Self {
        TokenizeOptions {
            completion_only_loss: true,
            assistant_only_loss: false,
        }
    }
}

fn with_eos(tok: &TextTokenizer, mut ids: Vec<u32>) -> Vec<u32> {
    if let Some(eos) = tok.eos_token_id {
        if ids.last() != Some(&eos) {
            ids.push(eos);
        }
    }
    ids
}

/// A record as a training example, the way TRL's SFTTrainer prepares it: EOS appended to text
/// and completions, prompt tokens masked under `completion_only_loss`, chat templates applied
/// to conversational rows.
pub fn to_example(record: &Record, tok: &TextTokenizer, opts: TokenizeOptions) -> Result<Example> {
    match record {
        Record::Text(t) => Ok(Example::full(with_eos(tok, tok.encode(t, false)?))),
        Record::Messages { messages, tools } => {
            tok.tokenize_chat(messages, tools.as_deref(), opts.assistant_only_loss)
        }
        Record::Tokens {
            input_ids,
            completion_mask,
        } => {
            let labels = match completion_mask {
                Some(mask) if opts.completion_only_loss => input_ids
                    .iter()
                    .zip(mask)
                    .map(|(&t, &m)| if m { t as i64 } else { IGNORE_INDEX })
                    .collect(),
                _ => input_ids.iter().map(|&t| t as i64).collect(),
            };
            Ok(Example {
                input_ids: input_ids.clone(),
                labels,
            })
        }
        Record::PromptCompletion {
            prompt,
            completion,
            tools,
        } => {
            let (prompt_ids, full_ids) = match (prompt, completion) {
                (Content::Text(p), Content::Text(c)) => {
                    let p_ids = tok.encode(p, false)?;
                    let full = with_eos(tok, tok.encode(&format!("{p}{c}"), false)?);
                    (p_ids, full)
                }
                (Content::Messages(p), Content::Messages(c)) => {
                    let tools = tools.as_deref();
                    let p_text = tok.apply_chat_template(p, tools, true)?.text;
                    let all: Vec<Message> = p.iter().chain(c).cloned().collect();
                    let full_text = tok.apply_chat_template(&all, tools, false)?.text;
                    (tok.encode(&p_text, false)?, tok.encode(&full_text, false)?)
                }
                _ => unreachable!("parse_record rejects mixed prompt/completion kinds"),
            };
            // Tokens of the prompt that survive as a prefix of the full sequence are masked.
            let shared = prompt_ids
                .iter()
                .zip(&full_ids)
                .take_while(|(a, b)| a == b)
                .count();
            let labels = full_ids
                .iter()
                .enumerate()
                .map(|(i, &t)| {
                    if opts.completion_only_loss && i < shared {
                        IGNORE_INDEX
                    } else {
                        t as i64
                    }
                })
                .collect();
            Ok(Example {
                input_ids: full_ids,
                labels,
            })
        }
    }
}
