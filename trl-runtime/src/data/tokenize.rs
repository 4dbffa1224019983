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

const GEN_START: char = '\u{E000}';
const GEN_END: char = '\u{E001}';

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
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
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: u32,
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

/// Today's date for `strftime_now` (%d %m %Y %b %B %y, others passed through).
fn strftime_now(format: String) -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    format
        .replace("%d", &format!("{day:02}"))
        .replace("%m", &format!("{month:02}"))
        .replace("%Y", &year.to_string())
        .replace("%y", &format!("{:02}", year % 100))
        .replace("%B", name)
        .replace("%b", &name[..3])
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
            bos_token,
            eos_token,
            eos_token_id,
            pad_token_id,
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

    /// Renders `messages` with the chat template, returning the text and the byte spans of
    /// `{% generation %}` blocks.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<RenderedChat> {
        let source = self.template_source.display().to_string();
        let template = self.chat_template.as_deref().ok_or_else(|| Error::Config {
            file: source.clone(),
            key: "chat_template".into(),
            message: "this tokenizer has no chat template: conversational data needs one (add chat_template to tokenizer_config.json)".into(),
        })?;
        let mut env = minijinja::Environment::new();
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
        let template_error = |e: minijinja::Error| Error::Config {
            file: source.clone(),
            key: "chat_template".into(),
            message: format!("template error: {e}"),
        };
        env.add_template_owned("chat", rewrite_generation_tags(template))
            .map_err(template_error)?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        let raw = env
            .get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(template_error)?;
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
        assistant_only_loss: bool,
    ) -> Result<Example> {
        let chat = self.apply_chat_template(messages, false)?;
        let (ids, offsets) = self.encode_with_offsets(&chat.text, false)?;
        let labels = if assistant_only_loss {
            if chat.generation_spans.is_empty() {
                return Err(Error::Config {
                    file: self.template_source.display().to_string(),
                    key: "chat_template".into(),
                    message: "assistant_only_loss needs {% generation %} ... {% endgeneration %} around assistant replies in the chat template".into(),
                });
            }
            ids.iter()
                .zip(&offsets)
                .map(|(&id, &(s, e))| {
                    let inside = chat
                        .generation_spans
                        .iter()
                        .any(|g| s < g.end && e > g.start);
                    if inside {
                        id as i64
                    } else {
                        IGNORE_INDEX
                    }
                })
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
