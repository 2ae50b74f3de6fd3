//! llama.cpp's and ggml's log output, routed through one place: quiet by default, everything
//! with `-v`. Errors are always shown, and the last few are kept so a failed load can say why.
//! Shown lines go through `progress::eprint`, so they never garble a progress line.

use super::sys;
use std::collections::VecDeque;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::Mutex;

static VERBOSITY: AtomicI32 = AtomicI32::new(0);
static LAST_LEVEL: AtomicU32 = AtomicU32::new(sys::GGML_LOG_LEVEL_INFO);
static RECENT_ERRORS: Mutex<VecDeque<String>> = Mutex::new(VecDeque::new());

/// 0: errors only; 1 and up: everything llama.cpp says.
pub fn set_verbosity(v: i32) {
    VERBOSITY.store(v, Ordering::Relaxed);
}

pub fn verbosity() -> i32 {
    VERBOSITY.load(Ordering::Relaxed)
}

/// The error and warning lines llama.cpp printed most recently (oldest first), then cleared.
pub fn take_recent_errors() -> Vec<String> {
    RECENT_ERRORS.lock().map(|mut q| q.drain(..).collect()).unwrap_or_default()
}

pub(super) fn install() {
    // SAFETY: the callback is a plain function that lives for the whole program.
    unsafe { sys::llama_log_set(Some(on_log), std::ptr::null_mut()) };
}

pub(super) unsafe extern "C" fn on_log(level: sys::ggml_log_level, text: *const c_char, _user: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string valid for this call.
    let msg = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let _ = std::panic::catch_unwind(|| route(level, &msg));
}

fn route(level: sys::ggml_log_level, msg: &str) {
    // CONT continues the previous line at the previous line's level
    let level = if level == sys::GGML_LOG_LEVEL_CONT { LAST_LEVEL.load(Ordering::Relaxed) } else { level };
    LAST_LEVEL.store(level, Ordering::Relaxed);
    let is_problem = level == sys::GGML_LOG_LEVEL_ERROR || level == sys::GGML_LOG_LEVEL_WARN;
    if is_problem {
        if let Ok(mut q) = RECENT_ERRORS.lock() {
            if q.len() == 8 {
                q.pop_front();
            }
            q.push_back(msg.trim_end().to_string());
        }
    }
    let show = match level {
        sys::GGML_LOG_LEVEL_ERROR => true,
        sys::GGML_LOG_LEVEL_DEBUG => verbosity() >= 2,
        _ => verbosity() >= 1,
    };
    if show {
        crate::progress::eprint(msg);
    }
}
