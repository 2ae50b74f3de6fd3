//! `reap-imatrix replay` (placeholder; being written).
use anyhow::Result;

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {}

pub fn run(_args: &ReplayArgs) -> Result<i32> {
    anyhow::bail!("`replay` is not implemented yet")
}
