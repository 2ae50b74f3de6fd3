//! Atomic file replacement: write beside the target, flush, rename. A killed run leaves
//! either the old file or the new one, never half of one.

use anyhow::{Context as _, Result};
use std::path::{Path, PathBuf};

/// A temporary name in the same folder (so the rename stays on one file system).
pub fn temp_path(target: &Path) -> PathBuf {
    let mut name = target.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".tmp{}", std::process::id()));
    target.with_file_name(name)
}

/// Writes `target` through `write(tmp_path)` and renames the result into place.
pub fn replace_with(target: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temp_path(target);
    let result = write(&tmp).and_then(|()| {
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("syncing {}", tmp.display()))?;
        std::fs::rename(&tmp, target).with_context(|| format!("renaming {} to {}", tmp.display(), target.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes `bytes` to `target` atomically.
pub fn write_bytes(target: &Path, bytes: &[u8]) -> Result<()> {
    replace_with(target, |tmp| std::fs::write(tmp, bytes).with_context(|| format!("writing {}", tmp.display())))
}
