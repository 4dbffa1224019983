//! `cargo trl slurm`: writes an sbatch script that runs one `cargo trl launch` per node under
//! srun, and submits it (or prints it with --print). The target is built first, once, and
//! named by absolute path, so nodes do not race to compile. Every node derives its machine
//! rank from SLURM_NODEID when its launcher starts (inside srun), never in the batch script:
//! the classic bug of every node believing it is machine 0 cannot happen.

use crate::target;
use std::path::PathBuf;
use std::process::Command;

#[derive(Debug, clap::Args)]
pub struct SlurmArgs {
    #[arg(long, default_value_t = 1)]
    pub nodes: u32,
    /// GPUs per node; the job then runs nodes x this many processes.
    #[arg(long = "gpus-per-node", default_value_t = 0)]
    pub gpus_per_node: u32,
    #[arg(long = "cpus-per-task")]
    pub cpus_per_task: Option<u32>,
    #[arg(long)]
    pub partition: Option<String>,
    /// Wall-clock limit (sbatch's --time, e.g. 02:00:00).
    #[arg(long)]
    pub time: Option<String>,
    #[arg(long)]
    pub account: Option<String>,
    #[arg(long = "job-name", default_value = "trl")]
    pub job_name: String,
    /// Print the script instead of submitting it.
    #[arg(long)]
    pub print: bool,
    /// Where to write the script (default: trl-JOBNAME.sbatch here).
    #[arg(long = "script")]
    pub script: Option<PathBuf>,
    /// `cargo trl launch` arguments: profile/config, flags, TARGET, -- program args.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub launch: Vec<String>,
}

/// Single-quotes a word for bash.
pub fn quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
    {
        return word.to_string();
    }
    format!("'{}'", word.replace('\'', "'\\''"))
}

/// Replaces a cargo TARGET in the launch arguments by the built executable's absolute path.
fn build_target(launch: &[String], release: bool) -> Result<Vec<String>, String> {
    // The target is the first word that is not a flag or a flag's value, before `--`.
    let with_value = [
        "--profile",
        "--config_file",
        "--num_processes",
        "--num_machines",
        "--machine_rank",
        "--main_process_ip",
        "--main_process_port",
        "--mixed_precision",
        "--gpu_ids",
        "--max_restarts",
        "--monitor_interval",
        "--stop_grace",
        "--log_dir",
        "--parallelism_config_dp_replicate_size",
        "--parallelism_config_dp_shard_size",
        "--parallelism_config_tp_size",
        "--parallelism_config_cp_size",
        "--parallelism_config_sp_size",
        "--parallelism_config_ep_size",
    ];
    let mut out = launch.to_vec();
    let mut i = 0;
    while i < out.len() {
        let a = out[i].as_str();
        if a == "--" {
            break;
        }
        if with_value.contains(&a) {
            i += 2;
            continue;
        }
        if !a.starts_with('-') {
            let t = target::resolve(Some(a))?;
            let exe = target::build(&t, release)?;
            out[i] = exe
                .canonicalize()
                .map_err(|e| format!("{}: {e}", exe.display()))?
                .display()
                .to_string();
            return Ok(out);
        }
        i += 1;
    }
    let t = target::resolve(None)?;
    let exe = target::build(&t, release)?;
    let pos = out.iter().position(|a| a == "--").unwrap_or(out.len());
    out.insert(
        pos,
        exe.canonicalize()
            .map_err(|e| format!("{}: {e}", exe.display()))?
            .display()
            .to_string(),
    );
    Ok(out)
}

/// The sbatch script for these arguments (launch args already final).
pub fn script(args: &SlurmArgs, launcher: &str, launch: &[String]) -> String {
    let mut s = String::from("#!/bin/bash\n");
    let mut directive = |k: &str, v: String| s.push_str(&format!("#SBATCH --{k}={v}\n"));
    directive("job-name", args.job_name.clone());
    directive("nodes", args.nodes.to_string());
    directive("ntasks-per-node", "1".into());
    if args.gpus_per_node > 0 {
        directive("gpus-per-node", args.gpus_per_node.to_string());
    }
    if let Some(c) = args.cpus_per_task {
        directive("cpus-per-task", c.to_string());
    }
    if let Some(p) = &args.partition {
        directive("partition", p.clone());
    }
    if let Some(t) = &args.time {
        directive("time", t.clone());
    }
    if let Some(a) = &args.account {
        directive("account", a.clone());
    }
    directive("output", format!("{}-%j.out", args.job_name));
    let mut launch = launch.to_vec();
    let has = |flag: &str| launch.iter().take_while(|a| *a != "--").any(|a| a == flag);
    if args.gpus_per_node > 0 && !has("--num_processes") {
        launch.insert(0, (args.nodes * args.gpus_per_node).to_string());
        launch.insert(0, "--num_processes".into());
    }
    let words: Vec<String> = launch.iter().map(|w| quote(w)).collect();
    s.push_str(
        "set -euo pipefail\n\
         # One secret per job, shared by the nodes' launchers (the store rejects other jobs).\n\
         export TRL_JOB_TOKEN=\"${TRL_JOB_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')}\"\n\
         # One launcher per node. Each reads its machine rank from SLURM_NODEID when it starts\n\
         # inside srun; nothing rank-specific is expanded here in the batch script.\n",
    );
    s.push_str(&format!(
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 {} launch {}\n",
        quote(launcher),
        words.join(" ")
    ));
    s
}

pub fn run(args: &SlurmArgs) -> Result<String, String> {
    if args.nodes == 0 {
        return Err("--nodes must be at least 1".into());
    }
    let release = !args
        .launch
        .iter()
        .take_while(|a| *a != "--")
        .any(|a| a == "--debug");
    let launch = build_target(&args.launch, release)?;
    let launcher = std::env::current_exe()
        .map_err(|e| e.to_string())?
        .display()
        .to_string();
    let text = script(args, &launcher, &launch);
    if args.print {
        return Ok(text);
    }
    let path = args
        .script
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("trl-{}.sbatch", args.job_name)));
    std::fs::write(&path, &text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let out = Command::new("sbatch").arg(&path).output().map_err(|e| {
        format!(
            "cannot run sbatch ({e}): is this a SLURM login node? The script is in {}",
            path.display()
        )
    })?;
    if !out.status.success() {
        return Err(format!(
            "sbatch failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(format!(
        "{} ({})",
        String::from_utf8_lossy(&out.stdout).trim(),
        path.display()
    ))
}
