//! `cargo trl`: scaffold, configure and launch distributed fine-tuning jobs.
//!
//! Implemented so far: `cargo trl profiles` (the shipped Accelerate profiles) and
//! `cargo trl check FILE` (validate an Accelerate config file as `launch` will read it).
//! `new` and `launch` come with the launcher issue.
//!
//! Exit codes: 0 success, 1 invalid input (a config that does not validate), 2 usage error.

use clap::{Parser, Subcommand};
use std::process::ExitCode;
use trl_runtime::config::LaunchConfig;

/// The profiles of templates/profiles, embedded so the binary works from anywhere.
const PROFILES: &[(&str, &str)] = &[
    (
        "single_gpu",
        include_str!("../../templates/profiles/single_gpu.yaml"),
    ),
    (
        "multi_gpu",
        include_str!("../../templates/profiles/multi_gpu.yaml"),
    ),
    ("zero1", include_str!("../../templates/profiles/zero1.yaml")),
    ("zero2", include_str!("../../templates/profiles/zero2.yaml")),
    ("zero3", include_str!("../../templates/profiles/zero3.yaml")),
    ("fsdp1", include_str!("../../templates/profiles/fsdp1.yaml")),
    ("fsdp2", include_str!("../../templates/profiles/fsdp2.yaml")),
    (
        "context_parallel_2gpu",
        include_str!("../../templates/profiles/context_parallel_2gpu.yaml"),
    ),
    (
        "alst_ulysses_4gpu",
        include_str!("../../templates/profiles/alst_ulysses_4gpu.yaml"),
    ),
    (
        "multi_node",
        include_str!("../../templates/profiles/multi_node.yaml"),
    ),
    (
        "multi_cpu",
        include_str!("../../templates/profiles/multi_cpu.yaml"),
    ),
    (
        "zero3_cpu",
        include_str!("../../templates/profiles/zero3_cpu.yaml"),
    ),
    (
        "fsdp2_cpu",
        include_str!("../../templates/profiles/fsdp2_cpu.yaml"),
    ),
    (
        "context_parallel_cpu",
        include_str!("../../templates/profiles/context_parallel_cpu.yaml"),
    ),
    (
        "alst_ulysses_cpu",
        include_str!("../../templates/profiles/alst_ulysses_cpu.yaml"),
    ),
];

#[derive(Parser)]
#[command(
    name = "cargo-trl",
    bin_name = "cargo",
    version,
    about = "Distributed fine-tuning for Candle models"
)]
enum Cargo {
    #[command(subcommand)]
    Trl(Command),
}

#[derive(Subcommand)]
enum Command {
    /// List the shipped launch profiles (Accelerate YAML).
    ///
    /// Example: cargo trl profiles
    Profiles {
        /// Print the YAML of this profile instead of the list.
        #[arg(long)]
        show: Option<String>,
    },
    /// Validate an Accelerate config file and print how it resolves.
    ///
    /// Example: cargo trl check ~/.cache/huggingface/accelerate/default_config.yaml
    Check { file: std::path::PathBuf },
}

fn describe(cfg: &LaunchConfig) -> String {
    let procs = cfg.num_processes.map_or("auto".into(), |n| n.to_string());
    let dims = cfg
        .parallelism
        .resolve(
            cfg.num_processes.unwrap_or(1) as usize,
            cfg.distributed_type,
        )
        .map(|d| {
            format!(
                "dp_replicate={} dp_shard={} cp={} sp={} tp={}",
                d.dp_replicate, d.dp_shard, d.cp, d.sp, d.tp
            )
        })
        .unwrap_or_else(|e| e.to_string());
    format!(
        "{:<10} processes={:<4} machines={} zero_stage={} precision={:<4} {}",
        cfg.distributed_type.as_str(),
        procs,
        cfg.num_machines,
        cfg.zero_stage(),
        cfg.mixed_precision.as_str(),
        dims
    )
}

fn main() -> ExitCode {
    // Invoked directly (`cargo-trl profiles`) or by cargo (`cargo trl profiles`).
    let mut args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some("trl") {
        args.insert(1, "trl".into());
    }
    let Cargo::Trl(command) = match Cargo::try_parse_from(&args) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match command {
        Command::Profiles { show: Some(name) } => match PROFILES.iter().find(|(n, _)| *n == name) {
            Some((_, yaml)) => {
                print!("{yaml}");
                ExitCode::SUCCESS
            }
            None => {
                let names: Vec<_> = PROFILES.iter().map(|(n, _)| *n).collect();
                eprintln!(
                    "error: no profile named '{name}': use one of {}",
                    names.join(", ")
                );
                ExitCode::from(1)
            }
        },
        Command::Profiles { show: None } => {
            for (name, yaml) in PROFILES {
                match LaunchConfig::from_yaml_str(yaml, name) {
                    Ok(cfg) => println!("{name:<22} {}", describe(&cfg)),
                    Err(e) => println!("{name:<22} invalid: {e}"),
                }
            }
            ExitCode::SUCCESS
        }
        Command::Check { file } => match LaunchConfig::from_file(&file) {
            Ok(cfg) => {
                for key in &cfg.unknown_keys {
                    eprintln!(
                        "warning: {}: unknown key `{key}` (ignored: check its spelling)",
                        file.display()
                    );
                }
                println!("{}: {}", file.display(), describe(&cfg));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(1)
            }
        },
    }
}
