//! sha256 of bytes and files, with a cache for large models.

use std::io::Read;
use std::path::Path;

pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of a file, streamed (models are large).
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// sha256 of a file, remembered per (canonical path, size, mtime, inode) in
/// `$REAP_IMATRIX_HASH_CACHE` (default `$XDG_CACHE_HOME/reap-imatrix/sha256.tsv` or
/// `~/.cache/…`; `off` disables it), so a model of hundreds of GB is hashed once, not on every
/// calibration run. The same heuristic make and git use: a file rewritten in place with the
/// same size and mtime would be missed; `reproduce` always hashes in full.
pub fn cached_sha256_file(path: &Path) -> std::io::Result<String> {
    match hash_cache_path() {
        Some(cache) => sha256_file_cached_in(path, &cache),
        None => sha256_file(path),
    }
}

/// As `cached_sha256_file`, with the cache file given.
pub fn sha256_file_cached_in(path: &Path, cache: &Path) -> std::io::Result<String> {
    use std::os::unix::fs::MetadataExt;
    let canon = std::fs::canonicalize(path)?;
    let m = std::fs::metadata(&canon)?;
    let key = format!("{}\t{}\t{}\t{}", m.len(), m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128, m.ino(), canon.display());
    let text = std::fs::read_to_string(cache).unwrap_or_default();
    if let Some(hit) = text.lines().find_map(|l| l.split_once('\t').filter(|(_, k)| *k == key).map(|(h, _)| h.to_string())) {
        return Ok(hit);
    }
    let sha = sha256_file(&canon)?;
    // keep the other entries (last 1000), replace this file's, write atomically
    let mut lines: Vec<&str> = text.lines().filter(|l| !l.ends_with(&format!("\t{}", canon.display()))).collect();
    let len = lines.len();
    lines.drain(..len.saturating_sub(999));
    let entry = format!("{sha}\t{key}");
    lines.push(&entry);
    if let Some(dir) = cache.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = crate::formats::atomic::write_bytes(cache, (lines.join("\n") + "\n").as_bytes());
    Ok(sha)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_cache_serves_an_unchanged_file_and_rehashes_a_changed_one() {
        let d = std::env::temp_dir().join(format!("reap-hash-cache-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let (f, cache) = (d.join("model.bin"), d.join("cache.tsv"));
        std::fs::write(&f, b"abc").unwrap();
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(sha256_file_cached_in(&f, &cache).unwrap(), abc);
        assert!(std::fs::read_to_string(&cache).unwrap().starts_with(abc));
        // a cache entry is trusted while size, mtime and inode match: prove it is read
        let text = std::fs::read_to_string(&cache).unwrap().replace(abc, &"f".repeat(64));
        std::fs::write(&cache, text).unwrap();
        assert_eq!(sha256_file_cached_in(&f, &cache).unwrap(), "f".repeat(64));
        // a changed file (size) is hashed again, and its entry replaced
        std::fs::write(&f, b"abcd").unwrap();
        let h = sha256_file_cached_in(&f, &cache).unwrap();
        assert_eq!(h, sha256_file(&f).unwrap());
        assert_eq!(std::fs::read_to_string(&cache).unwrap().lines().count(), 1);
        let _ = std::fs::remove_dir_all(&d);
    }
}

fn hash_cache_path() -> Option<std::path::PathBuf> {
    match std::env::var_os("REAP_IMATRIX_HASH_CACHE") {
        Some(v) if v == "off" => None,
        Some(v) if !v.is_empty() => Some(v.into()),
        _ => {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .filter(|v| !v.is_empty())
                .map(std::path::PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))?;
            Some(base.join("reap-imatrix/sha256.tsv"))
        }
    }
}
