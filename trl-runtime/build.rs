//! With the `cuda` feature: compiles the fused CUDA kernels (src/nn/kernels/fused.cu) to PTX
//! with nvcc, for compute capability 8.0 (the driver JIT-compiles it for newer GPUs, Hopper
//! included). nvcc is `$NVCC`, else `$CUDA_ROOT/bin/nvcc`, else `nvcc` on the PATH: the same
//! toolkit Candle's own kernels are built with.

use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "src/nn/kernels/fused.cu";

fn main() {
    println!("cargo::rerun-if-changed={SOURCE}");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_ROOT");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("fused.ptx");
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CUDA_ROOT").map(|r| PathBuf::from(r).join("bin/nvcc")))
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-arch=compute_80", "-std=c++17", "-o"])
        .arg(&out)
        .arg(SOURCE)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{} failed ({s}) compiling {SOURCE}", nvcc.display()),
        Err(e) => panic!(
            "the cuda feature compiles {SOURCE} with nvcc, but {} cannot run ({e}): install the \
             CUDA toolkit, or set NVCC or CUDA_ROOT (see .ci/cuda-toolkit)",
            nvcc.display()
        ),
    }
}
