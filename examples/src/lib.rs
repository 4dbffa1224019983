//! Runnable training programs (one per binary in `src/bin/`) and the bundled assets of the
//! embedded default: a checkable synthetic SFT task, a tokenizer trained on it, and a tiny
//! random-init Qwen2 in HF format. `cargo run -p trl-examples --bin make_assets` regenerates
//! `assets/tiny/` deterministically; nothing is downloaded.

pub mod assets;
pub mod phi;
pub mod sft;
