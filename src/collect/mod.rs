//! What the eval callback gathers: plain Rust over tensor views, no FFI, no disk.

pub mod imatrix;
pub mod pool;
pub mod reap;
pub mod trace_rows;
