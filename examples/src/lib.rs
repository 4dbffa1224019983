//! Runnable training programs; each binary in `src/bin/` is one example.
