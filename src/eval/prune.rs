//! `--keep-map`: each map is turned into a model file by this program's own `prune`
//! subcommand (a child process, so the pruned model is written and closed before it is
//! loaded, and `eval` depends only on prune's command line: `prune -m MODEL --keep-map MAP
//! -o OUT`).

use crate::error::UsageError;
use anyhow::{bail, Context as _, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Prunes `base` by `map` into `scratch`; returns the pruned model's path.
pub fn prune_into(scratch: &Path, base: &Path, map: &Path, index: usize) -> Result<PathBuf> {
    let stem = map.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let out = scratch.join(format!("{index}-{stem}.gguf"));
    let exe = std::env::current_exe().context("locating this program to run `prune`")?;
    eprintln!("pruning {} by {} into {}", base.display(), map.display(), out.display());
    let status = Command::new(&exe)
        .arg("prune")
        .arg("-m")
        .arg(base)
        .arg("--keep-map")
        .arg(map)
        .arg("-o")
        .arg(&out)
        .status()
        .with_context(|| format!("running {} prune", exe.display()))?;
    match status.code() {
        Some(0) if out.is_file() => Ok(out),
        Some(0) => bail!("`prune` for --keep-map {} reported success but wrote no {}", map.display(), out.display()),
        // prune's own message (above) says what is wrong with the map or the model
        Some(2) => bail!(UsageError(format!("--keep-map {}: `reap-imatrix prune` refused it (see its message above)", map.display()))),
        _ => bail!("--keep-map {}: `reap-imatrix prune` failed ({status})", map.display()),
    }
}

/// Fails early (before the base pass) when this build has no `prune` subcommand.
pub fn check_available() -> Result<()> {
    let exe = std::env::current_exe().context("locating this program to run `prune`")?;
    let out = Command::new(&exe).args(["prune", "--help"]).output().with_context(|| format!("running {} prune --help", exe.display()))?;
    let help = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !help.contains("--keep-map") {
        bail!(UsageError(format!("--keep-map needs the `prune` subcommand, which {} does not have", exe.display())));
    }
    Ok(())
}
