//! Configuration users already have: Accelerate's launch YAML and the parallelism config.

pub mod cli_value;
pub mod deepspeed_json;
pub mod effects;
pub mod launch;
pub mod named;
pub mod parallelism;
pub mod plan;
pub mod sections;
mod yaml;

pub use launch::LaunchConfig;
pub use parallelism::{ParallelismConfig, SpBackend};
pub use plan::LaunchPlan;
pub use sections::{
    ComputeEnvironment, DeepSpeedConfig, DistributedType, FsdpAutoWrapPolicy, FsdpBackwardPrefetch,
    FsdpConfig, FsdpShardingStrategy, FsdpStateDictType, GpuIds, MixedPrecision, OffloadDevice,
};
