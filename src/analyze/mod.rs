//! The downstream tools: they read files (saliency JSON, traces, imatrix), never the graph.

pub mod check;
pub mod export;
pub mod imatrix_diff;
pub mod prune;
pub mod replay;
pub mod reproduce;
pub mod select;
