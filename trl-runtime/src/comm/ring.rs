//! Collective algorithms over a [`Transport`]: ring reduce-scatter / all-gather (bandwidth
//! optimal: each rank sends 2(n-1)/n of the buffer for an all-reduce), pairwise all-to-all.

use super::elem::{dispatch, Elem};
use super::transport::{OpCode, Transport};
use super::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor};
use std::ops::Range;
use std::sync::Mutex;

/// Sends below this size go out before the receive starts (they fit in socket buffers).
const INLINE_SEND: usize = 8 << 10;

/// A group communicator running the ring algorithms over a transport.
pub(crate) struct RingComm<T: Transport> {
    transport: T,
    name: String,
    // One collective at a time per group, as on an NCCL stream.
    op_lock: Mutex<()>,
}

fn as_bytes<T: Elem>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Segment `i` of `n` over `len` elements (balanced, the first ones may be shorter by one).
fn segment(len: usize, n: usize, i: usize) -> Range<usize> {
    (i * len / n)..((i + 1) * len / n)
}

/// A shared view of `a` and a mutable view of `b` from one buffer (they must not overlap).
fn split_pair<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    assert!(
        a.end <= b.start || b.end <= a.start,
        "overlapping ring segments"
    );
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// Host copy of a tensor's elements in logical order (handles strides and devices).
fn host_vec<T: Elem>(x: &Tensor) -> Result<Vec<T>> {
    Ok(x.flatten_all()?.to_vec1::<T>()?)
}

fn to_tensor<T: Elem>(data: Vec<T>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
    let t = Tensor::from_vec(data, shape, &Device::Cpu)?;
    Ok(if device.is_cpu() {
        t
    } else {
        t.to_device(device)?
    })
}

impl<T: Transport> RingComm<T> {
    pub fn new(transport: T, name: String) -> Self {
        RingComm {
            transport,
            name,
            op_lock: Mutex::new(()),
        }
    }

    fn err(&self, op: OpCode, message: impl Into<String>) -> Error {
        Error::Comm {
            op: op.name(),
            group: self.name.clone(),
            rank: self.transport.rank(),
            message: message.into(),
        }
    }

    fn unsupported(&self, op: OpCode, dtype: DType) -> Error {
        self.err(
            op,
            format!("dtype {dtype:?} is not supported by the {} backend: use f32, f64, bf16, f16, u8, u32 or i64", self.transport.backend()),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.op_lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_peer(&self, op: OpCode, peer: usize) -> Result<()> {
        if peer >= self.transport.size() {
            return Err(self.err(
                op,
                format!(
                    "rank {peer} is outside the group of {} ranks",
                    self.transport.size()
                ),
            ));
        }
        Ok(())
    }

    /// Sends `data` to `to` while receiving `len` bytes from `from` into `sink`.
    fn exchange(
        &self,
        op: OpCode,
        to: usize,
        data: &[u8],
        from: usize,
        len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        let t = &self.transport;
        if !t.send_may_block() || data.len() <= INLINE_SEND {
            t.send(to, op, data).map_err(|m| self.err(op, m))?;
            return t.recv(from, op, len, sink).map_err(|m| self.err(op, m));
        }
        std::thread::scope(|s| {
            let sender = s.spawn(|| t.send(to, op, data));
            let received = t.recv(from, op, len, sink);
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err("sender thread panicked".into()));
            received.and(sent).map_err(|m| self.err(op, m))
        })
    }

    /// After this, rank r holds the full reduction of segment r.
    fn ring_reduce_scatter<E: Elem>(
        &self,
        op: OpCode,
        buf: &mut [E],
        reduce: ReduceOp,
    ) -> Result<()> {
        let size = std::mem::size_of::<E>();
        let n = self.transport.size();
        self.ring_steps(op, buf, n - 1, |recv, offset, bytes| {
            let start = offset / size;
            E::reduce_bytes(reduce, &mut recv[start..start + bytes.len() / size], bytes);
        })
    }

    /// Given rank r holding segment r, fills every segment on every rank.
    fn ring_all_gather<E: Elem>(&self, op: OpCode, buf: &mut [E]) -> Result<()> {
        self.ring_steps(op, buf, 0, |recv, offset, bytes| {
            let recv: &mut [u8] = bytemuck::cast_slice_mut(recv);
            recv[offset..offset + bytes.len()].copy_from_slice(bytes);
        })
    }

    /// n - 1 steps around the ring: at step s rank r sends segment (r + shift - s) mod n of
    /// `buf` to the next rank and hands each piece of segment (r + shift - s - 1) mod n that
    /// the previous rank sends to `on_recv` (that segment, the piece's byte offset, its bytes).
    fn ring_steps<E: Elem>(
        &self,
        op: OpCode,
        buf: &mut [E],
        shift: usize,
        mut on_recv: impl FnMut(&mut [E], usize, &[u8]),
    ) -> Result<()> {
        let (r, n) = (self.transport.rank(), self.transport.size());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        for step in 0..n - 1 {
            let send_seg = segment(buf.len(), n, (r + n + shift - step) % n);
            let recv_seg = segment(buf.len(), n, (r + 2 * n + shift - step - 1) % n);
            let recv_len = recv_seg.len() * std::mem::size_of::<E>();
            let (send, recv) = split_pair(buf, send_seg, recv_seg);
            self.exchange(
                op,
                next,
                as_bytes(send),
                prev,
                recv_len,
                &mut |offset, bytes| on_recv(&mut *recv, offset, bytes),
            )?;
        }
        Ok(())
    }

    fn all_reduce_typed<E: Elem>(&self, x: &Tensor, reduce: ReduceOp) -> Result<Tensor> {
        let n = self.transport.size();
        let mut buf = host_vec::<E>(x)?;
        if n > 1 {
            let op = OpCode::AllReduce;
            self.ring_reduce_scatter(op, &mut buf, reduce)?;
            self.ring_all_gather(op, &mut buf)?;
        }
        if reduce == ReduceOp::Avg {
            buf.iter_mut().for_each(|v| *v = v.divide(n));
        }
        to_tensor(buf, x.shape(), x.device())
    }

    /// `x` split along `dim` into n chunks, laid out chunk-major in one flat tensor.
    fn chunk_major(&self, op: OpCode, x: &Tensor, dim: usize) -> Result<(Tensor, Shape)> {
        let n = self.transport.size();
        let dims = x.dims();
        if dim >= dims.len() {
            return Err(self.err(op, format!("dim {dim} out of range for shape {:?}", dims)));
        }
        if !dims[dim].is_multiple_of(n) {
            return Err(self.err(
                op,
                format!("dimension {dim} of shape {dims:?} is not divisible by the group size {n}: pad it to a multiple of {n}"),
            ));
        }
        let chunk = dims[dim] / n;
        let mut chunk_shape = dims.to_vec();
        chunk_shape[dim] = chunk;
        let flat = if dims[..dim].iter().all(|&d| d == 1) {
            x.flatten_all()?
        } else {
            let parts = (0..n)
                .map(|i| x.narrow(dim, i * chunk, chunk)?.flatten_all())
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)?
        };
        Ok((flat, Shape::from(chunk_shape)))
    }

    fn reduce_scatter_typed<E: Elem>(
        &self,
        x: &Tensor,
        dim: usize,
        reduce: ReduceOp,
    ) -> Result<Tensor> {
        let op = OpCode::ReduceScatter;
        let (r, n) = (self.transport.rank(), self.transport.size());
        let (flat, chunk_shape) = self.chunk_major(op, x, dim)?;
        let mut buf = host_vec::<E>(&flat)?;
        if n > 1 {
            self.ring_reduce_scatter(op, &mut buf, reduce)?;
        }
        let mut mine = buf[segment(buf.len(), n, r)].to_vec();
        if reduce == ReduceOp::Avg {
            mine.iter_mut().for_each(|v| *v = v.divide(n));
        }
        to_tensor(mine, chunk_shape, x.device())
    }

    fn all_gather_typed<E: Elem>(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let op = OpCode::AllGather;
        let (r, n) = (self.transport.rank(), self.transport.size());
        if dim >= x.rank() {
            return Err(self.err(
                op,
                format!("dim {dim} out of range for shape {:?}", x.dims()),
            ));
        }
        let local = host_vec::<E>(x)?;
        let len = local.len();
        let mut buf = vec![E::zero(); len * n];
        buf[r * len..(r + 1) * len].copy_from_slice(&local);
        if n > 1 {
            self.ring_all_gather(op, &mut buf)?;
        }
        let mut stacked_shape = vec![n];
        stacked_shape.extend_from_slice(x.dims());
        let stacked = Tensor::from_vec(buf, stacked_shape, &Device::Cpu)?;
        let out = if x.dims()[..dim].iter().all(|&d| d == 1) {
            let mut shape = x.dims().to_vec();
            shape[dim] *= n;
            stacked.reshape(shape)?
        } else {
            let parts = (0..n)
                .map(|i| stacked.get(i))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&parts, dim)?
        };
        Ok(if x.device().is_cpu() {
            out
        } else {
            out.to_device(x.device())?
        })
    }

    fn recv_vec<E: Elem>(&self, op: OpCode, src: usize, count: usize) -> Result<Vec<E>> {
        let mut out = vec![E::zero(); count];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        self.transport
            .recv(src, op, bytes.len(), &mut |offset, chunk| {
                bytes[offset..offset + chunk.len()].copy_from_slice(chunk)
            })
            .map_err(|m| self.err(op, m))?;
        Ok(out)
    }

    fn broadcast_typed<E: Elem>(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let op = OpCode::Broadcast;
        let (r, n) = (self.transport.rank(), self.transport.size());
        if r == root {
            let data = host_vec::<E>(x)?;
            let bytes = as_bytes(&data);
            let t = &self.transport;
            // Send to every peer at once so one slow reader does not serialise the rest.
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..n)
                    .filter(|&p| p != root)
                    .map(|p| s.spawn(move || t.send(p, op, bytes)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err("sender thread panicked".into()))
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()
            })
            .map_err(|m| self.err(op, m))?;
            Ok(x.clone())
        } else {
            let data = self.recv_vec::<E>(op, root, x.elem_count())?;
            to_tensor(data, x.shape(), x.device())
        }
    }

    fn send_recv_typed<E: Elem>(&self, x: &Tensor, dst: usize, src: usize) -> Result<Tensor> {
        let op = OpCode::SendRecv;
        let data = host_vec::<E>(x)?;
        let mut out = vec![E::zero(); data.len()];
        {
            let out_bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
            let len = out_bytes.len();
            self.exchange(op, dst, as_bytes(&data), src, len, &mut |offset, chunk| {
                out_bytes[offset..offset + chunk.len()].copy_from_slice(chunk)
            })?;
        }
        to_tensor(out, x.shape(), x.device())
    }

    /// Rows of `x` to each rank by `counts`, `recv[j]` rows from rank j: each pair of ranks
    /// exchanges exactly its rows (no padding), as the even all-to-all's steps do.
    fn all_to_all_v_typed<E: Elem>(
        &self,
        x: &Tensor,
        counts: &[usize],
        recv: &[usize],
    ) -> Result<Tensor> {
        let op = OpCode::AllToAll;
        let (r, n) = (self.transport.rank(), self.transport.size());
        let row: usize = x.dims()[1..].iter().product();
        let data = host_vec::<E>(x)?;
        let starts: Vec<usize> = counts
            .iter()
            .scan(0, |at, &c| {
                let s = *at;
                *at += c * row;
                Some(s)
            })
            .collect();
        let part = |j: usize| &data[starts[j]..starts[j] + counts[j] * row];
        // Each sender's rows land in place in the output, in rank order.
        let total: usize = recv.iter().sum();
        let mut out = vec![E::zero(); total * row];
        let mut at = vec![0; n];
        for j in 1..n {
            at[j] = at[j - 1] + recv[j - 1] * row;
        }
        out[at[r]..at[r] + recv[r] * row].copy_from_slice(part(r));
        {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
            let size = std::mem::size_of::<E>();
            for step in 1..n {
                let (to, from) = ((r + step) % n, (r + n - step) % n);
                let (start, len) = (at[from] * size, recv[from] * row * size);
                let dst = &mut bytes[start..start + len];
                self.exchange(op, to, as_bytes(part(to)), from, len, &mut |o, c| {
                    dst[o..o + c.len()].copy_from_slice(c)
                })?;
            }
        }
        let mut shape = x.dims().to_vec();
        shape[0] = total;
        to_tensor(out, shape, x.device())
    }

    /// `dims`: (split, concat).
    fn all_to_all_typed<E: Elem>(&self, x: &Tensor, dims: (usize, usize)) -> Result<Tensor> {
        let (split_dim, concat_dim) = dims;
        let op = OpCode::AllToAll;
        let (r, n) = (self.transport.rank(), self.transport.size());
        if concat_dim >= x.rank() {
            return Err(self.err(
                op,
                format!(
                    "concat dim {concat_dim} out of range for shape {:?}",
                    x.dims()
                ),
            ));
        }
        let (flat, chunk_shape) = self.chunk_major(op, x, split_dim)?;
        let data = host_vec::<E>(&flat)?;
        let chunk = data.len() / n;
        let mut received: Vec<Vec<E>> = vec![Vec::new(); n];
        received[r] = data[r * chunk..(r + 1) * chunk].to_vec();
        for step in 1..n {
            let (to, from) = ((r + step) % n, (r + n - step) % n);
            let mut incoming = vec![E::zero(); chunk];
            {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut incoming);
                let len = bytes.len();
                self.exchange(
                    op,
                    to,
                    as_bytes(&data[to * chunk..(to + 1) * chunk]),
                    from,
                    len,
                    &mut |o, c| bytes[o..o + c.len()].copy_from_slice(c),
                )?;
            }
            received[from] = incoming;
        }
        let parts = received
            .into_iter()
            .map(|v| Tensor::from_vec(v, chunk_shape.clone(), &Device::Cpu))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let out = Tensor::cat(&parts, concat_dim)?;
        Ok(if x.device().is_cpu() {
            out
        } else {
            out.to_device(x.device())?
        })
    }
}

impl<T: Transport> Communicator for RingComm<T> {
    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn size(&self) -> usize {
        self.transport.size()
    }

    fn backend(&self) -> &'static str {
        self.transport.backend()
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let _g = self.lock();
        dispatch!(x.dtype(), E => self.all_reduce_typed::<E>(x, op), |d| Err(self.unsupported(OpCode::AllReduce, d)))
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let _g = self.lock();
        dispatch!(x.dtype(), E => self.all_gather_typed::<E>(x, dim), |d| Err(self.unsupported(OpCode::AllGather, d)))
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let _g = self.lock();
        dispatch!(x.dtype(), E => self.reduce_scatter_typed::<E>(x, dim, op), |d| Err(self.unsupported(OpCode::ReduceScatter, d)))
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.check_peer(OpCode::Broadcast, root)?;
        let _g = self.lock();
        dispatch!(x.dtype(), E => self.broadcast_typed::<E>(x, root), |d| Err(self.unsupported(OpCode::Broadcast, d)))
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        let op = OpCode::SendRecv;
        self.check_peer(op, dst)?;
        let _g = self.lock();
        dispatch!(x.dtype(), E => {
            let data = host_vec::<E>(x)?;
            self.transport.send(dst, op, as_bytes(&data)).map_err(|m| self.err(op, m))
        }, |d| Err(self.unsupported(op, d)))
    }

    fn recv(&self, shape: &Shape, dtype: DType, device: &Device, src: usize) -> Result<Tensor> {
        let op = OpCode::SendRecv;
        self.check_peer(op, src)?;
        let _g = self.lock();
        dispatch!(dtype, E => {
            let data = self.recv_vec::<E>(op, src, shape.elem_count())?;
            to_tensor(data, shape.clone(), device)
        }, |d| Err(self.unsupported(op, d)))
    }

    fn send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Tensor> {
        self.check_peer(OpCode::SendRecv, dst)?;
        self.check_peer(OpCode::SendRecv, src)?;
        let _g = self.lock();
        dispatch!(x.dtype(), E => self.send_recv_typed::<E>(x, dst, src), |d| Err(self.unsupported(OpCode::SendRecv, d)))
    }

    fn all_to_all(&self, x: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let _g = self.lock();
        dispatch!(x.dtype(), E => self.all_to_all_typed::<E>(x, (split_dim, concat_dim)), |d| Err(self.unsupported(OpCode::AllToAll, d)))
    }

    fn all_to_all_v(&self, x: &Tensor, counts: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        let all = super::exchange_counts(self, x, counts)?;
        let n = self.transport.size();
        let recv: Vec<usize> = (0..n).map(|j| all[j * n + self.transport.rank()]).collect();
        let _g = self.lock();
        let y = dispatch!(x.dtype(), E => self.all_to_all_v_typed::<E>(x, counts, &recv), |d| Err(self.unsupported(OpCode::AllToAll, d)))?;
        Ok((y, recv))
    }

    fn barrier(&self) -> Result<()> {
        let _g = self.lock();
        let n = self.transport.size();
        if n > 1 {
            let mut buf = vec![1u8; n];
            self.ring_reduce_scatter(OpCode::Barrier, &mut buf, ReduceOp::Sum)?;
            self.ring_all_gather(OpCode::Barrier, &mut buf)?;
        }
        Ok(())
    }
}
