//! Custom ops whose forward is computed outside them. FSDP units, the blockwise attention and
//! the tiled loss compute their result with ordinary tensor ops on detached inputs (so Candle's
//! graph keeps none of the intermediates) and hand it to a custom op, whose backward is theirs.
//! Candle asks the op for a fresh storage, so the result is copied once (on the CPU or, for
//! ops evaluated on a GPU, on the device).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, Layout, Result, Shape, Storage, Tensor};
use std::sync::Mutex;

/// A result waiting for its op's `cpu_fwd`.
#[derive(Default)]
pub(crate) struct Precomputed(Mutex<Option<Tensor>>);

impl Precomputed {
    pub(crate) fn new(t: Tensor) -> Self {
        Precomputed(Mutex::new(Some(t)))
    }

    fn take_tensor(&self, op: &str) -> Result<Tensor> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{op} was evaluated twice")))
    }

    /// The result as the op's output storage (once: a second call is an error naming `op`).
    pub(crate) fn take(&self, op: &str) -> Result<(CpuStorage, Shape)> {
        let t = self.take_tensor(op)?;
        let (storage, layout) = t.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => copy_storage(s, layout),
            _ => candle_core::bail!(
                "{op}: the result is on {:?}, its inputs on the CPU",
                t.device()
            ),
        }
    }

    /// The same for an op evaluated on a GPU: a device-side copy of the result.
    pub(crate) fn take_cuda(&self, op: &str) -> Result<(CudaStorage, Shape)> {
        let t = self.take_tensor(op)?;
        let (storage, layout) = t.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => copy_storage(s, layout),
            _ => candle_core::bail!(
                "{op}: the result is on {:?}, its inputs on a GPU",
                t.device()
            ),
        }
    }
}

/// A fresh, contiguous copy of `s` viewed through `l`, on its own device: what a custom op
/// hands back to Candle.
pub(crate) fn copy_storage<S>(s: &S, l: &Layout) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    // Not zeroed first (one pass fewer: a memset per op, on the CPU and the GPU alike).
    // SAFETY: the storage holds exactly the layout's elements and `copy_strided_src` writes
    // every one of them before anything reads it.
    let mut out = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut out, 0, l)?;
    Ok((out, l.shape().clone()))
}

/// The backward of a three-input computation done outside its op (blockwise and ring
/// attention, the tiled MLP): what it needs besides its inputs, the output and the output's
/// gradient, which it gets detached.
pub(crate) trait Backward3: Send + Sync {
    const NAME: &'static str;
    /// The gradients of the three inputs (None: an input that takes none, a frozen weight).
    fn backward(&self, saved: &Saved3) -> Result<[Option<Tensor>; 3]>;
}

/// What a [`Backward3`] gets, detached: the three inputs, the output and its gradient.
pub(crate) struct Saved3 {
    pub inputs: [Tensor; 3],
    pub out: Tensor,
    pub dout: Tensor,
}

struct Op3<B> {
    backward: B,
    out: Precomputed,
}

impl<B: Backward3> candle_core::CustomOp3 for Op3<B> {
    fn name(&self) -> &'static str {
        B::NAME
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &candle_core::Layout,
        _: &CpuStorage,
        _: &candle_core::Layout,
        _: &CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.out.take(B::NAME)
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &candle_core::Layout,
        _: &CudaStorage,
        _: &candle_core::Layout,
        _: &CudaStorage,
        _: &candle_core::Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.out.take_cuda(B::NAME)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Detached: gradients built from graph tensors would record (and keep alive) every
        // block they were computed from.
        let [dq, dk, dv] = self.backward.backward(&Saved3 {
            inputs: [q.detach(), k.detach(), v.detach()],
            out: out.detach(),
            dout: dout.detach(),
        })?;
        Ok((dq, dk, dv))
    }
}

/// `out`, computed from the three inputs outside the graph, as the result of an op on them
/// whose backward is `backward`'s.
pub(crate) fn with_backward3<B: Backward3 + 'static>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: Tensor,
    backward: B,
) -> Result<Tensor> {
    let op = Op3 {
        backward,
        out: Precomputed::new(out),
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}
