//! Parallel training strategies beyond plain data parallelism.

pub mod zero;

pub use zero::{ZeroOptimizer, ZeroStage};
