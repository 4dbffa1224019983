//! Keeps freed tensor memory in the process instead of returning it to the OS.
//!
//! Training allocates and frees the same large buffers every step (activations, gradients,
//! collective buffers). glibc hands blocks above 32 MiB back to the kernel on free, so the next
//! allocation pays a page fault per 4 KiB page: 33 ms per 64 MiB on the 2-core CI VM, ten times
//! the cost of using the memory. Like PyTorch's caching allocator, we keep it: raise the mmap
//! and trim thresholds so large blocks come from (and return to) the heap. Peak memory is
//! unchanged; it is reused instead of being unmapped and faulted in again.

use std::sync::Once;

static TUNE: Once = Once::new();

/// Applies the setting once per process (no-op outside glibc). Called by `DistContext::init`.
pub fn keep_freed_memory() {
    TUNE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes allocator thresholds; it runs before heavy allocation.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
            libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        }
    });
}

/// Returns the memory freed so far to the OS (glibc `malloc_trim`). Called once start-up is
/// done: what loading and sharding the model freed is not reused by the steps, so keeping it
/// would only inflate the process (ZeRO-3 ranks drop the full model after taking their slices).
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only gives free heap pages back to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Bytes the given tensors keep allocated, each allocation counted once: tensors sharing a
/// storage count it once, and a view (a slice) counts the whole storage it keeps alive, which
/// is what it really costs. Memory reports are measured with it rather than computed from shapes.
#[derive(Default)]
pub struct StorageBytes {
    seen: std::collections::HashSet<usize>,
    pub total: usize,
}

impl StorageBytes {
    pub fn add(&mut self, t: &candle_core::Tensor) {
        let (storage, layout) = t.storage_and_layout();
        // The storage lives behind the tensor's lock: its address names the allocation.
        if !self
            .seen
            .insert(&*storage as *const candle_core::Storage as usize)
        {
            return;
        }
        self.total += match &*storage {
            candle_core::Storage::Cpu(cpu) => cpu_bytes(cpu),
            // Device storages are allocated at their tensor's size; views are counted as such.
            _ => layout.shape().elem_count() * t.dtype().size_in_bytes(),
        };
    }
}

/// Bytes of a CPU storage.
fn cpu_bytes(s: &candle_core::CpuStorage) -> usize {
    use candle_core::CpuStorage as S;
    use std::mem::size_of_val;
    match s {
        S::U8(v) | S::F6E2M3(v) | S::F6E3M2(v) | S::F4(v) | S::F8E8M0(v) => v.len(),
        S::U32(v) => size_of_val(v.as_slice()),
        S::I16(v) => size_of_val(v.as_slice()),
        S::I32(v) => size_of_val(v.as_slice()),
        S::I64(v) => size_of_val(v.as_slice()),
        S::BF16(v) => size_of_val(v.as_slice()),
        S::F16(v) => size_of_val(v.as_slice()),
        S::F32(v) => size_of_val(v.as_slice()),
        S::F64(v) => size_of_val(v.as_slice()),
        S::F8E4M3(v) => size_of_val(v.as_slice()),
    }
}

/// GPU memory: Candle allocates through CUDA's stream-ordered pool (`cuMemAllocAsync`, each
/// device's default pool). Its default release threshold (0) hands every freed block back to
/// the driver at each synchronization, so the next step maps it again; like PyTorch's caching
/// allocator we keep it. The pool's high-water mark of used bytes is the peak of live
/// allocations (what torch reports as `max_memory_allocated`), read by the benches.
#[cfg(feature = "cuda")]
pub mod gpu {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::{CudaDevice, Result};

    fn pool(dev: &CudaDevice) -> Result<sys::CUmemoryPool> {
        let mut pool = std::ptr::null_mut();
        let ordinal = dev.cuda_stream().context().cu_device();
        // SAFETY: `pool` is a valid out-pointer; the device ordinal comes from a live context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ordinal) }
            .result()
            .map_err(|e| candle_core::Error::Msg(format!("GPU memory pool: {e}")))?;
        Ok(pool)
    }

    fn set(dev: &CudaDevice, attr: sys::CUmemPool_attribute, mut value: u64) -> Result<()> {
        let pool = pool(dev)?;
        // SAFETY: both attributes set here take a u64 (cuuint64_t).
        unsafe { sys::cuMemPoolSetAttribute(pool, attr, &mut value as *mut u64 as *mut _) }
            .result()
            .map_err(|e| candle_core::Error::Msg(format!("GPU memory pool: {e}")))
    }

    /// Keeps freed blocks in the pool for reuse (release threshold: unlimited).
    pub fn keep_freed_memory(dev: &CudaDevice) -> Result<()> {
        set(
            dev,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            u64::MAX,
        )
    }

    /// Returns the pool's free blocks to the driver (for another process on the same GPU).
    pub fn release_freed_memory(dev: &CudaDevice) -> Result<()> {
        candle_core::backend::BackendDevice::synchronize(dev)?;
        let pool = pool(dev)?;
        // SAFETY: trimming only unmaps blocks no allocation uses.
        unsafe { sys::cuMemPoolTrimTo(pool, 0) }
            .result()
            .map_err(|e| candle_core::Error::Msg(format!("GPU memory pool: {e}")))
    }

    /// Peak bytes of live allocations since the last [`reset_peak`] (or the start).
    pub fn peak_bytes(dev: &CudaDevice) -> Result<u64> {
        let pool = pool(dev)?;
        let mut value = 0u64;
        // SAFETY: USED_MEM_HIGH is a u64 (cuuint64_t).
        unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut value as *mut u64 as *mut _,
            )
        }
        .result()
        .map_err(|e| candle_core::Error::Msg(format!("GPU memory pool: {e}")))?;
        Ok(value)
    }

    /// Starts a new peak from the bytes live now (the driver accepts only 0 as the reset value).
    pub fn reset_peak(dev: &CudaDevice) -> Result<()> {
        set(
            dev,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            0,
        )
    }
}
