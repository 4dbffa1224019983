//! Parallel training strategies beyond plain data parallelism.

pub mod fsdp;
pub mod zero;

pub use fsdp::{FsdpOptimizer, Prefetch, ShardedModel, WrapPolicy};
pub use zero::{ZeroOptimizer, ZeroStage};
