//! The one place that talks to llama.cpp: raw bindings and safe owners around them.
//!
//! Everything above this module sees models, contexts, batches and tensor views, never raw
//! pointers.

mod abort;
pub mod batch;
pub mod chat;
pub mod context;
pub mod eval_callback;
pub mod expert_stats;
pub mod log;
pub mod model;
pub mod reduce;
pub mod sampler;
pub mod sys;
pub mod system;
pub mod tensor;

pub use batch::Batch;
pub use context::{Context, ContextParams};
pub use eval_callback::GraphObserver;
pub use chat::Message as ChatMessage;
pub use model::{Model, ModelParams, Vocab};
pub use sampler::{Sampler, Sampling};
pub use tensor::{Node, TensorInfo};

use std::sync::Once;

/// Initialises llama.cpp's backends once per process and routes its log through `log`.
pub fn init_backend() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        log::install();
        // SAFETY: plain global initialisation, guarded by Once.
        unsafe { sys::llama_backend_init() };
    });
}

/// ggml's aborts (a lost `--rpc` server above all) end the process with a clear message and
/// the run-failed exit code instead of a backtrace and SIGABRT; see `abort`.
pub fn install_abort_handler() {
    abort::install();
}

/// The llama.cpp revision this binary was built from (from vendor/llama.cpp.pin).
pub const PIN_COMMIT: &str = env!("REAP_LLAMA_COMMIT");
/// sha256 of the pinned source archive.
pub const PIN_SHA256: &str = env!("REAP_LLAMA_SHA256");
/// sha256 over the patches applied to it (see patches/).
pub const PATCHES_SHA256: &str = env!("REAP_PATCHES_SHA256");
