//! The one place that talks to llama.cpp: raw bindings and safe owners around them.
//!
//! Everything above this module sees models, contexts, batches and tensor views, never raw
//! pointers.

pub mod abort;
mod amx_guard;
pub mod batch;
pub mod chat;
pub mod context;
pub mod eval_callback;
pub mod expert_stats;
pub mod log;
pub mod model;
pub mod placement;
pub mod prefetch;
pub mod reduce;
pub mod rpc_watch;
pub mod sampler;
pub mod sys;
pub mod system;
pub mod tensor;

pub use batch::Batch;
pub use context::{Context, ContextParams};
pub use eval_callback::GraphObserver;
pub use chat::Message as ChatMessage;
pub use model::{Model, ModelParams, Vocab};
pub use placement::TensorOverride;
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
        load_backend_modules();
    });
}

/// `REAP_BACKEND_DIR`: ggml backend modules (`libggml-*.so`, built with `GGML_BACKEND_DL` from
/// the same pin, e.g. the CUDA backend on a machine without Rust; docs/gpu.md) are loaded into
/// the registry next to the backends linked in, before any model is loaded. The CPU backend is
/// linked in, so CPU modules there are skipped, and so is ggml's base library.
fn load_backend_modules() {
    let Some(dir) = std::env::var_os("REAP_BACKEND_DIR") else { return };
    let dir = std::path::PathBuf::from(dir);
    let mut paths: Vec<_> = match std::fs::read_dir(&dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libggml-") && n.contains(".so") && !n.starts_with("libggml-base.") && !n.starts_with("libggml-cpu")))
            .collect(),
        Err(e) => {
            crate::progress::eprintln(&format!("reap-imatrix: warning: REAP_BACKEND_DIR {}: {e}", dir.display()));
            return;
        }
    };
    paths.sort();
    for p in paths {
        let Ok(c) = std::ffi::CString::new(p.to_string_lossy().as_bytes()) else { continue };
        // SAFETY: ggml loads the module and registers its backend; a null result is reported.
        let reg = unsafe { sys::ggml_backend_load(c.as_ptr()) };
        if reg.is_null() {
            crate::progress::eprintln(&format!("reap-imatrix: warning: could not load the backend module {} (see llama.cpp's message above with -v)", p.display()));
        } else if log::verbosity() >= 1 {
            // SAFETY: a registered backend's name is a static string.
            let name = unsafe { std::ffi::CStr::from_ptr(sys::ggml_backend_reg_name(reg)) }.to_string_lossy().into_owned();
            crate::progress::eprintln(&format!("loaded backend module {} ({name})", p.display()));
        }
    }
    hook_module_base();
}

/// A module links ggml's base library as a shared object, a second copy beside the one linked
/// into this binary, with its own log and abort callbacks: route those through ours too, so a
/// module's messages follow `-v` and its aborts (a lost RPC server) end with our message.
fn hook_module_base() {
    // SAFETY: dlopen with RTLD_NOLOAD only finds a library already loaded; the symbols are
    // ggml's own setters, called with functions that live for the whole program.
    unsafe {
        let h = libc::dlopen(c"libggml-base.so.0".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if h.is_null() {
            return;
        }
        let abort = libc::dlsym(h, c"ggml_set_abort_callback".as_ptr());
        if !abort.is_null() {
            let set: unsafe extern "C" fn(sys::ggml_abort_callback_t) -> sys::ggml_abort_callback_t = std::mem::transmute(abort);
            set(Some(abort::on_abort));
        }
        let log_set = libc::dlsym(h, c"ggml_log_set".as_ptr());
        if !log_set.is_null() {
            let set: unsafe extern "C" fn(sys::ggml_log_callback, *mut std::ffi::c_void) = std::mem::transmute(log_set);
            set(Some(log::on_log), std::ptr::null_mut());
        }
    }
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
