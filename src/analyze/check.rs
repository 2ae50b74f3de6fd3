//! `reap-imatrix check`: every invariant we know of a saliency JSON, and of its imatrix and
//! trace when given. Prints a report; exit 0 only when all hold (1 when one fails, 2 for a
//! file that cannot be read).

use crate::error::UsageError;
use crate::formats::imatrix as imatrix_file;
use crate::formats::saliency::{LayerSums, Saliency};
use crate::formats::trace::{TraceReader, FLAG_NORMALISED};
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// saliency JSON (from --reap-out)
    #[arg(long = "reap", value_name = "FILE")]
    pub reap: PathBuf,
    /// the imatrix of the same run: its ffn_down_exps counts must equal the JSON's counts
    #[arg(long = "imatrix", value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// the routing trace of the same run
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
    if !s.domains.is_empty() {
        check_domains(s, rep);
    }
}

/// Per-domain sums (`--domains`) add up to the whole run: tokens and counts exactly, the float
/// sums up to the order of addition.
fn check_domains(s: &Saliency, rep: &mut Report) {
    let tokens: u64 = s.domains.iter().map(|d| d.tokens).sum();
    rep.check(tokens == s.tokens, format!("domains: Σ tokens over {} domains = {tokens} = tokens {}", s.domains.len(), s.tokens));
    for (slot, l) in s.layers.iter().enumerate() {
        let id = format!("layer {}", l.layer);
        let parts: Vec<&crate::formats::saliency::DomainLayer> = s.domains.iter().filter_map(|d| d.layers.get(slot)).collect();
        let shaped = parts.len() == s.domains.len() && parts.iter().all(|p| p.layer == l.layer && p.count.len() == l.n_expert);
        rep.check(shaped, format!("{id}: every domain has this layer with {} experts", l.n_expert));
        if !shaped {
            continue;
        }
        let count_off: Vec<usize> = (0..l.n_expert).filter(|&e| parts.iter().map(|p| p.count[e]).sum::<u64>() != l.count[e]).collect();
        rep.check(count_off.is_empty(), format!("{id}: Σ_domains count = count{}", list_if_any(&count_off)));
        for (name, whole, part) in [
            ("prob_sum", &l.prob_sum, parts.iter().map(|p| &p.prob_sum).collect::<Vec<_>>()),
            ("reap_l2_sum", &l.reap_l2_sum, parts.iter().map(|p| &p.reap_l2_sum).collect()),
        ] {
            let off: Vec<usize> = (0..l.n_expert).filter(|&e| !close(part.iter().map(|p| p[e]).sum(), whole[e], 1e-9)).collect();
            rep.check(off.is_empty(), format!("{id}: Σ_domains {name} = {name}{}", list_if_any(&off)));
        }
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
    let s = Saliency::read(&args.reap).map_err(|e| UsageError(format!("{e:#}")))?;
    let mut rep = Report::default();
    let normalised = s.metadata.get("routing").and_then(|r| r.get("normalised")).and_then(|v| v.as_bool());
    check_saliency(&s, normalised, args.top, &mut rep);

    if let Some(p) = &args.imatrix {
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

    if let Some(p) = &args.trace {
        let t = TraceReader::open(p).map_err(|e| UsageError(format!("{e:#}")))?;
        if t.header_count_missing {
            rep.notes.push(format!("trace {}: header says 0 rows; read the {} rows present", p.display(), t.n_rows));
        }
        rep.check(
            t.n_rows == s.trace_tokens_written,
            format!("trace rows {} = trace_tokens_written {}", t.n_rows, s.trace_tokens_written),
        );
        let layers_match = t.header.layers == s.layers.iter().map(|l| l.layer).collect::<Vec<_>>();
        rep.check(layers_match, format!("trace layers {:?} are the JSON's MoE layers", t.header.layers));
        if let Some(n) = normalised {
            rep.check((t.header.flags & FLAG_NORMALISED != 0) == n, "trace and JSON agree on normalised gating");
        }
        if layers_match && t.n_rows == s.tokens && s.nonfinite_drops == 0 {
            let k = t.header.k as usize;
            let mut counts: Vec<Vec<u64>> = s.layers.iter().map(|l| vec![0; l.n_expert]).collect();
            for r in t.rows() {
                for (li, c) in counts.iter_mut().enumerate() {
                    for &e in &r.sel_ids(li)[..k] {
                        if let Some(x) = c.get_mut(e as usize) {
                            *x += 1;
                        }
                    }
                }
            }
            for (li, l) in s.layers.iter().enumerate() {
                rep.check(counts[li] == l.count, format!("layer {}: counts recomputed from the trace equal the JSON's", l.layer));
            }
        } else {
            rep.notes.push(format!(
                "trace covers {} of {} tokens: counts not recomputed from it (only a whole-run trace can match)",
                t.n_rows, s.tokens
            ));
        }
    }

    print_report(args, &s, &rep);
    Ok(if rep.all_hold() { 0 } else { crate::error::EXIT_FAILURE })
}

fn print_report(args: &CheckArgs, s: &Saliency, rep: &Report) {
    println!("check {}: {} tokens, {} MoE layers, {} non-finite drops", args.reap.display(), s.tokens, s.layers.len(), s.nonfinite_drops);
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

    #[test]
    fn domain_parts_must_add_up() {
        use crate::formats::saliency::{DomainLayer, DomainSums};
        let l = layer();
        let part = |count: Vec<u64>, p: Vec<f64>, r: Vec<f64>| DomainLayer { layer: 0, count, prob_sum: p, reap_l2_sum: r };
        let mut s = Saliency { tokens: 3, layers: vec![l], ..Default::default() };
        s.domains = vec![
            DomainSums { name: "a".into(), tokens: 2, layers: vec![part(vec![2, 1, 1, 0], vec![1.0, 0.5, 0.5, 0.0], vec![2.0, 1.0, 1.0, 0.0])] },
            DomainSums { name: "b".into(), tokens: 1, layers: vec![part(vec![1, 1, 0, 0], vec![0.5, 0.5, 0.0, 0.0], vec![1.0, 1.0, 0.0, 0.0])] },
        ];
        let mut r = Report::default();
        check_saliency(&s, Some(true), 2, &mut r);
        assert!(r.all_hold(), "{:?}", r.findings);
        s.domains[1].layers[0].count[1] = 2;
        s.domains[1].layers[0].reap_l2_sum[0] = 1.5;
        s.domains[0].tokens = 3;
        let mut r = Report::default();
        check_saliency(&s, Some(true), 2, &mut r);
        let failed: Vec<&str> = r.findings.iter().filter(|f| !f.ok).map(|f| f.what.as_str()).collect();
        assert_eq!(failed.len(), 3, "{failed:?}");
        assert!(failed[1].contains("count = count (fails for experts [1])") && failed[2].contains("reap_l2_sum (fails for experts [0])"), "{failed:?}");
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
