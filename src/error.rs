//! The ground floor: the error kinds every module may raise and the exit codes they map to.
//! Nothing here imports the rest of the crate.

/// Exit codes (documented in the README): 0 ok, 1 run failed, 2 bad usage or bad input file,
/// 128 + signal when a signal stopped a run (130 SIGINT, 143 SIGTERM, as shells report it).
pub const EXIT_FAILURE: i32 = 1;
pub const EXIT_USAGE: i32 = 2;

/// An error in what the user gave us (a flag, a file), as opposed to a failure while running.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for UsageError {}

/// A run stopped by a signal after writing consistent outputs; the message says where.
#[derive(Debug)]
pub struct Interrupted {
    pub signal: i32,
    pub message: String,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}
impl std::error::Error for Interrupted {}

pub fn exit_code_for(e: &anyhow::Error) -> i32 {
    if let Some(i) = e.chain().find_map(|c| c.downcast_ref::<Interrupted>()) {
        128 + i.signal
    } else if e.chain().any(|c| c.is::<UsageError>()) {
        EXIT_USAGE
    } else {
        EXIT_FAILURE
    }
}
