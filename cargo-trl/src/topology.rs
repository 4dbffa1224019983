//! The flags `launch` and `config` share, with Accelerate's names: how many processes on how
//! many machines, where rank 0 is, precision, CPU, and the parallelism sizes.

use trl_runtime::config::launch::{GpuIds, MixedPrecision};
use trl_runtime::config::LaunchConfig;

#[derive(Debug, Clone, Default, clap::Args)]
#[command(rename_all = "snake_case")]
pub struct TopologyArgs {
    /// Total processes across all machines.
    #[arg(long)]
    pub num_processes: Option<u32>,
    #[arg(long)]
    pub num_machines: Option<u32>,
    #[arg(long)]
    pub machine_rank: Option<u32>,
    #[arg(long)]
    pub main_process_ip: Option<String>,
    /// 0 picks a free port.
    #[arg(long)]
    pub main_process_port: Option<u16>,
    /// no, fp16, bf16 or fp8.
    #[arg(long)]
    pub mixed_precision: Option<String>,
    /// `all` or a list like 0,1,3.
    #[arg(long)]
    pub gpu_ids: Option<String>,
    /// Run on CPU (host backend). Also `--cpu`, Accelerate's name.
    #[arg(long, alias = "cpu", num_args = 0..=1, default_missing_value = "true")]
    pub use_cpu: Option<bool>,
    #[arg(long)]
    pub parallelism_config_dp_replicate_size: Option<usize>,
    #[arg(long)]
    pub parallelism_config_dp_shard_size: Option<usize>,
    #[arg(long)]
    pub parallelism_config_tp_size: Option<usize>,
    #[arg(long)]
    pub parallelism_config_cp_size: Option<usize>,
    #[arg(long)]
    pub parallelism_config_sp_size: Option<usize>,
    /// Expert parallelism: each mixture's experts split over this many data-parallel ranks.
    #[arg(long)]
    pub parallelism_config_ep_size: Option<usize>,
}

impl TopologyArgs {
    /// Whether any flag was given.
    pub fn any(&self) -> bool {
        self.num_processes.is_some()
            || self.num_machines.is_some()
            || self.machine_rank.is_some()
            || self.main_process_ip.is_some()
            || self.main_process_port.is_some()
            || self.mixed_precision.is_some()
            || self.gpu_ids.is_some()
            || self.use_cpu.is_some()
            || self.parallelism_config_dp_replicate_size.is_some()
            || self.parallelism_config_dp_shard_size.is_some()
            || self.parallelism_config_tp_size.is_some()
            || self.parallelism_config_cp_size.is_some()
            || self.parallelism_config_sp_size.is_some()
            || self.parallelism_config_ep_size.is_some()
    }

    /// Writes the given flags over `cfg`.
    pub fn apply(&self, cfg: &mut LaunchConfig) -> Result<(), String> {
        if let Some(n) = self.num_processes {
            cfg.num_processes = Some(n);
        }
        if let Some(n) = self.num_machines {
            cfg.num_machines = n;
        }
        if let Some(n) = self.machine_rank {
            cfg.machine_rank = n;
        }
        if let Some(ip) = &self.main_process_ip {
            cfg.main_process_ip = Some(ip.clone());
        }
        if let Some(p) = self.main_process_port {
            cfg.main_process_port = Some(p);
        }
        if let Some(mp) = &self.mixed_precision {
            cfg.mixed_precision = MixedPrecision::parse(mp).ok_or_else(|| {
                format!("--mixed_precision '{mp}' is not accepted: use no, fp16, bf16 or fp8")
            })?;
        }
        if let Some(ids) = &self.gpu_ids {
            cfg.gpu_ids = GpuIds::parse(ids).map_err(|e| format!("--gpu_ids: {e}"))?;
        }
        if let Some(c) = self.use_cpu {
            cfg.use_cpu = c;
        }
        let p = &mut cfg.parallelism;
        if let Some(n) = self.parallelism_config_dp_replicate_size {
            p.dp_replicate = Some(n);
        }
        if let Some(n) = self.parallelism_config_dp_shard_size {
            p.dp_shard = Some(n);
        }
        if let Some(n) = self.parallelism_config_tp_size {
            p.tp = n;
        }
        if let Some(n) = self.parallelism_config_cp_size {
            p.cp = n;
        }
        if let Some(n) = self.parallelism_config_sp_size {
            p.sp = n;
        }
        if let Some(n) = self.parallelism_config_ep_size {
            p.ep = n;
        }
        Ok(())
    }
}
