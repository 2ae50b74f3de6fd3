//! `--keep-map`: each map is turned into a model file by this program's own `prune`
//! subcommand (a child process, so the pruned model is written and closed before it is
//! loaded, and `eval` depends only on prune's command line: `prune -m MODEL --keep-map MAP
//! -o OUT [--drop-nextn] [--hash-remap]`).

use crate::error::UsageError;
use anyhow::{bail, Context as _, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Prunes `base` by `map` into `scratch`; returns the pruned model's path.
pub fn prune_into(scratch: &Path, base: &Path, map: &Path, index: usize, flags: &[&str]) -> Result<PathBuf> {
    let out = scratch.join(out_name(map, index));
    eprintln!("pruning {} by {} into {}", base.display(), map.display(), out.display());
    run_prune(base, map, &out, false, flags)?;
    if !out.is_file() {
        bail!("`prune` for --keep-map {} reported success but wrote no {}", map.display(), out.display());
    }
    Ok(out)
}

/// Before the base pass: `prune --dry-run` of every map, so a map for another model (or a
/// split or unreadable base) fails in seconds, not after an hour of forward passes.
pub fn check_maps(scratch: &Path, base: &Path, maps: &[&Path], flags: &[&str]) -> Result<()> {
    for (i, map) in maps.iter().enumerate() {
        run_prune(base, map, &scratch.join(out_name(map, i)), true, flags)?;
    }
    Ok(())
}

fn out_name(map: &Path, index: usize) -> String {
    let stem = map.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{index}-{stem}.gguf")
}

fn run_prune(base: &Path, map: &Path, out: &Path, dry_run: bool, flags: &[&str]) -> Result<()> {
    let exe = std::env::current_exe().context("locating this program to run `prune`")?;
    let mut cmd = Command::new(&exe);
    cmd.arg("prune").arg("-m").arg(base).arg("--keep-map").arg(map).arg("-o").arg(out);
    if dry_run {
        cmd.arg("--dry-run");
    }
    // prune's own flags that eval passes on (`--drop-nextn`, `--hash-remap`)
    cmd.args(flags);
    // its status line to stderr: eval's stdout holds the statistics only
    let mut child = cmd.stdout(std::io::stderr()).spawn().with_context(|| format!("running {} prune", exe.display()))?;
    // a signal to eval reaches prune too, and eval waits for it to remove its temporary file
    let status = {
        let _passed_on = crate::interrupt::child(child.id());
        child.wait().with_context(|| format!("waiting for {} prune", exe.display()))?
    };
    match status.code() {
        Some(0) => Ok(()),
        // prune's own message (above) says what is wrong with the map or the model
        Some(2) => bail!(UsageError(format!("--keep-map {}: `reap-imatrix prune` refused it (see its message above)", map.display()))),
        _ => bail!("--keep-map {}: `reap-imatrix prune` failed ({status})", map.display()),
    }
}
