//! `reap-imatrix select` (placeholder; being written).
use anyhow::Result;

#[derive(clap::Args, Debug)]
pub struct SelectArgs {}

pub fn run(_args: &SelectArgs) -> Result<i32> {
    anyhow::bail!("`select` is not implemented yet")
}
