//! Generation as transformers' `generate` does it: a [`GenerationConfig`] with its field names
//! and defaults, read from a checkpoint's `generation_config.json`, and the logits processors
//! of its sampling, applied in transformers' order ([`processors`]).
//!
//! The decoding loop with a KV cache, under every strategy, is issue 76's next step; these are
//! what it samples with.

pub mod config;
pub mod processors;

pub use config::GenerationConfig;
pub use processors::{next_token, process, Sampler};
