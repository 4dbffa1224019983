//! A reference model held as weights beside the policy's, for trainers with a KL term or a
//! reference (TR-DPO's `sync_ref_model`, GRPO's): this rank's share of the weights (sharded
//! and split as the policy's), swapped into the model to run the reference with no second
//! model, mixed with the policy every few steps (TRL's SyncRefModelCallback), and saved
//! beside each checkpoint so that a resumed run continues with it.

use super::core::Core;
use crate::error::{Error, Result};
use crate::models::CausalModel;
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};

/// How the reference follows the policy: alpha x policy + (1 - alpha) x reference every
/// `every` steps (TRL's `ref_model_mixup_alpha`, `ref_model_sync_steps`).
#[derive(Debug, Clone, Copy)]
pub struct Mixing {
    pub alpha: f64,
    pub every: usize,
}

/// The reference's own weights, as this rank holds the policy's. Until the first mix they are
/// the policy before training (whose outputs a trainer may precompute).
pub struct HeldReference {
    mixing: Mixing,
    /// Under LoRA only the adapters are held (the frozen base is the reference's too): the
    /// initial adapters, whose product is zero, make the reference the base with its adapters
    /// off, at the adapters' size.
    adapters_only: bool,
    /// In [`crate::parallel::Model::held_values`]'s order; in a cell, for the swaps.
    weights: std::cell::RefCell<Vec<Tensor>>,
    mixed: bool,
}

/// What this rank holds of the weights a reference keeps (see [`HeldReference`]).
fn held<N: CausalModel>(core: &Core<'_, N>, adapters_only: bool) -> Vec<Tensor> {
    match adapters_only {
        true => core
            .model
            .params
            .iter()
            .map(|(_, v)| v.as_tensor().clone())
            .collect(),
        false => core.model.held_values(),
    }
}

/// Where a run keeps each rank's reference weights at checkpoint `step`.
fn weights_file(output_dir: &Path, step: usize, rank: usize) -> PathBuf {
    output_dir
        .join("ref_model")
        .join(format!("checkpoint-{step}"))
        .join(format!("rank-{rank}.safetensors"))
}

impl HeldReference {
    /// The reference of a run at step `step` holding `weights` (this rank's share): mixed
    /// once `step` has reached the first sync.
    fn new(mixing: Mixing, weights: Vec<Tensor>, step: usize, adapters_only: bool) -> Self {
        HeldReference {
            mixing,
            adapters_only,
            weights: weights.into(),
            mixed: step >= mixing.every,
        }
    }

    /// A copy of the policy as it is now (before training): this rank's share, in the
    /// compute dtype.
    pub fn of_policy<N: CausalModel>(mixing: Mixing, core: &Core<'_, N>) -> Result<Self> {
        let adapters_only = core.model.lora().is_some();
        let weights = held(core, adapters_only)
            .iter()
            .map(Tensor::copy)
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self::new(
            mixing,
            weights,
            core.state.global_step,
            adapters_only,
        ))
    }

    /// Whether it has been mixed with the policy (until then it is the policy before training).
    pub fn mixed(&self) -> bool {
        self.mixed
    }

    /// Writes this rank's reference weights for checkpoint `step` (atomically), and drops
    /// those of earlier checkpoints.
    pub fn save<N: CausalModel>(&self, core: &Core<'_, N>, step: usize) -> Result<()> {
        let path = weights_file(&core.args.output_dir, step, core.ctx.world().rank());
        let dir = path.parent().expect("a file in a directory");
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
        let named: std::collections::HashMap<String, Tensor> = self
            .weights
            .borrow()
            .iter()
            .enumerate()
            .map(|(i, t)| Ok((i.to_string(), t.to_device(&Device::Cpu)?)))
            .collect::<Result<_>>()?;
        let tmp = path.with_extension("tmp");
        candle_core::safetensors::save(&named, &tmp)?;
        std::fs::rename(&tmp, &path)
            .map_err(|e| Error::io(format!("cannot move {} into place", path.display()), e))?;
        if core.ctx.is_main_process() {
            let root = dir.parent().expect("ref_model");
            for old in std::fs::read_dir(root).into_iter().flatten().flatten() {
                let name = old.file_name().to_string_lossy().to_string();
                let earlier = name
                    .strip_prefix("checkpoint-")
                    .and_then(|n| n.parse::<usize>().ok())
                    .is_some_and(|n| n < step);
                if earlier {
                    let _ = std::fs::remove_dir_all(old.path());
                }
            }
        }
        Ok(())
    }

    /// The reference a resumed run had at its checkpoint: this rank's file, which must hold
    /// what this rank holds (the same launch layout).
    pub fn resume<N: CausalModel>(mixing: Mixing, core: &Core<'_, N>) -> Result<Self> {
        let step = core.state.global_step;
        let path = weights_file(&core.args.output_dir, step, core.ctx.world().rank());
        let source = path.display().to_string();
        let adapters_only = core.model.lora().is_some();
        let held = held(core, adapters_only);
        let device = held.first().map_or(Device::Cpu, |t| t.device().clone());
        let loaded = candle_core::safetensors::load(&path, &device).map_err(|e| {
            Error::config(&source, "sync_ref_model", format!("the reference of checkpoint-{step} cannot be read ({e}): resume from a checkpoint this run saved, under the launch it ran with"))
        })?;
        let mut weights = Vec::with_capacity(held.len());
        for (i, h) in held.iter().enumerate() {
            let t = loaded.get(&i.to_string()).filter(|t| t.dims() == h.dims());
            let t = t.ok_or_else(|| Error::config(&source, "sync_ref_model", format!("tensor {i} is missing or shaped otherwise than this rank's weights {:?}: resume under the launch (profile, processes, parallelism) the run was saved with", h.dims())))?;
            weights.push(t.to_dtype(h.dtype())?);
        }
        if loaded.len() != held.len() {
            return Err(Error::config(&source, "sync_ref_model", format!("{} tensors, this rank holds {}: resume under the launch the run was saved with", loaded.len(), held.len())));
        }
        Ok(Self::new(mixing, weights, step, adapters_only))
    }

    /// `f` run with the reference's weights in the model (swapped back however it ends).
    pub fn run<N: CausalModel, R>(
        &self,
        core: &Core<'_, N>,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let mut weights = self.weights.borrow_mut();
        let swap = |w: &mut [Tensor]| -> Result<()> {
            match self.adapters_only {
                true => {
                    for ((_, var), v) in core.model.params.iter().zip(w.iter_mut()) {
                        let current = var.as_tensor().copy()?;
                        var.set(v)?;
                        *v = current;
                    }
                    Ok(())
                }
                false => core.model.swap_held_values(w),
            }
        };
        swap(&mut weights)?;
        let out = f();
        swap(&mut weights)?;
        out
    }

    /// After an optimizer step: every `every` steps the reference becomes alpha x policy +
    /// (1 - alpha) x reference, on each rank's own share.
    pub fn after_step<N: CausalModel>(&mut self, core: &Core<'_, N>) -> Result<()> {
        if !core.state.global_step.is_multiple_of(self.mixing.every) {
            return Ok(());
        }
        let policy = held(core, self.adapters_only);
        let alpha = self.mixing.alpha;
        for (r, p) in self.weights.get_mut().iter_mut().zip(&policy) {
            *r = (r.affine(1.0 - alpha, 0.0)? + p.affine(alpha, 0.0)?)?;
        }
        self.mixed = true;
        Ok(())
    }
}

/// Reference log-probabilities computed before training, two per row (DPO's chosen and
/// rejected, KTO's completion and mismatched completion), for the training and held-out
/// rows: kept in the output directory for a resumed run, whose policy is no longer the
/// reference.
pub type RefLogps = Vec<(f64, f64)>;

/// What `output_dir/ref_logps.json` holds.
#[derive(serde::Serialize, serde::Deserialize)]
struct RefCache {
    model: PathBuf,
    train: RefLogps,
    eval: RefLogps,
}

fn ref_logps_file(output_dir: &Path) -> PathBuf {
    output_dir.join("ref_logps.json")
}

/// Writes the reference log-probabilities of a run on `model` (atomically).
pub fn save_ref_logps(
    output_dir: &Path,
    model: &Path,
    train: &RefLogps,
    eval: &RefLogps,
) -> Result<()> {
    std::fs::create_dir_all(output_dir)
        .map_err(|e| Error::io(format!("cannot create {}", output_dir.display()), e))?;
    let cache = RefCache {
        model: model.to_path_buf(),
        train: train.clone(),
        eval: eval.clone(),
    };
    let text = serde_json::to_string(&cache).expect("numbers serialize");
    crate::models::params::write_atomic(&ref_logps_file(output_dir), text.as_bytes())
}

/// The reference log-probabilities a `trainer` run saved before training, for its resume:
/// refused when missing or when their counts are not the datasets' (`rows`: training and
/// held-out rows now; `noun`: what a row is).
pub fn resume_ref_logps(
    output_dir: &Path,
    trainer: &str,
    rows: (usize, usize),
    noun: &str,
) -> Result<(RefLogps, RefLogps)> {
    let path = ref_logps_file(output_dir);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::io(
            format!(
                "resuming {trainer} needs the reference log-probabilities the run computed before training ({}); without them the reference would be the resumed policy",
                path.display()
            ),
            e,
        )
    })?;
    let cache: RefCache = serde_json::from_str(&text)
        .map_err(|e| Error::config(path.display().to_string(), "<document>", e.to_string()))?;
    if (cache.train.len(), cache.eval.len()) != rows {
        return Err(Error::config(
            path.display().to_string(),
            "train",
            format!(
                "{} / {} {noun} cached, the datasets have {} / {}: resume with the data the run started with",
                cache.train.len(),
                cache.eval.len(),
                rows.0,
                rows.1
            ),
        ));
    }
    Ok((cache.train, cache.eval))
}

/// A trainer's synced reference, if it keeps one, saved beside checkpoint `step`.
pub fn save_synced<N: CausalModel>(
    sync: &Option<HeldReference>,
    core: &Core<'_, N>,
    step: usize,
) -> Result<()> {
    sync.as_ref().map_or(Ok(()), |s| s.save(core, step))
}

/// A trainer's synced reference, if it keeps one, mixed after a step when it is due.
pub fn mix_synced<N: CausalModel>(
    sync: &mut Option<HeldReference>,
    core: &Core<'_, N>,
) -> Result<()> {
    sync.as_mut().map_or(Ok(()), |s| s.after_step(core))
}

/// The reference's log-probabilities of `len` rows, computed before training as TRL's
/// precompute DataLoader deals them (`batch` per data-parallel rank, no row dropped, every
/// rank running as many batches): `batch_logps` gives a batch's, by row index; every rank
/// gets every row's.
pub fn precompute_ref_logps<N: CausalModel>(
    core: &Core<'_, N>,
    len: usize,
    batch: usize,
    mut batch_logps: impl FnMut(&[usize]) -> Result<RefLogps>,
) -> Result<RefLogps> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let deal = crate::data::BatchDeal {
        len,
        batch,
        world: core.dp.size(),
        drop_last: false,
    };
    let rank = core.dp.rank();
    let mut out = vec![0.0; 2 * len];
    for round in 0..deal.rounds() {
        let idx = deal.rows(round, rank);
        let logps = batch_logps(&idx)?;
        // The refill repeats rows another batch holds: each is written once.
        for (j, &k) in idx[..deal.real_rows(round, rank)].iter().enumerate() {
            (out[2 * k], out[2 * k + 1]) = logps[j];
        }
    }
    let all = core.global_sum(&out)?;
    Ok(all.chunks(2).map(|c| (c[0], c[1])).collect())
}

/// TRL's refusals of `sync_ref_model` (DPO's and KTO's): with LoRA (the reference is the base
/// with its adapters off, no model of its own to mix into), with precomputed reference
/// log-probabilities (a fixed reference), with 0 steps between syncs, and a mixing weight
/// outside [0, 1]. The key and why.
pub fn sync_refusal(
    use_peft: bool,
    precompute_ref_log_probs: bool,
    mixing: Mixing,
) -> Option<(&'static str, String)> {
    if use_peft {
        return Some(("sync_ref_model", "with use_peft the reference is the base with its adapters off, so there is no reference model of its own to mix the policy into (TRL refuses it too): drop one of the two".into()));
    }
    if precompute_ref_log_probs {
        return Some(("sync_ref_model", "precompute_ref_log_probs assumes a fixed reference, and the sync changes it every ref_model_sync_steps (TRL refuses it too): drop one of the two".into()));
    }
    if mixing.every == 0 {
        return Some((
            "ref_model_sync_steps",
            "0: give the number of steps between syncs (TRL's default is 512)".into(),
        ));
    }
    (!(0.0..=1.0).contains(&mixing.alpha)).then(|| {
        (
            "ref_model_mixup_alpha",
            format!(
                "{}: the policy's share of the new reference lies in [0, 1]",
                mixing.alpha
            ),
        )
    })
}
