//! The NCCL communicator: the [`Communicator`] collectives on CUDA tensors, issued on Candle's
//! own CUDA stream, so they are ordered with the kernels that produce and consume them (no host
//! synchronisation between a backward kernel and the all-reduce of its gradient).
//!
//! NCCL works on contiguous buffers: collectives along a dimension other than the first are
//! rearranged with tensor ops (chunks stacked first), as torch.distributed's wrappers do.
//! All-to-all is grouped send/recv. Buffers are freed in stream order (cudarc frees
//! asynchronously on the stream), so a tensor dropped right after a call stays valid for it.

use super::library::{data_type, red_op, NcclCommHandle, NcclLibrary, UniqueId};
use crate::comm::store::Store;
use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Device, Shape, Storage, Tensor};
use cudarc::driver::{CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

static INSTANCES: AtomicUsize = AtomicUsize::new(0);
use std::time::Duration;

/// Makes communicators for the mesh groups of one process on one GPU: the unique id of each
/// group travels through the rendezvous store, one key per group and generation.
pub struct NcclBackend {
    store: Option<Arc<Store>>,
    rank: usize,
    timeout: Duration,
    device: Device,
    /// Candle's stream on `device`: every communicator issues its calls on it.
    stream: Arc<CudaStream>,
    /// Groups with the same members share one NCCL communicator (each costs GPU memory and
    /// setup time); the mesh names several such groups when an axis has size 1.
    by_members: Mutex<HashMap<Vec<usize>, Arc<dyn Communicator>>>,
    /// Which backend of this process (every rank makes them in the same order): keeps the
    /// store keys of a second context apart from the first's.
    instance: usize,
}

impl NcclBackend {
    /// `rank` is this process's world rank; `device` the CUDA device the model lives on. The
    /// store is needed for groups of more than one rank. Fails with what to install when
    /// libnccl cannot be loaded, before any collective is attempted.
    pub fn new(
        store: Option<Arc<Store>>,
        rank: usize,
        timeout: Duration,
        device: &Device,
    ) -> Result<Self> {
        let fail = |message: String| Error::Comm {
            op: "init",
            group: "world".into(),
            rank,
            message,
        };
        NcclLibrary::get().map_err(fail)?;
        let Device::Cuda(cuda) = device else {
            return Err(fail(format!(
                "the NCCL backend needs a CUDA device, not {device:?}"
            )));
        };
        Ok(NcclBackend {
            store,
            rank,
            timeout,
            device: device.clone(),
            stream: cuda.cuda_stream(),
            by_members: Mutex::new(HashMap::new()),
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Joins the group `name` made of `members` (world ranks, in group order). Every member
    /// must call this, with the same name and members, in the same order of groups.
    pub fn group(&self, name: &str, members: &[usize]) -> Result<Arc<dyn Communicator>> {
        let mut shared = self.by_members.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = shared.get(members) {
            return Ok(c.clone());
        }
        let c = self.join(name, members)?;
        shared.insert(members.to_vec(), c.clone());
        Ok(c)
    }

    fn join(&self, name: &str, members: &[usize]) -> Result<Arc<dyn Communicator>> {
        let fail = |message: String| Error::Comm {
            op: "new_group",
            group: name.into(),
            rank: self.rank,
            message,
        };
        let me = members
            .iter()
            .position(|&m| m == self.rank)
            .ok_or_else(|| fail(format!("rank {} is not a member of {members:?}", self.rank)))?;
        let lib = NcclLibrary::get().map_err(fail)?;
        let key = format!("nccl/{}/{members:?}", self.instance);
        let mut id = UniqueId { internal: [0; 128] };
        if me == 0 {
            // SAFETY: ncclGetUniqueId fills the 128-byte id.
            lib.check(unsafe { (lib.get_unique_id)(&mut id) })
                .map_err(fail)?;
        }
        if members.len() > 1 {
            let store = self.store.as_ref().ok_or_else(|| {
                fail("a group of several ranks needs the rendezvous store".into())
            })?;
            if me == 0 {
                let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                store.set(&key, &bytes)?;
            } else {
                let bytes = store.get_timeout(&key, self.timeout)?;
                if bytes.len() != 128 {
                    return Err(fail(format!(
                        "the NCCL id under {key} has {} bytes, not 128",
                        bytes.len()
                    )));
                }
                for (c, b) in id.internal.iter_mut().zip(bytes) {
                    *c = b as _;
                }
            }
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| fail(format!("cannot make the CUDA device current: {e}")))?;
        let mut handle: NcclCommHandle = std::ptr::null_mut();
        // SAFETY: every member passes the same id and size with its own rank; this blocks until
        // all members have joined.
        lib.check(unsafe {
            (lib.comm_init_rank)(&mut handle, members.len() as c_int, id, me as c_int)
        })
        .map_err(fail)?;
        Ok(Arc::new(NcclCommunicator {
            lib,
            handle: Mutex::new(Handle(handle)),
            rank: me,
            size: members.len(),
            name: name.to_string(),
            device: self.device.clone(),
            stream: self.stream.clone(),
        }))
    }
}

/// Where a same-shape collective reads and writes, and what.
#[derive(Clone, Copy)]
struct Addresses {
    src: *mut c_void,
    dst: *mut c_void,
    count: usize,
    dtype: c_int,
}

struct Handle(NcclCommHandle);
// SAFETY: an NCCL communicator may be used from any thread; the mutex keeps calls on it from
// interleaving.
unsafe impl Send for Handle {}

pub struct NcclCommunicator {
    lib: &'static NcclLibrary,
    handle: Mutex<Handle>,
    rank: usize,
    size: usize,
    name: String,
    device: Device,
    stream: Arc<CudaStream>,
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        let h = self.handle.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the handle came from ncclCommInitRank and is destroyed once.
        unsafe { (self.lib.comm_destroy)(h.0) };
    }
}

fn nccl_type(dtype: DType) -> Option<c_int> {
    Some(match dtype {
        DType::F32 => data_type::FLOAT32,
        DType::F64 => data_type::FLOAT64,
        DType::BF16 => data_type::BFLOAT16,
        DType::F16 => data_type::FLOAT16,
        DType::U8 => data_type::UINT8,
        DType::U32 => data_type::UINT32,
        DType::I64 => data_type::INT64,
        _ => return None,
    })
}

fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => red_op::SUM,
        ReduceOp::Avg => red_op::AVG,
        ReduceOp::Max => red_op::MAX,
        ReduceOp::Min => red_op::MIN,
    }
}

/// The address of a contiguous CUDA tensor's first element.
fn device_address(t: &Tensor, stream: &CudaStream) -> candle_core::Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        candle_core::bail!("NCCL needs a CUDA tensor, got one on {:?}", t.device())
    };
    let base = base_address(s, stream)?;
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

fn base_address(s: &CudaStorage, stream: &CudaStream) -> candle_core::Result<u64> {
    macro_rules! address {
        ($t:ty) => {{
            let (ptr, _record) = s.as_cuda_slice::<$t>()?.device_ptr(stream);
            ptr
        }};
    }
    Ok(match s.dtype() {
        DType::F32 => address!(f32),
        DType::F64 => address!(f64),
        DType::BF16 => address!(half::bf16),
        DType::F16 => address!(half::f16),
        DType::U8 => address!(u8),
        DType::U32 => address!(u32),
        DType::I64 => address!(i64),
        other => candle_core::bail!("NCCL collectives do not take {other:?} tensors"),
    })
}

impl NcclCommunicator {
    fn fail(&self, op: &'static str, message: impl Into<String>) -> Error {
        Error::Comm {
            op,
            group: self.name.clone(),
            rank: self.rank,
            message: message.into(),
        }
    }

    /// `x` contiguous on this communicator's GPU, with its NCCL type.
    fn prepare(&self, op: &'static str, x: &Tensor) -> Result<(Tensor, c_int)> {
        let dtype = nccl_type(x.dtype())
            .ok_or_else(|| self.fail(op, format!("{:?} tensors are not supported", x.dtype())))?;
        Ok((x.to_device(&self.device)?.contiguous()?, dtype))
    }

    fn address(&self, t: &Tensor) -> Result<*mut c_void> {
        Ok(device_address(t, &self.stream)? as usize as *mut c_void)
    }

    /// Runs NCCL calls on this communicator and Candle's stream, as one group when there are
    /// several (grouped send/recv).
    fn issue(
        &self,
        op: &'static str,
        calls: impl FnOnce(&NcclLibrary, NcclCommHandle, *mut c_void) -> Vec<c_int>,
    ) -> Result<()> {
        let handle = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        let lib = self.lib;
        let stream = self.stream.cu_stream() as *mut c_void;
        // SAFETY: group start/end bracket the calls; the handle is this group's.
        lib.check(unsafe { (lib.group_start)() })
            .map_err(|m| self.fail(op, m))?;
        let results = calls(lib, handle.0, stream);
        let end = lib.check(unsafe { (lib.group_end)() });
        for r in results {
            lib.check(r).map_err(|m| self.fail(op, m))?;
        }
        end.map_err(|m| self.fail(op, m))
    }

    /// A collective whose result has `x`'s shape (all-reduce, broadcast, send/recv): `calls`
    /// gets the input and output addresses, the element count and the NCCL type. The result
    /// comes back on `x`'s device.
    fn same_shape(
        &self,
        op: &'static str,
        x: &Tensor,
        calls: impl FnOnce(&NcclLibrary, Addresses, NcclCommHandle, *mut c_void) -> Vec<c_int>,
    ) -> Result<Tensor> {
        let (input, dtype) = self.prepare(op, x)?;
        let out = input.zeros_like()?;
        let at = Addresses {
            src: self.address(&input)?,
            dst: self.address(&out)?,
            count: input.elem_count(),
            dtype,
        };
        self.issue(op, |l, c, s| calls(l, at, c, s))?;
        Ok(out.to_device(x.device())?)
    }

    /// `x`'s `size()` equal chunks along `dim`, stacked into one contiguous [size, ..] buffer.
    fn stacked_chunks(&self, op: &'static str, x: &Tensor, dim: usize) -> Result<Tensor> {
        let d = x.dim(dim)?;
        if d % self.size != 0 {
            return Err(self.fail(
                op,
                format!(
                    "dimension {dim} ({d}) does not split into {} equal chunks",
                    self.size
                ),
            ));
        }
        Ok(Tensor::stack(&x.chunk(self.size, dim)?, 0)?)
    }

    /// Rows of a [size, ..] buffer concatenated along `dim`.
    fn concat_rows(&self, rows: &Tensor, dim: usize) -> Result<Tensor> {
        let parts = (0..self.size)
            .map(|r| rows.get(r))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, dim)?)
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.same_shape("all_reduce", x, |l, a, c, s| {
            vec![unsafe { (l.all_reduce)(a.src, a.dst, a.count, a.dtype, nccl_op(op), c, s) }]
        })
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let (input, dtype) = self.prepare("all_gather", x)?;
        let mut dims = vec![self.size];
        dims.extend_from_slice(input.dims());
        let rows = Tensor::zeros(dims, input.dtype(), &self.device)?;
        let (src, dst) = (self.address(&input)?, self.address(&rows)?);
        let n = input.elem_count();
        self.issue("all_gather", |l, c, s| {
            vec![unsafe { (l.all_gather)(src, dst, n, dtype, c, s) }]
        })?;
        let out = self.concat_rows(&rows, dim)?;
        Ok(out.to_device(x.device())?)
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let (input, dtype) = self.prepare("reduce_scatter", x)?;
        let stacked = self.stacked_chunks("reduce_scatter", &input, dim)?;
        let out = stacked.get(0)?.zeros_like()?;
        let (src, dst) = (self.address(&stacked)?, self.address(&out)?);
        let n = out.elem_count();
        self.issue("reduce_scatter", |l, c, s| {
            vec![unsafe { (l.reduce_scatter)(src, dst, n, dtype, nccl_op(op), c, s) }]
        })?;
        Ok(out.to_device(x.device())?)
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.same_shape("broadcast", x, |l, a, c, s| {
            vec![unsafe { (l.broadcast)(a.src, a.dst, a.count, a.dtype, root as c_int, c, s) }]
        })
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        let (input, dtype) = self.prepare("send", x)?;
        let src = self.address(&input)?;
        let n = input.elem_count();
        self.issue("send", |l, c, s| {
            vec![unsafe { (l.send)(src, n, dtype, dst as c_int, c, s) }]
        })
    }

    fn recv(&self, shape: &Shape, dtype: DType, device: &Device, src: usize) -> Result<Tensor> {
        let nccl_dtype = nccl_type(dtype)
            .ok_or_else(|| self.fail("recv", format!("{dtype:?} tensors are not supported")))?;
        let out = Tensor::zeros(shape, dtype, &self.device)?;
        let dst = self.address(&out)?;
        let n = out.elem_count();
        self.issue("recv", |l, c, s| {
            vec![unsafe { (l.recv)(dst, n, nccl_dtype, src as c_int, c, s) }]
        })?;
        Ok(out.to_device(device)?)
    }

    fn send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Tensor> {
        self.same_shape("send_recv", x, |l, a, c, s| unsafe {
            vec![
                (l.send)(a.src, a.count, a.dtype, dst as c_int, c, s),
                (l.recv)(a.dst, a.count, a.dtype, src as c_int, c, s),
            ]
        })
    }

    fn all_to_all(&self, x: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let (input, dtype) = self.prepare("all_to_all", x)?;
        let stacked = self.stacked_chunks("all_to_all", &input, split_dim)?;
        let rows = stacked.zeros_like()?;
        let n = stacked.elem_count() / self.size;
        let bytes = n * stacked.dtype().size_in_bytes();
        let (from, into) = (self.address(&stacked)?, self.address(&rows)?);
        let size = self.size;
        self.issue("all_to_all", |l, c, s| {
            let mut results = Vec::with_capacity(2 * size);
            for peer in 0..size {
                let offset = peer * bytes;
                // SAFETY: chunk `peer` of both [size, ..] buffers, n elements each.
                unsafe {
                    results.push((l.send)(
                        (from as *const u8).add(offset) as *const c_void,
                        n,
                        dtype,
                        peer as c_int,
                        c,
                        s,
                    ));
                    results.push((l.recv)(
                        (into as *mut u8).add(offset) as *mut c_void,
                        n,
                        dtype,
                        peer as c_int,
                        c,
                        s,
                    ));
                }
            }
            results
        })?;
        let out = self.concat_rows(&rows, concat_dim)?;
        Ok(out.to_device(x.device())?)
    }

    /// Exactly each peer's rows, as torch's `all_to_all_single` with split sizes: the counts
    /// exchanged first (one all-gather), then one grouped send and receive per peer with
    /// rows to move (none for a zero count), no padding.
    fn all_to_all_v(&self, x: &Tensor, counts: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        let all = super::super::exchange_counts(self, x, counts)?;
        let (n, rank) = (self.size, self.rank);
        let recv: Vec<usize> = (0..n).map(|j| all[j * n + rank]).collect();
        let (input, dtype) = self.prepare("all_to_all_v", x)?;
        let row: usize = input.dims()[1..].iter().product();
        let mut dims = input.dims().to_vec();
        dims[0] = recv.iter().sum();
        let out = Tensor::zeros(dims, input.dtype(), &self.device)?;
        // Nothing to move either way (a rank that routed nothing and gets nothing).
        if out.elem_count() == 0 && input.elem_count() == 0 {
            return Ok((out.to_device(x.device())?, recv));
        }
        let bytes = row * input.dtype().size_in_bytes();
        let (from, into) = (self.address(&input)?, self.address(&out)?);
        let starts = |c: &[usize]| -> Vec<usize> {
            c.iter()
                .scan(0, |at, &k| {
                    let s = *at;
                    *at += k;
                    Some(s)
                })
                .collect()
        };
        let (send_at, recv_at) = (starts(counts), starts(&recv));
        let counts = counts.to_vec();
        let recv_counts = recv.clone();
        self.issue("all_to_all_v", |l, c, s| {
            let mut results = Vec::with_capacity(2 * n);
            for peer in 0..n {
                // SAFETY: rows send_at[peer].. of the input and recv_at[peer].. of the output,
                // counts[peer] and recv_counts[peer] of them, inside their buffers.
                unsafe {
                    if counts[peer] > 0 {
                        results.push((l.send)(
                            (from as *const u8).add(send_at[peer] * bytes) as *const c_void,
                            counts[peer] * row,
                            dtype,
                            peer as c_int,
                            c,
                            s,
                        ));
                    }
                    if recv_counts[peer] > 0 {
                        results.push((l.recv)(
                            (into as *mut u8).add(recv_at[peer] * bytes) as *mut c_void,
                            recv_counts[peer] * row,
                            dtype,
                            peer as c_int,
                            c,
                            s,
                        ));
                    }
                }
            }
            results
        })?;
        Ok((out.to_device(x.device())?, recv))
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::ones(1, DType::F32, &self.device)?;
        self.all_reduce(&one, ReduceOp::Sum)?;
        self.stream
            .synchronize()
            .map_err(|e| self.fail("barrier", e.to_string()))
    }
}
