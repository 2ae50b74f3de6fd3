//! The downstream tools: they read files (saliency JSON, traces, imatrix), never the graph.

pub mod check;
pub mod export;
pub mod replay;
pub mod reproduce;
pub mod select;
