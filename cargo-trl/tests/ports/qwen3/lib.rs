//! The port's crate layout mirrors candle-transformers' (`crate::models::with_tracing`,
//! `crate::utils`), so that qwen3.rs's own imports resolve to trl-runtime's drop-ins.

// candle-transformers names candle-core `candle`.
extern crate candle_core as candle;

pub mod models {
    pub mod qwen3;
    pub mod with_tracing {
        pub use trl_runtime::nn::with_tracing::*;
    }
}

pub mod utils {
    pub use trl_runtime::nn::utils::*;
}
