//! `reap-imatrix check` (placeholder; being written).
use anyhow::Result;

#[derive(clap::Args, Debug)]
pub struct CheckArgs {}

pub fn run(_args: &CheckArgs) -> Result<i32> {
    anyhow::bail!("`check` is not implemented yet")
}
