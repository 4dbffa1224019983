//! `cargo trl env`: what a bug report needs — versions, CPU cores, GPUs with driver and NCCL
//! presence, the default launch config, and the distributed variables already set.

use std::ffi::CString;

fn library_present(name: &str) -> bool {
    let c = CString::new(name).expect("no NUL");
    // SAFETY: dlopen with a valid C string; the handle is closed right away.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            false
        } else {
            libc::dlclose(h);
            true
        }
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
        "libcuda.so.1: {}",
        if library_present("libcuda.so.1") {
            "found"
        } else {
            "not found"
        }
    ));
    lines.push(format!(
        "libnccl.so.2: {}",
        if library_present("libnccl.so.2") {
            "found"
        } else {
            "not found (GPU collectives need it)"
        }
    ));
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
