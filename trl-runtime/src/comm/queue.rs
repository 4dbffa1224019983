//! Collectives run in the background, in the order they were submitted.
//!
//! A communicator must not be used by two threads at once, and every rank must issue the same
//! collectives in the same order. A [`CommQueue`] keeps both rules while the caller computes:
//! one worker thread per queue takes the submitted collectives first in, first out, and each
//! submission returns a [`Pending`] to wait on. Whoever owns the queue waits for everything it
//! submitted before using the communicator directly again.

use super::Communicator;
use crate::error::{Error, Result};
use candle_core::Tensor;
use std::sync::{mpsc, Arc};

type Job = Box<dyn FnOnce(&dyn Communicator) + Send>;

/// A collective running in the background; [`Pending::wait`] returns its result.
pub struct Pending {
    rx: mpsc::Receiver<Result<Tensor>>,
    group: String,
    rank: usize,
}

impl Pending {
    pub fn wait(self) -> Result<Tensor> {
        self.rx.recv().unwrap_or_else(|_| {
            Err(Error::Comm {
                op: "background collective",
                group: self.group,
                rank: self.rank,
                message: "the communication thread ended before finishing it".into(),
            })
        })
    }
}

/// A worker thread running one communicator's collectives in submission order.
pub struct CommQueue {
    comm: Arc<dyn Communicator>,
    jobs: mpsc::Sender<Job>,
}

impl CommQueue {
    pub fn new(comm: Arc<dyn Communicator>) -> Result<Self> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let worker = comm.clone();
        std::thread::Builder::new()
            .name(format!("trl-comm {}", comm.name()))
            // Ends when the queue (the only sender) is dropped.
            .spawn(move || {
                for job in rx {
                    job(worker.as_ref());
                }
            })
            .map_err(|e| Error::Comm {
                op: "start communication thread",
                group: comm.name().into(),
                rank: comm.rank(),
                message: e.to_string(),
            })?;
        Ok(CommQueue { comm, jobs })
    }

    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Queues `collective`; it runs after everything submitted before it.
    pub fn submit<F>(&self, collective: F) -> Pending
    where
        F: FnOnce(&dyn Communicator) -> Result<Tensor> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        // If the worker is gone the sender is dropped with the job and `wait` reports it.
        let _ = self.jobs.send(Box::new(move |comm: &dyn Communicator| {
            let _ = tx.send(collective(comm));
        }));
        Pending {
            rx,
            group: self.comm.name().into(),
            rank: self.comm.rank(),
        }
    }

    /// Runs `collective` after everything queued before it and returns its result.
    pub fn run<F>(&self, collective: F) -> Result<Tensor>
    where
        F: FnOnce(&dyn Communicator) -> Result<Tensor> + Send + 'static,
    {
        self.submit(collective).wait()
    }
}
