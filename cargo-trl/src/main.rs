//! `cargo trl`: scaffold, configure and launch distributed fine-tuning jobs.
//!
//! Commands: `new` (scaffold a training crate), `launch` (run a program on local ranks, like
//! `accelerate launch`), `merge` (a LoRA adapter into its base), `plan` (memory and speed of every layout), `env` (environment report), `profiles`
//! (the shipped Accelerate profiles), `check FILE` (validate an Accelerate config file).
//!
//! Exit codes: 0 success; 1 a worker failed (launch) or the config is invalid (check);
//! 2 usage error or a launch that fails validation before starting; 3 the target cannot be
//! found, built or started.

mod accelerate_flags;
mod config_cmd;
mod env;
mod generate;
mod launch;
mod machine;
mod merge;
mod new;
mod plan;
mod profiles;
mod slurm;
mod target;
mod topology;
mod tp_plan;

use clap::{Parser, Subcommand};
use profiles::PROFILES;
use std::process::ExitCode;
use trl_runtime::config::LaunchConfig;

#[derive(Parser)]
#[command(
    name = "cargo-trl",
    bin_name = "cargo",
    version,
    about = "Distributed fine-tuning for Candle models"
)]
enum Cargo {
    #[command(subcommand, version, display_name = "cargo-trl")]
    Trl(Command),
}

#[derive(Subcommand)]
enum Command {
    #[command(verbatim_doc_comment)]
    /// Run a program on every local rank with torchrun's environment, supervised.
    ///
    /// Examples:
    ///   cargo trl launch --profile multi_cpu sft -- --learning_rate 1e-3
    ///   cargo trl launch --config_file my.yaml --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 ./train
    ///   cargo trl launch --profile zero3_cpu --dry-run sft
    Launch(Box<launch::LaunchArgs>),
    /// Write and submit an sbatch script running one launcher per node under srun.
    ///
    /// Example: cargo trl slurm --nodes 2 --gpus-per-node 8 --partition gpu --profile fsdp2 sft -- --max_steps 1000
    Slurm(slurm::SlurmArgs),
    /// Scaffold a training crate (tiny model and data included; trains offline).
    ///
    /// Example: cargo trl new my-sft && cd my-sft && cargo trl launch --profile multi_cpu
    New(new::NewArgs),
    #[command(verbatim_doc_comment)]
    /// Per-rank memory and speed of every layout the hardware allows; marks what fits, picks the fastest.
    ///
    /// Examples:
    ///   cargo trl plan --model Qwen2-0.5B --seq 8192 --batch 2 --gpus 8 --gpu_memory 80GiB
    ///   cargo trl plan --model assets/tiny/model --seq 64 --batch 2 --explain
    Plan(plan::PlanArgs),
    /// Merge a LoRA adapter into its base: a plain transformers checkpoint (peft's merge_and_unload).
    ///
    /// Example: cargo trl merge output/sft-tiny-lora/checkpoint-50 --output_dir merged
    Merge(merge::MergeArgs),
    #[command(verbatim_doc_comment)]
    /// Generate completions from a checkpoint (a model or a LoRA adapter) as JSONL rows.
    ///
    /// Examples:
    ///   cargo trl generate assets/tiny/model --prompt "What is 2 + 3?" --max_new_tokens 8
    ///   cargo trl generate output/sft-tiny --dataset_name assets/tiny/data/eval.jsonl --output_file answers.jsonl
    Generate(generate::GenerateArgs),
    /// Chat with a checkpoint on the terminal: its chat template, streamed replies, multi-turn.
    ///
    /// Example: cargo trl chat output/sft-tiny --max_new_tokens 64
    Chat(generate::ChatArgs),
    /// List the shipped launch profiles (Accelerate YAML).
    ///
    /// Example: cargo trl profiles
    Profiles {
        /// Print the YAML of this profile instead of the list.
        #[arg(long)]
        show: Option<String>,
        /// `show NAME` prints one profile's YAML.
        #[arg(num_args = 0..=2)]
        action: Vec<String>,
    },
    #[command(verbatim_doc_comment)]
    /// Write a launch config by questions (like `accelerate config`) or from flags.
    ///
    /// Examples:
    ///   cargo trl config
    ///   cargo trl config --profile zero3_cpu --num_processes 4 --output zero3_4.yaml
    Config(config_cmd::ConfigArgs),
    /// Versions, CPU cores, GPUs, driver and NCCL presence, the default config.
    ///
    /// Example: cargo trl env
    Env,
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

/// A subcommand's outcome: its message on stdout, or its error on stderr with exit code 2.
fn report<E: std::fmt::Display>(outcome: Result<String, E>) -> ExitCode {
    match outcome {
        Ok(msg) => {
            println!("{msg}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// [`report`] for commands whose output is their rows: a message only when there is one.
fn report_quiet(outcome: Result<String, String>) -> ExitCode {
    match outcome {
        Ok(msg) if msg.is_empty() => ExitCode::SUCCESS,
        other => report(other),
    }
}

fn main() -> ExitCode {
    // Output piped into `head` ends quietly, as a command-line tool's does, not with a
    // panic on the broken pipe.
    // SAFETY: restoring a signal's default disposition before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // Invoked directly (`cargo-trl profiles`) or by cargo (`cargo trl profiles`).
    let mut args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some("trl") {
        args.insert(1, "trl".into());
    }
    if args.get(2).map(String::as_str) == Some("launch") {
        accelerate_flags::underscore_flags(&mut args[3..]);
    }
    let Cargo::Trl(command) = match Cargo::try_parse_from(&args) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match command {
        Command::Launch(args) => match launch::plan(&args) {
            Ok(plan) if args.dry_run => {
                launch::print_plan(&plan, &args);
                ExitCode::SUCCESS
            }
            Ok(plan) => ExitCode::from(launch::run(plan, &args)),
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(launch::EXIT_INVALID)
            }
        },
        Command::New(args) => report(new::run(&args)),
        Command::Merge(args) => report(merge::run(&args)),
        Command::Generate(args) => report_quiet(generate::run(&args)),
        Command::Chat(args) => report_quiet(generate::chat(&args)),
        Command::Plan(args) => report(plan::run(&args)),
        Command::Slurm(args) => report(slurm::run(&args)),
        Command::Config(args) => report(config_cmd::run(&args)),
        Command::Env => {
            println!("{}", env::report());
            ExitCode::SUCCESS
        }
        Command::Profiles { show, action }
            if show.is_some() || action.first().map(String::as_str) == Some("show") =>
        {
            let Some(name) = show.or_else(|| action.get(1).cloned()) else {
                eprintln!("error: `profiles show` needs a profile name");
                return ExitCode::from(2);
            };
            match PROFILES.iter().find(|(n, _)| *n == name) {
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
            }
        }
        Command::Profiles { action, .. } if !action.is_empty() => {
            eprintln!(
                "error: unknown profiles action '{}': use `profiles` or `profiles show NAME`",
                action[0]
            );
            ExitCode::from(2)
        }
        Command::Profiles { .. } => {
            println!("{:<22} DISTRIBUTED_TYPE AND LAYOUT", "PROFILE");
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
