//! The in-process backend: ranks are threads of one process, messages go through channels.
//! Same algorithms and checks as the host backend, without sockets: for fast numerical tests.

use super::ring::RingComm;
use super::transport::{mismatch, OpCode, Sent, Sink, Transport};
use super::Communicator;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct Message {
    op: u32,
    data: Vec<u8>,
}

/// One direction between two ranks.
type Link = (Sender<Message>, Mutex<Receiver<Message>>);

/// Channels between all members of one group: `links[src][dst]`.
struct Mailbox {
    links: Vec<Vec<Link>>,
    alive: Vec<AtomicBool>,
}

impl Mailbox {
    fn new(n: usize) -> Self {
        Mailbox {
            links: (0..n)
                .map(|_| {
                    (0..n)
                        .map(|_| {
                            let (tx, rx) = channel();
                            (tx, Mutex::new(rx))
                        })
                        .collect()
                })
                .collect(),
            alive: (0..n).map(|_| AtomicBool::new(true)).collect(),
        }
    }
}

type GroupKey = (String, Vec<usize>);

/// A set of in-process ranks. Groups are created by name and member list; every member
/// thread asks for the same group and gets its own endpoint.
pub struct InProcessWorld {
    size: usize,
    timeout: Duration,
    /// Mailboxes by group name and member list.
    groups: Mutex<HashMap<GroupKey, Arc<Mailbox>>>,
}

struct Endpoint {
    mailbox: Arc<Mailbox>,
    rank: usize,
    timeout: Duration,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Peers waiting on us learn that we left instead of waiting for the timeout.
        self.mailbox.alive[self.rank].store(false, Ordering::SeqCst);
    }
}

impl Transport for Endpoint {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.mailbox.alive.len()
    }
    fn backend(&self) -> &'static str {
        "inprocess"
    }
    fn send_may_block(&self) -> bool {
        false
    }

    fn send(&self, peer: usize, op: OpCode, data: &[u8]) -> Sent {
        self.mailbox.links[self.rank][peer]
            .0
            .send(Message {
                op: op as u32,
                data: data.to_vec(),
            })
            .map_err(|_| format!("rank {peer} is gone"))
    }

    fn recv(&self, peer: usize, op: OpCode, len: usize, sink: &mut Sink<'_>) -> Sent {
        let rx = self.mailbox.links[peer][self.rank]
            .1
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let start = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(msg) => {
                    if msg.op != op as u32 || msg.data.len() != len {
                        return Err(mismatch(peer, op, len, msg.op, msg.data.len()));
                    }
                    sink(0, &msg.data);
                    return Ok(());
                }
                Err(RecvTimeoutError::Timeout) => {
                    if !self.mailbox.alive[peer].load(Ordering::SeqCst) {
                        return Err(format!("rank {peer} left the group (its thread ended or failed) before sending"));
                    }
                    if start.elapsed() > self.timeout {
                        return Err(format!(
                            "no message from rank {peer} within {:?}: it may be hung or running a different collective",
                            self.timeout
                        ));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(format!("rank {peer} is gone")),
            }
        }
    }
}

impl InProcessWorld {
    pub fn new(size: usize) -> Arc<Self> {
        Self::with_timeout(size, Duration::from_secs(60))
    }

    pub fn with_timeout(size: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(InProcessWorld {
            size,
            timeout,
            groups: Mutex::new(HashMap::new()),
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The communicator of `rank` over all ranks.
    pub fn world(&self, rank: usize) -> Result<Arc<dyn Communicator>> {
        let all: Vec<usize> = (0..self.size).collect();
        self.group("world", &all, rank)
    }

    /// The endpoint of global rank `rank` in the group `members` (global ranks, in group order).
    pub fn group(
        &self,
        name: &str,
        members: &[usize],
        rank: usize,
    ) -> Result<Arc<dyn Communicator>> {
        let local = members
            .iter()
            .position(|&m| m == rank)
            .ok_or_else(|| Error::Comm {
                op: "new_group",
                group: name.into(),
                rank,
                message: format!("rank {rank} is not a member of {members:?}"),
            })?;
        if let Some(&bad) = members.iter().find(|&&m| m >= self.size) {
            return Err(Error::Comm {
                op: "new_group",
                group: name.into(),
                rank,
                message: format!("member {bad} is outside the world of {}", self.size),
            });
        }
        let mailbox = self
            .groups
            .lock()
            .unwrap()
            .entry((name.to_string(), members.to_vec()))
            .or_insert_with(|| Arc::new(Mailbox::new(members.len())))
            .clone();
        mailbox.alive[local].store(true, Ordering::SeqCst);
        let endpoint = Endpoint {
            mailbox,
            rank: local,
            timeout: self.timeout,
        };
        Ok(Arc::new(RingComm::new(
            endpoint,
            format!("{name}{members:?}"),
        )))
    }

    /// Runs `f(rank, world_communicator)` on one thread per rank and returns the results in
    /// rank order. A panic on any rank is re-raised after all threads end.
    pub fn run<R: Send>(
        size: usize,
        f: impl Fn(usize, Arc<dyn Communicator>) -> R + Sync,
    ) -> Vec<R> {
        let world = Self::new(size);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..size)
                .map(|rank| {
                    let world = &world;
                    let f = &f;
                    s.spawn(move || f(rank, world.world(rank).expect("in-process group")))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    }
}
