//! transformers' `GenerationConfig`: the fields generation reads, under transformers' names,
//! with the defaults `generate` applies when neither the checkpoint nor the caller sets them
//! (`GenerationConfig._get_default_generation_params`).

use crate::error::{Error, Result};
use std::path::Path;

/// How tokens are chosen. `Default` is transformers' defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// Tokens generated after the prompt (transformers' `max_length` 20 counts the prompt
    /// too: a checkpoint's `max_length` is read as that many minus the prompt by the loop).
    pub max_new_tokens: usize,
    /// Sample from the processed distribution; greedy (the most likely token) otherwise.
    pub do_sample: bool,
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens (0: off). transformers' default is 50.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1.0: off).
    pub top_p: f64,
    /// Drop tokens less likely than `min_p` times the most likely one.
    pub min_p: Option<f64>,
    /// CTRL's penalty on every token already in the row, prompt included (1.0: off).
    pub repetition_penalty: f64,
    /// A row stops at any of these (empty: none).
    pub eos_token_id: Vec<u32>,
    /// Fills a row after it stopped (and left-pads prompts).
    pub pad_token_id: Option<u32>,
    /// Seeds the sampler: the same seed draws the same tokens.
    pub seed: u64,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            max_new_tokens: 20,
            do_sample: false,
            temperature: 1.0,
            top_k: 50,
            top_p: 1.0,
            min_p: None,
            repetition_penalty: 1.0,
            eos_token_id: Vec::new(),
            pad_token_id: None,
            seed: 0,
        }
    }
}

impl GenerationConfig {
    /// `dir`'s generation_config.json over the defaults, or the defaults when it has none.
    pub fn from_pretrained(dir: impl AsRef<Path>) -> Result<Self> {
        let path = dir.as_ref().join("generation_config.json");
        if !path.is_file() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// transformers' `model.generation_config`: `dir`'s generation_config.json, else the
    /// generation keys of its config.json (a composite's text_config's), as
    /// `GenerationConfig.from_model_config` takes them (a model's `eos_token_id`, ...).
    pub fn for_model(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if dir.join("generation_config.json").is_file() {
            return Self::from_pretrained(dir);
        }
        let path = dir.join("config.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(Self::default());
        };
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let decoder = v.get("text_config").unwrap_or(&v);
        Self::from_json(&decoder.to_string(), &path.display().to_string())
    }

    /// A generation_config.json's text (named `source` in errors) over the defaults. Keys that
    /// do not change greedy decoding or sampling here are left as transformers leaves unknown
    /// ones: ignored.
    pub fn from_json(text: &str, source: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::config(source, "<document>", format!("not valid JSON: {e}")))?;
        let mut c = Self::default();
        let err = |key: &str, what: &str| Error::config(source, key, what.to_string());
        let number = |key: &str| -> Result<Option<f64>> {
            match v.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| err(key, "expected a number")),
            }
        };
        let ids = |key: &str| -> Result<Option<Vec<u32>>> {
            match v.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .map(|x| x.as_u64().map(|n| n as u32))
                    .collect::<Option<Vec<_>>>()
                    .map(Some)
                    .ok_or_else(|| err(key, "expected token ids")),
                Some(x) => x
                    .as_u64()
                    .map(|n| Some(vec![n as u32]))
                    .ok_or_else(|| err(key, "expected a token id or a list of them")),
            }
        };
        if let Some(n) = number("max_new_tokens")? {
            c.max_new_tokens = n as usize;
        }
        if let Some(b) = v.get("do_sample").and_then(|b| b.as_bool()) {
            c.do_sample = b;
        }
        if let Some(t) = number("temperature")? {
            c.temperature = t;
        }
        if let Some(k) = number("top_k")? {
            c.top_k = k as usize;
        }
        if let Some(p) = number("top_p")? {
            c.top_p = p;
        }
        c.min_p = number("min_p")?;
        if let Some(r) = number("repetition_penalty")? {
            c.repetition_penalty = r;
        }
        if let Some(e) = ids("eos_token_id")? {
            c.eos_token_id = e;
        }
        if let Some(p) = ids("pad_token_id")? {
            c.pad_token_id = p.first().copied();
        }
        c.check(source)?;
        Ok(c)
    }

    /// The values transformers refuses, refused here with the key.
    pub fn check(&self, source: &str) -> Result<()> {
        let err = |key: &str, what: String| Err(Error::config(source, key, what));
        let positive = |x: f64| x > 0.0 && x.is_finite();
        if !positive(self.temperature) && self.do_sample {
            return err(
                "temperature",
                format!("{} is not a strictly positive float: sampling needs temperature > 0 (do_sample false decodes greedily)", self.temperature),
            );
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return err("top_p", format!("{} is not in [0, 1]", self.top_p));
        }
        if let Some(m) = self.min_p.filter(|m| !(0.0..=1.0).contains(m)) {
            return err("min_p", format!("{m} is not in [0, 1]"));
        }
        if !positive(self.repetition_penalty) {
            return err(
                "repetition_penalty",
                format!(
                    "{} is not a strictly positive float",
                    self.repetition_penalty
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_checkpoints_generation_config_over_transformers_defaults() {
        let c = GenerationConfig::from_json(
            r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.95,
                "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                "transformers_version": "5.0"}"#,
            "generation_config.json",
        )
        .unwrap();
        assert!(c.do_sample && c.temperature == 0.6 && c.top_p == 0.95);
        assert_eq!(c.top_k, 50, "transformers' default");
        assert_eq!(c.eos_token_id, [151645, 151643]);
        assert_eq!(c.pad_token_id, Some(151643));
        let one = GenerationConfig::from_json(r#"{"eos_token_id": 2}"#, "g.json").unwrap();
        assert_eq!(one.eos_token_id, [2]);
        let bad = GenerationConfig::from_json(r#"{"top_p": 1.5}"#, "g.json").unwrap_err();
        assert!(bad.to_string().contains("top_p"), "{bad}");
    }
}
