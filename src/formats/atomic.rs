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

/// The file a write to `target` lands in: a symlink's target (followed, also when it does not
/// exist yet), as upstream's `std::ofstream` writes through a link; otherwise `target`.
/// Replacing the link itself would leave the file it points to stale.
pub fn resolve(target: &Path) -> PathBuf {
    let mut p = target.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => match std::fs::read_link(&p) {
                Ok(to) => p = p.parent().map_or(to.clone(), |d| d.join(&to)),
                Err(_) => break,
            },
            _ => break,
        }
    }
    p
}

/// Whether `target` is written in place rather than replaced: an existing file that is
/// neither a regular file nor a folder (`/dev/null`, a FIFO). A rename over it would put a
/// regular file where the device node was (as root, `-o /dev/null` would replace the system's
/// `/dev/null`), and a temporary file beside it may not be allowed (`/dev`).
pub fn in_place(target: &Path) -> bool {
    std::fs::metadata(target).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Whether two paths name one file: the same path once made absolute with its folder's links
/// and `..` resolved (`a.json`, `./a.json`, `sub/../a.json`; for outputs that do not exist
/// yet), or, both existing, the same inode (a symlink or hard link to it). Used to refuse an
/// output that would overwrite an input, or another output. A device written in place
/// (`/dev/null`) holds nothing to overwrite: it is never "the same file".
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if in_place(a) || in_place(b) {
        return false;
    }
    let real = |p: &Path| -> Option<PathBuf> {
        let p = std::path::absolute(resolve(p)).ok()?;
        let name = p.file_name()?.to_os_string();
        let dir = std::fs::canonicalize(p.parent()?).ok()?;
        Some(dir.join(name))
    };
    let inode = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    a == b || matches!((real(a), real(b)), (Some(x), Some(y)) if x == y) || matches!((inode(a), inode(b)), (Some(x), Some(y)) if x == y)
}

/// Whether `target` can be written the way `replace_with` writes it: its folder exists and a
/// temporary file can be created (and is removed) there; a device written in place must open
/// for writing. Checked before a long run starts, so a typo in an output path costs a second,
/// not the whole computation.
pub fn check_writable(target: &Path) -> std::result::Result<(), String> {
    let real = resolve(target);
    if in_place(&real) {
        return match std::fs::OpenOptions::new().write(true).open(&real) {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("{}: cannot write to it: {e}", target.display())),
        };
    }
    let dir = match real.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(format!("{}: the folder {} does not exist", target.display(), dir.display()));
    }
    if real.is_dir() {
        return Err(format!("{}: is a folder", target.display()));
    }
    let tmp = temp_path(&real);
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
    // a device (`/dev/null`) is written directly: nothing to sync, rename or remove
    let reals: Vec<PathBuf> = targets.iter().map(|t| resolve(t)).collect();
    let direct: Vec<bool> = reals.iter().map(|r| in_place(r)).collect();
    let tmps: Vec<PathBuf> = reals.iter().zip(&direct).map(|(r, &d)| if d { r.clone() } else { temp_path(r) }).collect();
    let _on_signal: Vec<_> = tmps.iter().zip(&direct).filter(|(_, &d)| !d).map(|(t, _)| crate::interrupt::remove_on_signal(t)).collect();
    let result = (|| {
        for (i, tmp) in tmps.iter().enumerate() {
            write(i, tmp)?;
            if !direct[i] {
                std::fs::File::open(tmp).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", tmp.display()))?;
            }
        }
        for ((tmp, real), &d) in tmps.iter().zip(&reals).zip(&direct) {
            if !d {
                std::fs::rename(tmp, real).with_context(|| format!("renaming {} to {}", tmp.display(), real.display()))?;
            }
        }
        Ok(())
    })();
    if result.is_err() {
        for (tmp, &d) in tmps.iter().zip(&direct) {
            if !d {
                let _ = std::fs::remove_file(tmp);
            }
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

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("reap-atomic-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_symlink_is_written_through_and_a_fifo_in_place() {
        use std::os::unix::fs::FileTypeExt;
        let d = scratch("links");
        std::fs::create_dir(d.join("real")).unwrap();
        std::fs::write(d.join("real/im.gguf"), "old").unwrap();
        std::os::unix::fs::symlink("real/im.gguf", d.join("link.gguf")).unwrap();
        check_writable(&d.join("link.gguf")).unwrap();
        write_bytes(&d.join("link.gguf"), b"new").unwrap();
        assert!(std::fs::symlink_metadata(d.join("link.gguf")).unwrap().file_type().is_symlink(), "the link was replaced");
        assert_eq!(std::fs::read_to_string(d.join("real/im.gguf")).unwrap(), "new");
        // a dangling link: the file it names is created
        std::os::unix::fs::symlink("real/new.json", d.join("dangling.json")).unwrap();
        write_bytes(&d.join("dangling.json"), b"{}").unwrap();
        assert_eq!(std::fs::read_to_string(d.join("real/new.json")).unwrap(), "{}");
        // a FIFO (as /dev/null would be) is written, not replaced, and leaves nothing beside it
        let fifo = d.join("pipe");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let reader = {
            let f = fifo.clone();
            std::thread::spawn(move || std::fs::read(f).unwrap())
        };
        assert!(in_place(&fifo));
        write_bytes(&fifo, b"through the pipe").unwrap();
        assert_eq!(reader.join().unwrap(), b"through the pipe");
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced by a file");
        assert!(!same_file(&fifo, &fifo), "two writes to a device do not overwrite each other");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 4, "temporary files left");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn same_file_sees_through_dot_dot_and_linked_folders_before_the_file_exists() {
        let d = scratch("same");
        std::fs::create_dir(d.join("sub")).unwrap();
        std::os::unix::fs::symlink(".", d.join("here")).unwrap();
        let a = d.join("i.gguf");
        assert!(same_file(&a, &d.join("sub/../i.gguf")));
        assert!(same_file(&a, &d.join("here/i.gguf")));
        assert!(same_file(&a, &d.join("./i.gguf")));
        assert!(!same_file(&a, &d.join("sub/i.gguf")));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
