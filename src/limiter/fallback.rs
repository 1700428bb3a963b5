//! The `on_error` wrapper around a shared store (being written).
