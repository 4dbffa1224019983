//! One call that turns the process environment into a working distributed context: the
//! store (served by rank 0), the mesh, and a host-backend communicator per mesh group.

use super::env::ProcessEnv;
use super::mesh::{Axis, DeviceMesh, DP, DP_CP, DP_SHARD_CP, DP_SHARD_SP, DP_SP};
use super::store::Store;
use crate::comm::{Communicator, HostBackend, InProcessWorld, Timed};
use crate::config::launch::DistributedType;
use crate::config::parallelism::ParallelismConfig;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Bounds every wait on a peer (seconds). Like NCCL's timeout, generous by default.
pub const TIMEOUT_VAR: &str = "TRL_COMM_TIMEOUT";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The axis sets that get a communicator: each axis, the flattened ones, and the world.
pub const GROUP_AXES: &[&[Axis]] = &[
    &[Axis::DpReplicate],
    &[Axis::DpShard],
    &[Axis::Cp],
    &[Axis::Sp],
    &[Axis::Tp],
    DP,
    DP_SHARD_CP,
    DP_CP,
    DP_SP,
    DP_SHARD_SP,
    &[
        Axis::DpReplicate,
        Axis::DpShard,
        Axis::Cp,
        Axis::Sp,
        Axis::Tp,
    ],
];

pub struct DistContext {
    pub env: ProcessEnv,
    pub mesh: DeviceMesh,
    /// None for a single process or in-process ranks.
    pub store: Option<Arc<Store>>,
    /// Every group's communicator, timed (see [`Self::comm_seconds`]).
    groups: BTreeMap<Vec<Axis>, Arc<Timed>>,
}

fn key(axes: &[Axis]) -> Vec<Axis> {
    let mut k = axes.to_vec();
    k.sort();
    k.dedup();
    k
}

pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var(TIMEOUT_VAR) {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| Error::Env {
                var: TIMEOUT_VAR.into(),
                message: format!("'{v}' is not a positive number of seconds"),
            }),
    }
}

impl DistContext {
    /// Reads the environment (torchrun / SLURM / single), the PARALLELISM_CONFIG_* variables
    /// over `parallelism`, connects to the store and builds every group's communicator.
    pub fn init(
        parallelism: &ParallelismConfig,
        distributed_type: DistributedType,
    ) -> Result<Self> {
        crate::alloc::keep_freed_memory();
        let env = ProcessEnv::from_process()?;
        let parallelism = parallelism.clone().with_process_env()?;
        let dims = parallelism.resolve(env.world_size, distributed_type)?;
        let mesh = DeviceMesh::new(dims, env.world_size)?;
        let timeout = timeout_from_env()?;
        let store = if env.world_size > 1 {
            let token = Store::token_from_env();
            let store = Arc::new(Store::for_rank(env.rank, &env.master(), &token, timeout)?);
            store.rendezvous("init", env.rank, env.world_size, timeout)?;
            Some((store, token))
        } else {
            None
        };
        let mut groups = BTreeMap::new();
        let host = store
            .as_ref()
            .map(|(s, token)| HostBackend::new(s.clone(), token.clone(), env.rank, timeout));
        for axes in GROUP_AXES {
            let members = mesh.group(env.rank, axes);
            let name = mesh.group_name(env.rank, axes);
            let comm: Arc<dyn Communicator> = match &host {
                Some(h) => h.group(&name, &members)?,
                None => InProcessWorld::new(1).world(0)?,
            };
            groups.insert(key(axes), Arc::new(Timed::new(comm)));
        }
        tracing::debug!(
            rank = env.rank,
            "distributed context ready: {:?}",
            mesh.dims()
        );
        Ok(DistContext {
            env,
            mesh,
            store: store.map(|(s, _)| s),
            groups,
        })
    }

    /// A context for rank `rank` of in-process ranks (threads): for numerical tests.
    pub fn in_process(world: &InProcessWorld, rank: usize, mesh: DeviceMesh) -> Result<Self> {
        let n = world.size();
        let env = ProcessEnv {
            rank,
            local_rank: rank,
            world_size: n,
            local_world_size: n,
            node_rank: 0,
            num_nodes: 1,
            master_addr: "in-process".into(),
            master_port: 0,
            source: super::env::EnvSource::Single,
        };
        let mut groups = BTreeMap::new();
        for axes in GROUP_AXES {
            let members = mesh.group(rank, axes);
            let comm = world.group(&mesh.group_name(rank, axes), &members, rank)?;
            groups.insert(key(axes), Arc::new(Timed::new(comm)));
        }
        Ok(DistContext {
            env,
            mesh,
            store: None,
            groups,
        })
    }

    pub fn rank(&self) -> usize {
        self.env.rank
    }

    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    pub fn is_main_process(&self) -> bool {
        self.env.rank == 0
    }

    /// The communicator of this rank's group along `axes` (any of [`GROUP_AXES`]).
    pub fn group(&self, axes: &[Axis]) -> Arc<dyn Communicator> {
        self.timed(axes).clone()
    }

    fn timed(&self, axes: &[Axis]) -> &Arc<Timed> {
        self.groups
            .get(&key(axes))
            .unwrap_or_else(|| panic!("no communicator for axes {axes:?}: use one of GROUP_AXES"))
    }

    /// Seconds this rank has spent inside the collectives of its group along `axes` (all
    /// threads; collectives queued in the background overlap other work).
    pub fn comm_seconds(&self, axes: &[Axis]) -> f64 {
        self.timed(axes).seconds()
    }

    pub fn world(&self) -> Arc<dyn Communicator> {
        self.group(GROUP_AXES[GROUP_AXES.len() - 1])
    }
}
