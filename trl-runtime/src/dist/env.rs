//! The process environment: torchrun's contract (RANK, LOCAL_RANK, WORLD_SIZE, ...), else
//! SLURM's (SLURM_PROCID, ...), else a single process. Values are checked against each other.

use super::hostlist;
use crate::error::{Error, Result};

pub const DEFAULT_MASTER_PORT: u16 = 29500;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    Torchrun,
    Slurm,
    Single,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnv {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    /// Node (machine) index: torchrun's GROUP_RANK, SLURM_NODEID.
    pub node_rank: usize,
    pub num_nodes: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub source: EnvSource,
}

const TORCHRUN_VARS: &[&str] = &["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"];

fn parse_num(var: &str, value: &str) -> Result<usize> {
    value.trim().parse::<usize>().map_err(|_| Error::Env {
        var: var.into(),
        message: format!("'{value}' is not a non-negative integer"),
    })
}

/// MASTER_PORT when set, else `default()`.
fn master_port(
    get: &impl Fn(&str) -> Option<String>,
    default: impl FnOnce() -> Result<u16>,
) -> Result<u16> {
    match get("MASTER_PORT") {
        Some(p) => parse_port("MASTER_PORT", &p),
        None => default(),
    }
}

fn parse_port(var: &str, value: &str) -> Result<u16> {
    value.trim().parse::<u16>().map_err(|_| Error::Env {
        var: var.into(),
        message: format!("'{value}' is not a port number (0-65535)"),
    })
}

impl ProcessEnv {
    /// Reads the real process environment.
    pub fn from_process() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads through `get`, so tests can supply variables without touching the process env.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let present: Vec<&str> = TORCHRUN_VARS
            .iter()
            .copied()
            .filter(|v| get(v).is_some())
            .collect();
        if !present.is_empty() {
            if present.len() < TORCHRUN_VARS.len() {
                let missing: Vec<_> = TORCHRUN_VARS
                    .iter()
                    .filter(|v| !present.contains(v))
                    .collect();
                return Err(Error::Env {
                    var: missing.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", "),
                    message: format!(
                        "missing while {} set: a launcher must set all of RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (use `cargo trl launch` or torchrun), or none for a single process",
                        present.join(", ")
                    ),
                });
            }
            return Self::from_torchrun(&get);
        }
        if get("SLURM_PROCID").is_some() && get("SLURM_NTASKS").is_some() {
            return Self::from_slurm(&get);
        }
        Ok(ProcessEnv {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            node_rank: 0,
            num_nodes: 1,
            master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port: master_port(&get, || Ok(DEFAULT_MASTER_PORT))?,
            source: EnvSource::Single,
        })
    }

    fn from_torchrun(get: &impl Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |var: &str| parse_num(var, &get(var).unwrap_or_default());
        let rank = num("RANK")?;
        let local_rank = num("LOCAL_RANK")?;
        let world_size = num("WORLD_SIZE")?;
        let local_world_size = num("LOCAL_WORLD_SIZE")?;
        let node_rank = match get("GROUP_RANK") {
            Some(v) => parse_num("GROUP_RANK", &v)?,
            None => rank / local_world_size.max(1),
        };
        let num_nodes = match get("GROUP_WORLD_SIZE") {
            Some(v) => parse_num("GROUP_WORLD_SIZE", &v)?,
            None => world_size.div_ceil(local_world_size.max(1)),
        };
        let master_addr = get("MASTER_ADDR").ok_or_else(|| Error::Env {
            var: "MASTER_ADDR".into(),
            message: format!(
                "not set but WORLD_SIZE is {world_size}: set it to the address of the machine running rank 0"
            ),
        })?;
        let master_port = master_port(get, || Ok(DEFAULT_MASTER_PORT))?;
        let env = ProcessEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank,
            num_nodes,
            master_addr,
            master_port,
            source: EnvSource::Torchrun,
        };
        env.check(
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
        )?;
        Ok(env)
    }

    fn from_slurm(get: &impl Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |var: &str| -> Result<Option<usize>> {
            get(var).map(|v| parse_num(var, &v)).transpose()
        };
        let rank = num("SLURM_PROCID")?.unwrap_or(0);
        let world_size = num("SLURM_NTASKS")?.unwrap_or(1);
        let local_rank = num("SLURM_LOCALID")?.unwrap_or(0);
        let node_rank = num("SLURM_NODEID")?.unwrap_or(0);
        let nodelist = get("SLURM_STEP_NODELIST").or_else(|| get("SLURM_JOB_NODELIST"));
        let hosts = match &nodelist {
            Some(list) => hostlist::expand(list).map_err(|m| Error::Env {
                var: "SLURM_JOB_NODELIST".into(),
                message: m,
            })?,
            None => Vec::new(),
        };
        let num_nodes = num("SLURM_STEP_NUM_NODES")?
            .or(num("SLURM_NNODES")?)
            .unwrap_or(hosts.len().max(1));
        // SLURM_STEP_TASKS_PER_NODE looks like "2(x3),1": tasks of each node in order.
        let local_world_size = match get("SLURM_STEP_TASKS_PER_NODE")
            .or_else(|| get("SLURM_TASKS_PER_NODE"))
        {
            Some(spec) => tasks_on_node(&spec, node_rank).ok_or_else(|| Error::Env {
                var: "SLURM_TASKS_PER_NODE".into(),
                message: format!("cannot read the task count of node {node_rank} from '{spec}'"),
            })?,
            None => world_size.div_ceil(num_nodes.max(1)),
        };
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a,
            None => hosts.first().cloned().ok_or_else(|| Error::Env {
                var: "MASTER_ADDR".into(),
                message: "not set and SLURM_JOB_NODELIST is empty: set MASTER_ADDR to the first node of the job".into(),
            })?,
        };
        let master_port = master_port(get, || {
            Ok(match get("SLURM_JOB_ID") {
                // A common rule: 15000 + the last four digits of the job id (ports differ per job).
                Some(id) => 15000 + (parse_num("SLURM_JOB_ID", &id)? % 10000) as u16,
                None => DEFAULT_MASTER_PORT,
            })
        })?;
        let env = ProcessEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank,
            num_nodes,
            master_addr,
            master_port,
            source: EnvSource::Slurm,
        };
        env.check(
            "SLURM_PROCID",
            "SLURM_LOCALID",
            "SLURM_NTASKS",
            "SLURM_TASKS_PER_NODE",
            "SLURM_NODEID",
        )?;
        Ok(env)
    }

    /// Cross-checks the values, naming the variables in the launcher's vocabulary.
    fn check(
        &self,
        rank_var: &str,
        local_var: &str,
        world_var: &str,
        local_world_var: &str,
        node_var: &str,
    ) -> Result<()> {
        let err = |var: &str, message: String| {
            Err(Error::Env {
                var: var.into(),
                message,
            })
        };
        if self.world_size == 0 {
            return err(world_var, "is 0: a job needs at least one process".into());
        }
        // `value` of `var` must be below `bound`, named `bound_name`.
        let below = |var: &str, value: usize, bound_name: &str, bound: usize| match value < bound {
            true => Ok(()),
            false => err(var, format!("{value} must be below {bound_name} ({bound})")),
        };
        below(rank_var, self.rank, world_var, self.world_size)?;
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return err(
                local_world_var,
                format!(
                    "{} must be between 1 and {world_var} ({})",
                    self.local_world_size, self.world_size
                ),
            );
        }
        below(
            local_var,
            self.local_rank,
            local_world_var,
            self.local_world_size,
        )?;
        if self.node_rank >= self.num_nodes {
            return err(
                node_var,
                format!("{} must be below the number of nodes ({}); on SLURM, is $SLURM_NODEID escaped in the batch script?", self.node_rank, self.num_nodes),
            );
        }
        Ok(())
    }

    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    pub fn master(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

/// Parses SLURM's `2(x3),1` and returns the task count of node `node`.
fn tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut index = 0;
    for part in spec.split(',') {
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => (
                c.trim().parse().ok()?,
                r.trim_end_matches(')').parse::<usize>().ok()?,
            ),
            None => (part.trim().parse().ok()?, 1),
        };
        if node < index + repeat {
            return Some(count);
        }
        index += repeat;
    }
    None
}
