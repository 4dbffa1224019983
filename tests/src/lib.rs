//! End-to-end tests live in `tests/`; the worker programs they launch live in `src/bin/`.
