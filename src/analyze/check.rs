//! `reap-imatrix check`: every invariant we know of a saliency JSON, and of its imatrix and
//! trace when given. Prints a report; exit 0 only when all hold (1 when one fails, 2 for a
//! file that cannot be read).

use crate::error::UsageError;
use crate::formats::imatrix as imatrix_file;
use crate::formats::saliency::{LayerSums, Saliency};
use crate::formats::trace::{phase_name, TraceReader, FLAG_DECODE, FLAG_NORMALISED, PHASE_DECODE, PHASE_PREFILL};
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// saliency JSON (from --reap-out)
    #[arg(long = "reap", value_name = "FILE")]
    pub reap: Option<PathBuf>,
    /// the imatrix of the same run: its ffn_down_exps counts must equal the JSON's counts
    #[arg(long = "imatrix", value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// a routing trace: checked on its own, and against --reap (the same run's, or for a
    /// trace-decode trace any run of the same model)
    #[arg(long = "trace", value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// slot share of the heaviest experts: how many to list per layer
    #[arg(long = "top", value_name = "N", default_value_t = 3)]
    pub top: usize,
}

/// One verdict line.
#[derive(Debug, Clone)]
pub struct Finding {
    pub ok: bool,
    pub what: String,
}

#[derive(Debug, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub notes: Vec<String>,
}

impl Report {
    fn check(&mut self, ok: bool, what: impl Into<String>) {
        self.findings.push(Finding { ok, what: what.into() });
    }
    pub fn all_hold(&self) -> bool {
        self.findings.iter().all(|f| f.ok)
    }
}

/// Relative closeness for sums of many f32 values accumulated in f64.
fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1.0)
}

/// The invariants of one JSON, on its own.
pub fn check_saliency(s: &Saliency, normalised: Option<bool>, top: usize, rep: &mut Report) {
    rep.check(!s.layers.is_empty(), format!("{} MoE layers present", s.layers.len()));
    let drops_total: u64 = s.layers.iter().map(|l| s.tokens.saturating_sub(l.tokens)).sum();
    rep.check(
        drops_total == s.nonfinite_drops,
        format!("nonfinite_drops = {} equals Σ over layers of (tokens − layer tokens) = {drops_total}", s.nonfinite_drops),
    );
    for l in &s.layers {
        check_layer(l, s.tokens, normalised, top, rep);
    }
}

fn check_layer(l: &LayerSums, tokens: u64, normalised: Option<bool>, top: usize, rep: &mut Report) {
    let id = format!("layer {}", l.layer);
    let sum_count: u64 = l.count.iter().sum();
    rep.check(l.tokens <= tokens, format!("{id}: layer tokens {} ≤ tokens {tokens}", l.tokens));
    rep.check(
        sum_count == l.tokens * l.n_expert_used as u64,
        format!("{id}: Σcount = {sum_count} = tokens {} × k {}", l.tokens, l.n_expert_used),
    );
    if normalised == Some(true) {
        let sp: f64 = l.prob_sum.iter().sum();
        rep.check(close(sp, l.tokens as f64, 1e-5), format!("{id}: Σprob_sum = {sp:.6} = tokens {} (normalised gating)", l.tokens));
    }
    let arrays = [
        ("prob_sum", &l.prob_sum),
        ("reap_l2_sum", &l.reap_l2_sum),
        ("reap_l2_sq_sum", &l.reap_l2_sq_sum),
        ("ean_sum", &l.ean_sum),
        ("router_prob_sum", &l.router_prob_sum),
        ("max_l2", &l.max_l2),
    ];
    let nonfinite: Vec<&str> = arrays.iter().filter(|(_, v)| v.iter().any(|x| !x.is_finite())).map(|(n, _)| *n).collect();
    rep.check(nonfinite.is_empty(), format!("{id}: all values finite{}", if nonfinite.is_empty() { String::new() } else { format!(" (not: {})", nonfinite.join(", ")) }));
    let negative: Vec<&str> = arrays.iter().filter(|(_, v)| v.iter().any(|x| *x < 0.0)).map(|(n, _)| *n).collect();
    rep.check(negative.is_empty(), format!("{id}: no negative sums{}", if negative.is_empty() { String::new() } else { format!(" (not: {})", negative.join(", ")) }));
    let zero_mismatch: Vec<usize> = (0..l.n_expert).filter(|&e| (l.count[e] == 0) != (l.reap_l2_sum[e] == 0.0)).collect();
    rep.check(zero_mismatch.is_empty(), format!("{id}: count = 0 ⇔ reap_l2_sum = 0{}", list_if_any(&zero_mismatch)));
    // Cauchy–Schwarz: Σx² ≥ (Σx)²/n, up to rounding of the f64 sums
    let cs: Vec<usize> = (0..l.n_expert)
        .filter(|&e| l.count[e] > 0 && l.reap_l2_sq_sum[e] < l.reap_l2_sum[e].powi(2) / l.count[e] as f64 * (1.0 - 1e-12))
        .collect();
    rep.check(cs.is_empty(), format!("{id}: reap_l2_sq_sum ≥ reap_l2_sum²/count{}", list_if_any(&cs)));
    let dead: Vec<usize> = (0..l.n_expert).filter(|&e| l.count[e] == 0).collect();
    let mut order: Vec<usize> = (0..l.n_expert).collect();
    order.sort_by(|&a, &b| l.count[b].cmp(&l.count[a]).then(a.cmp(&b)));
    let heavy: Vec<String> = order
        .iter()
        .take(top)
        .map(|&e| format!("{e} ({:.1}%)", 100.0 * l.count[e] as f64 / sum_count.max(1) as f64))
        .collect();
    rep.notes.push(format!("{id}: {} dead experts {:?}; heaviest slot shares: {}", dead.len(), dead, heavy.join(", ")));
}

fn list_if_any(v: &[usize]) -> String {
    if v.is_empty() {
        String::new()
    } else {
        format!(" (fails for experts {v:?})")
    }
}

pub fn run(args: &CheckArgs) -> Result<i32> {
    if args.reap.is_none() && args.trace.is_none() {
        return Err(UsageError("give --reap FILE, --trace FILE, or both".into()).into());
    }
    if args.imatrix.is_some() && args.reap.is_none() {
        return Err(UsageError("--imatrix is compared with the saliency JSON: give --reap too".into()).into());
    }
    let s = match &args.reap {
        Some(p) => Some(Saliency::read(p).map_err(|e| UsageError(format!("{e:#}")))?),
        None => None,
    };
    let mut rep = Report::default();
    let normalised = s.as_ref().and_then(|s| s.metadata.get("routing")).and_then(|r| r.get("normalised")).and_then(|v| v.as_bool());
    if let Some(s) = &s {
        check_saliency(s, normalised, args.top, &mut rep);
    }

    if let (Some(p), Some(s)) = (&args.imatrix, &s) {
        let im = imatrix_file::load(p).map_err(|e| UsageError(format!("{e:#}")))?;
        for l in &s.layers {
            let name = format!("blk.{}.ffn_down_exps.weight", l.layer);
            match im.entries.get(&name) {
                None => rep.check(false, format!("layer {}: imatrix {} has no {name}", l.layer, p.display())),
                Some(e) => {
                    let same = e.counts.len() == l.n_expert && e.counts.iter().zip(&l.count).all(|(&a, &b)| a >= 0 && a as u64 == b);
                    rep.check(same, format!("layer {}: count equals the imatrix counts of {name}", l.layer));
                }
            }
        }
    }

    let mut trace_rows = None;
    if let Some(p) = &args.trace {
        let t = TraceReader::open(p).map_err(|e| UsageError(format!("{e:#}")))?;
        if t.header_count_missing {
            rep.notes.push(format!("trace {}: header says 0 rows; read the {} rows present", p.display(), t.n_rows));
        }
        trace_rows = Some(t.n_rows);
        let phases = check_trace(&t, args.top, &mut rep);
        if let Some(s) = &s {
            compare_trace(&t, s, normalised, &phases, &mut rep);
        }
    }

    print_report(args, s.as_ref(), trace_rows, &rep);
    Ok(if rep.all_hold() { 0 } else { crate::error::EXIT_FAILURE })
}

/// Per phase (prefill, decode): rows, and per MoE layer the times each expert was selected.
pub struct PhaseCounts {
    pub rows: [u64; 2],
    /// `[phase][layer][expert]`
    pub counts: [Vec<Vec<u64>>; 2],
}

/// What a trace must satisfy on its own (any trace; a decode trace also its sequence layout).
/// Returns the selection counts recomputed from its rows, per phase.
pub fn check_trace(t: &TraceReader, top: usize, rep: &mut Report) -> PhaseCounts {
    let h = &t.header;
    let (nl, ne, k) = (h.n_layers(), h.n_expert as usize, h.k as usize);
    let decode_trace = h.flags & FLAG_DECODE != 0;
    let mut pc = PhaseCounts { rows: [0; 2], counts: [vec![vec![0; ne]; nl], vec![vec![0; ne]; nl]] };
    // first offending row of each invariant
    let (mut bad_id, mut dup, mut bad_w, mut bad_norm, mut bad_cand, mut bad_phase, mut bad_seq) =
        (None, None, None, None, None, None, None::<(u64, String)>);
    let mut prev: Option<(u32, u32, u32)> = None; // (sequence, pos, phase)
    let mut seen = vec![u64::MAX; ne];
    for i in 0..t.n_rows {
        let r = t.row(i);
        let phase = r.phase();
        if phase > PHASE_DECODE || (!decode_trace && phase != PHASE_PREFILL) {
            bad_phase.get_or_insert(i);
            continue;
        }
        pc.rows[phase as usize] += 1;
        if decode_trace {
            // each sequence: positions 0, 1, … in order, its prompt (prefill) before its
            // generated tokens; sequences numbered 0, 1, … in order
            let ok = match prev {
                None => r.chunk() == 0 && r.pos() == 0 && phase == PHASE_PREFILL,
                Some((s, pos, ph)) if r.chunk() == s => r.pos() == pos + 1 && phase >= ph,
                Some((s, _, _)) => r.chunk() == s + 1 && r.pos() == 0 && phase == PHASE_PREFILL,
            };
            if !ok && bad_seq.is_none() {
                bad_seq = Some((i, format!("sequence {} pos {} phase {}", r.chunk(), r.pos(), phase_name(phase))));
            }
            prev = Some((r.chunk(), r.pos(), phase));
        }
        for li in 0..nl {
            let (sel, w) = (r.sel_ids(li), r.sel_weights(li));
            let (cand, cp) = (r.cand_ids(li), r.cand_probs(li));
            if sel.iter().chain(cand).any(|&e| e as usize >= ne) {
                bad_id.get_or_insert(i);
                continue;
            }
            let stamp = i * nl as u64 + li as u64;
            for &e in sel {
                if seen[e as usize] == stamp {
                    dup.get_or_insert(i);
                }
                seen[e as usize] = stamp;
                pc.counts[phase as usize][li][e as usize] += 1;
            }
            if w.iter().any(|x| !x.is_finite() || *x < 0.0) {
                bad_w.get_or_insert(i);
            } else if h.flags & FLAG_NORMALISED != 0 && !close(w.iter().map(|&x| x as f64).sum(), 1.0, 1e-4) {
                bad_norm.get_or_insert(i);
            }
            if cp.iter().any(|p| !p.is_finite() || !(0.0..=1.0).contains(p)) || cp.windows(2).any(|x| x[1] > x[0]) {
                bad_cand.get_or_insert(i);
            }
        }
    }
    let at = |r: Option<u64>| r.map_or(String::new(), |r| format!(" (fails at row {r})"));
    rep.check(bad_phase.is_none(), format!(
        "every row's phase is {}{}",
        if decode_trace { "prefill or decode" } else { "prefill (not a trace-decode trace)" },
        at(bad_phase)
    ));
    rep.check(bad_id.is_none(), format!("every selected and candidate expert id is below n_expert {ne}{}", at(bad_id)));
    rep.check(dup.is_none(), format!("the {k} selected experts of each token and layer are distinct{}", at(dup)));
    rep.check(bad_w.is_none(), format!("gate weights finite and ≥ 0{}", at(bad_w)));
    if h.flags & FLAG_NORMALISED != 0 {
        rep.check(bad_norm.is_none(), format!("gate weights sum to 1 over the top-k (normalised gating){}", at(bad_norm)));
    }
    rep.check(bad_cand.is_none(), format!("router candidates' probabilities in [0, 1], best first{}", at(bad_cand)));
    if decode_trace {
        let what = "sequences 0, 1, … in order, each at positions 0, 1, …, its prompt (prefill) before its generated tokens (decode)";
        match &bad_seq {
            None => rep.check(true, what),
            Some((i, row)) => rep.check(false, format!("{what} (fails at row {i}: {row})")),
        }
    }
    for (ph, name) in [(0usize, "prefill"), (1, "decode")] {
        if pc.rows[ph] == 0 {
            continue;
        }
        rep.notes.push(format!("trace phase {name}: {} rows", pc.rows[ph]));
        for (li, c) in pc.counts[ph].iter().enumerate() {
            let unused: Vec<usize> = (0..ne).filter(|&e| c[e] == 0).collect();
            let total: u64 = c.iter().sum();
            let mut order: Vec<usize> = (0..ne).collect();
            order.sort_by(|&a, &b| c[b].cmp(&c[a]).then(a.cmp(&b)));
            let heavy: Vec<String> =
                order.iter().take(top).map(|&e| format!("{e} ({:.1}%)", 100.0 * c[e] as f64 / total.max(1) as f64)).collect();
            rep.notes.push(format!("  {name} layer {}: {} experts never selected; heaviest slot shares: {}", h.layers[li], unused.len(), heavy.join(", ")));
        }
    }
    pc
}

/// A trace against a saliency JSON: the same MoE layout always; the same tokens (row count,
/// counts) only for the run that wrote both. A decode trace comes from trace-decode, never
/// from the calibration run: its counts are set beside the JSON's, not compared.
fn compare_trace(t: &TraceReader, s: &Saliency, normalised: Option<bool>, pc: &PhaseCounts, rep: &mut Report) {
    let layers_match = t.header.layers == s.layers.iter().map(|l| l.layer).collect::<Vec<_>>();
    rep.check(layers_match, format!("trace layers {:?} are the JSON's MoE layers", t.header.layers));
    let shape_match = layers_match && s.layers.iter().all(|l| l.n_expert == t.header.n_expert as usize && l.n_expert_used == t.header.k as usize);
    if layers_match {
        rep.check(shape_match, format!("trace shape ({} experts, k = {}) is the JSON's", t.header.n_expert, t.header.k));
    }
    if let Some(n) = normalised {
        rep.check((t.header.flags & FLAG_NORMALISED != 0) == n, "trace and JSON agree on normalised gating");
    }
    if !shape_match {
        return;
    }
    if t.header.flags & FLAG_DECODE != 0 {
        for (li, l) in s.layers.iter().enumerate() {
            let revived: Vec<usize> = (0..l.n_expert).filter(|&e| l.count[e] == 0 && pc.counts[1][li][e] > 0).collect();
            if !revived.is_empty() {
                rep.notes.push(format!("layer {}: experts unused in the JSON's run but selected while decoding: {revived:?}", l.layer));
            }
        }
        rep.notes.push("decode trace (trace-decode): not the JSON's run, so its rows and counts are not compared with the JSON's".into());
        return;
    }
    rep.check(t.n_rows == s.trace_tokens_written, format!("trace rows {} = trace_tokens_written {}", t.n_rows, s.trace_tokens_written));
    if t.n_rows == s.tokens && s.nonfinite_drops == 0 {
        for (li, l) in s.layers.iter().enumerate() {
            rep.check(pc.counts[0][li] == l.count, format!("layer {}: counts recomputed from the trace equal the JSON's", l.layer));
        }
    } else {
        rep.notes.push(format!(
            "trace covers {} of {} tokens: counts not recomputed from it (only a whole-run trace can match)",
            t.n_rows, s.tokens
        ));
    }
}

fn print_report(args: &CheckArgs, s: Option<&Saliency>, trace_rows: Option<u64>, rep: &Report) {
    match (s, &args.reap) {
        (Some(s), Some(p)) => {
            println!("check {}: {} tokens, {} MoE layers, {} non-finite drops", p.display(), s.tokens, s.layers.len(), s.nonfinite_drops)
        }
        _ => println!("check {}: {} rows", args.trace.as_deref().unwrap_or(std::path::Path::new("?")).display(), trace_rows.unwrap_or(0)),
    }
    for f in &rep.findings {
        println!("  [{}] {}", if f.ok { "ok" } else { "FAIL" }, f.what);
    }
    for n in &rep.notes {
        println!("  note: {n}");
    }
    let failed = rep.findings.iter().filter(|f| !f.ok).count();
    if failed == 0 {
        println!("all {} invariants hold", rep.findings.len());
    } else {
        println!("{failed} of {} invariants FAIL", rep.findings.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer() -> LayerSums {
        let mut l = LayerSums::new(0, 4, 2);
        l.tokens = 3;
        l.count = vec![3, 2, 1, 0];
        l.prob_sum = vec![1.5, 1.0, 0.5, 0.0];
        l.reap_l2_sum = vec![3.0, 2.0, 1.0, 0.0];
        l.reap_l2_sq_sum = vec![3.0, 2.0, 1.0, 0.0];
        l.ean_sum = vec![6.0, 4.0, 2.0, 0.0];
        l
    }

    fn verdict(l: LayerSums, tokens: u64, drops: u64) -> Report {
        let s = Saliency { tokens, nonfinite_drops: drops, layers: vec![l], ..Default::default() };
        let mut r = Report::default();
        check_saliency(&s, Some(true), 2, &mut r);
        r
    }

    #[test]
    fn a_consistent_layer_passes() {
        let r = verdict(layer(), 3, 0);
        assert!(r.all_hold(), "{:?}", r.findings);
        assert!(r.notes[0].contains("1 dead experts [3]"), "{:?}", r.notes);
    }

    #[test]
    fn each_broken_invariant_is_caught() {
        let mut l = layer();
        l.count[0] = 4; // Σcount ≠ tokens·k
        assert!(!verdict(l, 3, 0).all_hold());
        let mut l = layer();
        l.prob_sum[0] = 2.5; // Σprob ≠ tokens
        assert!(!verdict(l, 3, 0).all_hold());
        let mut l = layer();
        l.reap_l2_sum[3] = 0.1; // dead expert with saliency
        assert!(!verdict(l, 3, 0).all_hold());
        let mut l = layer();
        l.reap_l2_sq_sum[0] = 2.0; // below (Σx)²/n = 3
        assert!(!verdict(l, 3, 0).all_hold());
        let mut l = layer();
        l.ean_sum[1] = f64::NAN;
        assert!(!verdict(l, 3, 0).all_hold());
        // drops must account for the missing tokens
        assert!(!verdict(layer(), 4, 0).all_hold());
        assert!(verdict(layer(), 4, 1).all_hold());
    }
}
