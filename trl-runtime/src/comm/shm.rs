//! Shared-memory rings for host-backend peers on the same machine: one single-producer,
//! single-consumer byte ring per direction in a /dev/shm mapping. Data crosses once (sender
//! copies in, receiver reduces straight out of the ring) instead of twice through the kernel,
//! and waiting uses futexes on the shared counters, so idle ranks do not burn cores.
//!
//! Layout: a 256-byte header (write position, read position, and two futex words, each on its
//! own cache line) followed by `cap` bytes of data. Positions only grow; everything moved is a
//! multiple of 8 bytes except the end of a message, and messages are padded to 8 bytes, so the
//! pieces handed to a reader stay 8-byte aligned.

use memmap2::MmapMut;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

const HEADER: usize = 256;
const HEAD: usize = 0;
const TAIL: usize = 64;
const DATA_SEQ: usize = 128;
const SPACE_SEQ: usize = 192;
/// How long one futex wait lasts before the caller re-checks that its peer is alive.
const POLL: Duration = Duration::from_millis(50);

pub(crate) struct ShmRing {
    map: MmapMut,
    cap: usize,
    /// Bytes of the data region this side has written or read (at most `cap`).
    touched: AtomicUsize,
}

/// Bytes of ring files this process has touched: they count in its resident memory (as
/// RssShmem) beside what the memory plan counts. A ring's pages are touched as traffic goes
/// round it, so a group that only ever sends small messages costs little.
static RESIDENT: AtomicUsize = AtomicUsize::new(0);

/// Bytes of shared-memory rings resident in this process now (the header page and the data
/// traffic has reached, of both directions of every same-machine peer of every group).
pub fn resident_bytes() -> usize {
    RESIDENT.load(Ordering::Relaxed)
}

impl Drop for ShmRing {
    fn drop(&mut self) {
        RESIDENT.fetch_sub(
            PAGE + self.touched.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
    }
}

/// The header's page, touched when the ring is mapped.
const PAGE: usize = 4096;

// SAFETY: the mapping is only accessed through atomics (header) and through disjoint regions
// handed out by the single producer / single consumer protocol below.
unsafe impl Send for ShmRing {}
unsafe impl Sync for ShmRing {}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a FUTEX_WAIT on a valid, aligned u32 in a shared mapping (not process-private).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Called while waiting; returns an error to abandon the wait (peer dead, timeout).
pub(crate) type Check<'a> = &'a mut dyn FnMut() -> Result<(), String>;

impl ShmRing {
    /// Creates a new ring file (failing if it exists) with `cap` data bytes.
    pub fn create(path: &Path, cap: usize) -> std::io::Result<Self> {
        assert!(cap.is_multiple_of(8));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        file.set_len((HEADER + cap) as u64)?;
        // SAFETY: the file is ours and sized above; it is shared only with the peer process.
        let map = unsafe { MmapMut::map_mut(&file)? };
        RESIDENT.fetch_add(PAGE, Ordering::Relaxed);
        Ok(ShmRing {
            map,
            cap,
            touched: AtomicUsize::new(0),
        })
    }

    /// Maps a ring created by the peer.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len() as usize;
        if len <= HEADER || !(len - HEADER).is_multiple_of(8) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not a ring file",
            ));
        }
        // SAFETY: as in create.
        let map = unsafe { MmapMut::map_mut(&file)? };
        RESIDENT.fetch_add(PAGE, Ordering::Relaxed);
        Ok(ShmRing {
            map,
            cap: len - HEADER,
            touched: AtomicUsize::new(0),
        })
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offset is 8-aligned inside the page-aligned header.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: offset is 4-aligned inside the header.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// Moves `pos` (head or tail) to `to` and wakes the side waiting on the sequence at
    /// `seq` (data for the consumer, space for the producer).
    fn publish(&self, pos: &AtomicU64, to: u64, seq: usize) {
        pos.store(to, Ordering::Release);
        self.touch(to);
        self.u32_at(seq).fetch_add(1, Ordering::Release);
        futex_wake(self.u32_at(seq));
    }

    /// Counts the data region up to stream position `upto` as resident.
    fn touch(&self, upto: u64) {
        // Once traffic has gone round the ring there is nothing more to count.
        if self.touched.load(Ordering::Relaxed) == self.cap {
            return;
        }
        let upto = (upto as usize).min(self.cap);
        let before = self.touched.fetch_max(upto, Ordering::Relaxed);
        if upto > before {
            RESIDENT.fetch_add(upto - before, Ordering::Relaxed);
        }
    }

    fn data_ptr(&self) -> *mut u8 {
        // SAFETY: the data region follows the header inside the mapping.
        unsafe { (self.map.as_ptr() as *mut u8).add(HEADER) }
    }

    /// Appends `data` (the producer side). Blocks while the ring is full.
    pub fn write(&self, data: &[u8], check: Check) -> Result<(), String> {
        let (head, tail) = (self.u64_at(HEAD), self.u64_at(TAIL));
        let mut written = 0;
        while written < data.len() {
            let seq = self.u32_at(SPACE_SEQ).load(Ordering::Acquire);
            let h = head.load(Ordering::Relaxed);
            let free = self.cap - (h - tail.load(Ordering::Acquire)) as usize;
            if free == 0 {
                futex_wait(self.u32_at(SPACE_SEQ), seq, POLL);
                // Only a wait that brought nothing counts against the peer.
                if tail.load(Ordering::Acquire) + self.cap as u64 == h {
                    check()?;
                }
                continue;
            }
            let pos = (h as usize) % self.cap;
            let n = free.min(data.len() - written).min(self.cap - pos);
            // SAFETY: [pos, pos+n) is free space that the consumer does not read until head moves.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr().add(written),
                    self.data_ptr().add(pos),
                    n,
                )
            };
            self.publish(head, h + n as u64, DATA_SEQ);
            written += n;
        }
        Ok(())
    }

    /// Consumes exactly `len` bytes (the consumer side), handing them to `sink(offset, bytes)`
    /// straight from the ring, in pieces that are multiples of 8 bytes except the last.
    pub fn read(
        &self,
        len: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
        check: Check,
    ) -> Result<(), String> {
        let (head, tail) = (self.u64_at(HEAD), self.u64_at(TAIL));
        let mut done = 0;
        while done < len {
            let seq = self.u32_at(DATA_SEQ).load(Ordering::Acquire);
            let t = tail.load(Ordering::Relaxed);
            let avail = (head.load(Ordering::Acquire) - t) as usize;
            let pos = (t as usize) % self.cap;
            let mut n = avail.min(len - done).min(self.cap - pos);
            if n < len - done {
                n &= !7;
            }
            if n == 0 {
                futex_wait(self.u32_at(DATA_SEQ), seq, POLL);
                // A peer may write its last message and exit: read what it left before
                // asking whether it is alive.
                if head.load(Ordering::Acquire) - t == avail as u64 {
                    check()?;
                }
                continue;
            }
            // SAFETY: [pos, pos+n) was published by the producer and is not rewritten until tail moves.
            let piece = unsafe { std::slice::from_raw_parts(self.data_ptr().add(pos), n) };
            sink(done, piece);
            self.publish(tail, t + n as u64, SPACE_SEQ);
            done += n;
        }
        Ok(())
    }
}

/// A fresh, unguessable path under /dev/shm for one ring.
pub(crate) fn ring_path(tag: &str) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/trl-{}-{:016x}-{tag}",
        std::process::id(),
        rand::random::<u64>()
    ))
}
