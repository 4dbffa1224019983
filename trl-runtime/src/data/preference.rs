//! Preference data as TRL's DPOTrainer reads it: `{"prompt", "chosen", "rejected"}` with
//! strings (standard) or message lists (conversational), or without `prompt` (implicit: the
//! shared start of chosen and rejected is the prompt, as `trl.extract_prompt` finds it), and
//! an optional `tools` column. Tokenized as TRL 1.16 tokenizes them, so the same rows give
//! the same token ids: the chat template applied to the prompt (with the generation prompt)
//! and to prompt + each completion; EOS appended to standard completions; the completion
//! starting where the tokenized prompt and prompt + completion part.

use super::dataset::{columns, content, tools, Content};
use super::tokenize::{Message, TextTokenizer};
use crate::error::Result;
use serde_json::Value;

/// One preference row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferenceRecord {
    pub prompt: Content,
    pub chosen: Content,
    pub rejected: Content,
    pub tools: Option<Vec<Value>>,
}

/// A tokenized preference pair: the shared prompt and the two completions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferencePair {
    pub prompt_ids: Vec<u32>,
    pub chosen_ids: Vec<u32>,
    pub rejected_ids: Vec<u32>,
}

/// Reads one preference row (JSON object, or a Parquet row as one).
pub fn parse_preference(v: &Value) -> std::result::Result<PreferenceRecord, String> {
    let obj = columns(v)?;
    let field = |key: &str| {
        obj.get(key).ok_or_else(|| {
            let keys: Vec<&String> = obj.keys().collect();
            format!("no `{key}` (keys {keys:?}): preference rows need chosen and rejected, and optionally prompt")
        })
    };
    let chosen = content(field("chosen")?, "chosen")?;
    let rejected = content(field("rejected")?, "rejected")?;
    let tools = tools(&obj)?;
    let (prompt, chosen, rejected) = match obj.get("prompt") {
        Some(p) => (content(p, "prompt")?, chosen, rejected),
        None => extract_prompt(chosen, rejected)?,
    };
    let kinds = [&prompt, &chosen, &rejected].map(|c| matches!(c, Content::Messages(_)));
    if kinds.iter().any(|&k| k != kinds[0]) {
        return Err(
            "prompt, chosen and rejected must all be strings or all be message lists".into(),
        );
    }
    Ok(PreferenceRecord {
        prompt,
        chosen,
        rejected,
        tools,
    })
}

/// TRL's `extract_prompt`: the longest shared start of chosen and rejected (messages, or
/// characters, a space before the split left with the completions) is the prompt.
fn extract_prompt(
    chosen: Content,
    rejected: Content,
) -> std::result::Result<(Content, Content, Content), String> {
    // Python's loop leaves `idx` at its last value when nothing differs.
    fn split_at<T: PartialEq>(a: &[T], b: &[T], space: Option<&T>) -> usize {
        let n = a.len().min(b.len());
        let mut idx = n.saturating_sub(1);
        for i in 0..n {
            if a[i] != b[i] {
                idx = i;
                if i > 0 && space.is_some_and(|s| &a[i - 1] == s) {
                    idx -= 1;
                }
                break;
            }
        }
        if n == 0 {
            0
        } else {
            idx
        }
    }
    match (chosen, rejected) {
        (Content::Text(c), Content::Text(r)) => {
            let (cc, rc): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
            let at = split_at(&cc, &rc, Some(&' '));
            let text = |v: &[char]| v.iter().collect::<String>();
            Ok((
                Content::Text(text(&cc[..at])),
                Content::Text(text(&cc[at..])),
                Content::Text(text(&rc[at.min(rc.len())..])),
            ))
        }
        (Content::Messages(c), Content::Messages(r)) => {
            let at = split_at(&c, &r, None);
            Ok((
                Content::Messages(c[..at].to_vec()),
                Content::Messages(c[at..].to_vec()),
                Content::Messages(r[at.min(r.len())..].to_vec()),
            ))
        }
        _ => Err("chosen and rejected must both be strings or both be message lists".into()),
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Tokenizes a preference row as TRL 1.16's DPOTrainer does.
pub fn tokenize_preference(r: &PreferenceRecord, tok: &TextTokenizer) -> Result<PreferencePair> {
    let (prompt_ids, chosen_full, rejected_full) = match (&r.prompt, &r.chosen, &r.rejected) {
        (Content::Messages(p), Content::Messages(c), Content::Messages(rj)) => {
            let tools = r.tools.as_deref();
            let render = |m: &[Message], gen: bool| -> Result<Vec<u32>> {
                let text = tok.apply_chat_template(m, tools, gen)?.text;
                tok.encode(&text, false)
            };
            let joined = |c: &[Message]| p.iter().chain(c).cloned().collect::<Vec<_>>();
            (
                render(p, true)?,
                render(&joined(c), false)?,
                render(&joined(rj), false)?,
            )
        }
        (Content::Text(p), Content::Text(c), Content::Text(rj)) => {
            // EOS is added to standard completions that lack it (as text, as TRL does).
            let eos = tok.eos_token.as_deref().unwrap_or_default();
            let with_eos = |s: &str| {
                if s.ends_with(eos) {
                    s.to_string()
                } else {
                    format!("{s}{eos}")
                }
            };
            (
                tok.encode(p, true)?,
                tok.encode(&format!("{p}{}", with_eos(c)), true)?,
                tok.encode(&format!("{p}{}", with_eos(rj)), true)?,
            )
        }
        _ => unreachable!("parse_preference rejects mixed kinds"),
    };
    let prompt_len =
        common_prefix(&prompt_ids, &chosen_full).min(common_prefix(&prompt_ids, &rejected_full));
    Ok(PreferencePair {
        prompt_ids: prompt_ids[..prompt_len].to_vec(),
        chosen_ids: chosen_full[prompt_len..].to_vec(),
        rejected_ids: rejected_full[prompt_len..].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Content {
        Content::Text(s.into())
    }

    #[test]
    fn implicit_prompts_split_as_trl_splits_them() {
        let row =
            serde_json::json!({"chosen": "The sky is blue.", "rejected": "The sky is green."});
        let r = parse_preference(&row).unwrap();
        // The space before the split goes with the completions.
        assert_eq!(r.prompt, text("The sky is"));
        assert_eq!(r.chosen, text(" blue."));
        assert_eq!(r.rejected, text(" green."));
        let row = serde_json::json!({
            "chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
            "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go"}],
        });
        let r = parse_preference(&row).unwrap();
        assert!(matches!(&r.prompt, Content::Messages(m) if m.len() == 1 && m[0].role == "user"));
        assert!(matches!(&r.chosen, Content::Messages(m) if m.len() == 1));
    }

    #[test]
    fn rows_without_both_completions_are_refused_by_name() {
        let err = parse_preference(&serde_json::json!({"prompt": "a", "chosen": "b"})).unwrap_err();
        assert!(err.contains("`rejected`"), "{err}");
        let err = parse_preference(&serde_json::json!({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]})).unwrap_err();
        assert!(err.contains("all be strings"), "{err}");
    }
}
