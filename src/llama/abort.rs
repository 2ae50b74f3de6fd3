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

/// The `--rpc` servers added so far.
pub(super) fn rpc_servers() -> Vec<String> {
    RPC_SERVERS.lock().map(|v| v.clone()).unwrap_or_default()
}

/// A model of this process was loaded with the CPU backend's extra buffer types (AMX, weight
/// repacking: on unless `--no-repack`), for the message.
static EXTRA_BUFTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(super) fn note_extra_bufts() {
    EXTRA_BUFTS.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Whether a model of this process has weights in the extra buffer types.
pub(super) fn extra_bufts() -> bool {
    EXTRA_BUFTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// What ggml's scheduler says when no backend takes one of the graph's ops.
const NO_BACKEND: &str = "cur_backend_id != -1";

pub(super) fn install() {
    // SAFETY: the handler is a plain function that lives for the whole program.
    unsafe { sys::ggml_set_abort_callback(Some(on_abort)) };
}

pub(super) unsafe extern "C" fn on_abort(message: *const c_char) {
    let msg = if message.is_null() { String::new() } else { unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned() };
    let text = std::panic::catch_unwind(|| describe(&msg)).unwrap_or_else(|_| format!("llama.cpp stopped: {msg}"));
    end_run(&text)
}

/// What a stopped run leaves: outputs are written atomically, so nothing half-written.
const INTACT: &str = "files written before this point (the last checkpoint) are intact; later ones were not written";

/// Ends the run for an `--rpc` server that moved no bytes for `--rpc-timeout` seconds while
/// ggml-rpc waited on it (`rpc_watch`): ggml-rpc would wait for ever.
pub(super) fn stop_for_silent_server(endpoint: &str, waited: std::time::Duration, timeout_s: u64) -> ! {
    end_run(&format!(
        "the RPC server {endpoint} has not answered for {} s (stopped, hung, or the network to it is down); --rpc-timeout is {timeout_s} s (0 waits for ever)\n  {INTACT}",
        waited.as_secs()
    ))
}

/// Says why the run stopped and exits: 1, or 0 when every output was already written.
fn end_run(text: &str) -> ! {
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
    let servers = rpc_servers();
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
    if msg.contains(NO_BACKEND) && EXTRA_BUFTS.load(std::sync::atomic::Ordering::SeqCst) {
        // seen at the pin on a CPU with AMX: its buffer type holds f16 and quantized matrices,
        // and an op on one of them that it does not implement has no backend left (deepseek2's
        // graph; upstream's llama-imatrix and llama-perplexity abort alike)
        text.push_str(
            "\n  no backend took one of the graph's ops: with the CPU backend's extra buffer types (AMX, weight repacking) llama.cpp aborts so on some models (deepseek2 on a CPU with AMX); --no-repack (-nr) turns them off",
        );
    }
    text.push_str(&format!("\n  {INTACT}"));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The scheduler's abort with the extra buffer types on names the way around it; any
    /// other abort does not.
    #[test]
    fn no_backend_for_an_op_names_no_repack() {
        note_extra_bufts();
        let t = describe("ggml/src/ggml-backend.cpp:1294: GGML_ASSERT(*cur_backend_id != -1) failed\n");
        assert!(t.contains("--no-repack (-nr)") && t.ends_with("later ones were not written"), "{t}");
        let t = describe("ggml/src/ggml.c:1: GGML_ASSERT(x) failed");
        assert!(!t.contains("--no-repack"), "{t}");
    }
}
