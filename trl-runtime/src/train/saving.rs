//! Checkpoints a trainer writes and reads: whole (HF safetensors and the optimizer state per
//! parameter), sharded (each rank its slices), streamed a unit at a time under ZeRO-3 / FSDP,
//! or a LoRA run's adapters in peft's format; each made in a hidden directory and moved into
//! place.

use super::checkpoint::{self};
use super::core::{parallel_options, Core};
use crate::dist::mesh::Axis;
use crate::error::{Error, Result};
use crate::models::tensor_file::{TensorSpec, WeightsWriter};
use crate::models::{CausalModel, Params};
use crate::nn::lora::LoraConfig;
use crate::optim::{self, AdamW, OPTIMIZER_FILE};
use crate::parallel::fsdp::FsdpOptimizer;
use crate::parallel::sharded_optimizer::ShardedOptimizer;
use crate::parallel::sharded_state;
use crate::parallel::{build, shard_axes, CheckpointFormat};
use crate::tp::state as tp_state;
use candle_core::Tensor;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;

impl<'a, N: CausalModel> Core<'a, N> {
    /// Reads checkpoint `dir` back in place of the trained model and optimizer state, built
    /// as the run was (load_best_model_at_end; collective: every rank calls it).
    pub(super) fn load_checkpoint(&mut self, dir: &std::path::Path) -> Result<()> {
        let step = checkpoint::read_trainer_state(dir)?.global_step as u64;
        let resume = Some((dir.to_path_buf(), step));
        let built = build::<N>(
            self.ctx,
            &parallel_options(&self.args, self.ctx, self.strategy, resume)?,
        )?;
        self.model = built.model;
        self.optimizer = built.optimizer;
        self.tp_grads = built.tp_grads;
        Ok(())
    }

    /// Saves a checkpoint of the current step in the configured format (collective).
    pub fn save_checkpoint(&self) -> Result<Option<PathBuf>> {
        self.save_checkpoint_as(self.checkpoint_format)
    }

    /// Every rank writes its slices into the staging directory; rank 0 adds the config,
    /// tokenizer and index and renames it into place. With HSDP only the first replica writes.
    pub(super) fn save_sharded_checkpoint(&self) -> Result<Option<PathBuf>> {
        let sharded = self
            .optimizer
            .sharded()
            .expect("DDP checkpoints are written full");
        let (pieces, step) = (sharded.pieces()?, sharded.step_count());
        let out = &self.args.output_dir;
        let main = self.ctx.is_main_process();
        let world = self.ctx.world();
        let tmp = checkpoint::staging_dir(out, self.state.global_step);
        if main {
            self.begin_checkpoint(self.state.global_step)?;
        }
        world.barrier()?;
        // The group the optimizer state is sharded over (sequence chunks' ranks included).
        let shard = self.ctx.group(shard_axes(self.model.split()));
        if self.ctx.group(&[Axis::DpReplicate]).rank() == 0 {
            sharded_state::write_rank(&tmp, shard.rank(), shard.size(), &pieces)?;
        }
        world.barrier()?;
        let path = if main {
            let shapes = self.model.parameter_shapes();
            sharded_state::write_index(&tmp, shard.size(), shapes, step)?;
            Some(checkpoint::finish(
                out,
                &tmp,
                &self.state,
                self.args.save_total_limit,
            )?)
        } else {
            None
        };
        world.barrier()?;
        Ok(path)
    }

    /// The whole optimizer state: gathered from the data-parallel shards, then the
    /// tensor-parallel slices joined (collective: every rank calls it).
    pub(super) fn gather_optimizer_state(&self) -> Result<Cow<'_, AdamW>> {
        let state = self.optimizer.gather_full_state()?;
        if self.model.tp().is_none() && self.model.ep().is_none() {
            return Ok(state);
        }
        let state = state.into_owned();
        let states = self
            .model
            .gather_split(state.states, tp_state::gather_param_states)?;
        Ok(Cow::Owned(AdamW { states, ..state }))
    }

    /// A LoRA run's checkpoint: the adapters gathered whole (tensor-parallel slices joined)
    /// and written by rank 0 in peft's format, with their optimizer state.
    pub(super) fn save_adapter_checkpoint(&self, lora: &LoraConfig) -> Result<Option<PathBuf>> {
        let mine: BTreeMap<String, Tensor> = self
            .model
            .params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let mut tensors = self.model.gather_split(mine, tp_state::gather_full)?;
        crate::models::peft::add_aliases(self.model.net(), &mut tensors);
        let order = crate::models::peft::parameter_order(self.model.net());
        self.write_checkpoint(checkpoint::Weights::Adapter {
            tensors: &tensors,
            lora,
            base: &self.args.model_name_or_path,
            order: &order,
        })
    }

    /// Gathers the optimizer state (unless save_only_model), then rank 0 writes the
    /// checkpoint of `weights`.
    pub(super) fn write_checkpoint(
        &self,
        weights: checkpoint::Weights<'_>,
    ) -> Result<Option<PathBuf>> {
        let state = match self.args.save_only_model {
            true => None,
            false => Some(self.gather_optimizer_state()?),
        };
        let path = if self.ctx.is_main_process() {
            Some(checkpoint::save(
                &self.args.output_dir,
                weights,
                &self.tokenizer,
                state.as_deref(),
                &self.state,
                self.args.save_total_limit,
            )?)
        } else {
            None
        };
        self.ctx.world().barrier()?;
        Ok(path)
    }

    /// A full checkpoint of a ZeRO-3 / FSDP model, streamed: each unit's parameters and
    /// optimizer state are gathered whole (tensor-parallel slices joined), written by rank 0
    /// into the weights and optimizer files and dropped before the next unit, so saving holds
    /// one unit beyond the slices instead of the whole model and its state.
    pub(super) fn save_streamed_checkpoint(&self, fsdp: &FsdpOptimizer) -> Result<Option<PathBuf>> {
        let (out, step) = (&self.args.output_dir, self.state.global_step);
        let shapes = self.model.parameter_shapes();
        let plan = self.model.expert_plan();
        let order = fsdp.full_order(|n| plan.names_of(n));
        let shape_of = |name: &str| {
            shapes.get(name).cloned().ok_or_else(|| {
                Error::Parallelism(format!("{name} is sharded but not a model parameter"))
            })
        };
        let mut files = None;
        if self.ctx.is_main_process() {
            let tmp = self.begin_checkpoint(step)?;
            let specs = order
                .iter()
                .map(|(n, dtype)| Ok(TensorSpec::new(n.clone(), *dtype, &shape_of(n)?)))
                .collect::<Result<Vec<_>>>()?;
            let weights = WeightsWriter::with_others(&tmp, specs, usize::MAX, self.model.others());
            let state_shapes = order
                .iter()
                .map(|(n, _)| Ok((n.clone(), shape_of(n)?)))
                .collect::<Result<Vec<_>>>()?;
            let opt = match self.args.save_only_model {
                true => None,
                false => Some(optim::state_file(
                    &tmp.join(OPTIMIZER_FILE),
                    state_shapes,
                    fsdp.step_count(),
                )?),
            };
            files = Some((tmp, weights, opt));
        }
        // A write that fails on rank 0 stops its writing, not its part in the gathers, so
        // that the other ranks are not left waiting; the error is returned after the loop.
        let mut failed = None;
        fsdp.for_each_full_unit(!self.args.save_only_model, |params, states| {
            // Tensor-parallel slices joined, every rank's experts gathered.
            let params = self.model.gather_split(params, tp_state::gather_full)?;
            let states = self
                .model
                .gather_split(states, tp_state::gather_param_states)?;
            if let (Some((_, weights, opt)), None) = (files.as_mut(), &failed) {
                let written: Result<()> = params
                    .iter()
                    .try_for_each(|(n, t)| weights.push(n, t))
                    .and_then(|_| {
                        states.iter().try_for_each(|(n, s)| match opt.as_mut() {
                            Some(opt) => optim::write_state(opt, n, s),
                            None => Ok(()),
                        })
                    });
                failed = written.err();
            }
            Ok(())
        })?;
        let path = match (files, failed) {
            (_, Some(e)) => Err(e),
            (Some((tmp, weights, opt)), None) => weights
                .finish()
                .and_then(|_| opt.map_or(Ok(()), |o| o.finish()))
                .and_then(|_| {
                    checkpoint::finish(out, &tmp, &self.state, self.args.save_total_limit)
                })
                .map(Some),
            (None, None) => Ok(None),
        };
        self.ctx.world().barrier()?;
        path
    }

    /// Starts step `step`'s checkpoint (rank 0): its staging directory, holding config.json
    /// and the tokenizer files; the weights and state follow.
    pub(super) fn begin_checkpoint(&self, step: usize) -> Result<PathBuf> {
        let tmp = checkpoint::begin(&self.args.output_dir, step)?;
        let config = self.model.config_json();
        checkpoint::write_model_files(&tmp, None, config, &self.tokenizer)?;
        Ok(tmp)
    }

    pub(super) fn save_checkpoint_as(&self, format: CheckpointFormat) -> Result<Option<PathBuf>> {
        if let Some(lora) = self.model.lora() {
            return self.save_adapter_checkpoint(lora);
        }
        let tp = self.model.tp();
        // Sharded state is the optimizer's slices: a model-only checkpoint is written full.
        if format == CheckpointFormat::Sharded
            && tp.is_none()
            && self.model.ep().is_none()
            && self.optimizer.sharded().is_some()
            && !self.args.save_only_model
        {
            return self.save_sharded_checkpoint();
        }
        if let Some(fsdp) = self.optimizer.fsdp() {
            return self.save_streamed_checkpoint(fsdp);
        }
        // Weights held whole and unsplit are saved as they are; others are gathered.
        let gathered_params;
        let params = match (&self.model.sharding, tp, self.model.ep()) {
            (None, None, None) => &self.model.params,
            _ => {
                gathered_params = Params::from_tensors(self.gather_weights()?)?;
                &gathered_params
            }
        };
        self.write_checkpoint(checkpoint::Weights::Full {
            params,
            config_json: self.model.config_json(),
            others: self.model.others(),
        })
    }
}
