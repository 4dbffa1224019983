//! trl-runtime: everything that runs inside a training process.
//!
//! - [`config`]: Accelerate launch YAML and the parallelism config.
//! - [`dist`]: process environment (torchrun / SLURM), rendezvous store, device mesh.
//! - [`comm`]: the `Communicator` trait, its backends and differentiable collectives.
//! - [`tp`]: tensor parallelism from `#[derive(Parallelize)]` annotations.
//! - [`context_parallel`]: what `#[context_parallel]` runs around a training step.
//! - [`progress`]: rank 0's training progress as the launcher shows it.

// The derive macros name this crate `::trl_runtime`, also when used inside it.
extern crate self as trl_runtime;

pub mod alloc;
pub mod comm;
pub mod config;
pub mod context_parallel;
pub mod data;
pub mod dist;
pub mod error;
pub mod generation;
pub mod hub;
pub mod kernels;
pub mod models;
pub mod nn;
pub mod optim;
pub mod parallel;
pub(crate) mod precomputed;
pub mod progress;
pub mod tp;
pub mod train;

pub use candle_core;
pub use error::{Error, Result};
// The trait and its derive share the name, as serde does.
pub use nn::module::Parallelize;
pub use trl_macros::{context_parallel, Parallelize};
