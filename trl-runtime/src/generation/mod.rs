//! Generation as transformers' `generate` does it: a [`GenerationConfig`] with its field names
//! and defaults, read from a checkpoint's `generation_config.json`, and the logits processors
//! of its sampling, applied in transformers' order ([`processors`]).
//!
//! [`generate`] is the decoding loop over a KV cache (`crate::nn::KvCache`), for any model
//! that implements [`CachedForward`].

pub mod config;
mod forward;
pub mod generate;
pub mod processors;
pub mod prompts;
mod steps;

pub use config::GenerationConfig;
pub use generate::{
    generate, generate_fixed, generate_rows, generate_rows_seeded, generate_streaming, left_pad,
    row_seed, CachedForward,
};
pub use processors::{next_token, process, Sampler};
pub use prompts::{load_prompts, Prompt};
