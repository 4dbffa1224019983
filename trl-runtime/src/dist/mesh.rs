//! The device mesh: ranks laid out on the axes dp_replicate, dp_shard, cp, sp, tp (outermost
//! first, tp on consecutive ranks), and the groups of ranks along one or several axes.

use crate::config::parallelism::ParallelDims;
use crate::error::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    DpReplicate,
    DpShard,
    Cp,
    Sp,
    Tp,
}

impl Axis {
    /// Outermost first.
    pub const ALL: [Axis; 5] = [
        Axis::DpReplicate,
        Axis::DpShard,
        Axis::Cp,
        Axis::Sp,
        Axis::Tp,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Axis::DpReplicate => "dp_replicate",
            Axis::DpShard => "dp_shard",
            Axis::Cp => "cp",
            Axis::Sp => "sp",
            Axis::Tp => "tp",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Flattened axes, named as in Accelerate/torchtitan.
pub const DP: &[Axis] = &[Axis::DpReplicate, Axis::DpShard];
/// What FSDP shards parameters over.
pub const DP_SHARD_CP: &[Axis] = &[Axis::DpShard, Axis::Cp];
/// What the loss is averaged over.
pub const DP_CP: &[Axis] = &[Axis::DpReplicate, Axis::DpShard, Axis::Cp];
/// Ranks that see different tokens under sequence parallelism (data-parallel ranks and the
/// sp chunks): token counts and gradients are summed over them.
pub const DP_SP: &[Axis] = &[Axis::DpReplicate, Axis::DpShard, Axis::Sp];
/// What ZeRO / FSDP shard over when sequences are split (DeepSpeed's ALST shards over the
/// sequence-parallel ranks as well).
pub const DP_SHARD_SP: &[Axis] = &[Axis::DpShard, Axis::Sp];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMesh {
    dims: ParallelDims,
    world_size: usize,
}

impl DeviceMesh {
    /// Builds the mesh after checking the shape against the world size.
    pub fn new(dims: ParallelDims, world_size: usize) -> Result<Self> {
        dims.validate(world_size)?;
        Ok(DeviceMesh { dims, world_size })
    }

    pub fn dims(&self) -> ParallelDims {
        self.dims
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn size(&self, axis: Axis) -> usize {
        self.sizes()[axis.index()]
    }

    fn sizes(&self) -> [usize; 5] {
        let d = self.dims;
        [d.dp_replicate, d.dp_shard, d.cp, d.sp, d.tp]
    }

    /// The rank's position on each axis, outermost first.
    pub fn coordinate(&self, rank: usize) -> [usize; 5] {
        assert!(
            rank < self.world_size,
            "rank {rank} outside world {}",
            self.world_size
        );
        let sizes = self.sizes();
        let mut coord = [0; 5];
        let mut rest = rank;
        for i in (0..5).rev() {
            coord[i] = rest % sizes[i];
            rest /= sizes[i];
        }
        coord
    }

    pub fn rank_of(&self, coord: [usize; 5]) -> usize {
        let sizes = self.sizes();
        coord.iter().zip(sizes).fold(0, |acc, (&c, s)| acc * s + c)
    }

    /// Position of `rank` along `axes` flattened (outer axis major).
    pub fn local_rank(&self, rank: usize, axes: &[Axis]) -> usize {
        let coord = self.coordinate(rank);
        let mut sorted = axes.to_vec();
        sorted.sort();
        sorted
            .iter()
            .fold(0, |acc, a| acc * self.size(*a) + coord[a.index()])
    }

    /// Ranks of the group through `rank` along `axes` (the other coordinates fixed), in order of
    /// their position in the flattened axes.
    pub fn group(&self, rank: usize, axes: &[Axis]) -> Vec<usize> {
        let base = self.coordinate(rank);
        let mut sorted = axes.to_vec();
        sorted.sort();
        sorted.dedup();
        let n: usize = sorted.iter().map(|a| self.size(*a)).product();
        (0..n)
            .map(|mut flat| {
                let mut coord = base;
                for a in sorted.iter().rev() {
                    let s = self.size(*a);
                    coord[a.index()] = flat % s;
                    flat /= s;
                }
                self.rank_of(coord)
            })
            .collect()
    }

    /// Every group along `axes`: disjoint, covering the world, ordered by their first rank.
    pub fn all_groups(&self, axes: &[Axis]) -> Vec<Vec<usize>> {
        let mut seen = vec![false; self.world_size];
        let mut groups = Vec::new();
        for r in 0..self.world_size {
            if !seen[r] {
                let g = self.group(r, axes);
                for &m in &g {
                    seen[m] = true;
                }
                groups.push(g);
            }
        }
        groups
    }

    /// Expert parallelism's groups through `rank` for groups of `ep`: the ep group, `ep`
    /// consecutive data-parallel ranks (dp_replicate x dp_shard flattened, dp_shard minor;
    /// the other coordinates fixed), which exchange tokens and each hold a share of the
    /// experts; and the experts' replicas, the ranks of `batch` (those whose gradients are
    /// summed) holding the same share, over which the experts' gradients are summed.
    pub fn ep_groups(&self, rank: usize, ep: usize, batch: &[Axis]) -> (Vec<usize>, Vec<usize>) {
        let dp = |r: usize| self.local_rank(r, DP);
        let block = dp(rank) / ep;
        let group = self
            .group(rank, DP)
            .into_iter()
            .filter(|&r| dp(r) / ep == block)
            .collect();
        let share = dp(rank) % ep;
        let replicas = self
            .group(rank, batch)
            .into_iter()
            .filter(|&r| dp(r) % ep == share)
            .collect();
        (group, replicas)
    }

    /// A stable name for the group through `rank` along `axes`, e.g. `dp_shard+cp:0,2`.
    pub fn group_name(&self, rank: usize, axes: &[Axis]) -> String {
        let mut sorted = axes.to_vec();
        sorted.sort();
        let axes: Vec<_> = sorted.iter().map(|a| a.name()).collect();
        let members: Vec<_> = self
            .group(rank, &sorted)
            .iter()
            .map(|r| r.to_string())
            .collect();
        format!("{}:{}", axes.join("+"), members.join(","))
    }
}
