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
    let mut write = Some(write);
    replace_together(&[target], |_, tmp| (write.take().expect("one target, written once"))(tmp))
}

/// Files that belong together (a pruned model and its imatrix; a mix and its domains and
/// report): every one is written to its temporary name and synced before any is renamed into
/// place, so a failed write leaves all the old files, never a new one beside an old one.
/// `write(i, tmp)` writes the i-th. (A failure between two renames, which write nothing, is
/// the one window left.)
pub fn replace_together(targets: &[&Path], mut write: impl FnMut(usize, &Path) -> Result<()>) -> Result<()> {
    let tmps: Vec<PathBuf> = targets.iter().map(|t| temp_path(t)).collect();
    let _on_signal: Vec<_> = tmps.iter().map(|t| crate::interrupt::remove_on_signal(t)).collect();
    let result = (|| {
        for (i, tmp) in tmps.iter().enumerate() {
            write(i, tmp)?;
            std::fs::File::open(tmp).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", tmp.display()))?;
        }
        for (tmp, target) in tmps.iter().zip(targets) {
            std::fs::rename(tmp, target).with_context(|| format!("renaming {} to {}", tmp.display(), target.display()))?;
        }
        Ok(())
    })();
    if result.is_err() {
        for tmp in &tmps {
            let _ = std::fs::remove_file(tmp);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_replaced_together_stay_old_together_when_one_write_fails() {
        let d = std::env::temp_dir().join(format!("reap-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let (a, b) = (d.join("a"), d.join("b"));
        std::fs::write(&a, "old a").unwrap();
        std::fs::write(&b, "old b").unwrap();
        let e = replace_together(&[&a, &b], |i, tmp| {
            if i == 1 {
                anyhow::bail!("disk full");
            }
            Ok(std::fs::write(tmp, "new a")?)
        });
        assert!(e.is_err());
        assert_eq!((std::fs::read_to_string(&a).unwrap(), std::fs::read_to_string(&b).unwrap()), ("old a".into(), "old b".into()));
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 2, "temporary files left");
        replace_together(&[&a, &b], |i, tmp| Ok(std::fs::write(tmp, format!("new {i}"))?)).unwrap();
        assert_eq!((std::fs::read_to_string(&a).unwrap(), std::fs::read_to_string(&b).unwrap()), ("new 0".into(), "new 1".into()));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
