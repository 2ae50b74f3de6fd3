//! `--base-logits FILE`: when the base's log-probabilities on disk can be reused.
//!
//! The file (upstream's `--kl-divergence-base` format) records the tokens it was computed on,
//! `n_ctx`, `n_vocab` and the chunk count, but not the model. So:
//!
//! - the header must match this run exactly: same `n_ctx` (-c), chunk count (--chunks and the
//!   text's length), `n_vocab`, and the same tokens (the text tokenized by the base's
//!   vocabulary). Any difference is refused with what differs; the file is left alone.
//! - `eval` writes a sidecar `FILE.meta.json` beside it with the base model's sha256, the
//!   settings, and the sha256 of FILE itself. When the sidecar belongs to FILE (its recorded
//!   sha256 matches) and names another base model, the file is refused. Settings that only move
//!   the last bits of the logits (-b, -ub, -fa, -ngl) are reported when they differ, not
//!   refused.
//! - a FILE without a sidecar (written by `llama-perplexity`) is reused on the header match
//!   alone, with a notice that its base model cannot be checked.

use crate::error::UsageError;
use crate::formats::atomic;
use crate::formats::base_logits::Header;
use crate::formats::sha256::cached_sha256_file;
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

pub const SIDECAR_FORMAT: &str = "reap-base-logits-meta";

pub fn sidecar_path(file: &Path) -> PathBuf {
    let mut s = file.as_os_str().to_os_string();
    s.push(".meta.json");
    PathBuf::from(s)
}

/// What the sidecar records about how the base file was made.
#[derive(Clone, Debug, PartialEq)]
pub struct Provenance {
    pub base_path: String,
    pub base_sha256: String,
    pub text_path: String,
    pub text_sha256: String,
    /// settings that change the logits' last bits: batch, ubatch, flash_attn, n_gpu_layers
    pub settings: Value,
}

impl Provenance {
    fn to_json(&self, header: &Header, logits_sha256: &str) -> Value {
        json!({
            "format": SIDECAR_FORMAT,
            "version": 1,
            "logits_sha256": logits_sha256,
            "base": {"path": self.base_path, "sha256": self.base_sha256},
            "text": {"path": self.text_path, "sha256": self.text_sha256},
            "n_ctx": header.n_ctx,
            "n_vocab": header.n_vocab,
            "n_chunk": header.n_chunk,
            "settings": self.settings,
            "build": crate::calibrate::metadata::build_block(),
        })
    }
}

/// Writes the sidecar of a base file just written (atomically).
pub fn write_sidecar(file: &Path, header: &Header, logits_sha256: &str, p: &Provenance) -> Result<()> {
    atomic::write_json(&sidecar_path(file), &p.to_json(header, logits_sha256), "base log-probs sidecar")
}

pub enum Decision {
    /// no file yet: compute it
    Compute,
    /// reuse it; the lines say what was and was not checked
    Reuse(Vec<String>),
}

/// Where the header first differs from what this run needs, in words.
pub fn header_difference(found: &Header, want: &Header) -> Option<String> {
    if found.n_ctx != want.n_ctx {
        return Some(format!("n_ctx {} (this run: -c {})", found.n_ctx, want.n_ctx));
    }
    if found.n_vocab != want.n_vocab {
        return Some(format!("n_vocab {} (the base model has {})", found.n_vocab, want.n_vocab));
    }
    if found.n_chunk != want.n_chunk {
        return Some(format!("{} chunks (this run: {}; see --chunks and the text's length)", found.n_chunk, want.n_chunk));
    }
    let at = found.tokens.iter().zip(&want.tokens).position(|(a, b)| a != b)?;
    Some(format!(
        "other tokens: token {at} (chunk {}) is {} there, {} in this text (another text or tokenizer)",
        at / want.n_ctx as usize + 1,
        found.tokens[at],
        want.tokens[at]
    ))
}

/// Decides whether `file` can stand in for the base pass of this run. `base_sha256` is called
/// only when a sidecar needs it (hashing a large model takes a while).
pub fn decide(file: &Path, want: &Header, base_sha256: impl FnOnce() -> Result<String>, settings: &Value) -> Result<Decision> {
    if !file.exists() {
        return Ok(Decision::Compute);
    }
    let usage = |m: String| UsageError(format!("--base-logits {}: {m}; nothing was changed (remove it or name another file)", file.display()));
    let found = Header::read(file).map_err(|e| usage(format!("{e:#}")))?;
    if let Some(d) = header_difference(&found, want) {
        bail!(usage(format!("computed for {d}")));
    }
    let mut notes = vec![format!(
        "reusing base log-probs {}: tokens, n_ctx {}, n_vocab {}, {} chunks match",
        file.display(),
        want.n_ctx,
        want.n_vocab,
        want.n_chunk
    )];
    let side = sidecar_path(file);
    if !side.exists() {
        notes.push(format!("note: no {} (a llama-perplexity file?): the base model it came from is not checked", side.display()));
        return Ok(Decision::Reuse(notes));
    }
    let v = atomic::read_json(&side, "base log-probs sidecar")?;
    if v.get("format").and_then(Value::as_str) != Some(SIDECAR_FORMAT) {
        bail!(UsageError(format!("{}: not a base log-probs sidecar (\"format\" is not \"{SIDECAR_FORMAT}\")", side.display())));
    }
    let file_sha = cached_sha256_file(file)?;
    if v.get("logits_sha256").and_then(Value::as_str) != Some(file_sha.as_str()) {
        notes.push(format!(
            "warning: {} describes another version of {} (sha256 differs); ignored: the base model is not checked",
            side.display(),
            file.display()
        ));
        return Ok(Decision::Reuse(notes));
    }
    let recorded = v.pointer("/base/sha256").and_then(Value::as_str).unwrap_or("");
    let sha = base_sha256()?;
    if recorded != sha {
        let from = v.pointer("/base/path").and_then(Value::as_str).unwrap_or("?");
        bail!(usage(format!("computed from another base model ({from}, sha256 {recorded}; --base has {sha})")));
    }
    notes.push("base model sha256 matches the sidecar".into());
    // both sides' keys: a setting left at its default is not written (tensor_overrides)
    let then_settings = v.get("settings").and_then(Value::as_object);
    let mut keys: Vec<&String> = settings.as_object().into_iter().flatten().map(|(k, _)| k).collect();
    keys.extend(then_settings.into_iter().flatten().map(|(k, _)| k).filter(|k| settings.get(k.as_str()).is_none()));
    for k in keys {
        let (then, now) = (then_settings.and_then(|s| s.get(k)), settings.get(k));
        if then != now {
            let show = |x: Option<&Value>| x.cloned().unwrap_or(Value::Null);
            notes.push(format!("note: computed with {k} = {}, this run has {}: reused (it moves only the last bits)", show(then), show(now)));
        }
    }
    Ok(Decision::Reuse(notes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(tokens: Vec<i32>) -> Header {
        Header { n_ctx: 4, n_vocab: 10, n_chunk: (tokens.len() / 4) as i32, tokens }
    }

    #[test]
    fn header_differences_are_named() {
        let a = header((0..8).collect());
        assert_eq!(header_difference(&a, &a), None);
        let mut b = a.clone();
        b.tokens[5] = 99;
        let d = header_difference(&b, &a).unwrap();
        assert!(d.contains("token 5 (chunk 2) is 99 there, 5 in this text"), "{d}");
        let c = Header { n_ctx: 8, ..a.clone() };
        assert!(header_difference(&c, &a).unwrap().contains("n_ctx 8 (this run: -c 4)"));
        let e = header((0..4).collect());
        assert!(header_difference(&e, &a).unwrap().contains("1 chunks (this run: 2"));
    }
}
