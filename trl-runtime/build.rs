//! With the `cuda` feature: compiles the CUDA kernels (src/kernels/*.cu: the fused ops,
//! flash attention, decode attention and the gated delta rule) to PTX with nvcc, for compute capability 8.0 (the driver JIT-compiles it
//! for newer GPUs, Hopper included), and the Hopper attention kernels (flash_sm90.cu, wgmma)
//! for sm_90a, which only Hopper GPUs load. nvcc is `$NVCC`, else `$CUDA_ROOT/bin/nvcc`, else
//! `nvcc` on the PATH: the same toolkit Candle's own kernels are built with.

use std::path::PathBuf;
use std::process::Command;

/// Each source and the virtual architecture its PTX is for.
const SOURCES: &[(&str, &str)] = &[
    ("fused", "compute_80"),
    ("flash", "compute_80"),
    ("decode", "compute_80"),
    ("gated_delta", "compute_80"),
    ("flash_sm90", "compute_90a"),
];

fn main() {
    for (name, _) in SOURCES {
        println!("cargo::rerun-if-changed=src/kernels/{name}.cu");
    }
    println!("cargo::rerun-if-changed=src/kernels/flash_common.cuh");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_ROOT");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CUDA_ROOT").map(|r| PathBuf::from(r).join("bin/nvcc")))
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    for (name, arch) in SOURCES {
        let source = format!("src/kernels/{name}.cu");
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", &format!("-arch={arch}"), "-std=c++17", "-o"])
            .arg(out_dir.join(format!("{name}.ptx")))
            .arg(&source)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("{} failed ({s}) compiling {source}", nvcc.display()),
            Err(e) => panic!(
                "the cuda feature compiles {source} with nvcc, but {} cannot run ({e}): install \
                 the CUDA toolkit, or set NVCC or CUDA_ROOT (see .ci/cuda-toolkit)",
                nvcc.display()
            ),
        }
    }
}
