//! Where this process stands in the job: its environment, the rendezvous store, the device mesh.

pub mod context;
pub mod device;
pub mod env;
pub mod hostlist;
pub mod mesh;
pub mod spawn;

pub use context::{compute_on_this_thread, DistContext};
pub use env::{EnvSource, ProcessEnv};
pub use mesh::{Axis, DeviceMesh};
// The rendezvous store is a collective transport concern; it lives in `comm`.
pub use crate::comm::store::{Store, StoreServer};
