//! libnccl, loaded at run time. A binary that linked NCCL would not start at all on a machine
//! without it (and cudarc panics on first use when it loads NCCL itself), so the library is
//! opened here once, every function it must export is looked up, and what is missing becomes an
//! error that says what to install. Compiled without the `nccl` feature too: `cargo trl env`
//! reports the NCCL version through it.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// The names tried, in order: the runtime soname first (what the nvidia-nccl wheels and the
/// distribution packages install), then the development symlink.
pub const LIBRARY_NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];

/// ncclResult_t.
pub type NcclResult = c_int;
/// ncclComm_t.
pub type NcclCommHandle = *mut c_void;
/// cudaStream_t (the same handle as the driver's CUstream).
pub type Stream = *mut c_void;

/// ncclUniqueId: 128 opaque bytes that rank 0 of a group makes and every member receives.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

/// ncclDataType_t values.
pub mod data_type {
    use std::ffi::c_int;
    pub const UINT8: c_int = 1;
    pub const UINT32: c_int = 3;
    pub const INT64: c_int = 4;
    pub const FLOAT16: c_int = 6;
    pub const FLOAT32: c_int = 7;
    pub const FLOAT64: c_int = 8;
    pub const BFLOAT16: c_int = 9;
}

/// ncclRedOp_t values.
pub mod red_op {
    use std::ffi::c_int;
    pub const SUM: c_int = 0;
    pub const MAX: c_int = 2;
    pub const MIN: c_int = 3;
    /// Since NCCL 2.10.
    pub const AVG: c_int = 4;
}

type Count = usize;

/// ncclAllReduce, ncclReduceScatter and ncclBroadcast: send buffer, receive buffer, count,
/// data type, then the reduction op (or the broadcast root), communicator and stream.
type BufferOp = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    Count,
    c_int,
    c_int,
    NcclCommHandle,
    Stream,
) -> NcclResult;

/// Declares each NCCL entry point once, with its C name and signature: the field of
/// [`NcclLibrary`] and its lookup in [`NcclLibrary::resolve`].
macro_rules! nccl_functions {
    ($($field:ident = $name:literal: $sig:ty,)+) => {
        /// The NCCL entry points the communicator uses.
        pub struct NcclLibrary {
            /// Which file was opened (for messages).
            pub path: &'static str,
            $(pub $field: $sig,)+
            /// Kept open for the life of the process: the function pointers above point into it.
            _library: libloading::Library,
        }

        impl NcclLibrary {
            fn resolve(
                path: &'static str,
                library: libloading::Library,
            ) -> Result<NcclLibrary, String> {
                Ok(NcclLibrary {
                    path,
                    $($field: {
                        // SAFETY: the declared signature is NCCL's (nccl.h, stable since 2.7).
                        *unsafe { library.get::<$sig>(concat!($name, "\0").as_bytes()) }
                            .map_err(|e| {
                                format!(
                                    "{path} lacks {} ({e}): it is too old or not NCCL; {INSTALL_HINT}",
                                    $name
                                )
                            })?
                    },)+
                    _library: library,
                })
            }
        }
    };
}

nccl_functions! {
    get_version = "ncclGetVersion": unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id = "ncclGetUniqueId": unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank = "ncclCommInitRank":
        unsafe extern "C" fn(*mut NcclCommHandle, c_int, UniqueId, c_int) -> NcclResult,
    comm_destroy = "ncclCommDestroy": unsafe extern "C" fn(NcclCommHandle) -> NcclResult,
    get_error_string = "ncclGetErrorString": unsafe extern "C" fn(NcclResult) -> *const c_char,
    all_reduce = "ncclAllReduce": BufferOp,
    all_gather = "ncclAllGather": unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        Count,
        c_int,
        NcclCommHandle,
        Stream,
    ) -> NcclResult,
    reduce_scatter = "ncclReduceScatter": BufferOp,
    broadcast = "ncclBroadcast": BufferOp,
    send = "ncclSend":
        unsafe extern "C" fn(*const c_void, Count, c_int, c_int, NcclCommHandle, Stream) -> NcclResult,
    recv = "ncclRecv":
        unsafe extern "C" fn(*mut c_void, Count, c_int, c_int, NcclCommHandle, Stream) -> NcclResult,
    group_start = "ncclGroupStart": unsafe extern "C" fn() -> NcclResult,
    group_end = "ncclGroupEnd": unsafe extern "C" fn() -> NcclResult,
}

/// What to do when libnccl cannot be used, for every message that reports it.
pub const INSTALL_HINT: &str = "install NCCL (pip install nvidia-nccl-cu12 or nvidia-nccl-cu13, or the libnccl2 package) and put the directory holding libnccl.so.2 on LD_LIBRARY_PATH, or train on CPU (--use_cpu) with the host backend";

impl NcclLibrary {
    /// The process's NCCL, opened on first use. The error names the files tried, what failed
    /// and what to install.
    pub fn get() -> Result<&'static NcclLibrary, String> {
        static LIBRARY: OnceLock<Result<NcclLibrary, String>> = OnceLock::new();
        LIBRARY
            .get_or_init(Self::open)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn open() -> Result<NcclLibrary, String> {
        let mut failures = Vec::new();
        for &path in LIBRARY_NAMES {
            // SAFETY: loading NCCL runs only its (side-effect free) initialisers.
            match unsafe { libloading::Library::new(path) } {
                Ok(library) => return Self::resolve(path, library),
                Err(e) => failures.push(match std::error::Error::source(&e) {
                    Some(cause) => format!("{cause}"),
                    None => format!("{path}: {e}"),
                }),
            }
        }
        Err(format!(
            "NCCL could not be loaded ({}): {INSTALL_HINT}",
            failures.join("; ")
        ))
    }

    /// NCCL's version as major.minor.patch.
    pub fn version(&self) -> Result<String, String> {
        let mut code: c_int = 0;
        // SAFETY: ncclGetVersion writes one int.
        self.check(unsafe { (self.get_version)(&mut code) })?;
        Ok(version_string(code))
    }

    /// `Ok` for ncclSuccess, else NCCL's description of the code.
    pub fn check(&self, result: NcclResult) -> Result<(), String> {
        if result == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let text = unsafe { (self.get_error_string)(result) };
        let text = if text.is_null() {
            "unknown error".into()
        } else {
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        Err(format!("NCCL error {result}: {text}"))
    }
}

/// NCCL_VERSION_CODE as text: major*10000 + minor*100 + patch since 2.9 (major*1000 +
/// minor*100 + patch before).
pub fn version_string(code: c_int) -> String {
    let (major, minor, patch) = if code >= 10000 {
        (code / 10000, code % 10000 / 100, code % 100)
    } else {
        (code / 1000, code % 1000 / 100, code % 100)
    };
    format!("{major}.{minor}.{patch}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_of_both_eras() {
        assert_eq!(version_string(22105), "2.21.5");
        assert_eq!(version_string(2804), "2.8.4");
    }

    /// Where NCCL is absent (this CI machine), the error names the files and what to install
    /// instead of a panic; where it is present, the version reads back.
    #[test]
    fn missing_library_is_a_clear_error() {
        match NcclLibrary::get() {
            Ok(lib) => assert!(lib.version().unwrap().starts_with('2')),
            Err(e) => {
                assert!(e.contains("libnccl.so.2"), "{e}");
                assert!(e.contains("nvidia-nccl"), "{e}");
                assert!(e.contains("LD_LIBRARY_PATH"), "{e}");
            }
        }
    }
}
