//! `cargo trl env`: what a bug report needs — versions, CPU cores and their matmul rate, GPUs
//! with driver and NCCL presence, the default launch config, and the distributed variables
//! already set.

fn library_present(name: &str) -> bool {
    // SAFETY: opening a system library runs only its initialisers; it is closed right away.
    unsafe { libloading::Library::new(name) }.is_ok()
}

/// The CUDA version the driver supports (cuDriverGetVersion), as major.minor.
fn cuda_driver_version() -> Option<String> {
    // SAFETY: libcuda's initialisers only; cuDriverGetVersion writes one int and needs no
    // cuInit.
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1").ok()?;
        let get: libloading::Symbol<unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int> =
            lib.get(b"cuDriverGetVersion\0").ok()?;
        let mut v = 0;
        (get(&mut v) == 0).then(|| format!("{}.{}", v / 1000, v % 1000 / 10))
    }
}

fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn report() -> String {
    let mut lines = vec![
        format!("cargo-trl: {}", env!("CARGO_PKG_VERSION")),
        format!(
            "rustc: {}",
            command_output("rustc", &["--version"]).unwrap_or_else(|| "not found".into())
        ),
        format!("os: {} {}", std::env::consts::OS, std::env::consts::ARCH),
        format!("host: {}", trl_runtime::dist::spawn::hostname()),
        format!(
            "cpu cores: {}",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
    ];
    // What `cargo trl plan` predicts CPU steps with.
    let threads = trl_runtime::parallel::estimate::cpu_threads();
    let rates = trl_runtime::parallel::estimate::cpu_step_rates(1, threads);
    lines.push(format!(
        "cpu f32 matmul: {:.1} GFLOP/s (512-cube GEMMs, one on each of {threads} thread(s) at once)",
        rates.rank_flops / 1e9,
    ));
    lines.push(format!(
        "cpu matmul share of a step: {:.2} (forward+backward of a small model against its matmuls' time, {threads} thread(s))",
        rates.matmul_share
    ));
    lines.push(format!(
        "cpu LoRA step: {:.1} ns per token and adapted feature beyond its FLOPs (r 16, dropout 0.05)",
        rates.adapter_element_seconds * 1e9
    ));
    lines.push(format!(
        "cpu whole-logits loss: {:.1} ns per logit, forward and backward (what ZeRO-3, FSDP and tp add)",
        trl_runtime::parallel::estimate::cpu_whole_logits_seconds() * 1e9
    ));
    // And the host backend's collectives between 2 ranks (what plan predicts CPU runs with).
    lines.push(
        match trl_runtime::parallel::estimate::host_all_reduce_speed(2) {
            Ok(l) => format!(
                "host all-reduce (2 ranks, shared memory): {:.0} us per collective, {:.2} GB/s bus bandwidth",
                l.latency * 1e6,
                l.bandwidth / 1e9
            ),
            Err(e) => format!("host all-reduce: not measured ({e})"),
        },
    );
    let gpus = command_output(
        "nvidia-smi",
        &[
            "--query-gpu=index,name,memory.total",
            "--format=csv,noheader",
        ],
    );
    match gpus {
        Some(list) if !list.is_empty() => {
            lines.push("gpus:".into());
            lines.extend(list.lines().map(|l| format!("  {l}")));
        }
        _ => lines.push("gpus: none found (nvidia-smi unavailable or no devices)".into()),
    }
    let driver = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|v| v.lines().next().map(str::to_string));
    lines.push(format!(
        "nvidia driver: {}",
        driver.unwrap_or_else(|| "not loaded".into())
    ));
    lines.push(format!(
        "cuda driver api: {}",
        match cuda_driver_version() {
            Some(v) => format!("{v} (libcuda.so.1)"),
            None if library_present("libcuda.so.1") => "libcuda.so.1 found, version unknown".into(),
            None => "libcuda.so.1 not found (no NVIDIA driver)".into(),
        }
    ));
    lines.push(format!(
        "nccl: {}",
        match trl_runtime::comm::nccl::NcclLibrary::get() {
            Ok(lib) => match lib.version() {
                Ok(v) => format!("{v} ({})", lib.path),
                Err(e) => format!("{} loaded but its version is unknown: {e}", lib.path),
            },
            Err(e) => format!("not usable: {e}"),
        }
    ));
    lines.push(
        "gpu build: a training crate uses GPUs when built with `--features trl-runtime/cuda,trl-runtime/nccl` (nvcc needed; see the README)"
            .into(),
    );
    let default = crate::launch::default_config_path();
    lines.push(format!(
        "default launch config: {} ({})",
        default.display(),
        if default.exists() {
            "present"
        } else {
            "absent: launch runs 1 CPU process unless given --profile or --config_file"
        }
    ));
    let vars = [
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_JOB_ID",
        "SLURM_JOB_NODELIST",
        "CUDA_VISIBLE_DEVICES",
    ];
    let set: Vec<String> = vars
        .iter()
        .filter_map(|v| std::env::var(v).ok().map(|x| format!("{v}={x}")))
        .collect();
    lines.push(format!(
        "distributed variables set: {}",
        if set.is_empty() {
            "none".into()
        } else {
            set.join(" ")
        }
    ));
    lines.join("\n")
}
