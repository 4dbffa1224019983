//! The tensor-parallel plan of the model a launch will train: which tensors are split how and
//! the shape each rank holds. `--dry-run` prints it; a launch checks it first, so a tp size
//! that does not divide the heads or a dimension fails before any process starts.

use std::path::{Path, PathBuf};
use trl_runtime::comm::InProcessWorld;
use trl_runtime::models::ModelConfig;
use trl_runtime::parallel::CausalLm;
use trl_runtime::tp::PlanEntry;
use trl_runtime::train::SFTConfig;

/// The value of TRL flag `name` (snake_case) among the program's arguments, in either
/// spelling (`--a_b`, `--a-b`, `=VALUE` or the next argument); `Some("")` for a bare flag.
fn flag_value(program_args: &[String], name: &str) -> Option<String> {
    let mut found = None;
    for (i, a) in program_args.iter().enumerate() {
        let Some(flag) = a.strip_prefix("--") else {
            continue;
        };
        let (key, inline) = match flag.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string())),
            None => (flag, None),
        };
        if key.replace('-', "_") != name {
            continue;
        }
        // The last one wins, as with HF's argument parser.
        found = Some(inline.unwrap_or_else(|| match program_args.get(i + 1) {
            Some(next) if !next.starts_with("--") => next.clone(),
            _ => String::new(),
        }));
    }
    found
}

/// The `--config FILE` the program's arguments pass, read as TRL's SFTConfig.
fn config_file(program_args: &[String]) -> Option<SFTConfig> {
    SFTConfig::from_file(flag_value(program_args, "config")?).ok()
}

/// The model directory the program's arguments name: TRL's `--model_name_or_path DIR`, or
/// `model_name_or_path` in the `--config FILE` they pass. None when they name neither.
pub fn model_dir(program_args: &[String]) -> Option<PathBuf> {
    if let Some(dir) = flag_value(program_args, "model_name_or_path") {
        return Some(dir.into());
    }
    Some(config_file(program_args)?.model_name_or_path)
}

/// Whether a TRL-style program recomputes layers in backward: `--gradient_checkpointing`
/// (or transformers 5's `--activation_checkpointing`), else its `--config FILE`, else TRL's
/// SFTConfig default (on).
pub fn gradient_checkpointing(program_args: &[String]) -> bool {
    use trl_runtime::config::cli_value::CliValue;
    for name in ["gradient_checkpointing", "activation_checkpointing"] {
        if let Some(v) = flag_value(program_args, name) {
            return v.is_empty() || bool::parse_cli(v.trim()).unwrap_or(true);
        }
    }
    config_file(program_args).map_or(SFTConfig::default().gradient_checkpointing, |c| {
        c.gradient_checkpointing
    })
}

/// The plan for the model in `dir` split over `tp` ranks, from its config.json alone (no
/// weights are read): every parameter once, with its style and full and per-rank shapes.
pub fn plan(dir: &Path, tp: usize) -> trl_runtime::Result<Vec<PlanEntry>> {
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
