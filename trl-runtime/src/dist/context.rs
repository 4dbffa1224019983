//! One call that turns the process environment into a working distributed context: the
//! store (served by rank 0), the mesh, the device, and a communicator per mesh group: NCCL
//! when the device is a GPU and the `nccl` feature is on, the host backend otherwise.

use super::env::ProcessEnv;
use super::mesh::{Axis, DeviceMesh, DP, DP_CP, DP_SHARD_CP, DP_SHARD_SP, DP_SP};
use crate::comm::store::Store;
use crate::comm::{Communicator, HostBackend, InProcessWorld, Timed};
use crate::config::{DistributedType, LaunchPlan};
use crate::error::{Error, Result};
use candle_core::Device;
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
    /// Under expert parallelism: the ep group, and the experts' replicas for each set of
    /// batch axes ([`DeviceMesh::ep_groups`]).
    ep: Option<EpGroups>,
    /// Where this rank computes (Accelerate's `accelerator.device`).
    device: Device,
    /// What the launch asked every worker to run.
    plan: LaunchPlan,
}

/// Every group's communicator by its sorted axes.
type Groups = BTreeMap<Vec<Axis>, Arc<Timed>>;

/// Expert parallelism's communicators.
struct EpGroups {
    group: Arc<Timed>,
    /// By the axes they are taken from (sorted): the batch axes (DP, DP_CP, DP_SP) and the
    /// shard axes (dp_shard, DP_SHARD_CP, DP_SHARD_SP).
    replicas: BTreeMap<Vec<Axis>, Arc<Timed>>,
}

/// The sets of axes whose ranks see different tokens (`parallel::batch_axes`) and those
/// ZeRO-3 / FSDP shard over (`parallel::shard_axes`).
const EP_AXES: &[&[Axis]] = &[DP, DP_CP, DP_SP, &[Axis::DpShard], DP_SHARD_CP, DP_SHARD_SP];

/// The ep groups of `rank` for groups of `ep` (None for 1), each made by `make(name,
/// members)`.
fn make_ep_groups(
    mesh: &DeviceMesh,
    rank: usize,
    ep: usize,
    mut make: impl FnMut(&str, &[usize]) -> Result<Arc<dyn Communicator>>,
) -> Result<Option<EpGroups>> {
    if ep <= 1 {
        return Ok(None);
    }
    let names = |m: &[usize]| {
        m.iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (members, _) = mesh.ep_groups(rank, ep, DP);
    let group = make(&format!("ep:{}", names(&members)), &members)?;
    let mut replicas = BTreeMap::new();
    for axes in EP_AXES {
        let (_, members) = mesh.ep_groups(rank, ep, axes);
        let name = format!("ep_replicas+{}:{}", key(axes).len(), names(&members));
        replicas.insert(key(axes), Arc::new(Timed::new(make(&name, &members)?)));
    }
    Ok(Some(EpGroups {
        group: Arc::new(Timed::new(group)),
        replicas,
    }))
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

/// One communicator per mesh group; groups of one rank need no backend.
fn make_groups(
    env: &ProcessEnv,
    mesh: &DeviceMesh,
    store: Option<&(Arc<Store>, String)>,
    timeout: Duration,
    device: &Device,
    ep: usize,
) -> Result<(Groups, Option<EpGroups>)> {
    enum Backend {
        Host(HostBackend),
        #[cfg(feature = "nccl")]
        Nccl(crate::comm::nccl::NcclBackend),
        Single,
    }
    let backend = match store {
        #[cfg(feature = "nccl")]
        Some((s, _)) if device.is_cuda() => Backend::Nccl(crate::comm::nccl::NcclBackend::new(
            Some(s.clone()),
            env.rank,
            timeout,
            device,
        )?),
        Some((s, token)) => {
            if device.is_cuda() {
                tracing::warn!("built without the `nccl` feature: collectives between GPUs go through host memory over the host backend");
            }
            Backend::Host(HostBackend::new(
                s.clone(),
                token.clone(),
                env.rank,
                timeout,
            ))
        }
        None => Backend::Single,
    };
    let make = |name: &str, members: &[usize]| -> Result<Arc<dyn Communicator>> {
        Ok(match &backend {
            Backend::Host(h) => h.group(name, members)?,
            #[cfg(feature = "nccl")]
            Backend::Nccl(_) if members.len() == 1 => InProcessWorld::new(1).world(0)?,
            #[cfg(feature = "nccl")]
            Backend::Nccl(n) => n.group(name, members)?,
            Backend::Single => InProcessWorld::new(1).world(0)?,
        })
    };
    let mut groups = BTreeMap::new();
    for axes in GROUP_AXES {
        let members = mesh.group(env.rank, axes);
        let comm = make(&mesh.group_name(env.rank, axes), &members)?;
        groups.insert(key(axes), Arc::new(Timed::new(comm)));
    }
    let ep = make_ep_groups(mesh, env.rank, ep, make)?;
    Ok((groups, ep))
}

/// Makes the calling thread (the one that trains) worker 0 of rayon's global pool, with
/// RAYON_NUM_THREADS threads in all, once a process; [`DistContext`] calls it, programs
/// without one (the benches) may. Otherwise the thread hands each of the kernels' parallel
/// loops to a pool thread and waits, while candle's single-thread matmuls run on it: a
/// one-thread rank moved its activations between two cores at every op (15% of a CPU step,
/// 26% with LoRA). Nothing else may call rayon and wait on this thread: at one thread only
/// this thread runs rayon's jobs (collectives' threads do not use it).
pub fn compute_on_this_thread() {
    if rayon::current_thread_index().is_some() {
        return;
    }
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(candle_core::utils::get_num_threads())
        .use_current_thread()
        .build_global();
    if let Err(e) = built {
        tracing::debug!("rayon's pool was started before the distributed context: {e}");
    }
}

impl DistContext {
    /// The launch contract: reads the process environment (torchrun / SLURM / single) and the
    /// plan the launcher exported in Accelerate's variables ([`LaunchPlan::from_env`]: the
    /// distributed type, every mesh size, the strategy settings), connects to the store and
    /// builds every group's communicator. The same under `cargo trl launch`, `accelerate
    /// launch` and torchrun with Accelerate's variables.
    pub fn from_env() -> Result<Self> {
        let env = ProcessEnv::from_process()?;
        let plan = LaunchPlan::from_process_env(env.world_size)?;
        Self::with_env_and_plan(env, plan)
    }

    /// As [`Self::from_env`], with the plan given in code instead of read from the
    /// environment (benchmarks and programs that choose their own strategy).
    pub fn with_plan(plan: LaunchPlan) -> Result<Self> {
        Self::with_env_and_plan(ProcessEnv::from_process()?, plan)
    }

    fn with_env_and_plan(env: ProcessEnv, mut plan: LaunchPlan) -> Result<Self> {
        crate::alloc::keep_freed_memory();
        compute_on_this_thread();
        let dims = plan.resolve(env.world_size)?;
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
        let device = super::device::select(env.local_rank)?;
        // Accelerate's rule: several processes without a GPU are MULTI_CPU, whatever the
        // variables guessed (torchrun sets no ACCELERATE_USE_CPU).
        if plan.distributed_type == DistributedType::MultiGpu && device.is_cpu() {
            plan.distributed_type = DistributedType::MultiCpu;
        }
        let ep = plan.parallelism.ep;
        let (groups, ep) = make_groups(&env, &mesh, store.as_ref(), timeout, &device, ep)?;
        tracing::debug!(
            rank = env.rank,
            "distributed context ready: {:?} on {device:?}, {} backend",
            mesh.dims(),
            groups.values().next().map_or("none", |c| c.backend())
        );
        Ok(DistContext {
            env,
            mesh,
            store: store.map(|(s, _)| s),
            groups,
            ep,
            device,
            plan,
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
            ep: None,
            device: Device::Cpu,
            plan: LaunchPlan::default(),
        })
    }

    /// The same context with expert parallelism over groups of `ep` ranks of `world` (the
    /// in-process world it was made from; every rank calls it).
    pub fn with_in_process_ep(mut self, world: &InProcessWorld, ep: usize) -> Result<Self> {
        let rank = self.env.rank;
        let make = |name: &str, members: &[usize]| world.group(name, members, rank);
        self.ep = make_ep_groups(&self.mesh, rank, ep, make)?;
        self.plan.parallelism.ep = ep;
        Ok(self)
    }

    /// The expert-parallel group, when experts are split over ranks.
    pub fn ep(&self) -> Option<Arc<dyn Communicator>> {
        self.ep
            .as_ref()
            .map(|e| e.group.clone() as Arc<dyn Communicator>)
    }

    /// Seconds this rank has spent inside expert parallelism's collectives (the ep group's
    /// exchanges and the experts' replica groups); 0 without ep.
    pub fn ep_comm_seconds(&self) -> f64 {
        self.ep.as_ref().map_or(0.0, |e| {
            e.group.seconds() + e.replicas.values().map(|r| r.seconds()).sum::<f64>()
        })
    }

    /// The ranks holding the same experts as this one among those of `axes` (the batch axes
    /// gradients are summed over, or the shard axes), under expert parallelism.
    pub fn expert_replicas(&self, axes: &[Axis]) -> Option<Arc<dyn Communicator>> {
        let ep = self.ep.as_ref()?;
        let group = ep.replicas.get(&key(axes)).unwrap_or_else(|| {
            panic!("no experts' replica group for axes {axes:?}: use batch or shard axes")
        });
        Some(group.clone())
    }

    /// The same context with its ranks computing on `device` (the in-process backend moves
    /// tensors through host memory): several ranks on one GPU, for tests.
    pub fn on_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// What the launch asked every worker to run (strategy settings beside the mesh).
    pub fn plan(&self) -> &LaunchPlan {
        &self.plan
    }

    /// The same context running `plan` (tests of in-process ranks choose their strategy).
    pub fn with_launch_plan(mut self, plan: LaunchPlan) -> Self {
        self.plan = plan;
        self
    }

    /// Where this rank computes: a GPU when one was selected, else the CPU.
    pub fn device(&self) -> &Device {
        &self.device
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
