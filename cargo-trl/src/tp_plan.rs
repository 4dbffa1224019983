//! The tensor-parallel plan of the model a launch will train: which tensors are split how and
//! the shape each rank holds. A launch asks the built program for its own model's plan
//! ([`ask`]: only the program knows its model type), so a tp size that does not divide the
//! heads or a dimension fails before any process starts; `--dry-run`, which builds nothing,
//! prints the plan of the built-in decoder for the model directory the arguments name.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use trl_runtime::comm::InProcessWorld;
use trl_runtime::models::ModelConfig;
use trl_runtime::parallel::CausalLm;
use trl_runtime::tp::PlanEntry;
use trl_runtime::train::kinds::ReadArgs;
use trl_runtime::train::plan_query::{PlanAnswer, QUERY_OUT_VAR, QUERY_TP_VAR};
use trl_runtime::train::registry;
use trl_runtime::train::SFTConfig;

/// What the program said when asked for its plan.
pub enum Answer {
    /// The plan of its model in the directory, or why that model cannot be split.
    Plan(Box<PlanAnswer>),
    /// It did not answer (it does not train through trl_runtime's Trainer): why.
    None(String),
}

/// How long a program may take to answer (it reads only config.json and the weight files'
/// headers).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `program` once as a single CPU process with `args`, asking its trainer for the plan
/// of its model over `tp` ranks; see `trl_runtime::train::plan_query`.
pub fn ask(program: &Path, args: &[String], tp: usize) -> Answer {
    let files = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => return Answer::None(format!("no temporary directory: {e}")),
    };
    let (out, log) = (files.path().join("plan.json"), files.path().join("stderr"));
    // Its stderr goes to a file: a pipe nobody reads until it exits could fill and stall it.
    let stderr = match std::fs::File::create(&log) {
        Ok(f) => f,
        Err(e) => return Answer::None(format!("cannot create {}: {e}", log.display())),
    };
    let child = Command::new(program)
        .args(args)
        .env(QUERY_TP_VAR, tp.to_string())
        .env(QUERY_OUT_VAR, &out)
        // One process, on the CPU, outside any launch.
        .envs([
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_WORLD_SIZE", "1"),
            ("ACCELERATE_USE_CPU", "true"),
            // A world of one starts no rendezvous; the address is only read.
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .env_remove("TRL_LOCAL_PROCESSES")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return Answer::None(format!("cannot run {}: {e}", program.display())),
    };
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() < ANSWER_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(20))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Answer::None(format!(
                    "it did not answer within {} s",
                    ANSWER_TIMEOUT.as_secs()
                ));
            }
        }
    };
    let Ok(text) = std::fs::read_to_string(&out) else {
        let err = std::fs::read_to_string(&log).unwrap_or_default();
        let last = err.lines().last().unwrap_or("").trim().to_string();
        return Answer::None(format!("it exited ({status}) without answering: {last}"));
    };
    match serde_json::from_str::<PlanAnswer>(&text) {
        Ok(answer) => Answer::Plan(Box::new(answer)),
        Err(e) => Answer::None(format!("its answer is unreadable: {e}")),
    }
}

/// The training arguments a TRL-style program reads from `program_args` (its `--config`
/// file, then its flags) as the first registered trainer whose arguments they are
/// (`trl_runtime::train::registry`), whether they name the model, and what its rows cost a
/// rank; None when they are no trainer's (another program's flags) or do not resolve.
pub fn program_args(program_args: &[String]) -> Option<ReadArgs> {
    registry::read_program_args(program_args).map(|(_, read)| read)
}

/// The model directory the program's arguments name (`--model_name_or_path DIR`, or
/// `model_name_or_path` in the `--config FILE` they pass). None when they name neither.
pub fn model_dir(args: &[String]) -> Option<PathBuf> {
    let read = program_args(args)?;
    read.names_model.then_some(read.training.model_name_or_path)
}

/// Whether a TRL-style program recomputes layers in backward: `--gradient_checkpointing`
/// (or transformers 5's `--activation_checkpointing`), else its `--config FILE`, else TRL's
/// default (on).
pub fn gradient_checkpointing(args: &[String]) -> bool {
    program_args(args).map_or(SFTConfig::default().training.gradient_checkpointing, |r| {
        r.training.gradient_checkpointing
    })
}

/// The plan of the built-in decoder (Llama, Qwen2, Qwen3, Mistral) for the model in `dir` split over `tp`
/// ranks, from its config.json alone (no weights are read): every parameter once.
pub fn builtin(dir: &Path, tp: usize) -> trl_runtime::Result<Vec<PlanEntry>> {
    let config = ModelConfig::from_file(dir.join("config.json"))?;
    let mut model = CausalLm::skeleton(
        config,
        trl_runtime::candle_core::DType::F32,
        &trl_runtime::candle_core::Device::Cpu,
    )?;
    // Splitting needs only the group's size and a rank: no collective runs.
    model.parallelize(InProcessWorld::new(tp).world(0)?)?;
    Ok(model.tp_plan().to_vec())
}

/// The plan as the dry run prints it. Decoder layers after the first are split like it, so
/// only layer 0 is listed.
pub fn render(entries: &[PlanEntry], tp: usize, dir: &Path) -> String {
    let later_layer = |name: &str| {
        name.split('.')
            .collect::<Vec<_>>()
            .windows(2)
            .any(|w| w[0] == "layers" && w[1].parse::<usize>().is_ok_and(|l| l > 0))
    };
    let mut out = format!("tensor-parallel plan (tp = {tp}) of {}:\n", dir.display());
    let width = entries.iter().map(|e| e.name.len()).max().unwrap_or(0);
    for e in entries.iter().filter(|e| !later_layer(&e.name)) {
        let split = match e.split.dim {
            Some(d) => format!("dim {d}"),
            None => "whole".into(),
        };
        out += &format!(
            "  {:width$}  {:9}  {:5}  {:?} -> {:?} per rank\n",
            e.name,
            e.split.style.name(),
            split,
            e.full_shape,
            e.local_shape
        );
    }
    if entries.iter().any(|e| later_layer(&e.name)) {
        out += "  (layers 1 and up are split as layer 0)\n";
    }
    let count = |shape: &[usize]| shape.iter().product::<usize>();
    let full: usize = entries.iter().map(|e| count(&e.full_shape)).sum();
    let local: usize = entries.iter().map(|e| count(&e.local_shape)).sum();
    out += &format!(
        "  per rank: {local} of {full} parameters ({:.1}%)",
        100.0 * local as f64 / full as f64
    );
    out
}
