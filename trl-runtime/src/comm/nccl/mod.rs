//! NCCL, the GPU backend: [`library`] loads libnccl at run time (always compiled, so tools can
//! report its version); the communicator comes with the `nccl` feature.

pub mod library;

#[cfg(feature = "nccl")]
mod communicator;
#[cfg(feature = "nccl")]
pub use communicator::{NcclBackend, NcclCommunicator};

pub use library::NcclLibrary;
