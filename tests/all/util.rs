//! Shared test helpers: paths, temp dirs, generated fixtures, the upstream reference tools.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn ours() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_reap-imatrix"))
}

pub fn corpus() -> PathBuf {
    repo().join("corpus/calibration.txt")
}

/// The folder with upstream's tools built from the same pin (scripts/build-reference).
/// Missing tools fail the test: parity is never skipped silently.
pub fn reference_bin(tool: &str) -> PathBuf {
    let dir = std::env::var_os("REAP_REFERENCE_BIN").map(PathBuf::from).unwrap_or_else(|| {
        let pin = std::fs::read_to_string(repo().join("vendor/llama.cpp.pin")).unwrap();
        let commit = pin.lines().find_map(|l| l.strip_prefix("commit=")).unwrap().trim().to_string();
        repo().join(format!("vendor/cache/reference-{commit}/bin"))
    });
    let p = dir.join(tool);
    assert!(p.is_file(), "upstream reference tool {} is missing: run scripts/build-reference (or scripts/test)", p.display());
    p
}

/// A fresh empty folder for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = repo().join("target/test-tmp").join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
    out
}

pub fn run_ok(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A generated fixture model, built once per test run and shared.
pub fn fixture(arch: &str) -> PathBuf {
    static MADE: OnceLock<Mutex<Vec<(String, PathBuf)>>> = OnceLock::new();
    let made = MADE.get_or_init(|| Mutex::new(Vec::new()));
    let mut made = made.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = made.iter().find(|(a, _)| a == arch) {
        return p.clone();
    }
    let dir = temp_dir(&format!("fixture-{arch}"));
    let path = dir.join(format!("{arch}.gguf"));
    run_ok(Command::new(ours()).args(["fixture", "--arch", arch, "-o"]).arg(&path));
    made.push((arch.to_string(), path.clone()));
    path
}

pub fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Asserts two files are byte-identical, saying where they first differ.
pub fn assert_same_bytes(a: &Path, b: &Path) {
    let (x, y) = (read(a), read(b));
    if x != y {
        let at = x.iter().zip(&y).position(|(p, q)| p != q).unwrap_or(x.len().min(y.len()));
        panic!("{} ({} bytes) and {} ({} bytes) differ, first at byte {at}", a.display(), x.len(), b.display(), y.len());
    }
}

/// The perplexity lines a run printed on stdout (`[1]…,` and `Final estimate: …`).
pub fn ppl_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('[') || l.starts_with("Final estimate"))
        .map(String::from)
        .collect()
}
