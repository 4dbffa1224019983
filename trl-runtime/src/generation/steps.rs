//! How the decode steps after the prompt run the model.
//!
//! - **Eager**: each step uploads its tokens and positions and runs the forward op by op.
//! - **Fixed**: the step's tokens, positions, length and key spans are written into device
//!   buffers that every step's kernels read (`KvCache::fix_steps`), the forward then run as
//!   it is; on the CPU this checks that those buffers say what the eager steps say.
//! - **Graph** (a GPU, `TRL_CUDA_GRAPHS=1`): fixed steps whose forward (and greedy pick) is
//!   captured once as a CUDA graph and replayed: one launch a step instead of hundreds,
//!   which is what bounds a decode step on a GPU (docs/gpu.md). The first fixed step runs
//!   eagerly with Candle's upload cache on (its shape uploads are then served on the
//!   device), the second is captured, the rest replay it.
//!
//! A model or layer that cannot run as fixed steps (a recurrent state, latent attention,
//! rotary tables that depend on the length, a host read inside the forward) says so with an
//! error at its first fixed step; decoding then goes on eagerly from that step, with a
//! warning, and gives the same tokens.

use super::forward::CachedForward;
use crate::error::Result;
use crate::nn::KvCache;
use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Mutex};

/// How the steps run (see the module's text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Eager,
    Fixed,
    #[cfg(feature = "cuda")]
    Graph,
}

impl Mode {
    /// Graph on a GPU when `TRL_CUDA_GRAPHS=1` and the model reads fixed steps; else eager.
    pub(crate) fn for_run(model: &impl CachedForward, device: &Device) -> Mode {
        let wanted = std::env::var("TRL_CUDA_GRAPHS").is_ok_and(|v| v == "1");
        #[cfg(feature = "cuda")]
        if wanted && device.is_cuda() && model.fixed_steps() {
            return Mode::Graph;
        }
        if wanted {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(
                    "TRL_CUDA_GRAPHS=1: decode steps replay as CUDA graphs on a GPU only, for \
                     a model held whole on one process: here they run eagerly"
                )
            });
        }
        let _ = (model, device);
        Mode::Eager
    }
}

impl Mode {
    /// Fixed steps: as a CUDA graph on a GPU, run as they are elsewhere.
    pub(crate) fn fixed_on(device: &Device) -> Mode {
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            return Mode::Graph;
        }
        let _ = device;
        Mode::Fixed
    }
}

/// A step's result: the last logits [batch, vocab] (f32), or the greedy pick [batch] (u32)
/// when it is made on the device.
pub(crate) enum Out {
    Logits(Tensor),
    Tokens(Tensor),
}

/// The decode steps of one generation.
pub(crate) struct Steps {
    mode: Mode,
    /// Fixed steps' inputs: token ids (u32 [b, 1]) and positions (i64 [b, 1]).
    inputs: Option<(Tensor, Tensor)>,
    /// The greedy pick on the device: every vocabulary index, and past the last (made once,
    /// outside any capture).
    pick: Option<(Tensor, Tensor)>,
    /// Why fixed steps were given up, when they were.
    pub(crate) gave_up: Option<String>,
    #[cfg(feature = "cuda")]
    graph: Option<graph::Captured>,
    /// Fixed steps run so far.
    fixed_runs: usize,
}

impl Steps {
    pub(crate) fn new(mode: Mode) -> Self {
        Steps {
            mode,
            inputs: None,
            pick: None,
            gave_up: None,
            #[cfg(feature = "cuda")]
            graph: None,
            fixed_runs: 0,
        }
    }

    /// The logits (or tokens) after `tokens` at `positions` (one per row) join the cache.
    pub(crate) fn forward(
        &mut self,
        model: &impl CachedForward,
        cache: &Arc<Mutex<KvCache>>,
        (tokens, positions): (&[u32], &[i64]),
        pick_on_device: bool,
    ) -> Result<Out> {
        if self.mode != Mode::Eager {
            match self.fixed(model, cache, (tokens, positions), pick_on_device) {
                Ok(out) => return Ok(out),
                Err(e) => self.give_up(cache, e),
            }
        }
        let device = model.input_device();
        let b = tokens.len();
        let ids = Tensor::from_vec(tokens.to_vec(), (b, 1), &device)?;
        let pos = Tensor::from_vec(positions.to_vec(), (b, 1), &device)?;
        let logits = model.last_logits(&ids, &pos, Some(cache))?;
        lock(cache).commit(1)?;
        Ok(Out::Logits(logits))
    }

    /// Back to eager steps from this one on: the fixed step that failed left nothing held.
    fn give_up(&mut self, cache: &Arc<Mutex<KvCache>>, e: crate::Error) {
        let mut c = lock(cache);
        c.abandon();
        c.set_capturing(false);
        c.unfix_steps();
        // The error's first line: the reason, without a backtrace.
        let why = e.to_string().lines().next().unwrap_or_default().to_string();
        tracing::warn!("generation: decoding on without fixed steps (CUDA graphs): {why}");
        self.gave_up = Some(why);
        self.mode = Mode::Eager;
        #[cfg(feature = "cuda")]
        {
            self.graph = None;
        }
    }

    fn fixed(
        &mut self,
        model: &impl CachedForward,
        cache: &Arc<Mutex<KvCache>>,
        (tokens, positions): (&[u32], &[i64]),
        pick_on_device: bool,
    ) -> Result<Out> {
        let device = model.input_device();
        let b = tokens.len();
        if self.inputs.is_none() {
            lock(cache).fix_steps(&device)?;
            self.inputs = Some((
                Tensor::zeros((b, 1), DType::U32, &device)?,
                Tensor::zeros((b, 1), DType::I64, &device)?,
            ));
        }
        let (ids, pos) = self.inputs.clone().expect("made above");
        ids.slice_set(&Tensor::from_vec(tokens.to_vec(), (b, 1), &device)?, 0, 0)?;
        pos.slice_set(
            &Tensor::from_vec(positions.to_vec(), (b, 1), &device)?,
            0,
            0,
        )?;
        lock(cache).write_step()?;
        let pick = &mut self.pick;
        // The step's forward and pick; the pick's tables are made at the first step (outside
        // any capture: they are uploaded).
        let mut run = move || -> Result<Out> {
            let logits = model.last_logits(&ids, &pos, Some(cache))?;
            if !pick_on_device {
                return Ok(Out::Logits(logits));
            }
            if pick.is_none() {
                *pick = Some(pick_tables(&logits)?);
            }
            let tables = pick.as_ref().expect("made above");
            Ok(Out::Tokens(first_argmax_on(&logits, tables)?))
        };
        self.fixed_runs += 1;
        #[cfg(feature = "cuda")]
        if self.mode == Mode::Graph {
            return graph::step(&mut self.graph, self.fixed_runs, cache, &device, run);
        }
        let out = run()?;
        lock(cache).commit(1)?;
        Ok(out)
    }
}

/// For [`first_argmax_on`] over `logits` [b, vocab]: every vocabulary index, and
/// `u32::MAX` (a row without a maximum: NaNs), [b, vocab] u32 each.
pub(crate) fn pick_tables(logits: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, vocab) = logits.dims2()?;
    let device = logits.device();
    let index = Tensor::arange(0u32, vocab as u32, device)?.broadcast_as((b, vocab))?;
    let past = Tensor::full(u32::MAX, (b, vocab), device)?;
    Ok((index, past))
}

/// Each row's first index of its largest logit, [b] u32 on `logits`' device (`u32::MAX`
/// where a row holds no maximum: NaNs).
pub(crate) fn first_argmax_on(logits: &Tensor, (index, past): &(Tensor, Tensor)) -> Result<Tensor> {
    let l = logits.to_dtype(DType::F32)?;
    let hit = l.broadcast_eq(&l.max_keepdim(1)?)?;
    Ok(hit.where_cond(index, past)?.min(1)?)
}

fn lock(cache: &Arc<Mutex<KvCache>>) -> std::sync::MutexGuard<'_, KvCache> {
    cache.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(feature = "cuda")]
mod graph {
    //! The capture and the replays (`TRL_CUDA_GRAPHS=1`).

    use super::{lock, Out};
    use crate::error::{Error, Result};
    use crate::nn::KvCache;
    use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph};
    use candle_core::Device;
    use std::sync::{Arc, Mutex};

    /// A captured step: the graph and the tensor its launch writes.
    pub(super) struct Captured {
        // Declared first: the graph goes before the memory its launches wrote.
        graph: CudaGraph,
        out: Out,
    }

    fn clone(out: &Out) -> Out {
        match out {
            Out::Logits(t) => Out::Logits(t.clone()),
            Out::Tokens(t) => Out::Tokens(t.clone()),
        }
    }

    fn cuda_err(e: impl std::fmt::Display) -> Error {
        Error::Parallelism(format!("CUDA graph: {e}"))
    }

    /// One fixed step under a graph: the first eager with the upload cache on (what it
    /// uploads is then found on the device), the second captured and launched, the rest
    /// launched. `run` is the step's forward and pick.
    pub(super) fn step(
        graph: &mut Option<Captured>,
        fixed_runs: usize,
        cache: &Arc<Mutex<KvCache>>,
        device: &Device,
        run: impl FnOnce() -> Result<Out>,
    ) -> Result<Out> {
        let Device::Cuda(dev) = device else {
            return Err(cuda_err("the model is not on a GPU"));
        };
        if let Some(c) = graph {
            c.graph.launch().map_err(cuda_err)?;
            lock(cache).advance(1);
            return Ok(clone(&c.out));
        }
        let _uploads = dev.enable_cuda_graph_htod_cache();
        if fixed_runs == 1 {
            let out = run()?;
            lock(cache).commit(1)?;
            return Ok(out);
        }
        let stream = dev.cuda_stream();
        // Whatever the first step left to run is not part of the graph.
        stream.synchronize().map_err(cuda_err)?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda_err)?;
        lock(cache).set_capturing(true);
        let recorded = run();
        {
            let mut c = lock(cache);
            c.set_capturing(false);
            // Nothing ran: the launch below is the step.
            c.abandon();
        }
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let ended = stream.end_capture(flags);
        // An error a failed capture left recorded on the context would surface at the next
        // call: take it now.
        let recorded_err = stream.context().check_err();
        let out = recorded?;
        let captured = ended
            .map_err(cuda_err)?
            .ok_or_else(|| cuda_err("the capture recorded nothing"))?;
        recorded_err.map_err(cuda_err)?;
        captured.launch().map_err(cuda_err)?;
        lock(cache).advance(1);
        let c = graph.insert(Captured {
            graph: captured,
            out,
        });
        Ok(clone(&c.out))
    }
}
