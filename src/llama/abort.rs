//! What happens when ggml gives up (`GGML_ABORT`, a failed `GGML_ASSERT`): by default it prints
//! the message with a gdb backtrace and dies of SIGABRT. The commonest cause in a real run is
//! not a bug but a lost `--rpc` server (ggml-rpc aborts with "Remote RPC server crashed or
//! returned malformed response", naming no server). So the binary installs a handler that says
//! what stopped, which servers are unreachable now, and that the files already written (the
//! last checkpoint) are intact, then exits with the run-failed code. Outputs are written
//! atomically, so nothing half-written is left under an output's name.

use super::sys;
use crate::error::EXIT_FAILURE;
use std::ffi::{c_char, CStr};
use std::sync::Mutex;

/// Set once every output and the manifest are on disk: an abort after that (a lost `--rpc`
/// server while the model is freed) cannot cost anything, so the run still succeeds.
static OUTPUTS_COMPLETE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn outputs_complete() {
    OUTPUTS_COMPLETE.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// `--rpc` servers of this process, for the message.
static RPC_SERVERS: Mutex<Vec<String>> = Mutex::new(Vec::new());

pub(super) fn note_rpc_server(endpoint: &str) {
    if let Ok(mut v) = RPC_SERVERS.lock() {
        v.push(endpoint.to_string());
    }
}

pub(super) fn install() {
    // SAFETY: the handler is a plain function that lives for the whole program.
    unsafe { sys::ggml_set_abort_callback(Some(on_abort)) };
}

pub(super) unsafe extern "C" fn on_abort(message: *const c_char) {
    let msg = if message.is_null() { String::new() } else { unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned() };
    let text = std::panic::catch_unwind(|| describe(&msg)).unwrap_or_else(|_| format!("llama.cpp stopped: {msg}"));
    if crate::progress::LINE_SHOWN.load(std::sync::atomic::Ordering::SeqCst) {
        eprintln!();
    }
    if OUTPUTS_COMPLETE.load(std::sync::atomic::Ordering::SeqCst) {
        eprintln!("reap-imatrix: warning: {}\n  every output was written before (complete); only the clean-up stopped", text.lines().next().unwrap_or_default());
        // SAFETY: as below
        unsafe { libc::_exit(0) };
    }
    eprintln!("reap-imatrix: error: {text}");
    // SAFETY: _exit ends the process without running destructors, as abort() would.
    unsafe { libc::_exit(EXIT_FAILURE) };
}

/// The message: ggml's own line, the RPC servers that no longer answer (when the abort came
/// from the RPC backend), and what is left on disk.
pub fn describe(msg: &str) -> String {
    let servers = RPC_SERVERS.lock().map(|v| v.clone()).unwrap_or_default();
    let mut text = format!("llama.cpp stopped the run: {}", msg.trim_end());
    if msg.contains("RPC") && !servers.is_empty() {
        let dead: Vec<&String> = servers.iter().filter(|s| !answers(s)).collect();
        if dead.is_empty() {
            text.push_str(&format!("\n  RPC servers of this run: {} (all accept connections now)", servers.join(", ")));
        } else {
            let names: Vec<&str> = dead.iter().map(|s| s.as_str()).collect();
            text.push_str(&format!("\n  lost the RPC server {} (no longer accepts connections)", names.join(", ")));
        }
    }
    text.push_str("\n  files written before this point (the last checkpoint) are intact; later ones were not written");
    text
}

/// Whether a HOST:PORT keeps accepting TCP connections: five tries 200 ms apart, all must
/// connect. A killed server's listening socket can outlive its dropped connection by a moment,
/// so one successful connect right after the loss proves nothing.
fn answers(endpoint: &str) -> bool {
    use std::net::ToSocketAddrs;
    let Ok(addrs) = endpoint.to_socket_addrs().map(|a| a.collect::<Vec<_>>()) else { return false };
    (0..5).all(|i| {
        if i > 0 {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        addrs.iter().any(|a| std::net::TcpStream::connect_timeout(a, std::time::Duration::from_secs(1)).is_ok())
    })
}
