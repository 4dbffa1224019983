//! Configuration users already have: Accelerate's launch YAML and the parallelism config.

pub mod cli_value;
pub mod deepspeed_json;
pub mod effects;
pub mod launch;
pub mod parallelism;
pub mod plan;
mod yaml;

pub use launch::{
    ComputeEnvironment, DeepSpeedConfig, DistributedType, FsdpAutoWrapPolicy, FsdpBackwardPrefetch,
    FsdpConfig, FsdpShardingStrategy, FsdpStateDictType, GpuIds, LaunchConfig, MixedPrecision,
    OffloadDevice,
};
pub use parallelism::{ParallelismConfig, SpBackend};
pub use plan::LaunchPlan;
