//! The metadata block of the saliency JSON: what was run, on what, with which build.

use crate::llama::{self, Model};
use serde_json::{json, Map, Value};
use std::path::Path;

pub use crate::formats::sha256::{cached_sha256_file, sha256_file, sha256_hex};

/// What the model's GGUF says about its routing.
/// `shards`: a split model's further shards (path, size, sha256), listed under `"shards"`.
pub fn model_block(model: &Model, path: &Path, size: u64, sha256: Option<&str>, shards: &[(std::path::PathBuf, u64, String)]) -> Value {
    let arch = model.meta_str("general.architecture").unwrap_or_default();
    let key = |k: &str| model.meta_str(&format!("{arch}.{k}"));
    let mut v = json!({
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
        // routing within groups (DeepSeek-V3): select keeps the same number in every group
        "expert_group_count": key("expert_group_count"),
        "expert_group_used_count": key("expert_group_used_count"),
        // DeepSeek-V4: its first blocks route by token id (`ffn_gate_tid2eid`); select and
        // replay read which from here
        "hash_layer_count": key("hash_layer_count"),
    });
    if !shards.is_empty() {
        v["shards"] = shards.iter().map(|(p, size, sha)| json!({"path": p.to_string_lossy(), "size": size, "sha256": sha})).collect();
    }
    v
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
