//! The launcher's question to a built training program: "what will you train, and how does
//! your model split over tp?" Only the program knows its model type and its own defaults (a
//! config file it reads unless told otherwise, settings in code), so `cargo trl launch` runs
//! it once with [`QUERY_TP_VAR`] and [`QUERY_OUT_VAR`] set before starting the workers; the
//! trainer answers as it loads (the training arguments it resolved, what its rows cost a rank,
//! and the plan of its own model over its model directory, read from
//! config.json and the weight files' shapes, no weights read), writes the answer as JSON to
//! the file and exits. The launcher then refuses a tp size the model cannot take, with
//! nothing started, and `--profile auto` plans the run the program will make.

use super::TrainingArguments;
use crate::comm::InProcessWorld;
use crate::error::{Error, Result};
use crate::models::CausalModel;
use crate::parallel::estimate::Workload;
use crate::parallel::Model;
use crate::tp::PlanEntry;
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};

/// The tp size the launcher asks about.
pub const QUERY_TP_VAR: &str = "TRL_TP_PLAN_QUERY";
/// Where the answer goes.
pub const QUERY_OUT_VAR: &str = "TRL_TP_PLAN_OUT";

/// The answer: the training arguments the program resolved, the model directory it reads, and
/// the plan of its model there, or why that model cannot be split over the asked size.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct PlanAnswer {
    pub model_dir: PathBuf,
    pub plan: std::result::Result<Vec<PlanEntry>, String>,
    /// Its flags over its own defaults and config file, as its workers will read them.
    pub training: TrainingArguments,
    /// What its rows cost a rank ([`super::core::Task::workload`]).
    pub workload: Workload,
}

/// When the launcher asks, writes the training arguments `args`, the task's `workload` and
/// the plan of model `N` in `args.model_name_or_path` split over the asked tp size to the
/// asked file and exits the process; otherwise returns.
pub fn answer_if_asked<N: CausalModel>(args: &TrainingArguments, workload: Workload) -> Result<()> {
    let (Ok(tp), Ok(out)) = (std::env::var(QUERY_TP_VAR), std::env::var(QUERY_OUT_VAR)) else {
        return Ok(());
    };
    let tp: usize = tp.parse().map_err(|_| Error::Env {
        var: QUERY_TP_VAR.into(),
        message: format!("'{tp}' is not a tp size"),
    })?;
    let model_dir = &args.model_name_or_path;
    let answer = PlanAnswer {
        model_dir: model_dir.clone(),
        plan: plan::<N>(model_dir, tp).map_err(|e| e.to_string()),
        training: args.clone(),
        workload,
    };
    let json = serde_json::to_string(&answer).map_err(|e| Error::Env {
        var: QUERY_OUT_VAR.into(),
        message: format!("cannot write the plan: {e}"),
    })?;
    std::fs::write(&out, json)
        .map_err(|e| Error::io(format!("cannot write the plan to {out}"), e))?;
    std::process::exit(0)
}

/// Every parameter's name, split and full and per-rank shapes.
fn plan<N: CausalModel>(dir: &Path, tp: usize) -> Result<Vec<PlanEntry>> {
    let mut model = Model::<N>::skeleton_for(dir, DType::F32, &Device::Cpu)?;
    // Splitting needs only the group's size and a rank: no collective runs.
    model.parallelize(InProcessWorld::new(tp).world(0)?)?;
    Ok(model.tp_plan().to_vec())
}
