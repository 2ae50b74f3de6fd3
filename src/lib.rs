//! reap-imatrix: importance matrices and REAP expert saliency for MoE models, computed by a
//! drop-in replacement for llama.cpp's `llama-imatrix` on a pinned llama.cpp.
//!
//! Data flows one way: corpus → tokens → chunks → graph → callback → collectors → writers →
//! files. The analysis tools only read files.

pub mod analyze;
pub mod calibrate;
pub mod cli;
pub mod collect;
pub mod corpus;
pub mod decode;
pub mod error;
pub mod eval;
pub mod fixture;
pub mod formats;
pub mod interrupt;
pub mod llama;
pub mod progress;
