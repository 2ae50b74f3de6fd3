//! The run manifest (`--manifest-out`, default `<stem>.manifest.json`): what was run (argv,
//! working folder, build), on which inputs (sha256), and what came out (sha256 per file), so
//! `reap-imatrix reproduce` can run it again and compare every output byte for byte.

use super::atomic;
use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "reap-manifest";
pub const VERSION: u64 = 1;

#[derive(Clone, Debug, PartialEq)]
pub struct FileRecord {
    /// model, corpus, in_file; imatrix, imatrix_at, reap, trace
    pub role: String,
    /// as given on the command line (relative to `cwd` when relative)
    pub path: PathBuf,
    pub size: u64,
    pub sha256: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    pub tool_version: String,
    pub llama_cpp_commit: String,
    pub patches_sha256: String,
    pub cwd: PathBuf,
    /// the arguments after the program name, as given
    pub argv: Vec<String>,
    pub inputs: Vec<FileRecord>,
    pub outputs: Vec<FileRecord>,
}

impl FileRecord {
    /// Hashes `path` (resolved against `cwd` when relative).
    pub fn of(role: &str, path: &Path, cwd: &Path) -> Result<FileRecord> {
        let full = if path.is_absolute() { path.to_path_buf() } else { cwd.join(path) };
        let size = std::fs::metadata(&full).with_context(|| format!("{}", full.display()))?.len();
        let sha256 = crate::calibrate::metadata::sha256_file(&full).with_context(|| format!("hashing {}", full.display()))?;
        Ok(FileRecord { role: role.into(), path: path.to_path_buf(), size, sha256 })
    }

    fn to_json(&self) -> Value {
        json!({"role": self.role, "path": self.path.to_string_lossy(), "size": self.size, "sha256": self.sha256})
    }

    fn from_json(v: &Value) -> Result<FileRecord> {
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(String::from).with_context(|| format!("file record without \"{k}\""));
        Ok(FileRecord {
            role: s("role")?,
            path: PathBuf::from(s("path")?),
            size: v.get("size").and_then(Value::as_u64).context("file record without \"size\"")?,
            sha256: s("sha256")?,
        })
    }
}

impl Manifest {
    pub fn to_json(&self) -> Value {
        json!({
            "format": FORMAT,
            "version": VERSION,
            "tool": {"name": "reap-imatrix", "version": self.tool_version, "llama_cpp_commit": self.llama_cpp_commit, "patches_sha256": self.patches_sha256},
            "cwd": self.cwd.to_string_lossy(),
            "argv": self.argv,
            "inputs": self.inputs.iter().map(FileRecord::to_json).collect::<Vec<_>>(),
            "outputs": self.outputs.iter().map(FileRecord::to_json).collect::<Vec<_>>(),
        })
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        atomic::write_json(path, &self.to_json(), "manifest")
    }

    pub fn read(path: &Path) -> Result<Manifest> {
        let v = atomic::read_json(path, "manifest")?;
        Self::from_json(&v).with_context(|| format!("manifest {}", path.display()))
    }

    pub fn from_json(v: &Value) -> Result<Manifest> {
        if v.get("format").and_then(Value::as_str) != Some(FORMAT) {
            bail!("\"format\" is not \"{FORMAT}\"");
        }
        if v.get("version").and_then(Value::as_u64) != Some(VERSION) {
            bail!("unsupported \"version\" (this build reads {VERSION})");
        }
        let tool = v.get("tool").context("missing \"tool\"")?;
        let ts = |k: &str| tool.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        let files = |k: &str| -> Result<Vec<FileRecord>> {
            v.get(k).and_then(Value::as_array).with_context(|| format!("missing array \"{k}\""))?.iter().map(FileRecord::from_json).collect()
        };
        Ok(Manifest {
            tool_version: ts("version"),
            llama_cpp_commit: ts("llama_cpp_commit"),
            patches_sha256: ts("patches_sha256"),
            cwd: PathBuf::from(v.get("cwd").and_then(Value::as_str).context("missing \"cwd\"")?),
            argv: v
                .get("argv")
                .and_then(Value::as_array)
                .context("missing array \"argv\"")?
                .iter()
                .map(|a| a.as_str().map(String::from).context("\"argv\" holds a non-string"))
                .collect::<Result<_>>()?,
            inputs: files("inputs")?,
            outputs: files("outputs")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let m = Manifest {
            tool_version: "0.1.0".into(),
            llama_cpp_commit: "0c1e57098".into(),
            patches_sha256: "ab".into(),
            cwd: "/w".into(),
            argv: vec!["-m".into(), "m.gguf".into()],
            inputs: vec![FileRecord { role: "model".into(), path: "m.gguf".into(), size: 3, sha256: "00".into() }],
            outputs: vec![FileRecord { role: "imatrix".into(), path: "i.gguf".into(), size: 5, sha256: "11".into() }],
        };
        assert_eq!(Manifest::from_json(&m.to_json()).unwrap(), m);
        assert!(Manifest::from_json(&json!({"format": "x"})).is_err());
    }
}
