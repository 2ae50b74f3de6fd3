//! Whether eval's scored tokens are text the calibration saw. A keep map is fitted on the
//! calibration's tokens, so its KL divergence on those tokens says less about unseen text; eval
//! counts them and says so.
//!
//! A scored token is **in-sample** when the [`WINDOW`] tokens ending at it (the token and the
//! context before it in its chunk) occur, in that order, within one chunk the calibration
//! evaluated (its saliency JSON's `coverage`: `chunk_indices` × `n_ctx` over the text tokenized
//! as the run did), or anywhere in the text given by `--calibration-text`. A scored token with
//! fewer than [`WINDOW`] tokens of its chunk before it (`-c` under 2·WINDOW) counts as unseen.
//! Windows are compared by a 64-bit hash of their tokens.

use crate::analyze::select::keep_map::KeepMap;
use crate::fixture::rng::mix64;
use crate::formats::base_logits::scored_per_chunk;
use crate::llama::model::Vocab;
use anyhow::Result;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Tokens per window.
pub const WINDOW: usize = 32;

/// The calibration text a model was fitted on, and which of its chunks the run evaluated.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    pub text: PathBuf,
    pub sha256: String,
    /// tokenized as the run did (`--parse-special`)
    pub parse_special: bool,
    /// (n_ctx, the chunks evaluated, the text's token count as the run counted it); None: all of it
    pub chunks: Option<(usize, Vec<usize>, u64)>,
    /// where it was found: the saliency JSON's path, or `--calibration-text`
    pub via: String,
}

/// A file recorded by a relative path from another folder: as recorded (from the current
/// folder), else beside `near` or in its parent folder; the first that exists and has the
/// recorded sha256. Err: why none, naming `what`.
fn find(recorded: &str, sha256: &str, near: &Path, what: &str) -> std::result::Result<PathBuf, String> {
    let p = PathBuf::from(recorded);
    let mut tries = vec![p.clone()];
    if p.is_relative() {
        let dir = near.parent().unwrap_or(Path::new(""));
        tries.push(dir.join(&p));
        if let Some(up) = dir.parent() {
            tries.push(up.join(&p));
        }
    }
    tries.dedup();
    let mut changed = None;
    for t in &tries {
        match crate::formats::sha256::sha256_file(t) {
            Ok(s) if s == sha256 => return Ok(t.clone()),
            Ok(_) => changed = changed.or(Some(t.clone())),
            Err(_) => {}
        }
    }
    Err(match changed {
        Some(t) => format!("its {what} {} has changed since (sha256)", t.display()),
        None => format!("its {what} {recorded} cannot be read (looked for {})", tries.iter().map(|t| t.display().to_string()).collect::<Vec<_>>().join(", ")),
    })
}

/// The calibration behind a keep map: its `source` (the saliency JSON, checked by sha256), then
/// that JSON's `metadata.corpus` (the text, checked by sha256) and `coverage`. Paths as
/// recorded, from the current folder, else near the file that records them ([find]). Err: why
/// it cannot be told, in words.
pub fn of_keep_map(map: &Path) -> std::result::Result<Calibration, String> {
    let m = KeepMap::read(map).map_err(|e| format!("{e:#}"))?;
    let src = m.source.ok_or("the map names no saliency JSON (\"source\")")?;
    let json = find(&src.path, &src.sha256, map, "saliency JSON")?;
    let bytes = std::fs::read(&json).map_err(|e| format!("its saliency JSON {} cannot be read: {e}", json.display()))?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("{}: not JSON: {e}", json.display()))?;
    let corpus = &v["metadata"]["corpus"];
    let (Some(text), Some(sha)) = (corpus["path"].as_str(), corpus["sha256"].as_str()) else {
        return Err(format!("{} does not record its calibration text (metadata.corpus)", json.display()));
    };
    let text = find(text, sha, &json, "calibration text")?;
    let cov = &v["coverage"];
    let chunks = match (cov["n_ctx"].as_u64(), cov["chunk_indices"].as_array(), cov["corpus_tokens"].as_u64()) {
        (Some(n), Some(ix), Some(total)) if n > 0 => Some((n as usize, ix.iter().filter_map(|i| i.as_u64().map(|i| i as usize)).collect(), total)),
        _ => None,
    };
    Ok(Calibration {
        text,
        sha256: sha.to_string(),
        parse_special: corpus["parse_special"].as_bool().unwrap_or(false),
        chunks,
        via: json.display().to_string(),
    })
}

/// A window's hash.
fn window_hash(w: &[i32]) -> u64 {
    w.iter().fold(0x9E37_79B9_7F4A_7C15, |h, &t| mix64(h ^ t as u32 as u64))
}

/// The hashes of every window inside each of `ranges` of `tokens`.
fn windows(tokens: &[i32], ranges: impl Iterator<Item = Range<usize>>) -> HashSet<u64> {
    let mut set = HashSet::new();
    for r in ranges {
        let r = r.start.min(tokens.len())..r.end.min(tokens.len());
        set.extend(tokens[r].windows(WINDOW).map(window_hash));
    }
    set
}

/// The windows the calibration saw, from its text tokenized by `vocab`. With the run's chunks,
/// each chunk's tokens after its first (which the run replaced by BOS), and where the run
/// parsed special tokens, also each chunk's text tokenized as eval does (without); where the
/// text no longer tokenizes to the run's count, all of it (and a note why).
pub fn seen(vocab: &Vocab<'_>, cal: &Calibration) -> Result<(HashSet<u64>, Option<String>)> {
    let text = crate::calibrate::validate::corpus("--calibration-text", &cal.text, 1, 0)?;
    let tokens = vocab.tokenize(&text, true, cal.parse_special)?;
    Ok(match &cal.chunks {
        Some((n_ctx, ix, total)) if *total == tokens.len() as u64 => {
            let ranges = || ix.iter().map(|&c| c * n_ctx + 1..(c + 1) * n_ctx);
            let mut set = windows(&tokens, ranges());
            if cal.parse_special {
                // eval does not parse special tokens: each chunk's text tokenized its way too
                let at = byte_offsets(vocab, &tokens);
                for r in ranges() {
                    let (a, b) = (at[r.start.min(at.len() - 1)], at[r.end.min(at.len() - 1)]);
                    let t = vocab.tokenize(&text[a.min(text.len())..b.min(text.len())], false, false)?;
                    set.extend(windows(&t, std::iter::once(0..t.len())));
                }
            }
            (set, None)
        }
        Some((_, _, total)) => (
            windows(&tokens, std::iter::once(0..tokens.len())),
            Some(format!("{} tokenizes to {} tokens here, {total} in the run: every window of it counts", cal.text.display(), tokens.len())),
        ),
        None => (windows(&tokens, std::iter::once(0..tokens.len())), None),
    })
}

/// Where each of `tokens` (the text tokenized with BOS) starts in the text, and the text's end
/// last: the spelled lengths added up, BOS spelling nothing. Approximate by a byte where the
/// tokenizer adds a leading space (SentencePiece): enough to cut a chunk's text.
fn byte_offsets(vocab: &Vocab<'_>, tokens: &[i32]) -> Vec<usize> {
    let mut at = Vec::with_capacity(tokens.len() + 1);
    let mut pos = 0usize;
    let mut buf = Vec::new();
    for (i, &t) in tokens.iter().enumerate() {
        at.push(pos);
        if !(i == 0 && vocab.add_bos() && t == vocab.bos()) {
            if vocab.token_to_piece(t, &mut buf).is_ok() {
                pos += buf.len();
            }
        }
    }
    at.push(pos);
    at
}

/// (scored tokens, those in-sample) of eval's `n_chunk` chunks of `n_ctx` over `tokens`: the
/// tokens each chunk's second half predicts (`llama-perplexity`'s scored positions).
pub fn count(tokens: &[i32], n_ctx: usize, n_chunk: usize, seen: &HashSet<u64>) -> (u64, u64) {
    let first = n_ctx / 2;
    let (mut scored, mut hit) = (0u64, 0u64);
    for c in 0..n_chunk {
        let start = c * n_ctx;
        // logits at position j score token j + 1, for j in first..n_ctx-1
        for j in first..first + scored_per_chunk(n_ctx) {
            let t = start + j + 1;
            scored += 1;
            // the chunk's first token is BOS in the pass; windows start after it
            if t + 1 >= start + 1 + WINDOW && seen.contains(&window_hash(&tokens[t + 1 - WINDOW..=t])) {
                hit += 1;
            }
        }
    }
    (scored, hit)
}

/// The JSON entry of one model's check (`in_sample` in eval's JSON).
pub fn to_json(cal: &Calibration, scored: u64, hit: u64) -> Value {
    json!({
        "calibration_text": cal.text,
        "calibration_text_sha256": cal.sha256,
        "chunks": if cal.chunks.is_some() { "the run's" } else { "all" },
        "window": WINDOW,
        "scored_tokens": scored,
        "in_sample_tokens": hit,
        "fraction": if scored > 0 { hit as f64 / scored as f64 } else { 0.0 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scored_token_is_in_sample_when_its_window_lies_in_a_seen_chunk() {
        // 4 chunks of 80 tokens (40 scored... 39 per chunk: positions 40..78 score tokens 41..79)
        let n_ctx = 80;
        let tokens: Vec<i32> = (0..320).map(|i| 1000 + i).collect();
        assert_eq!(count(&tokens, n_ctx, 4, &HashSet::new()), (4 * 39, 0));
        // the calibration saw tokens 0..80 as one chunk: every scored token of chunk 0 whose
        // window is inside 1..80 (t ≥ 32) is in-sample, none of the others
        let seen = windows(&tokens, std::iter::once(1..80));
        assert_eq!(count(&tokens, n_ctx, 4, &seen), (4 * 39, 39));
        // the same tokens, seen split across two chunks: windows across the cut are not seen
        let seen = windows(&tokens, [1..60, 61..80].into_iter());
        // scored t = 41..=79; windows t-31..=t inside 1..60 need t ≤ 59 (19 of them); none fits in 61..80
        assert_eq!(count(&tokens, n_ctx, 4, &seen), (4 * 39, 19));
        // a window that reaches the chunk's first token (BOS in the pass) is never in-sample
        let short = 40;
        let seen = windows(&tokens, std::iter::once(0..320));
        // chunks of 40: scored t = start + 21..=start + 39; a window needs t ≥ start + 32
        assert_eq!(count(&tokens, short, 8, &seen), (8 * 19, 8 * 8));
    }

    #[test]
    fn a_keep_map_without_its_saliency_json_cannot_tell() {
        let d = std::env::temp_dir().join(format!("reap-in-sample-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let map = d.join("m.json");
        std::fs::write(&map, r#"{"method": "x", "k": 1, "layers": [[0]]}"#).unwrap();
        assert!(of_keep_map(&map).unwrap_err().contains("names no saliency JSON"));
        std::fs::write(&map, r#"{"method": "x", "k": 1, "layers": [[0]], "source": {"path": "/nonexistent/s.json", "sha256": "00", "tokens": 1}}"#).unwrap();
        assert!(of_keep_map(&map).unwrap_err().contains("/nonexistent/s.json cannot be read"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn relative_paths_are_found_beside_the_file_that_records_them_and_checked() {
        // run/imatrix.reap.json records text.txt; run/keep/m.json records imatrix.reap.json:
        // both relative to run/, where select and calibration ran; eval runs elsewhere
        let d = std::env::temp_dir().join(format!("reap-in-sample-find-{}", std::process::id()));
        std::fs::create_dir_all(d.join("run/keep")).unwrap();
        std::fs::write(d.join("run/text.txt"), "some calibration text").unwrap();
        let sha = |p: &Path| crate::formats::sha256::sha256_file(p).unwrap();
        let json = json!({"metadata": {"corpus": {"path": "text.txt", "sha256": sha(&d.join("run/text.txt")), "parse_special": true}},
                          "coverage": {"n_ctx": 4, "chunk_indices": [1, 3], "corpus_tokens": 20}});
        std::fs::write(d.join("run/imatrix.reap.json"), serde_json::to_vec(&json).unwrap()).unwrap();
        let map = d.join("run/keep/m.json");
        let write_map = |sha: &str| {
            let m = json!({"method": "x", "k": 1, "layers": [[0]], "source": {"path": "imatrix.reap.json", "sha256": sha, "tokens": 1}});
            std::fs::write(&map, serde_json::to_vec(&m).unwrap()).unwrap();
        };
        write_map(&sha(&d.join("run/imatrix.reap.json")));
        let c = of_keep_map(&map).unwrap();
        assert_eq!(c.text, d.join("run/text.txt"));
        assert_eq!((c.parse_special, c.chunks), (true, Some((4, vec![1, 3], 20))));
        assert_eq!(c.via, d.join("run/imatrix.reap.json").display().to_string());
        // a JSON that is not the one select read: refused, named
        write_map(&"0".repeat(64));
        assert!(of_keep_map(&map).unwrap_err().contains("saliency JSON") && of_keep_map(&map).unwrap_err().contains("has changed since"));
        let _ = std::fs::remove_dir_all(&d);
    }
}
