//! `--show-statistics`: loads the single `--in-file` as upstream does, then prints upstream's
//! tables (formats::imatrix_stats) in a deterministic order.

use super::args::ImatrixArgs;
use crate::collect::imatrix::{Imatrix, ImatrixCollector, ImatrixConfig};
use crate::error::UsageError;
use crate::formats::imatrix_stats::{compute, compute_cossim, render, sort_rows, TensorStats};
use anyhow::{bail, Result};
use std::path::Path;

pub fn show(args: &ImatrixArgs) -> Result<()> {
    let files: Vec<&str> = args.in_file.last().map(|l| l.split(',').filter(|s| !s.is_empty()).collect()).unwrap_or_default();
    if files.len() != 1 {
        bail!(UsageError("a single imatrix file is required to compute tensor statistics".into()));
    }
    let path = Path::new(files[0]);
    let loaded = crate::formats::imatrix::load(path).map_err(|e| UsageError(format!("{} is not a valid imatrix file: {e:#}", path.display())))?;
    // upstream reads the file before it adjusts n_ctx for batching: chunk size is plain -c
    // (it only scales legacy files)
    let cfg = ImatrixConfig { chunk_size: args.ctx_size.max(1), out_freq: 1, save_freq: 0, process_output: false, small_by_rows: false };
    let mut c = ImatrixCollector::new(cfg, Imatrix::default());
    c.merge(&loaded).map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
    let mut ts: Vec<TensorStats> = c.state.stats.iter().filter_map(|(n, s)| compute(n, s)).collect();
    if ts.is_empty() {
        bail!("cannot compute statistics for {}", path.display());
    }
    compute_cossim(&mut ts);
    sort_rows(&mut ts);
    // to stderr, where upstream's logger prints the tables
    eprint!("{}", render(path, &ts));
    Ok(())
}

