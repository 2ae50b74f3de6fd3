//! A keep map over a trace: which experts it keeps, whether it was fitted on the replayed
//! rows, and how the pruned model routes a token whose picks it drops (the selection bias,
//! expert groups, DeepSeek-V4's hash-routed blocks), as `replay --keep-map` models it.

use super::engine::{Keep, Rows};
use super::{gguf, usage, ReplayArgs};
use crate::analyze::select::keep_map::{sha256_hex, KeepMap};
use crate::formats::saliency::Saliency;
use crate::formats::trace::TraceReader;
use anyhow::{anyhow, Result};
use serde_json::{json, Value};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// `--keep-map` read and checked against the trace, with what re-routing under it needs.
pub struct Rerouting {
    pub path: PathBuf,
    pub map: KeepMap,
    /// `n_layers × n_expert`: kept
    pub flags: Vec<bool>,
    /// whether the replayed rows are in-sample: the report's JSON object and its note
    pub validity: (Value, String),
    /// per layer: routed by token id (None where no layer is)
    pub hash: Option<Vec<bool>>,
    /// `--hash-remap`: per layer, the stand-in order (empty where not hash-routed)
    pub remap: Option<Vec<Vec<u16>>>,
    /// the model's selection bias and whether its router is a softmax (renormalised)
    pub reroute: Option<(Vec<f32>, bool)>,
    /// (expert groups, groups used), where the trace lets replay model them
    pub groups: Option<(usize, usize)>,
    /// what re-routing follows, in words (the report's)
    pub by: String,
}

impl Rerouting {
    pub fn keep(&self) -> Keep<'_> {
        Keep {
            flags: &self.flags,
            bias: self.reroute.as_ref().map(|(b, _)| b.as_slice()),
            renormalise: self.reroute.as_ref().is_some_and(|(_, r)| *r),
            groups: self.groups,
            fixed: self.hash.as_deref(),
            remap: self.remap.as_deref(),
        }
    }
}

/// Reads `--keep-map` (None without it) and everything its re-routing needs from `--model`,
/// `--reap` and the trace; notes and warnings go to stderr and `warnings`.
pub fn rerouting(args: &ReplayArgs, trace: &TraceReader, rows: &Range<u64>, visit: &Rows, warnings: &mut Vec<String>) -> Result<Option<Rerouting>> {
    let Some(p) = &args.keep_map else { return Ok(None) };
    let h = &trace.header;
    let (ne, k) = (h.n_expert as usize, h.k as usize);
    let mut m = KeepMap::read(p).map_err(|e| usage(format!("--keep-map: {e:#}")))?;
    without_blocks_after_the_trace(&mut m, &h.layers, p, warnings);
    let flags = keep_flags(p, &m, &h.layers, ne, k, warnings)?;
    let validity = validity(p, &m, args.reap.as_deref(), trace, rows, visit)?;
    eprintln!("note: {}", validity.1);
    // DeepSeek-V4's hash-routed blocks: not re-routed (the pruned model's table keeps each
    // token's experts), and refused where the map drops one of the trace's picks there, as
    // prune refuses it. Which blocks: the model's tables, else the map's hash_layer_count
    // (select copies it from the calibration's JSON)
    let map_hash = m.model.as_ref().filter(|r| r.hash_layer_count.is_some()).map(|r| h.layers.iter().map(|&b| r.hash_routed(b) == Some(true)).collect::<Vec<bool>>());
    if args.hash_remap && args.model.is_none() && map_hash.is_none() {
        return Err(usage(
            "--hash-remap needs --model, or a keep map that states the model's hash_layer_count (select writes it from a calibration \
             of this version): the model's tables say which blocks route by token id"
                .into(),
        ));
    }
    let hash = match (&args.model, map_hash) {
        (None, None) => None,
        (model, map_hash) => {
            let hash = match model {
                Some(model) => gguf::hash_blocks(model, &h.layers).map_err(|e| usage(format!("--model: {e:#}")))?,
                None => map_hash.unwrap_or_default(),
            };
            if let Some(li) = hash.iter().position(|&x| x) {
                let how = if args.hash_remap {
                    "the trace's, a dropped one sent to the first kept expert of the map's stand_in the row lacks (--hash-remap)"
                } else {
                    hash_picks_kept(p, trace, &hash, &flags, ne)?;
                    "the trace's, not re-routed"
                };
                eprintln!("note: block {} routes by token id (ffn_gate_tid2eid): its picks are {how}", h.layers[li]);
            }
            Some(hash).filter(|v| v.iter().any(|&x| x))
        }
    };
    if args.hash_remap && hash.is_none() {
        eprintln!("note: --hash-remap: the model has no hash-routed block (no blk.N.ffn_gate_tid2eid); the flag changes nothing");
    }
    // --hash-remap: each hash-routed layer's stand-in order
    let remap: Option<Vec<Vec<u16>>> = match &hash {
        Some(hash) if args.hash_remap => Some(
            m.layers
                .iter()
                .zip(hash)
                .zip(&h.layers)
                .map(|((l, &x), b)| match (l.stand_ins(), x) {
                    (Ok(r), _) => Ok(r.to_vec()),
                    (Err(_), false) => Ok(Vec::new()),
                    (Err(why), true) => Err(usage(format!("--keep-map {}: --hash-remap: block {b} routes by token id, and {why}", p.display()))),
                })
                .collect::<Result<_>>()?,
        ),
        _ => None,
    };
    // the selection bias (and whether the router is a softmax) that re-routing follows
    let reroute = match &args.model {
        Some(model) => reroute_by(model, trace, args.reap.as_deref())?,
        None => None,
    };
    // group-limited routing (DeepSeek-V3): modelled where the trace lists every expert
    let mut groups = None;
    let mut model_groups = None;
    if let Some(model) = &args.model {
        if let Some((n, used)) = gguf::expert_groups(model).map_err(|e| usage(format!("--model: {e:#}")))? {
            model_groups = Some((n, used));
            // llama.cpp's own checks on loading (llama-model.cpp)
            if ne % n as usize != 0 || n as usize >= ne || used == 0 || used >= n {
                return Err(usage(format!(
                    "--model {}: {ne} experts in {n} expert groups, {used} used: llama.cpp refuses such a model (the groups must split the \
                     experts, and 0 < groups used < groups)",
                    model.display()
                )));
            }
            let keep: Vec<Vec<u16>> = m.layers.iter().map(|l| l.keep.clone()).collect();
            crate::analyze::prune::check_groups(&keep, &h.layers, p, ne as u64, n as u64, used as u64, k as u64)?;
            if (h.top_n as usize) < ne {
                let w = format!(
                    "the model routes within {used} of {n} expert groups (expert_group_count); re-routing for --keep-map {} needs \
                     every expert's score to choose the groups, and the trace lists the top {} of {ne}: the choice of groups is \
                     not modelled (trace again with --trace-top-n {ne})",
                    p.display(),
                    h.top_n
                );
                eprintln!("warning: {w}");
                warnings.push(w);
            } else {
                groups = Some((n as usize, used as usize));
            }
        }
    }
    let by = format!("{}{}", described(&reroute), if groups.is_some() { ", within the chosen expert groups" } else { "" });
    // (group masking moves picks below their first candidates too; the groups' own warning or
    // modelling covers it)
    if reroute.is_none() && model_groups.is_none() {
        let (off, scanned) = picks_off_candidates(trace, visit);
        if off > 0 {
            let w = match &args.model {
                None => format!(
                    "{off} token-layers of {scanned} pick experts below their first k candidates: the router adds a selection \
                     bias or routes within expert groups, which re-routing for --keep-map {} ignores without the model (give \
                     --model GGUF to re-route by them)",
                    p.display()
                ),
                Some(m) => format!(
                    "{off} token-layers of {scanned} pick experts below their first k candidates, but --model {} has no \
                     selection bias (exp_probs_b): is the trace of this model?",
                    m.display()
                ),
            };
            eprintln!("warning: {w}");
            warnings.push(w);
        }
    }
    Ok(Some(Rerouting { path: p.clone(), map: m, flags, validity, hash, remap, reroute, groups, by }))
}

/// What re-routing follows without a keep map's model groups, in words.
pub fn described(reroute: &Option<(Vec<f32>, bool)>) -> &'static str {
    match reroute {
        None => "probability",
        Some((_, false)) => "probability + selection bias",
        Some((_, true)) => "renormalised probability + selection bias",
    }
}

/// Token-layers with a pick below the trace's first k candidates (ranked lower, or not listed):
/// the mark of a selection bias (or of another trace's model), which re-routing by probability
/// order cannot follow. A pick tied with the k-th candidate is not counted (an exact tie may
/// fall either way). The bias is the model's, so where the replayed rows show none the trace's
/// first rows are looked at too. Returns the count and the rows it is of, in words.
pub fn picks_off_candidates(trace: &TraceReader, rows: &Rows) -> (u64, String) {
    let nl = trace.header.n_layers();
    let off_in = |row: u64| {
        let row = trace.row(row);
        (0..nl)
            .filter(|&li| {
                let (sel, cand, cp) = (row.sel_ids(li), row.cand_ids(li), row.cand_probs(li));
                let k = sel.len().min(cand.len());
                if k == 0 {
                    return false;
                }
                let p_k = cp[k - 1];
                sel.iter().any(|e| match cand.iter().position(|c| c == e) {
                    Some(r) => r >= k && cp[r] < p_k,
                    None => true,
                })
            })
            .count() as u64
    };
    let off: u64 = (0..rows.len()).map(|i| off_in(rows.get(i))).sum();
    if off > 0 {
        return (off, format!("{} replayed rows", rows.len()));
    }
    let first = trace.n_rows.min(4096);
    ((0..first).map(off_in).sum(), format!("the trace's first {first} rows (none among the replayed rows)"))
}

/// Every pick of the trace in a hash-routed layer (`hash[li]`) must be kept by the map
/// (`flags`, layer-major): the pruned model has no other expert for that token there.
fn hash_picks_kept(map: &Path, trace: &TraceReader, hash: &[bool], flags: &[bool], ne: usize) -> Result<()> {
    for i in 0..trace.n_rows {
        let row = trace.row(i);
        for (li, _) in hash.iter().enumerate().filter(|(_, &x)| x) {
            if let Some(&e) = row.sel_ids(li).iter().find(|&&e| !flags[li * ne + e as usize]) {
                return Err(usage(format!(
                    "--keep-map {}: block {} routes by token id (DeepSeek-V4's hash routing: ffn_gate_tid2eid), and the map drops expert {e}, \
                     which row {i} (token {}) is routed to there; prune refuses such a map unless given --hash-remap",
                    map.display(),
                    trace.header.layers[li],
                    row.token()
                )));
            }
        }
    }
    Ok(())
}

/// `replay --keep-map --model`: the model's selection bias per trace layer and whether its
/// router is a softmax (so that pruning renormalises p, which moves the choice once a bias is
/// added), or None when it has no bias. The model must be the trace's (its MoE blocks hold
/// the trace's expert count). A softmax's renormalisation needs every expert's p: a trace of
/// fewer candidates is refused.
fn reroute_by(model: &Path, trace: &TraceReader, reap: Option<&Path>) -> Result<Option<(Vec<f32>, bool)>> {
    let h = &trace.header;
    let ne = h.n_expert as usize;
    let bad = |e: anyhow::Error| usage(format!("--model: {e:#}"));
    gguf::expert_bytes(model, &h.layers, ne).map_err(bad)?;
    let hash = gguf::hash_blocks(model, &h.layers).map_err(bad)?;
    let Some(bias) = gguf::selection_bias(model, &h.layers, ne, &hash).map_err(bad)? else { return Ok(None) };
    // The router's kind: as the trace's run saw it in the graph (--reap's metadata.routing),
    // else the model's expert_gating_func (llama_expert_gating_func_type: 1 softmax; 2
    // sigmoid and 4 sqrt-softplus, elementwise; 3 selection by the raw logits, whose softmax
    // the trace holds; 0 or absent: the arch's own, which some graphs hard-code).
    enum Kind {
        Softmax,
        Elementwise,
        Logits,
    }
    let kind = match reap {
        Some(r) => {
            let sal = Saliency::read(r).map_err(|e| usage(format!("--reap {}: {e:#}", r.display())))?;
            let routing = sal.routing();
            match (routing.probs_from_logits, routing.probs_op.as_deref()) {
                (Some(true), _) => Kind::Logits,
                (_, Some("SOFT_MAX")) => Kind::Softmax,
                (_, Some(_)) => Kind::Elementwise,
                (_, None) => {
                    return Err(usage(format!(
                        "--reap {}: records no metadata.routing.probs_op (an older file); cannot tell whether {}'s router is a softmax",
                        r.display(),
                        model.display()
                    )))
                }
            }
        }
        None => match gguf::gating_func(model).map_err(bad)? {
            Some(1) => Kind::Softmax,
            Some(2 | 4) => Kind::Elementwise,
            Some(3) => Kind::Logits,
            _ => {
                return Err(usage(format!(
                    "--model {}: has a selection bias (exp_probs_b) but no expert_gating_func key: cannot tell whether its router \
                     is a softmax, which pruning renormalises; give --reap with the saliency JSON of the trace's run (it records the router's op)",
                    model.display()
                )))
            }
        },
    };
    let softmax = match kind {
        Kind::Softmax => true,
        Kind::Elementwise => false,
        Kind::Logits => {
            return Err(usage(format!(
                "--model {}: selects by the router's raw logits plus a selection bias (expert_gating_func 3); the trace holds their \
                 softmax, not the logits, so replay cannot re-route it",
                model.display()
            )))
        }
    };
    if softmax && (h.top_n as usize) < ne {
        return Err(usage(format!(
            "--model {}: a softmax router with a selection bias: the pruned model's probabilities are renormalised over the kept \
             experts, which needs every expert's p, and the trace lists the top {} of {ne}; trace again with --trace-top-n {ne}",
            model.display(),
            h.top_n
        )));
    }
    Ok(Some((bias, softmax)))
}

/// Drops the keep map's trailing entries named for blocks after the trace's last one: a
/// nextn/MTP block (`--nextn` calibrates it and `select` keeps its experts), which no trace
/// holds, as the forward pass never runs it. Noted, as `prune --drop-nextn` notes them.
fn without_blocks_after_the_trace(m: &mut KeepMap, blocks: &[u32], path: &Path, warnings: &mut Vec<String>) {
    let Some(&last) = blocks.last() else { return };
    let n = m.layers.iter().rev().take_while(|l| l.layer.is_some_and(|b| b > last)).count();
    if n == 0 || m.layers.len() - n != blocks.len() {
        return;
    }
    let dropped: Vec<u32> = m.layers.drain(m.layers.len() - n..).filter_map(|l| l.layer).collect();
    let w = format!("keep map {}: block(s) {dropped:?} come after the trace's last block {last} (a nextn/MTP block, which no trace holds): not replayed", path.display());
    eprintln!("note: {w}");
    warnings.push(w);
}

/// The keep map's survivors as `n_layers × n_expert` flags, checked against the trace.
fn keep_flags(path: &Path, m: &KeepMap, blocks: &[u32], ne: usize, k: usize, warnings: &mut Vec<String>) -> Result<Vec<bool>> {
    m.fits(blocks, ne, "the trace").map_err(|e| usage(format!("--keep-map {}: {e}", path.display())))?;
    let mut f = vec![false; blocks.len() * ne];
    for (li, (l, &b)) in m.layers.iter().zip(blocks).enumerate() {
        for &e in &l.keep {
            f[li * ne + e as usize] = true;
        }
        if l.keep.len() < k {
            let w =
                format!("keep map keeps {} experts in block {b}, fewer than k = {k}: every token there has forced misses", l.keep.len());
            eprintln!("warning: {w}");
            warnings.push(w);
        }
    }
    Ok(f)
}

/// Whether the replayed rows are tokens the keep map was fitted on (the audit's validity note).
/// The map's saliency file covers the first `source.tokens` tokens of its run, and a trace holds
/// the first tokens of its run, so rows below `source.tokens` of the same run are in-sample.
fn validity(path: &Path, m: &KeepMap, reap: Option<&Path>, trace: &TraceReader, rows: &Range<u64>, visit: &Rows) -> Result<(Value, String)> {
    let reap = reap.map(|r| read_reap(r, trace)).transpose()?;
    let Some(src) = &m.source else {
        let note = format!(
            "keep map {} records no source: cannot tell whether these rows are in-sample (replaying a map on the tokens it was fitted on is in-sample)",
            path.display()
        );
        return Ok((json!({"same_run": "unknown", "in_sample": Value::Null, "note": note}), note));
    };
    if trace.header.flags & crate::formats::trace::FLAG_DECODE != 0 {
        // trace-decode writes no saliency JSON: no keep map is fitted on its run
        let note = format!(
            "keep map fitted on {} ({} tokens of a calibration run); this trace was written by trace-decode over its own prompts and \
             generations: out-of-sample, unless those prompts appear in the text the map was fitted on",
            src.path, src.tokens
        );
        return Ok((
            json!({
                "source": {"path": src.path, "sha256": src.sha256, "tokens": src.tokens, "trace_tokens_written": src.trace_tokens_written},
                "same_run": "different", "decode_trace": true, "in_sample_rows": Value::Null, "in_sample": Value::Null, "note": note,
            }),
            note,
        ));
    }
    let h = &trace.header;
    let (same_run, why) = match reap {
        Some((sha, top_n)) => {
            if sha != src.sha256 {
                ("different", "--reap is not the keep map's source file, so the map was fitted on another run (or another checkpoint)".to_string())
            } else if src.trace_tokens_written == 0 {
                ("unknown", "--reap is the keep map's source, but that run wrote no trace: this trace is another run's".to_string())
            } else if let Some(n) = top_n.filter(|&n| n != h.top_n as u64) {
                let why = format!(
                    "--reap is the keep map's source, but that run traced the top-{n} candidates and this trace holds the top-{}: another run's trace",
                    h.top_n
                );
                ("unknown", why)
            } else if trace.n_rows >= src.trace_tokens_written {
                // a JSON of a checkpoint counts fewer rows than its run's trace goes on to hold
                ("confirmed", "--reap has the keep map's source sha256".to_string())
            } else {
                let why = format!(
                    "--reap is the keep map's source, but that run had traced {} rows and this trace holds {}: another run's trace",
                    src.trace_tokens_written, trace.n_rows
                );
                ("unknown", why)
            }
        }
        None if src.trace_tokens_written > 0 && src.trace_tokens_written == trace.n_rows => (
            "assumed",
            format!("the trace has exactly the {} rows the map's source run traced; pass --reap to confirm", src.trace_tokens_written),
        ),
        None => ("unknown", "pass --reap with the trace's saliency JSON to tell".to_string()),
    };
    let overlap = match visit {
        Rows::Range(_) => rows.end.min(src.tokens).saturating_sub(rows.start),
        Rows::List(l) => l.iter().filter(|&&i| i < src.tokens).count() as u64,
    };
    let in_sample = match same_run {
        "different" => Value::Null,
        _ => json!(overlap > 0),
    };
    let note = match same_run {
        "different" => format!(
            "keep map fitted on {} (sha256 {}…), {why}; in-sample only if that run saw these tokens",
            src.path,
            &src.sha256[..src.sha256.len().min(12)]
        ),
        _ => {
            let fair = if src.tokens < trace.n_rows {
                format!("a fair test replays rows ≥ {0} (--tokens {0}..) or a trace of other text", src.tokens)
            } else {
                "every row of this trace was in the fit: a fair test needs a trace of other text".to_string()
            };
            format!(
                "keep map fitted on the first {} tokens of the run that wrote {} (same run as this trace: {same_run}; {why}). \
                 Rows [{}, {}) include {overlap} of those tokens: {}; {fair}.",
                src.tokens,
                src.path,
                rows.start,
                rows.end,
                match (overlap > 0, same_run) {
                    (false, _) => "out-of-sample",
                    (true, "unknown") => "the replay is IN-SAMPLE if this trace is of that run",
                    (true, _) => "the replay is IN-SAMPLE",
                },
            )
        }
    };
    Ok((
        json!({
            "source": {"path": src.path, "sha256": src.sha256, "tokens": src.tokens, "trace_tokens_written": src.trace_tokens_written},
            "same_run": same_run,
            "in_sample_rows": overlap,
            "in_sample": in_sample,
            "note": note,
        }),
        note,
    ))
}

/// `--reap`: a saliency JSON of the trace's model (its MoE layers, experts and k; refused
/// otherwise), as its sha256 and the top-N its run traced (None where the file does not record
/// it).
fn read_reap(r: &Path, trace: &TraceReader) -> Result<(String, Option<u64>)> {
    let bytes = std::fs::read(r).map_err(|e| usage(format!("--reap {}: {e}", r.display())))?;
    let sal = serde_json::from_slice::<Value>(&bytes)
        .map_err(|e| anyhow!("not valid JSON: {e}"))
        .and_then(|v| Saliency::from_json(&v))
        .map_err(|e| usage(format!("--reap {}: not a saliency JSON: {e:#}", r.display())))?;
    let h = &trace.header;
    let blocks: Vec<u32> = sal.layers.iter().map(|l| l.layer).collect();
    if blocks != h.layers {
        return Err(usage(format!("--reap {}: its MoE layers {blocks:?} are not the trace's {:?}", r.display(), h.layers)));
    }
    if let Some(l) = sal.layers.iter().find(|l| l.n_expert != h.n_expert as usize || l.n_expert_used != h.k as usize) {
        return Err(usage(format!(
            "--reap {}: {} experts, k = {} in layer {}; the trace has {} experts per layer, k = {}",
            r.display(),
            l.n_expert,
            l.n_expert_used,
            l.layer,
            h.n_expert,
            h.k
        )));
    }
    // the run records the --trace-top-n asked for; its trace holds at most n_expert candidates
    let top_n = sal.metadata.get("run").and_then(|r| r.get("trace_top_n")).and_then(Value::as_u64).map(|n| n.min(h.n_expert as u64));
    Ok((sha256_hex(&bytes), top_n))
}

