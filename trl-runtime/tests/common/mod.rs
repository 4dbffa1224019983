//! Helpers shared by the integration tests: run a closure on n ranks of either CPU backend.

#![allow(dead_code)]

mod python;
#[allow(unused_imports)]
pub use python::{python_with, stdout_of};

pub mod collectives;

use std::sync::Arc;
use std::time::Duration;
use trl_runtime::comm::{Communicator, HostBackend, InProcessWorld};
use trl_runtime::dist::{Store, StoreServer};

#[derive(Clone, Copy, Debug)]
pub enum Backend {
    InProcess,
    /// Host backend as it runs on one machine: TCP handshake, shared-memory data.
    Host,
    /// Host backend with data over TCP, as between machines.
    HostTcp,
}

pub const BACKENDS: [Backend; 3] = [Backend::InProcess, Backend::Host, Backend::HostTcp];

/// Runs `f(rank, world)` on `n` threads; the host backend talks real TCP over loopback.
pub fn run<R: Send>(
    backend: Backend,
    n: usize,
    f: impl Fn(usize, Arc<dyn Communicator>) -> R + Sync,
) -> Vec<R> {
    match backend {
        Backend::InProcess => InProcessWorld::run(n, f),
        Backend::Host | Backend::HostTcp => run_host(n, Duration::from_secs(30), |rank, host| {
            let all: Vec<usize> = (0..n).collect();
            let host = host.clone_with_shared_memory(matches!(backend, Backend::Host));
            f(rank, host.group("world", &all).expect("host group"))
        }),
    }
}

/// Runs `f(rank, backend)` on `n` threads, each with its own store connection.
pub fn run_host<R: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(usize, &HostBackend) -> R + Sync,
) -> Vec<R> {
    let server = StoreServer::bind("127.0.0.1:0", "test-token").expect("store");
    let addr = server.addr().to_string();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (addr, f) = (&addr, &f);
                s.spawn(move || {
                    let store =
                        Arc::new(Store::connect(addr, "test-token", timeout).expect("connect"));
                    let host = HostBackend::new(store, "test-token", rank, timeout);
                    f(rank, &host)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// Largest absolute element-wise difference of two tensors of the same shape.
pub fn max_abs_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f64 {
    max_abs(&(a - b).unwrap())
}

/// Largest absolute element of a tensor.
pub fn max_abs(t: &candle_core::Tensor) -> f64 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// `max |a - b| / max |b|`: a difference relative to the reference's scale.
pub fn rel_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f64 {
    max_abs_diff(a, b) / max_abs(b).max(1e-12)
}

/// Logits [5, 4] with ties and their targets, for TRL's token figures: rows 0 and 1 hold
/// their maximum at ids 1 and 2 (target 2 tied with an earlier id: no hit; target 1, tied
/// with a later one: a hit), row 2 is a plain hit, row 3's target ties with id 0 (no hit), row
/// 4 is ignored. Every value is exact in bf16.
#[allow(dead_code)]
pub fn tied_logits() -> (candle_core::Tensor, candle_core::Tensor) {
    let dev = candle_core::Device::Cpu;
    let rows = [
        [3f32, 5.0, 5.0, 1.0],
        [3.0, 5.0, 5.0, 1.0],
        [0.5, 0.25, -1.0, 2.0],
        [2.0, 0.25, -1.0, 2.0],
        [0.5, 0.25, -1.0, 2.0],
    ];
    let logits = candle_core::Tensor::new(&rows, &dev).unwrap();
    let targets = candle_core::Tensor::new(&[2i64, 1, 3, 3, -100], &dev).unwrap();
    (logits, targets)
}
