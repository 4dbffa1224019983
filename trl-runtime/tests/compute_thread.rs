//! A CPU rank computes on the thread that built its `DistContext`: rayon's parallel loops
//! (the kernels') run there too, not on a pool thread it waits for. Its own test binary: the
//! global pool it sets up outlives the test's thread.

use rayon::prelude::*;
use trl_runtime::dist::DistContext;

#[test]
fn the_context_makes_its_thread_rayons_first_worker() {
    // One compute thread, as `cargo trl launch` gives each of two processes on two cores.
    std::env::set_var("RAYON_NUM_THREADS", "1");
    let _ctx = DistContext::from_env().unwrap();
    assert_eq!(rayon::current_thread_index(), Some(0));
    assert_eq!(rayon::current_num_threads(), 1);
    let here = std::thread::current().id();
    let ran_on: Vec<_> = (0..64)
        .into_par_iter()
        .map(|_| std::thread::current().id())
        .collect();
    assert!(
        ran_on.iter().all(|&t| t == here),
        "a kernel loop left the training thread"
    );
}
