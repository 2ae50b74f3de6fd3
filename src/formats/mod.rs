//! File formats, one module each. Writers never touch a tensor; readers never touch the graph.

pub mod atomic;
pub mod base_logits;
pub mod domains;
pub mod gguf_header;
pub mod gguf;
pub mod imatrix;
pub mod imatrix_stats;
pub mod manifest;
pub mod saliency;
pub mod sha256;
pub mod trace;
