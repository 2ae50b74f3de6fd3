//! Command line: llama.cpp-style argv normalisation, clap definitions, subcommand dispatch.
//!
//! Without a subcommand the binary is a drop-in `llama-imatrix`; the first argument naming a
//! subcommand (`fixture`, …) switches to that tool.

pub mod argv;
pub mod imatrix_args;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::ffi::OsString;

/// Exit codes (documented in the README): 0 ok, 1 run failed, 2 bad usage or bad input file.
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

pub fn exit_code_for(e: &anyhow::Error) -> i32 {
    if e.chain().any(|c| c.is::<UsageError>()) {
        EXIT_USAGE
    } else {
        EXIT_FAILURE
    }
}

#[derive(Parser, Debug)]
#[command(name = "reap-imatrix", version, about = "Importance matrices and REAP expert saliency for MoE models")]
struct Tools {
    #[command(subcommand)]
    command: Command,
}

/// The drop-in mode's parser.
#[derive(Parser, Debug)]
#[command(
    name = "reap-imatrix",
    version,
    about = "A drop-in llama-imatrix: same flags, same imatrix bytes.",
    after_help = "Subcommands: reap-imatrix fixture --help\n\nllama.cpp's single-dash long flags (-ngl, -ub, -fa, -tb, -sm, -ts, -mg, -lm, -ofreq) are accepted."
)]
struct DropIn {
    #[command(flatten)]
    args: imatrix_args::ImatrixArgs,
}

const SUBCOMMANDS: &[&str] = &["fixture", "check", "select", "replay", "reproduce"];

#[derive(Subcommand, Debug)]
enum Command {
    /// Write a small deterministic MoE model (GGUF) for tests and demos.
    Fixture(crate::fixture::FixtureArgs),
    /// Verify every invariant of a saliency JSON (and its imatrix and trace); exit 0 only if all hold.
    Check(crate::analyze::check::CheckArgs),
    /// Keep maps (which experts to keep per layer) from a saliency JSON.
    Select(crate::analyze::select::SelectArgs),
    /// Expert-cache simulation over a routing trace.
    Replay(crate::analyze::replay::ReplayArgs),
    /// Re-run a recorded run (its manifest) and report whether every output is byte-identical.
    Reproduce(crate::analyze::reproduce::ReproduceArgs),
}

pub fn main(argv: Vec<OsString>) -> Result<i32> {
    let first = argv.get(1).and_then(|a| a.to_str()).unwrap_or("");
    if !SUBCOMMANDS.contains(&first) {
        return drop_in(argv);
    }
    let cli = match Tools::try_parse_from(&argv) {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return Ok(code);
        }
    };
    match cli.command {
        Command::Fixture(args) => crate::fixture::run(&args).map(|()| 0),
        Command::Check(args) => crate::analyze::check::run(&args),
        Command::Select(args) => crate::analyze::select::run(&args),
        Command::Replay(args) => crate::analyze::replay::run(&args),
        Command::Reproduce(args) => crate::analyze::reproduce::run(&args),
    }
}

fn drop_in(argv: Vec<OsString>) -> Result<i32> {
    let given: Vec<String> = argv.iter().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
    let (argv, unsupported) = argv::normalize(argv);
    if let Some(flag) = unsupported {
        anyhow::bail!(UsageError(format!("{flag}: accepted by llama-imatrix but not supported by reap-imatrix")));
    }
    let parsed = match DropIn::try_parse_from(&argv) {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return Ok(code);
        }
    };
    crate::calibrate::run(parsed.args, &given)?;
    Ok(0)
}
