//! The metadata block of the saliency JSON: what was run, on what, with which build.

use crate::llama::{self, Model};
use serde_json::{json, Map, Value};
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

/// What the model's GGUF says about its routing.
pub fn model_block(model: &Model, path: &Path, size: u64, sha256: Option<&str>) -> Value {
    let arch = model.meta_str("general.architecture").unwrap_or_default();
    let key = |k: &str| model.meta_str(&format!("{arch}.{k}"));
    json!({
        "file": path.file_name().map(|n| n.to_string_lossy().into_owned()),
        "path": path.to_string_lossy(),
        "size": size,
        "sha256": sha256,
        "architecture": arch,
        "n_layer": model.n_layer(),
        "n_embd": model.n_embd(),
        "expert_count": key("expert_count"),
        "expert_used_count": key("expert_used_count"),
        // as the GGUF states them; absent keys mean the architecture's built-in default
        "expert_gating_func": key("expert_gating_func"),
        "expert_weights_norm": key("expert_weights_norm"),
        "expert_weights_scale": key("expert_weights_scale"),
    })
}

pub fn build_block() -> Value {
    json!({
        "tool": "reap-imatrix",
        "version": env!("CARGO_PKG_VERSION"),
        "llama_cpp_commit": llama::PIN_COMMIT,
        "llama_cpp_sha256": llama::PIN_SHA256,
        "patches_sha256": llama::PATCHES_SHA256,
    })
}

/// Assembles the metadata object.
pub fn assemble(model: Value, corpus: Value, run: Value, routing: Value) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("model".into(), model);
    m.insert("corpus".into(), corpus);
    m.insert("run".into(), run);
    m.insert("routing".into(), routing);
    m.insert("build".into(), build_block());
    m
}
