//! SIGINT and SIGTERM. Outside a calibration's compute loop a signal ends the process as it
//! would without a handler (after ending a shown progress line). Inside it (`graceful()`), the
//! first signal is only counted: the compute loop sees it between ubatches, stops, and writes
//! consistent outputs (see `calibrate`). A second signal exits at once (`_exit`, code 128 +
//! signal), leaving every file as its last complete write left it.
//!
//! The handler only touches atomics and calls async-signal-safe functions (`write`, `_exit`,
//! `signal`, `raise`).

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};

static RECEIVED: AtomicUsize = AtomicUsize::new(0);
static LAST: AtomicI32 = AtomicI32::new(0);
static GRACEFUL: AtomicBool = AtomicBool::new(false);

const SECOND: &[u8] = b"reap-imatrix: second signal: exiting at once; the outputs hold their previous checkpoint\n";

/// Installs the handler for SIGINT and SIGTERM, except where the signal is ignored (a
/// background job started with `nohup` or `&` must stay deaf to it).
pub fn install() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: sigaction with a zeroed struct and an empty mask; the handler is a plain
        // extern "C" function that lives for the whole program.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN {
                continue;
            }
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// While the guard lives, the first signal is a request to stop (see `requested`).
pub struct Graceful(());

pub fn graceful() -> Graceful {
    RECEIVED.store(0, Ordering::SeqCst);
    GRACEFUL.store(true, Ordering::SeqCst);
    Graceful(())
}

impl Drop for Graceful {
    fn drop(&mut self) {
        GRACEFUL.store(false, Ordering::SeqCst);
    }
}

/// The signal that asked the run to stop, if one did.
pub fn requested() -> Option<i32> {
    (RECEIVED.load(Ordering::SeqCst) > 0).then(|| LAST.load(Ordering::SeqCst))
}

pub fn name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}

extern "C" fn on_signal(sig: libc::c_int) {
    let n = RECEIVED.fetch_add(1, Ordering::SeqCst) + 1;
    LAST.store(sig, Ordering::SeqCst);
    let graceful = GRACEFUL.load(Ordering::SeqCst);
    if graceful && n == 1 {
        return;
    }
    // SAFETY: write, _exit, signal and raise are async-signal-safe.
    unsafe {
        if crate::progress::LINE_SHOWN.load(Ordering::SeqCst) {
            libc::write(libc::STDERR_FILENO, b"\n".as_ptr().cast(), 1);
        }
        if graceful {
            libc::write(libc::STDERR_FILENO, SECOND.as_ptr().cast(), SECOND.len());
            libc::_exit(128 + sig);
        }
        // die of the signal, as without a handler
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}
