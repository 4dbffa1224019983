//! Small f32 GEMMs on the CPU over strided views, through the `gemm` crate: the blocks of
//! the attention kernels ([`super::cpu_flash`]) and the loss's weight gradient added into its
//! running sum ([`super::precision`]).

/// Bytes of the `gemm` crate's packing buffer: one per thread that runs a GEMM, the size of
/// the L2 cache, allocated on the thread's first GEMM and kept until it exits.
pub fn packing_buffer_bytes() -> usize {
    gemm_common::cache::CACHE_INFO[1].cache_bytes
}

/// Allocates the packing buffer on this thread and on every rayon worker (once a process).
/// Otherwise a process holds one per thread that has happened to run a GEMM, which on a
/// small model depends on how the work was split; reserved (and resident), a CPU rank's heap is the same on
/// any model (what `parallel::estimate` counts: one buffer per compute thread, the training
/// thread being rayon's worker 0 once `DistContext` is built).
pub fn reserve_packing_buffers() {
    static RESERVED: std::sync::Once = std::sync::Once::new();
    RESERVED.call_once(|| {
        // Every page written once, so the buffer is resident whatever the GEMMs' sizes and a
        // rank's resident memory is what the plan counts.
        let touch = || {
            gemm_common::gemm::L2_SLAB.with(|slab| {
                for byte in slab.borrow_mut().iter_mut().step_by(4096) {
                    byte.write(0);
                }
            })
        };
        touch();
        rayon::broadcast(|_| touch());
    });
}

/// A row-major view: element (r, c) at `r * rs + c * cs`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// Row-major with rows `ld` apart.
    pub(crate) fn rows(data: &'a [f32], ld: usize) -> Self {
        Mat {
            data,
            rs: ld,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with rows `ld` apart.
    pub(crate) fn transposed(data: &'a [f32], ld: usize) -> Self {
        Mat {
            data,
            rs: 1,
            cs: ld,
        }
    }
}

/// `dst[m x n] (+)= beta * a[m x k] * b[k x n]` on the calling thread (the attention kernels
/// call it from their own rayon tasks); `dst` rows are `dst_rs` apart. With `accumulate` the
/// product is added to what `dst` holds, else it replaces it.
pub(crate) fn mm(
    dims: (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    a: Mat,
    b: Mat,
    beta: f32,
    accumulate: bool,
) {
    let parallelism = gemm::Parallelism::None;
    mm_with(parallelism, dims, (dst, dst_rs), (a, b), beta, accumulate)
}

/// [`mm`] with gemm's own parallelism; `dst` with its row stride.
pub(crate) fn mm_with(
    parallelism: gemm::Parallelism,
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (&mut [f32], usize),
    (a, b): (Mat, Mat),
    beta: f32,
    accumulate: bool,
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(last(m, n, dst_rs, 1) < dst.len());
    assert!(last(m, k, a.rs, a.cs) < a.data.len());
    assert!(last(k, n, b.rs, b.cs) < b.data.len());
    // SAFETY: the asserts above keep every element gemm touches inside the three slices, and
    // `dst` is borrowed mutably (no aliasing with `a` or `b`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        )
    }
}
