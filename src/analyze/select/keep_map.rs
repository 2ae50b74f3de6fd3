//! Keep maps: which experts each MoE layer keeps (written by `select`, read by `replay`).
//! The layout is in docs/select.md.

use crate::formats::atomic;
use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use std::path::Path;

pub const FORMAT: &str = "reap-keep-map";
pub const VERSION: u64 = 1;

/// The saliency JSON a map was fitted on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    pub path: String,
    /// sha256 of the JSON file's bytes, lowercase hex
    pub sha256: String,
    /// tokens the saliency sums cover (the first `tokens` tokens of that run)
    pub tokens: u64,
    /// rows that run wrote to its trace (the run's first tokens); 0 without a trace
    pub trace_tokens_written: u64,
}

/// The model the saliency was measured on (from the saliency JSON's `metadata.model`), so
/// `prune` can refuse a map meant for another model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRef {
    pub path: String,
    /// sha256 of the GGUF file, lowercase hex; None when the run did not record it
    pub sha256: Option<String>,
    pub expert_count: Option<u64>,
    /// a split model's further shards: (path as recorded, sha256), in order; empty otherwise
    pub shards: Vec<(String, String)>,
    /// the nextn/MTP block's own file, where the run read it from one (`--nextn-model`,
    /// DeepSeek-V4's): (path as recorded, sha256)
    pub nextn_model: Option<(String, Option<String>)>,
    /// `<arch>.hash_layer_count` (DeepSeek-V4): blocks below it route by token id
    /// (`ffn_gate_tid2eid`), so replay can tell them without the model; None when not stated
    pub hash_layer_count: Option<u32>,
}

impl ModelRef {
    /// From a saliency JSON's `metadata.model` or a keep map's `model`.
    pub fn from_json(m: &Value) -> ModelRef {
        let shards = m.get("shards").and_then(Value::as_array).map_or_else(Vec::new, |a| {
            a.iter()
                .filter_map(|s| Some((s.get("path")?.as_str()?.to_string(), s.get("sha256")?.as_str()?.to_string())))
                .collect()
        });
        ModelRef {
            path: m.get("path").and_then(Value::as_str).unwrap_or("").to_string(),
            sha256: m.get("sha256").and_then(Value::as_str).map(str::to_string),
            expert_count: m.get("expert_count").and_then(Value::as_u64),
            shards,
            nextn_model: m.get("nextn_model").and_then(|n| Some((n.get("path")?.as_str()?.to_string(), n.get("sha256").and_then(Value::as_str).map(str::to_string)))),
            // the saliency JSON states it as the GGUF's value printed (a string), a keep map as a number
            hash_layer_count: m.get("hash_layer_count").and_then(|v| v.as_u64().or_else(|| v.as_str()?.parse().ok())).and_then(|n| u32::try_from(n).ok()),
        }
    }

    /// Whether `block` routes by token id, where the map says (`hash_layer_count`).
    pub fn hash_routed(&self, block: u32) -> Option<bool> {
        self.hash_layer_count.map(|n| block < n)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct KeepLayer {
    /// block index; None when the file holds plain lists (then the position is the MoE layer slot)
    pub layer: Option<u32>,
    /// kept expert ids, sorted ascending, unique
    pub keep: Vec<u16>,
    /// the same ids in the order `prune --hash-remap` tries them as a stand-in for a dropped
    /// expert a hash-routed token's row names (select writes it for models with hash routing:
    /// the smallest mean REAP contribution per routed token first; a hand-made map may give any)
    pub stand_in: Option<Vec<u16>>,
}

impl KeepLayer {
    /// `stand_in`, where it lists exactly the kept experts; else why not (for a message).
    pub fn stand_ins(&self) -> Result<&[u16], String> {
        let r = self
            .stand_in
            .as_deref()
            .ok_or("the map has no \"stand_in\" (select writes one for a model with hash routing: the kept experts in the order to try them)")?;
        let mut sorted = r.to_vec();
        sorted.sort_unstable();
        if sorted != self.keep {
            return Err("its \"stand_in\" does not list the kept experts, each once (keep edited by hand? edit stand_in to match)".into());
        }
        Ok(r)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct KeepMap {
    pub method: String,
    pub k: usize,
    pub parameters: Value,
    pub source: Option<Source>,
    pub model: Option<ModelRef>,
    pub layers: Vec<KeepLayer>,
}

impl KeepMap {
    pub fn to_json(&self) -> Value {
        let layers: Vec<Value> =
            self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let mut v = json!({"layer": l.layer.unwrap_or(i as u32), "keep": l.keep});
                if let Some(r) = &l.stand_in {
                    v["stand_in"] = json!(r);
                }
                v
            })
            .collect();
        let source = self
            .source
            .as_ref()
            .map(|s| json!({"path": s.path, "sha256": s.sha256, "tokens": s.tokens, "trace_tokens_written": s.trace_tokens_written}));
        let mut v = json!({
            "format": FORMAT,
            "version": VERSION,
            "method": self.method,
            "k": self.k,
            "parameters": self.parameters,
            "source": source,
            "layers": layers,
        });
        if let Some(m) = &self.model {
            v["model"] = json!({"path": m.path, "sha256": m.sha256, "expert_count": m.expert_count});
            if !m.shards.is_empty() {
                v["model"]["shards"] = m.shards.iter().map(|(p, s)| json!({"path": p, "sha256": s})).collect();
            }
            if let Some((p, s)) = &m.nextn_model {
                v["model"]["nextn_model"] = json!({"path": p, "sha256": s});
            }
            if let Some(n) = m.hash_layer_count {
                v["model"]["hash_layer_count"] = json!(n);
            }
        }
        v
    }

    /// Writes the map atomically (pretty JSON, one line per layer's list is not guaranteed).
    pub fn write(&self, path: &Path) -> Result<()> {
        atomic::write_json(path, &self.to_json(), "keep map")
    }

    /// Reads a map. Accepts our own files and the contract's minimal form: `"method"`, `"k"`
    /// and `"layers"` as plain lists of ids or objects with `"layer"` and `"keep"`.
    pub fn read(path: &Path) -> Result<KeepMap> {
        let v = atomic::read_json(path, "keep map")?;
        Self::from_json(&v).with_context(|| format!("keep map {}", path.display()))
    }

    /// Whether the map is for a model (or trace) whose MoE layers are `blocks` with `n_expert`
    /// experts each; `what` names that other side in the message ("the trace", "MODEL").
    /// A map for another model fails here, before anything is computed.
    pub fn fits(&self, blocks: &[u32], n_expert: usize, what: &str) -> std::result::Result<(), String> {
        if let Some(n) = self.model.as_ref().and_then(|m| m.expert_count).filter(|&n| n != n_expert as u64) {
            return Err(format!("made for a model with {n} experts per layer; {what} has {n_expert}"));
        }
        if self.layers.len() != blocks.len() {
            return Err(format!("{} layers, {what} has {} MoE layers (a keep map for another model?)", self.layers.len(), blocks.len()));
        }
        for (li, (l, &b)) in self.layers.iter().zip(blocks).enumerate() {
            if let Some(lb) = l.layer.filter(|&lb| lb != b) {
                return Err(format!("entry {li} is block {lb}, {what}'s is block {b} (a keep map for another model?)"));
            }
            if let Some(e) = l.keep.iter().find(|&&e| e as usize >= n_expert) {
                return Err(format!("block {b} keeps expert {e}, {what} has {n_expert} experts (a keep map for another model?)"));
            }
        }
        Ok(())
    }

    pub fn from_json(v: &Value) -> Result<KeepMap> {
        if let Some(f) = v.get("format") {
            if f.as_str() != Some(FORMAT) {
                bail!("\"format\" is {f}, not \"{FORMAT}\"");
            }
        }
        let layers = v.get("layers").and_then(Value::as_array).context("missing array \"layers\"")?;
        let mut out = Vec::with_capacity(layers.len());
        for (i, l) in layers.iter().enumerate() {
            let (layer, ids, stand_in) = match l {
                Value::Array(a) => (None, a, None),
                Value::Object(_) => {
                    let layer =
                        l.get("layer").and_then(Value::as_u64).with_context(|| format!("layers[{i}]: missing integer \"layer\""))?;
                    let a = l.get("keep").and_then(Value::as_array).with_context(|| format!("layers[{i}]: missing array \"keep\""))?;
                    let stand_in = match l.get("stand_in") {
                        None | Some(Value::Null) => None,
                        Some(r) => Some(r.as_array().with_context(|| format!("layers[{i}]: \"stand_in\" is not an array"))?),
                    };
                    (Some(u32::try_from(layer).with_context(|| format!("layers[{i}]: layer {layer} is out of range"))?), a, stand_in)
                }
                _ => bail!("layers[{i}] is neither a list of ids nor an object"),
            };
            let ids_of = |a: &Vec<Value>| -> Result<Vec<u16>> {
                a.iter()
                    .map(|x| x.as_u64().filter(|&id| id <= u16::MAX as u64).map(|id| id as u16).with_context(|| format!("layers[{i}]: {x} is not an expert id")))
                    .collect()
            };
            let mut keep = ids_of(ids)?;
            keep.sort_unstable();
            if keep.windows(2).any(|w| w[0] == w[1]) {
                bail!("layers[{i}] lists an expert twice");
            }
            // checked against keep where it is used (KeepLayer::stand_ins): a map whose keep
            // was edited by hand serves everything else as before
            let stand_in = stand_in.map(ids_of).transpose()?;
            out.push(KeepLayer { layer, keep, stand_in });
        }
        let source = match v.get("source") {
            Some(s @ Value::Object(_)) => Some(Source {
                path: s.get("path").and_then(Value::as_str).unwrap_or("").to_string(),
                sha256: s.get("sha256").and_then(Value::as_str).unwrap_or("").to_string(),
                tokens: s.get("tokens").and_then(Value::as_u64).unwrap_or(0),
                trace_tokens_written: s.get("trace_tokens_written").and_then(Value::as_u64).unwrap_or(0),
            }),
            _ => None,
        };
        let model = match v.get("model") {
            Some(m @ Value::Object(_)) => Some(ModelRef::from_json(m)),
            _ => None,
        };
        Ok(KeepMap {
            method: v.get("method").and_then(Value::as_str).unwrap_or("").to_string(),
            k: v.get("k").and_then(Value::as_u64).unwrap_or(0) as usize,
            parameters: v.get("parameters").cloned().unwrap_or(Value::Null),
            source,
            model,
            layers: out,
        })
    }
}

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_map_round_trips_and_reads_the_minimal_form() {
        let m = KeepMap {
            method: "reap_l2_sum".into(),
            k: 2,
            parameters: json!({"min_count": 0}),
            source: Some(Source { path: "a.json".into(), sha256: sha256_hex(b"abc"), tokens: 10, trace_tokens_written: 4 }),
            model: Some(ModelRef { path: "m.gguf".into(), sha256: Some(sha256_hex(b"m")), expert_count: Some(8), shards: vec![("m-00002-of-00002.gguf".into(), sha256_hex(b"2"))], nextn_model: Some(("mtp-m.gguf".into(), Some(sha256_hex(b"mtp")))), hash_layer_count: Some(4) }),
            layers: vec![KeepLayer { layer: Some(3), keep: vec![1, 5], stand_in: Some(vec![5, 1]) }, KeepLayer { layer: Some(4), keep: vec![0, 2], stand_in: None }],
        };
        assert_eq!(KeepMap::from_json(&m.to_json()).unwrap(), m);
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let minimal = KeepMap::from_json(&json!({"method": "x", "k": 2, "layers": [[5, 1], [2, 0]]})).unwrap();
        assert_eq!(minimal.layers[0], KeepLayer { layer: None, keep: vec![1, 5], stand_in: None });
        assert!(minimal.source.is_none() && minimal.model.is_none());
        let e = KeepMap::from_json(&json!({"layers": [[1, 1]]})).unwrap_err();
        assert!(format!("{e:#}").contains("twice"), "{e:#}");
        let e = KeepMap::from_json(&json!({"layers": [[70000]]})).unwrap_err();
        assert!(format!("{e:#}").contains("not an expert id"), "{e:#}");
        // stand_in must be ids; it must list the kept experts, each once, where it is used
        for bad in [json!("1,5"), json!([1, -5])] {
            assert!(KeepMap::from_json(&json!({"layers": [{"layer": 0, "keep": [1, 5], "stand_in": bad}]})).is_err(), "{bad}");
        }
        for bad in [json!([1]), json!([1, 1]), json!([1, 6]), json!([1, 5, 2])] {
            let m = KeepMap::from_json(&json!({"layers": [{"layer": 0, "keep": [1, 5], "stand_in": bad}]})).unwrap();
            assert!(m.layers[0].stand_ins().unwrap_err().contains("does not list the kept experts"), "{bad}");
        }
        assert_eq!(m.layers[0].stand_ins(), Ok(&[5u16, 1][..]));
        assert!(m.layers[1].stand_ins().unwrap_err().contains("no \"stand_in\""));
        // hash_layer_count: the saliency JSON's string (the GGUF's value printed) or a map's number
        for v in [json!("3"), json!(3)] {
            let r = ModelRef::from_json(&json!({"path": "m.gguf", "hash_layer_count": v}));
            assert_eq!((r.hash_routed(0), r.hash_routed(2), r.hash_routed(3)), (Some(true), Some(true), Some(false)), "{v}");
        }
        for v in [json!(null), json!("x"), json!(-1), json!(5_000_000_000u64)] {
            assert_eq!(ModelRef::from_json(&json!({"path": "m.gguf", "hash_layer_count": v})).hash_routed(0), None, "{v}");
        }
        assert_eq!(ModelRef::from_json(&json!({"path": "m.gguf"})).hash_routed(0), None);
    }
}
