//! Where this process stands in the job: its environment, the rendezvous store, the device mesh.

pub mod context;
pub mod device;
pub mod env;
pub mod hostlist;
pub mod mesh;
pub mod spawn;
pub mod store;

pub use context::DistContext;
pub use env::{EnvSource, ProcessEnv};
pub use mesh::{Axis, DeviceMesh};
pub use store::{Store, StoreServer};
