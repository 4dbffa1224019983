//! One error type for the runtime. Every variant says what is wrong and, where it can, how to fix it.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A launch or training config file has a bad key or value.
    #[error("{file}: key `{key}`: {message}")]
    Config {
        file: String,
        key: String,
        message: String,
    },

    /// A parallelism shape that cannot be laid out on the world.
    #[error("invalid parallelism config: {0}")]
    Parallelism(String),

    /// A process-environment variable is missing, malformed or contradicts another.
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },

    /// The rendezvous store failed (unreachable, rejected, timed out).
    #[error("rendezvous store {addr}: {message}")]
    Store { addr: String, message: String },

    /// Some ranks did not arrive at a rendezvous in time.
    #[error("rendezvous `{name}` timed out after {timeout:?}: rank(s) {missing:?} of {world} never arrived (check that they were launched and can reach the store at {addr})")]
    RendezvousTimeout {
        name: String,
        addr: String,
        timeout: Duration,
        missing: Vec<usize>,
        world: usize,
    },

    /// A collective failed on this rank (dead peer, timeout, mismatched calls).
    #[error("{op} on rank {rank} of group `{group}`: {message}")]
    Comm {
        op: &'static str,
        group: String,
        rank: usize,
        message: String,
    },

    /// A training step's loss or gradient norm was NaN or infinite.
    #[error("non-finite values: {0}")]
    NonFinite(String),

    /// A parameter or count cannot be split over the tensor-parallel group as annotated.
    #[error("tensor parallelism: {name}: {message}")]
    TensorParallel { name: String, message: String },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// A bad value: in `file` (or another source: "command line"), at `key`, and why.
    pub fn config(
        file: impl Into<String>,
        key: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::Config {
            file: file.into(),
            key: key.into(),
            message: message.into(),
        }
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Wraps this error for code that must return Candle's error type (CustomOp backward passes).
    pub fn into_candle(self) -> candle_core::Error {
        match self {
            Error::Candle(e) => e,
            other => candle_core::Error::Msg(other.to_string()),
        }
    }
}
