//! Copying the pristine tree and applying `patches/*.patch` to the copy.
//! Also compiled into the test suite (`tests/build_steps.rs`), so it uses std and sha2 only.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Top-level entries of the llama.cpp tree that the library build never reads.
const SKIP: &[&str] = &["models", "docs", "media", "benches", ".git", "app", "pocs", "gguf-py"];

/// The patches to apply, in name order (`0001-…`, `0002-…`).
pub fn list_patches(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = match fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "patch"))
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e),
    };
    v.sort();
    Ok(v)
}

/// Copies `from` into `to` (which must not exist), leaving out what the build never reads.
pub fn copy_tree(from: &Path, to: &Path) -> io::Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        if SKIP.iter().any(|s| name == *s) {
            continue;
        }
        copy_entry(&entry.path(), &to.join(&name))?;
    }
    Ok(())
}

fn copy_entry(from: &Path, to: &Path) -> io::Result<()> {
    let ft = fs::symlink_metadata(from)?.file_type();
    if ft.is_dir() {
        fs::create_dir_all(to)?;
        for entry in fs::read_dir(from)? {
            let entry = entry?;
            copy_entry(&entry.path(), &to.join(entry.file_name()))?;
        }
    } else if ft.is_symlink() {
        #[cfg(unix)]
        std::os::unix::fs::symlink(fs::read_link(from)?, to)?;
    } else {
        fs::copy(from, to)?;
    }
    Ok(())
}

/// Applies each patch with `git apply` inside `tree`. The first one that does not apply stops
/// everything, and the error names it.
pub fn apply_patches(tree: &Path, patches: &[PathBuf]) -> Result<(), String> {
    for p in patches {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let out = Command::new("git")
            .args(["apply", "--whitespace=nowarn", "-p1"])
            .arg(p)
            .current_dir(tree)
            .env("GIT_DIR", "/nonexistent") // treat the copy as a plain folder, not part of our repo
            .output()
            .map_err(|e| format!("could not run git to apply patch {name}: {e}\nInstall Debian's git."))?;
        if !out.status.success() {
            return Err(format!(
                "patch {name} does not apply to the pinned llama.cpp tree ({}):\n{}",
                p.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    Ok(())
}

/// sha256 over the names and bytes of the patches, in order: a key for the build folder and
/// a value for the run manifest (stable across machines, unlike mtimes).
pub fn digest(patches: &[PathBuf]) -> io::Result<String> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in patches {
        let bytes = fs::read(p)?;
        h.update(p.file_name().unwrap_or_default().as_encoded_bytes());
        h.update([0]);
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
