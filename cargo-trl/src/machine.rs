//! Facts about this machine that the launcher and the planner both read: the GPUs present
//! and how many compute threads each local CPU process gets.

/// The NVIDIA GPUs this process may use: the driver's device nodes, narrowed by
/// CUDA_VISIBLE_DEVICES as CUDA narrows them.
pub fn gpus_present() -> usize {
    let nodes = std::fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.strip_prefix("nvidia").is_some_and(|rest| {
                        !rest.is_empty() && rest.chars().all(|c| c.is_ascii_digit())
                    })
                })
                .count()
        })
        .unwrap_or(0);
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) if !v.trim().is_empty() => v.split(',').count().min(nodes),
        _ => nodes,
    }
}

/// Compute threads of each of `nproc` CPU processes on this machine: its cores shared out.
pub fn cpu_threads_per_process(nproc: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / nproc.max(1)).max(1)
}
