//! A communicator that counts the time spent inside its collectives, so that a run can say
//! what share of a step went to communication. Every group a [`crate::dist::DistContext`]
//! hands out is wrapped; the cost is two clock reads per collective.

use super::{Communicator, ReduceOp};
use crate::error::Result;
use candle_core::{DType, Device, Shape, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub struct Timed {
    inner: Arc<dyn Communicator>,
    nanos: AtomicU64,
}

impl Timed {
    pub fn new(inner: Arc<dyn Communicator>) -> Self {
        Timed {
            inner,
            nanos: AtomicU64::new(0),
        }
    }

    /// Seconds spent inside this group's collectives so far (on any thread of this rank).
    pub fn seconds(&self) -> f64 {
        self.nanos.load(Ordering::Relaxed) as f64 * 1e-9
    }

    fn time<T>(&self, f: impl FnOnce(&dyn Communicator) -> T) -> T {
        let start = Instant::now();
        let out = f(self.inner.as_ref());
        self.nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }
}

impl Communicator for Timed {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.time(|c| c.all_reduce(x, op))
    }
    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        self.time(|c| c.all_gather(x, dim))
    }
    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.time(|c| c.reduce_scatter(x, dim, op))
    }
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.time(|c| c.broadcast(x, root))
    }
    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        self.time(|c| c.send(x, dst))
    }
    fn recv(&self, shape: &Shape, dtype: DType, device: &Device, src: usize) -> Result<Tensor> {
        self.time(|c| c.recv(shape, dtype, device, src))
    }
    fn send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Tensor> {
        self.time(|c| c.send_recv(x, dst, src))
    }
    fn all_to_all(&self, x: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        self.time(|c| c.all_to_all(x, split_dim, concat_dim))
    }
    fn barrier(&self) -> Result<()> {
        self.time(|c| c.barrier())
    }
    fn all_to_all_v(&self, x: &Tensor, counts: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        self.time(|c| c.all_to_all_v(x, counts))
    }
}
