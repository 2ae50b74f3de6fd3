//! SIGINT and SIGTERM. Outside a calibration's compute loop a signal ends the process as it
//! would without a handler (after ending a shown progress line). Inside it (`graceful()`), the
//! first signal is only counted: the compute loop sees it between ubatches, stops, and writes
//! consistent outputs (see `calibrate`). A second signal exits at once (`_exit`, code 128 +
//! signal), leaving every file as its last complete write left it.
//!
//! Before the process ends of a signal (or exits at a second one), the temporary files it was
//! writing (`remove_on_signal`: every atomic write's `NAME.tmpPID`, eval's scratch folder and
//! its pruned models) are removed, after a child it waits on (`child`: eval's `prune`) is
//! stopped, so an interrupted run leaves no half-written gigabytes behind. SIGKILL still can.
//!
//! The handler only touches atomics and static buffers and calls async-signal-safe functions
//! (`write`, `_exit`, `signal`, `raise`, `unlink`, `rmdir`, `kill`, `waitpid`).

use std::cell::UnsafeCell;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicUsize, Ordering};

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

/// Paths to remove if a signal ends the process: fixed slots, so the handler reads only
/// static memory. A slot is FREE, being FILLED by its owner, or ARMED (the handler may read it).
/// (128: `reproduce` registers every output of a run, `--save-frequency` snapshots included)
const SLOTS: usize = 128;
const PATH_BYTES: usize = 4096;
const FREE: u8 = 0;
const FILLED: u8 = 1;
const ARMED: u8 = 2;

struct Slot {
    state: AtomicU8,
    path: UnsafeCell<[u8; PATH_BYTES]>,
}

// SAFETY: `path` is written only by the thread that moved `state` FREE → FILLED, and read
// (by the handler) only while `state` is ARMED.
unsafe impl Sync for Slot {}

static CLEANUP: [Slot; SLOTS] = [const { Slot { state: AtomicU8::new(FREE), path: UnsafeCell::new([0; PATH_BYTES]) } }; SLOTS];
static CHILD: AtomicI32 = AtomicI32::new(0);

/// While it lives, a signal that ends the process removes its path first (a file, or a
/// folder once the registered files in it are gone).
pub struct RemoveOnSignal(Option<usize>);

/// Registers `path` (best effort: a path longer than PATH_MAX, or all slots taken, is not).
pub fn remove_on_signal(path: &Path) -> RemoveOnSignal {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= PATH_BYTES || bytes.contains(&0) {
        return RemoveOnSignal(None);
    }
    for (i, slot) in CLEANUP.iter().enumerate() {
        if slot.state.compare_exchange(FREE, FILLED, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            // SAFETY: this thread owns the slot (FILLED) until it arms it.
            unsafe {
                let buf = &mut *slot.path.get();
                buf[..bytes.len()].copy_from_slice(bytes);
                buf[bytes.len()] = 0;
            }
            slot.state.store(ARMED, Ordering::SeqCst);
            return RemoveOnSignal(Some(i));
        }
    }
    RemoveOnSignal(None)
}

impl RemoveOnSignal {
    /// Whether the path got a slot (a signal will remove it).
    pub fn armed(&self) -> bool {
        self.0.is_some()
    }
}

impl Drop for RemoveOnSignal {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            CLEANUP[i].state.store(FREE, Ordering::SeqCst);
        }
    }
}

/// While it lives, a signal that ends the process is passed to the child `pid` first, and
/// the handler waits for it to end (so it can remove its own temporary files).
pub struct ChildGuard(());

pub fn child(pid: u32) -> ChildGuard {
    CHILD.store(pid as i32, Ordering::SeqCst);
    ChildGuard(())
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        CHILD.store(0, Ordering::SeqCst);
    }
}

/// In the handler: stop the child, then remove the registered files, then the folders.
fn clean_up(sig: libc::c_int) {
    // SAFETY: kill, waitpid, unlink and rmdir are async-signal-safe; a slot's buffer is read
    // only while it is ARMED.
    unsafe {
        let pid = CHILD.load(Ordering::SeqCst);
        if pid > 0 {
            libc::kill(pid, sig);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        // files first, then the folders they were in
        for remove in [libc::unlink, libc::rmdir] {
            for slot in &CLEANUP {
                if slot.state.load(Ordering::SeqCst) == ARMED {
                    remove((*slot.path.get()).as_ptr().cast::<libc::c_char>());
                }
            }
        }
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
        clean_up(sig);
        if graceful {
            libc::write(libc::STDERR_FILENO, SECOND.as_ptr().cast(), SECOND.len());
            libc::_exit(128 + sig);
        }
        // die of the signal, as without a handler
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}
