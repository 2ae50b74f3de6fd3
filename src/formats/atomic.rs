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

/// Whether two paths name one file: the same spelling once made absolute (`a.json`,
/// `./a.json`; for outputs that do not exist yet), or, both existing, the same inode (a
/// symlink or hard link to it). Used to refuse an output that would overwrite an input.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let lexical = |p: &Path| -> Option<PathBuf> {
        Some(std::path::absolute(p).ok()?.components().filter(|c| !matches!(c, std::path::Component::CurDir)).collect())
    };
    let inode = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    a == b || matches!((lexical(a), lexical(b)), (Some(x), Some(y)) if x == y) || matches!((inode(a), inode(b)), (Some(x), Some(y)) if x == y)
}

/// Whether `target` can be written the way `replace_with` writes it: its folder exists and a
/// temporary file can be created (and is removed) there. Checked before a long run starts, so a
/// typo in an output path costs a second, not the whole computation.
pub fn check_writable(target: &Path) -> std::result::Result<(), String> {
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(format!("{}: the folder {} does not exist", target.display(), dir.display()));
    }
    if target.is_dir() {
        return Err(format!("{}: is a folder", target.display()));
    }
    let tmp = temp_path(target);
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp) {
        Ok(_) => {
            let _ = std::fs::remove_file(&tmp);
            Ok(())
        }
        Err(e) => Err(format!("{}: cannot write in {}: {e}", target.display(), dir.display())),
    }
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

/// Writes `v` as pretty JSON (newline-terminated) to `target` atomically; `what` names the
/// kind of file in the error ("saliency", "manifest", …).
pub fn write_json(target: &Path, v: &serde_json::Value, what: &str) -> Result<()> {
    let mut text = serde_json::to_string_pretty(v)?;
    text.push('\n');
    write_bytes(target, text.as_bytes()).with_context(|| format!("writing {what} {}", target.display()))
}

/// Reads a JSON file; errors name the file and the kind of file.
pub fn read_json(path: &Path, what: &str) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{what} {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{what} {}: not valid JSON", path.display()))
}
