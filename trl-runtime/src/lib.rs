//! trl-runtime: everything that runs inside a training process.
//!
//! - [`config`]: Accelerate launch YAML and the parallelism config.
//! - [`dist`]: process environment (torchrun / SLURM), rendezvous store, device mesh.
//! - [`comm`]: the `Communicator` trait, its backends and differentiable collectives.

pub mod alloc;
pub mod comm;
pub mod config;
pub mod data;
pub mod dist;
pub mod error;
pub mod models;
pub mod nn;
pub mod parallel;
pub mod train;

pub use error::{Error, Result};
