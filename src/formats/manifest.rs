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
    /// what makes the numbers machine-dependent (absent in manifests written before it existed)
    pub platform: Option<Platform>,
    /// set when a signal stopped the run: the outputs hold a prefix of it
    pub interrupted: Option<Interruption>,
}

/// Where a signal stopped a calibration run, and what its outputs hold.
#[derive(Clone, Debug, PartialEq)]
pub struct Interruption {
    /// "SIGINT", "SIGTERM"
    pub signal: String,
    /// the chunk (1-based) being computed when the run stopped; with several sequences per
    /// batch, the first chunk of that batch
    pub chunk: u64,
    /// chunks complete before it
    pub chunks_done: u64,
    /// tokens evaluated (whole ubatches): what the imatrix, saliency JSON and trace hold
    pub tokens: u64,
}

impl Interruption {
    fn to_json(&self) -> Value {
        json!({"signal": self.signal, "chunk": self.chunk, "chunks_done": self.chunks_done, "tokens": self.tokens})
    }

    fn from_json(v: &Value) -> Result<Interruption> {
        let n = |k: &str| v.get(k).and_then(Value::as_u64).with_context(|| format!("\"interrupted\" without \"{k}\""));
        Ok(Interruption {
            signal: v.get("signal").and_then(Value::as_str).context("\"interrupted\" without \"signal\"")?.to_string(),
            chunk: n("chunk")?,
            chunks_done: n("chunks_done")?,
            tokens: n("tokens")?,
        })
    }
}

/// The machine a run computed on: llama.cpp's system info, the CPU features it reports as on
/// (ggml is built with GGML_NATIVE, so these change the arithmetic) and the backend devices.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Platform {
    pub system_info: String,
    pub cpu_features: Vec<String>,
    pub devices: Vec<String>,
}

impl Platform {
    /// The machine this process computes on.
    pub fn current() -> Platform {
        use crate::llama::system;
        let info = system::system_info();
        Platform { cpu_features: system::cpu_features(&info), system_info: info, devices: system::devices() }
    }

    fn to_json(&self) -> Value {
        json!({"system_info": self.system_info, "cpu_features": self.cpu_features, "devices": self.devices})
    }

    fn from_json(v: &Value) -> Platform {
        let list = |k: &str| -> Vec<String> {
            v.get(k).and_then(Value::as_array).map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect()).unwrap_or_default()
        };
        Platform {
            system_info: v.get("system_info").and_then(Value::as_str).unwrap_or_default().to_string(),
            cpu_features: list("cpu_features"),
            devices: list("devices"),
        }
    }

    /// "built for AVX512 here, AVX2 in the manifest": the features one side has and the other
    /// lacks, or None when they agree.
    pub fn cpu_difference(&self, recorded: &Platform) -> Option<String> {
        let only = |a: &Platform, b: &Platform| -> Vec<String> {
            a.cpu_features.iter().filter(|f| !b.cpu_features.contains(f)).cloned().collect()
        };
        let (here, there) = (only(self, recorded), only(recorded, self));
        if here.is_empty() && there.is_empty() {
            return None;
        }
        let say = |v: &[String]| if v.is_empty() { "nothing extra".to_string() } else { v.join(", ") };
        Some(format!("built for {} here, {} in the manifest", say(&here), say(&there)))
    }
}

impl FileRecord {
    /// Hashes `path` (resolved against `cwd` when relative).
    pub fn of(role: &str, path: &Path, cwd: &Path) -> Result<FileRecord> {
        let full = if path.is_absolute() { path.to_path_buf() } else { cwd.join(path) };
        let size = std::fs::metadata(&full).with_context(|| format!("{}", full.display()))?.len();
        let sha256 = super::sha256::sha256_file(&full).with_context(|| format!("hashing {}", full.display()))?;
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
        let mut v = json!({
            "format": FORMAT,
            "version": VERSION,
            "tool": {"name": "reap-imatrix", "version": self.tool_version, "llama_cpp_commit": self.llama_cpp_commit, "patches_sha256": self.patches_sha256},
            "cwd": self.cwd.to_string_lossy(),
            "argv": self.argv,
            "inputs": self.inputs.iter().map(FileRecord::to_json).collect::<Vec<_>>(),
            "outputs": self.outputs.iter().map(FileRecord::to_json).collect::<Vec<_>>(),
            "platform": self.platform.as_ref().map(Platform::to_json),
        });
        if let Some(i) = &self.interrupted {
            v["interrupted"] = i.to_json();
        }
        v
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
            platform: v.get("platform").filter(|p| p.is_object()).map(Platform::from_json),
            interrupted: v.get("interrupted").filter(|i| !i.is_null()).map(Interruption::from_json).transpose()?,
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
            platform: Some(Platform { system_info: "CPU : AVX2 = 1 | ".into(), cpu_features: vec!["AVX2".into()], devices: vec!["CPU: x".into()] }),
            interrupted: None,
        };
        assert_eq!(Manifest::from_json(&m.to_json()).unwrap(), m);
        assert!(m.to_json().get("interrupted").is_none(), "a complete run's manifest has no \"interrupted\"");
        let stopped = Manifest { interrupted: Some(Interruption { signal: "SIGINT".into(), chunk: 5, chunks_done: 4, tokens: 4 * 128 + 64 }), ..m.clone() };
        assert_eq!(Manifest::from_json(&stopped.to_json()).unwrap(), stopped);
        assert_eq!(stopped.to_json()["interrupted"]["chunks_done"], 4);
        assert!(Manifest::from_json(&json!({"format": "x"})).is_err());
    }
}

#[cfg(test)]
mod platform_tests {
    use super::*;

    #[test]
    fn cpu_differences_name_both_sides() {
        let p = |f: &[&str]| Platform { cpu_features: f.iter().map(|s| s.to_string()).collect(), ..Default::default() };
        assert_eq!(p(&["AVX2", "FMA"]).cpu_difference(&p(&["FMA", "AVX2"])), None);
        assert_eq!(
            p(&["AVX2", "AVX512"]).cpu_difference(&p(&["AVX2"])).unwrap(),
            "built for AVX512 here, nothing extra in the manifest"
        );
        assert_eq!(p(&["AVX2"]).cpu_difference(&p(&["AVX2", "AVX512", "AVX512_VNNI"])).unwrap(), "built for nothing extra here, AVX512, AVX512_VNNI in the manifest");
    }
}
