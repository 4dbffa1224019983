//! A global allocator that counts heap bytes live now and at their peak: the allocated
//! memory `parallel::estimate` predicts (as torch's max_memory_allocated is to the reserved
//! memory). A binary includes this file and declares
//! `#[global_allocator] static A: counting::Counting = counting::Counting;`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

pub struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    PEAK.fetch_max(LIVE.fetch_add(by, Relaxed) + by, Relaxed);
}

// SAFETY: every call is forwarded to the system allocator; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            match new > l.size() {
                true => grew(new - l.size()),
                false => {
                    LIVE.fetch_sub(l.size() - new, Relaxed);
                }
            }
        }
        q
    }
}

/// Starts a peak from now; returns the bytes live now.
pub fn reset_peak() -> usize {
    let now = LIVE.load(Relaxed);
    PEAK.store(now, Relaxed);
    now
}

/// The most bytes live since the last [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Relaxed)
}
