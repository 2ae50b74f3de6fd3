//! Command line: llama.cpp-style argv normalisation, clap definitions, subcommand dispatch.
//!
//! Without a subcommand the binary is a drop-in `llama-imatrix`; the first argument naming a
//! subcommand (`fixture`, …) switches to that tool.

pub mod argv;
pub mod device;
pub mod placement;

use anyhow::Result;
use clap::{Parser, Subcommand};
use crate::error::{UsageError, EXIT_USAGE};
use std::ffi::OsString;

#[derive(Parser, Debug)]
#[command(name = "reap-imatrix", version, about = "Importance matrices and REAP expert saliency for MoE models")]
struct Tools {
    #[command(subcommand)]
    command: Command,
    /// progress line of long runs: auto (live on a terminal, plain lines otherwise), always, never
    #[arg(long, global = true, value_enum, value_name = "WHEN", default_value_t = crate::progress::Mode::Auto)]
    progress: crate::progress::Mode,
}

/// The drop-in mode's parser.
#[derive(Parser, Debug)]
#[command(
    name = "reap-imatrix",
    version,
    about = "A drop-in llama-imatrix: same flags, same imatrix bytes; plus REAP saliency and routing traces."
)]
struct DropIn {
    #[command(flatten)]
    args: crate::calibrate::args::ImatrixArgs,
}

/// The subcommands, as `Tools` declares them: (name, one-line description).
fn subcommands() -> Vec<(String, String)> {
    use clap::CommandFactory;
    Tools::command()
        .get_subcommands()
        .map(|s| (s.get_name().to_string(), s.get_about().map(|a| a.to_string()).unwrap_or_default()))
        .collect()
}

/// The drop-in `--help`'s closing text: every subcommand with one line.
fn drop_in_after_help() -> String {
    let subs = subcommands();
    let width = subs.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
    let mut s = String::from("Subcommands (reap-imatrix SUBCOMMAND --help for each):\n");
    for (name, about) in &subs {
        s += &format!("  {name:<width$}  {about}\n");
    }
    s += "\nllama.cpp's single-dash long flags (-ngl, -ub, -fa, -tb, -sm, -ts, -mg, -lm, -ofreq, -ot, -cmoe, -ncmoe, …) are accepted.";
    s
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Write a small deterministic MoE model (GGUF) for tests and demos.
    Fixture(crate::fixture::FixtureArgs),
    /// Verify every invariant of a saliency JSON (and its imatrix and trace); exit 0 only if all hold.
    Check(crate::analyze::check::CheckArgs),
    /// Keep maps (which experts to keep per layer) from a saliency JSON.
    Select(crate::analyze::select::SelectArgs),
    /// A pruned GGUF (and imatrix) keeping the experts a keep map lists.
    Prune(crate::analyze::prune::PruneArgs),
    /// Expert-cache simulation over a routing trace.
    Replay(crate::analyze::replay::ReplayArgs),
    /// Assemble a calibration text from JSONL sources with token-true shares (see docs/corpus.md).
    Corpus(crate::corpus::CorpusArgs),
    /// Re-run a recorded run (its manifest) and report whether every output is byte-identical.
    Reproduce(crate::analyze::reproduce::ReproduceArgs),
    /// KL divergence, top-1 agreement and PPL of models against a base (as llama-perplexity --kl-divergence).
    Eval(crate::eval::EvalArgs),
    /// Write a saliency JSON in another tool's terms (CerebrasResearch/reap's observer state).
    Export(crate::analyze::export::ExportArgs),
    /// How far two imatrix files are apart: counts, and the relative difference of every mean (Σx²/count).
    ImatrixDiff(crate::analyze::imatrix_diff::ImatrixDiffArgs),
    /// Generate from prompts and write the routing trace of prefill and decode (see docs/formats.md).
    TraceDecode(crate::decode::TraceDecodeArgs),
}

pub fn main(argv: Vec<OsString>) -> Result<i32> {
    crate::interrupt::install();
    crate::llama::install_abort_handler();
    let first = argv.get(1).and_then(|a| a.to_str()).unwrap_or("");
    if !subcommands().iter().any(|(n, _)| n == first) {
        return drop_in(argv);
    }
    // trace-decode and eval take llama.cpp's single-dash long flags (-ngl, -ub, -fa, -lm, -nr) as the drop-in does
    let argv = if first == "trace-decode" || first == "eval" { argv::normalize(argv) } else { argv };
    use clap::{CommandFactory, FromArgMatches};
    let (mut cli, m) = match Tools::command().try_get_matches_from(&argv).and_then(|m| Ok((Tools::from_arg_matches(&m)?, m))) {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return Ok(code);
        }
    };
    crate::progress::configure(cli.progress);
    if let Some((_, sub)) = m.subcommand() {
        match &mut cli.command {
            Command::Eval(a) => a.device.placement.order(sub)?,
            Command::TraceDecode(a) => a.device.placement.order(sub)?,
            _ => {}
        }
    }
    match cli.command {
        Command::Fixture(args) => crate::fixture::run(&args).map(|()| 0),
        Command::Check(args) => crate::analyze::check::run(&args),
        Command::Select(args) => crate::analyze::select::run(&args),
        Command::Prune(args) => crate::analyze::prune::run(&args),
        Command::Replay(args) => crate::analyze::replay::run(&args),
        Command::Reproduce(args) => crate::analyze::reproduce::run(&args),
        Command::Eval(args) => crate::eval::run(&args),
        Command::Export(args) => crate::analyze::export::run(&args),
        Command::ImatrixDiff(args) => crate::analyze::imatrix_diff::run(&args),
        Command::Corpus(args) => crate::corpus::run(&args),
        Command::TraceDecode(args) => crate::decode::run(&args),
    }
}

/// Whether the drop-in's parser takes `flag` as spelled (after argv::normalize): a long name or
/// alias, or a one-letter short one.
fn knows(command: &clap::Command, flag: &str) -> bool {
    command.get_arguments().any(|a| match flag.strip_prefix("--") {
        Some(long) => a.get_long() == Some(long) || a.get_all_aliases().is_some_and(|v| v.contains(&long)),
        None => {
            let mut c = flag.chars().skip(1);
            matches!((c.next(), c.next()), (Some(ch), None) if a.get_short() == Some(ch) || a.get_all_short_aliases().is_some_and(|v| v.contains(&ch)))
        }
    }) || matches!(flag, "-h" | "--help" | "-V" | "--version")
}

fn drop_in(argv: Vec<OsString>) -> Result<i32> {
    let given: Vec<String> = argv.iter().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
    let argv = argv::normalize(argv);
    use clap::{CommandFactory, FromArgMatches};
    let command = DropIn::command();
    if let Some(flag) = argv::unsupported(&argv, |f| knows(&command, f)) {
        anyhow::bail!(UsageError(format!("{flag}: accepted by llama-imatrix but not supported by reap-imatrix")));
    }
    // upstream keeps the last value of a repeated flag (and all files of a repeated --in-file)
    for flag in argv::repeated(&given) {
        let what = if flag == "--in-file" {
            "its files are all merged"
        } else if argv::CUMULATIVE.contains(&flag.as_str()) {
            "every value is applied, the first matching pattern deciding"
        } else {
            "only the last value is used"
        };
        eprintln!("warning: argument '{flag}' specified multiple times, use comma-separated values instead ({what})");
    }
    let (mut parsed, m) = match command.args_override_self(true).after_help(drop_in_after_help()).try_get_matches_from(&argv).and_then(|m| Ok((DropIn::from_arg_matches(&m)?, m))) {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return Ok(code);
        }
    };
    parsed.args.placement.order(&m)?;
    if parsed.args.list_devices {
        crate::llama::placement::print_offload_devices(parsed.args.rpc.as_deref())?;
        return Ok(0);
    }
    crate::calibrate::run(parsed.args, &given)?;
    Ok(0)
}
