//! Tokenizer and chat template of an HF model directory: `tokenizer.json` through the
//! `tokenizers` crate, the chat template from `tokenizer_config.json` (or `chat_template.jinja`)
//! rendered with minijinja plus the Python string methods HF templates use.
//!
//! `{% generation %}...{% endgeneration %}` (HF's marker for assistant-only loss) is rewritten
//! into invisible marker characters before rendering; after rendering they give the byte
//! spans of generated text, which become token masks through the tokenizer's offsets.

use super::Example;
use crate::error::{Error, Result};
use crate::nn::IGNORE_INDEX;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Token ids and the byte range of `text` each one covers.
pub type Encoded = (Vec<u32>, Vec<(usize, usize)>);

/// The files of a model directory that make its tokenizer (tokenizer.json is what is read
/// here; the others travel with it so that transformers finds what it looks for).
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// A vision-language model's processor files (gemma-3-4b's, Qwen3-VL's), copied with the tokenizer's so
/// that a checkpoint of it opens with AutoProcessor as the model it came from.
pub const PROCESSOR_FILES: &[&str] = &[
    "added_tokens.json",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
];

/// A model directory's generation settings (stop tokens, sampling defaults).
const GENERATION_CONFIG: &str = "generation_config.json";

const GEN_START: char = '\u{E000}';
const GEN_END: char = '\u{E001}';

/// One chat message as datasets and transformers carry it: a role, content (a string, a list
/// of content blocks, or absent for an assistant turn that only calls tools), and every other
/// key kept as it is (`tool_calls`, a tool message's `name` and `tool_call_id`,
/// `reasoning_content`, ...), for the template to read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<serde_json::Value>,
    #[serde(flatten)]
    pub fields: serde_json::Map<String, serde_json::Value>,
}

impl Message {
    /// A message with text content and nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: Some(content.into().into()),
            fields: Default::default(),
        }
    }

    /// The text of the content: the string, or the `text` of its text blocks joined.
    pub fn text(&self) -> String {
        match &self.content {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(blocks)) => blocks
                .iter()
                .filter_map(|b| b.get("text").and_then(|t| t.as_str()))
                .collect(),
            _ => String::new(),
        }
    }

    /// As transformers hands it to a template: keys whose value is null dropped, and the
    /// reasoning under every name templates read (`reasoning_content`, and `thinking` for
    /// gpt-oss), taken from whichever of `reasoning_content`, `thinking`, `reasoning` is set.
    pub fn for_template(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        m.insert("role".into(), self.role.clone().into());
        if let Some(c) = self.content.as_ref().filter(|c| !c.is_null()) {
            m.insert("content".into(), c.clone());
        }
        for (k, v) in &self.fields {
            if !v.is_null() {
                m.insert(k.clone(), v.clone());
            }
        }
        let reasoning = ["reasoning_content", "thinking", "reasoning"]
            .iter()
            .find_map(|k| m.get(*k).cloned());
        if let Some(r) = reasoning {
            // Python: {"thinking": r, **message, "reasoning_content": r}
            let mut out = serde_json::Map::new();
            out.insert("thinking".into(), r.clone());
            for (k, v) in m {
                out.insert(k, v);
            }
            out.insert("reasoning_content".into(), r);
            return out.into();
        }
        m.into()
    }
}

/// Rendered chat text and the byte ranges the template marked as generated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    pub text: String,
    pub generation_spans: Vec<Range<usize>>,
}

pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    template_source: PathBuf,
    /// transformers' `special_tokens_map`: the special tokens tokenizer_config.json names,
    /// which every template sees as variables (`bos_token`, `eos_token`, ...).
    special_tokens: Vec<(&'static str, String)>,
    /// The chat template compiled in [`template_env`], or why it does not compile.
    compiled: std::sync::OnceLock<std::result::Result<minijinja::Environment<'static>, String>>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: u32,
    /// The model directory it was read from: its files go into every checkpoint.
    dir: PathBuf,
    /// Whether the eos token and the chat template were changed since it was read
    /// ([`Self::with_eos_token`], [`Self::with_chat_template`]): checkpoints carry the changes.
    changed_eos: bool,
    changed_template: bool,
}

fn config_error(file: &Path, key: &str, message: impl Into<String>) -> Error {
    Error::Config {
        file: file.display().to_string(),
        key: key.into(),
        message: message.into(),
    }
}

/// A special token in tokenizer_config.json: a string or an AddedToken object with `content`.
fn token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (with any whitespace control) into
/// expressions that print the marker characters.
fn rewrite_generation_tags(template: &str) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start..start + len + 2];
        let inner = tag[2..tag.len() - 2].trim_matches('-').trim();
        let marker = match inner {
            "generation" => Some(GEN_START),
            "endgeneration" => Some(GEN_END),
            _ => None,
        };
        out.push_str(&rest[..start]);
        match marker {
            Some(m) => {
                let left = if tag.starts_with("{%-") { "-" } else { "" };
                let right = if tag.ends_with("-%}") { "-" } else { "" };
                out.push_str(&format!("{{{{{left} \"\\u{:04X}\" {right}}}}}", m as u32));
            }
            None => out.push_str(tag),
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// The time for `strftime_now` as Python's `datetime.now().strftime` writes it (UTC here), or
/// SOURCE_DATE_EPOCH's when set (reproducible renders, the fixture's pinned date).
fn strftime_now(format: String) -> String {
    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .unwrap_or_else(|| chrono::Utc::now().timestamp());
    strftime(&format, secs)
}

/// chrono's strftime, with codes it does not know kept as written (as Python's strftime keeps
/// them) instead of failing.
fn strftime(format: &str, secs: i64) -> String {
    use chrono::format::{Item, StrftimeItems};
    let known = |code: char| !StrftimeItems::new(&format!("%{code}")).any(|i| i == Item::Error);
    let mut escaped = String::with_capacity(format.len() + 4);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            escaped.push(c);
            continue;
        }
        match chars.next() {
            Some(code) => {
                escaped.push_str(if known(code) { "%" } else { "%%" });
                escaped.push(code);
            }
            None => escaped.push_str("%%"),
        }
    }
    chrono::DateTime::from_timestamp(secs, 0)
        .unwrap_or_default()
        .format(&escaped)
        .to_string()
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, with no HTML escaping (Jinja's own filter escapes).
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let indent = match kwargs.get::<Option<minijinja::Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v.as_i64().unwrap_or(0)).unwrap_or(0))),
        },
    };
    let separators = match kwargs.get::<Option<minijinja::Value>>("separators")? {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let items: Vec<String> = v
                .try_iter()?
                .map(|s| s.as_str().unwrap_or_default().to_string())
                .collect();
            match items.as_slice() {
                [item, key] => (item.clone(), key.clone()),
                _ => {
                    return Err(minijinja::Error::new(
                        minijinja::ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair (item, key)",
                    ))
                }
            }
        }
        // Python's defaults: no space before a newline when indenting.
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let mut out = String::new();
    let opts = PyJson {
        ensure_ascii,
        sort_keys,
        indent,
        item_sep: separators.0,
        key_sep: separators.1,
    };
    opts.write(&json, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

/// Python's json.dumps layout.
struct PyJson {
    ensure_ascii: bool,
    sort_keys: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
}

impl PyJson {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => match n.as_f64() {
                Some(f) if !n.is_i64() && !n.is_u64() => out.push_str(&py_float(f)),
                _ => out.push_str(&n.to_string()),
            },
            J::String(s) => self.string(s, out),
            J::Array(items) if items.is_empty() => out.push_str("[]"),
            J::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            J::Object(map) if map.is_empty() => out.push_str("{}"),
            J::Object(map) => {
                let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key_sep);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{:04x}", u));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// What Python's `str()` gives for a value, as Jinja2 prints it: `None`, `True`, `3.0`, and
/// lists and dicts in Python's repr (`[{'type': 'text'}]`); strings as they are.
fn py_str(v: &minijinja::Value) -> Option<String> {
    use minijinja::value::ValueKind as K;
    match v.kind() {
        K::String | K::Undefined => None,
        K::None | K::Bool | K::Seq | K::Map => Some(py_repr(v)),
        K::Number if !v.is_integer() => Some(py_repr(v)),
        _ => None,
    }
}

/// Python's `repr()` of a template value.
fn py_repr(v: &minijinja::Value) -> String {
    use minijinja::value::ValueKind as K;
    match v.kind() {
        K::None | K::Undefined => "None".into(),
        K::Bool => if v.is_true() { "True" } else { "False" }.into(),
        K::Number if v.is_integer() => v.to_string(),
        K::Number => {
            let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
            match py_float(f).as_str() {
                "NaN" => "nan".into(),
                "Infinity" => "inf".into(),
                "-Infinity" => "-inf".into(),
                s => s.into(),
            }
        }
        K::String => py_repr_str(v.as_str().unwrap_or_default()),
        K::Map => {
            let items: Vec<String> = v
                .try_iter()
                .into_iter()
                .flatten()
                .map(|k| {
                    let item = v.get_item(&k).unwrap_or_default();
                    format!("{}: {}", py_repr(&k), py_repr(&item))
                })
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        K::Seq | K::Iterable => {
            let items: Vec<String> = v
                .try_iter()
                .into_iter()
                .flatten()
                .map(|x| py_repr(&x))
                .collect();
            format!("[{}]", items.join(", "))
        }
        _ => v.to_string(),
    }
}

/// Python's repr of a string: single quotes unless it holds one and no double quote.
fn py_repr_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// A float as Python's repr writes it: shortest digits, exponent form below 1e-4 and from
/// 1e16 on (`1e-05`, `1e+16`), otherwise fixed with at least one decimal (`3.0`).
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}"); // shortest round-trip digits: "-1.2345e-5"
    let (mantissa, exp) = sci.split_once('e').expect("LowerExp has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    if (-4..16).contains(&exp) {
        let s = f.to_string();
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// transformers' Jinja environment for chat templates: trim_blocks and lstrip_blocks, its
/// own tojson, raise_exception and strftime_now, values printed as Python's str(), loop
/// controls and Python's string methods.
fn template_env() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_filter("tojson", tojson);
    // Printed values and `|string` as Python's str(): None, True, [{'a': 1}].
    env.set_formatter(|out, state, value| match py_str(value) {
        Some(s) => out
            .write_str(&s)
            .map_err(|_| minijinja::Error::new(minijinja::ErrorKind::WriteFailure, "cannot write")),
        None => minijinja::escape_formatter(out, state, value),
    });
    env.add_filter("string", |v: minijinja::Value| match py_str(&v) {
        Some(s) => minijinja::Value::from(s),
        None if v.is_undefined() => minijinja::Value::from(""),
        None => minijinja::Value::from(v.to_string()),
    });
    env.add_filter(
        "trim",
        |v: minijinja::Value, chars: Option<String>| -> String {
            let text = py_str(&v).unwrap_or_else(|| v.to_string());
            match chars {
                Some(c) => text.trim_matches(|x| c.contains(x)).to_string(),
                None => text.trim().to_string(),
            }
        },
    );
    // Jinja2: None is not iterable (minijinja iterates it as empty); undefined is.
    env.add_test("iterable", |v: minijinja::Value| {
        use minijinja::value::ValueKind as K;
        matches!(
            v.kind(),
            K::Undefined | K::String | K::Seq | K::Map | K::Iterable
        )
    });
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_function("strftime_now", strftime_now);
    env
}

/// Edits the JSON object in `path` with `f` and writes it back; a missing file is an empty
/// object when `create`, else left missing, and a file that is no JSON object is left as it is
/// (a checkpoint's copy of the model's own).
fn edit_json(
    path: &Path,
    create: bool,
    f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> Result<()> {
    let mut obj = match std::fs::read_to_string(path) {
        Ok(text) => match serde_json::from_str(&text) {
            Ok(serde_json::Value::Object(obj)) => obj,
            _ => return Ok(()),
        },
        Err(_) if create => Default::default(),
        Err(_) => return Ok(()),
    };
    f(&mut obj);
    let text = serde_json::to_string_pretty(&obj).expect("JSON values serialize");
    std::fs::write(path, text).map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}

impl TextTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` (and `chat_template.jinja` if present)
    /// from a model directory.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.exists() {
            return Err(config_error(
                &tok_path,
                "<file>",
                "not found: a model directory needs tokenizer.json (and tokenizer_config.json for the chat template)",
            ));
        }
        let inner = tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| {
            config_error(
                &tok_path,
                "<document>",
                format!("not a valid tokenizer: {e}"),
            )
        })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path)
                .map_err(|e| Error::io(format!("cannot read {}", cfg_path.display()), e))?;
            serde_json::from_str(&text).map_err(|e| {
                config_error(&cfg_path, "<document>", format!("not valid JSON: {e}"))
            })?
        } else {
            serde_json::Value::Object(Default::default())
        };
        let jinja_path = dir.join("chat_template.jinja");
        let (chat_template, template_source) = if jinja_path.exists() {
            let t = std::fs::read_to_string(&jinja_path)
                .map_err(|e| Error::io(format!("cannot read {}", jinja_path.display()), e))?;
            (Some(t), jinja_path)
        } else {
            let t = match cfg.get("chat_template") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // A list of named templates: take "default".
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| {
                        t.get("template")
                            .and_then(|t| t.as_str())
                            .map(str::to_string)
                    }),
                Some(_) => {
                    return Err(config_error(
                        &cfg_path,
                        "chat_template",
                        "expected a string or a list of {name, template}",
                    ))
                }
            };
            (t, cfg_path.clone())
        };
        let special_tokens = [
            "bos_token",
            "eos_token",
            "unk_token",
            "sep_token",
            "pad_token",
            "cls_token",
            "mask_token",
        ]
        .into_iter()
        .filter_map(|k| Some((k, token_text(cfg.get(k))?)))
        .collect();
        let bos_token = token_text(cfg.get("bos_token"));
        let eos_token = token_text(cfg.get("eos_token"));
        let pad_token = token_text(cfg.get("pad_token"));
        let eos_token_id = eos_token.as_deref().and_then(|t| inner.token_to_id(t));
        if let (Some(t), None) = (&eos_token, eos_token_id) {
            return Err(config_error(
                &cfg_path,
                "eos_token",
                format!("'{t}' is not in the vocabulary of tokenizer.json"),
            ));
        }
        let pad_token_id = pad_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or(eos_token_id)
            .unwrap_or(0);
        Ok(TextTokenizer {
            inner,
            chat_template,
            template_source,
            special_tokens,
            compiled: std::sync::OnceLock::new(),
            bos_token,
            eos_token,
            eos_token_id,
            pad_token_id,
            dir: dir.to_path_buf(),
            changed_eos: false,
            changed_template: false,
        })
    }

    /// The same tokenizer with another chat template (`source` names it in errors).
    pub fn with_chat_template(mut self, template: String, source: PathBuf) -> Self {
        self.changed_template = true;
        self.chat_template = Some(template);
        self.template_source = source;
        self.compiled = std::sync::OnceLock::new();
        self
    }

    /// The same tokenizer ending sequences with `token` (TRL's SFTConfig.eos_token): the id
    /// appended to text and completions, generation's stop, the templates' `eos_token`, and
    /// the padding where the tokenizer names no pad token. Err: why it cannot.
    pub fn with_eos_token(mut self, token: &str) -> std::result::Result<Self, String> {
        let id = self.inner.token_to_id(token).ok_or_else(|| {
            format!("'{token}' is not in the vocabulary of the tokenizer: name a token it has")
        })?;
        if !self.special_tokens.iter().any(|(k, _)| *k == "pad_token") {
            self.pad_token_id = id;
        }
        self.special_tokens.retain(|(k, _)| *k != "eos_token");
        self.special_tokens.push(("eos_token", token.to_string()));
        self.eos_token = Some(token.to_string());
        self.eos_token_id = Some(id);
        self.compiled = std::sync::OnceLock::new();
        self.changed_eos = true;
        Ok(self)
    }

    /// The chat template at `path` (TRL's SFTConfig.chat_template_path): a `.jinja` / `.j2`
    /// file, or a tokenizer directory whose template and end-of-sequence token are taken, as
    /// TRL's `clone_chat_template` does. Tokens that directory adds and this vocabulary lacks
    /// would need new embedding rows, which are not made here: Err says so.
    pub fn with_chat_template_from(self, path: &Path) -> std::result::Result<Self, String> {
        let is_jinja = matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("jinja" | "j2")
        );
        if path.is_file() && is_jinja {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            return Ok(self.with_chat_template(text, path.to_path_buf()));
        }
        if !path.is_dir() {
            return Err(format!(
                "{} is neither a .jinja / .j2 file nor a tokenizer directory (hub names are not \
                 fetched here: download it first)",
                path.display()
            ));
        }
        let source = TextTokenizer::from_dir(path).map_err(|e| e.to_string())?;
        let Some(template) = source.chat_template.clone() else {
            return Err(format!("{} has no chat template", path.display()));
        };
        let mut missing: Vec<String> = source
            .inner
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .filter(|t| self.inner.token_to_id(t).is_none())
            .collect();
        if !missing.is_empty() {
            missing.sort();
            return Err(format!(
                "its tokens {missing:?} are not in this model's vocabulary; adding them (TRL \
                 resizes the embeddings) is not supported here: use a template that needs none"
            ));
        }
        let source_eos = source.eos_token.clone();
        let this = self.with_chat_template(template, source.template_source);
        match source_eos {
            Some(eos) => this.with_eos_token(&eos),
            None => Ok(this),
        }
    }

    /// A model's config.json text with this tokenizer's end-of-sequence id where
    /// [`Self::with_eos_token`] changed it (top level and `text_config`), as TRL mirrors it
    /// into the model's config so that generation stops there too.
    pub fn model_config<'a>(&self, config_json: &'a str) -> std::borrow::Cow<'a, str> {
        let (true, Some(id)) = (self.changed_eos, self.eos_token_id) else {
            return config_json.into();
        };
        let Ok(serde_json::Value::Object(mut cfg)) = serde_json::from_str(config_json) else {
            return config_json.into();
        };
        cfg.insert("eos_token_id".into(), id.into());
        if let Some(serde_json::Value::Object(text)) = cfg.get_mut("text_config") {
            text.insert("eos_token_id".into(), id.into());
        }
        serde_json::to_string_pretty(&cfg)
            .expect("JSON values serialize")
            .into()
    }

    /// The tokenizer files of the model directory into `to` (a checkpoint), and its
    /// generation_config.json, with the settings changed since it was read
    /// ([`Self::with_eos_token`], [`Self::with_chat_template`]) written into them, so that
    /// transformers loads the tokenizer that was trained with and generation stops at its eos.
    pub fn copy_files(&self, to: &Path) -> Result<()> {
        let files = TOKENIZER_FILES.iter().chain(PROCESSOR_FILES);
        for f in files.chain(&[GENERATION_CONFIG]) {
            let src = self.dir.join(f);
            if src.exists() {
                std::fs::copy(&src, to.join(f))
                    .map_err(|e| Error::io(format!("cannot copy {}", src.display()), e))?;
            }
        }
        if let Some(template) = self
            .chat_template
            .as_ref()
            .filter(|_| self.changed_template)
        {
            // A processor's own copy (AutoProcessor reads it) says the same.
            let processor = to.join("chat_template.json");
            if processor.exists() {
                let json = serde_json::json!({ "chat_template": template });
                std::fs::write(&processor, json.to_string())
                    .map_err(|e| Error::io(format!("cannot write {}", processor.display()), e))?;
            }
            // transformers reads chat_template.jinja before tokenizer_config.json's template.
            let jinja = to.join("chat_template.jinja");
            match jinja.exists() {
                true => std::fs::write(&jinja, template)
                    .map_err(|e| Error::io(format!("cannot write {}", jinja.display()), e))?,
                false => edit_json(&to.join("tokenizer_config.json"), true, |c| {
                    c.insert("chat_template".into(), template.as_str().into());
                })?,
            }
        }
        let (true, Some(token), Some(id)) = (self.changed_eos, &self.eos_token, self.eos_token_id)
        else {
            return Ok(());
        };
        for (name, create) in [
            ("tokenizer_config.json", true),
            ("special_tokens_map.json", false),
        ] {
            edit_json(&to.join(name), create, |c| {
                c.insert("eos_token".into(), token.as_str().into());
            })?;
        }
        // TRL adds a changed eos to the generation config's stop tokens, ahead of the others.
        edit_json(&to.join(GENERATION_CONFIG), false, |c| {
            let mut ids = match c.remove("eos_token_id") {
                Some(serde_json::Value::Array(ids)) => ids,
                Some(serde_json::Value::Null) | None => Vec::new(),
                Some(one) => vec![one],
            };
            if !ids.iter().any(|v| v.as_u64() == Some(u64::from(id))) {
                ids.insert(0, id.into());
            }
            c.insert("eos_token_id".into(), ids.into());
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids and their byte offsets in `text`.
    pub fn encode_with_offsets(&self, text: &str, add_special_tokens: bool) -> Result<Encoded> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| {
            Error::Candle(candle_core::Error::Msg(format!("tokenization failed: {e}")))
        })?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.encode_with_offsets(text, add_special_tokens)?.0)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Candle(candle_core::Error::Msg(format!("decoding failed: {e}"))))
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders `messages` (and the `tools` schemas, TRL's `tools` column) with the chat
    /// template as transformers' `apply_chat_template` does, returning the text and the byte
    /// spans of `{% generation %}` blocks.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<RenderedChat> {
        let source = self.template_source.display().to_string();
        let template = self.chat_template.as_deref().ok_or_else(|| Error::Config {
            file: source.clone(),
            key: "chat_template".into(),
            message: "this tokenizer has no chat template: conversational data needs one (add chat_template to tokenizer_config.json)".into(),
        })?;
        let template_error = |message: String| Error::Config {
            file: source.clone(),
            key: "chat_template".into(),
            message,
        };
        // Compiled once per tokenizer, not per conversation.
        let env = self
            .compiled
            .get_or_init(|| {
                let mut env = template_env();
                // Jinja2 reads every newline of a template as "\n" (its newline_sequence).
                let template = template.replace("\r\n", "\n").replace('\r', "\n");
                env.add_template_owned("chat", rewrite_generation_tags(&template))
                    .map_err(|e| format!("template error: {e}"))?;
                Ok(env)
            })
            .as_ref()
            .map_err(|m| template_error(m.clone()))?;
        let messages: Vec<serde_json::Value> = messages.iter().map(Message::for_template).collect();
        let mut ctx: std::collections::BTreeMap<&str, minijinja::Value> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (*k, minijinja::Value::from(v.as_str())))
            .collect();
        ctx.insert("messages", minijinja::Value::from_serialize(&messages));
        ctx.insert("tools", minijinja::Value::from_serialize(tools));
        ctx.insert("documents", minijinja::Value::from(()));
        ctx.insert(
            "add_generation_prompt",
            minijinja::Value::from(add_generation_prompt),
        );
        let raw = env
            .get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| template_error(format!("template error: {e}")))?;
        let mut text = String::with_capacity(raw.len());
        let mut spans = Vec::new();
        let mut open: Option<usize> = None;
        for c in raw.chars() {
            match c {
                GEN_START => open = Some(text.len()),
                GEN_END => {
                    if let Some(start) = open.take() {
                        spans.push(start..text.len());
                    }
                }
                _ => text.push(c),
            }
        }
        Ok(RenderedChat {
            text,
            generation_spans: spans,
        })
    }

    /// A conversation as a training example. With `assistant_only_loss`, only tokens inside
    /// `{% generation %}` blocks are targets (an error if the template has none).
    pub fn tokenize_chat(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        assistant_only_loss: bool,
    ) -> Result<Example> {
        let chat = self.apply_chat_template(messages, tools, false)?;
        let (ids, offsets) = self.encode_with_offsets(&chat.text, false)?;
        let labels = if assistant_only_loss {
            if chat.generation_spans.is_empty() {
                return Err(Error::Config {
                    file: self.template_source.display().to_string(),
                    key: "chat_template".into(),
                    message: "assistant_only_loss needs {% generation %} ... {% endgeneration %} around assistant replies in the chat template".into(),
                });
            }
            let mask = assistant_mask(&chat, &offsets);
            ids.iter()
                .zip(mask)
                .map(|(&id, m)| if m { id as i64 } else { IGNORE_INDEX })
                .collect()
        } else {
            ids.iter().map(|&t| t as i64).collect()
        };
        Ok(Example {
            input_ids: ids,
            labels,
        })
    }
}

/// Which tokens are generated text, exactly as transformers' `return_assistant_tokens_mask`
/// computes it (the mask TRL trains on): for each `{% generation %}` span, the tokens from the
/// first one holding its first character to the first one holding its last character. A
/// character split over several byte-level tokens at a span's end thus counts only its first
/// token, as there.
fn assistant_mask(chat: &RenderedChat, offsets: &[(usize, usize)]) -> Vec<bool> {
    let mut mask = vec![false; offsets.len()];
    let token_at = |byte: usize| offsets.iter().position(|&(s, e)| s <= byte && byte < e);
    for span in &chat.generation_spans {
        if span.is_empty() {
            continue;
        }
        // The first byte of the span's last character.
        let last = (span.start..span.end)
            .rev()
            .find(|&b| chat.text.is_char_boundary(b))
            .unwrap_or(span.start);
        let Some(first) = token_at(span.start) else {
            // transformers stops at a span it cannot place (truncated text).
            break;
        };
        let end = token_at(last).map_or(offsets.len(), |t| t + 1);
        for m in mask.iter_mut().take(end).skip(first) {
            *m = true;
        }
    }
    mask
}

/// Trains a byte-level BPE tokenizer (Qwen style: digits split one by one) on `texts`, with `special_tokens`
/// added first (ids 0..). For bundled assets and tests: nothing is downloaded.
pub fn train_bpe(
    texts: &[String],
    vocab_size: usize,
    special_tokens: &[&str],
) -> Result<tokenizers::Tokenizer> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{
        AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
        TokenizerImpl,
    };
    let fail = |e: tokenizers::Error| {
        Error::Candle(candle_core::Error::Msg(format!(
            "tokenizer training failed: {e}"
        )))
    };
    let specials: Vec<AddedToken> = special_tokens
        .iter()
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok: TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerImpl::new(BPE::default());
    // Digits split one by one before byte-level BPE, as Qwen2 and Llama 3 tokenizers do.
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(
        tokenizers::pre_tokenizers::sequence::Sequence::new(vec![
            PreTokenizerWrapper::Digits(tokenizers::pre_tokenizers::digits::Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]),
    )));
    tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
    tok.train(&mut trainer, texts.iter().cloned())
        .map_err(fail)?;
    tok.add_special_tokens(specials.clone()).map_err(fail)?;
    let json = tok.to_string(false).map_err(fail)?;
    json.parse::<tokenizers::Tokenizer>().map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: serde_json::Value) -> String {
        template_env().render_str(template, ctx).unwrap()
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let v = serde_json::json!({"b": [1, 2.5, 1e-5, 1e16, 3.0], "a": "é<&>\"\n", "e": {}});
        // Keys keep their order; no HTML escaping; Python's float spellings.
        assert_eq!(
            render("{{ v | tojson }}", serde_json::json!({ "v": v })),
            r#"{"b": [1, 2.5, 1e-05, 1e+16, 3.0], "a": "é<&>\"\n", "e": {}}"#
        );
        assert_eq!(
            render(
                "{{ v | tojson(indent=2, ensure_ascii=true) }}",
                serde_json::json!({ "v": {"k": ["é"]} })
            ),
            "{\n  \"k\": [\n    \"\\u00e9\"\n  ]\n}"
        );
        assert_eq!(
            render(
                "{{ v | tojson(separators=(',', ':'), sort_keys=true) }}",
                serde_json::json!({ "v": {"z": 1, "a": [1, 2]} })
            ),
            r#"{"a":[1,2],"z":1}"#
        );
    }

    #[test]
    fn printed_values_are_pythons_str() {
        let ctx = serde_json::json!({"l": [{"t": "it's"}, null, true, 1.5], "n": null, "b": false});
        assert_eq!(
            render("{{ l }}|{{ n }}|{{ b }}", ctx),
            r#"[{'t': "it's"}, None, True, 1.5]|None|False"#
        );
    }

    #[test]
    fn strftime_speaks_pythons_codes() {
        // 2026-11-23 13:05:09 UTC, a Monday, day 327 of the year.
        let t = 1_795_392_000 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(
            strftime("%A %a %d %b %B %Y %y %H:%M:%S %I%p %j %% %Q", t),
            "Monday Mon 23 Nov November 2026 26 13:05:09 01PM 327 % %Q"
        );
    }
}
