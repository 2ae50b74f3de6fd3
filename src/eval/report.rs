//! The summary table across models and the JSON file (CONTRACT §4).

use super::{Candidate, Outcome};
use serde_json::{json, Value};
use std::path::Path;

/// Models sorted by mean KLD (ascending; input order among equals).
pub fn table(outcomes: &[Outcome]) -> String {
    let mut order: Vec<&Outcome> = outcomes.iter().collect();
    order.sort_by(|a, b| a.summary.kld_mean.0.total_cmp(&b.summary.kld_mean.0));
    let width = order.iter().map(|o| o.candidate.label().chars().count()).max().unwrap_or(5).max(5);
    let mut s = String::from("====== Models by mean KLD ======\n");
    if let Some(o) = outcomes.first() {
        s += &format!("PPL(base) = {:.6} ± {:.6} over {} scored tokens\n", o.summary.base_ppl.0, o.summary.base_ppl.1, o.summary.count);
    }
    s += &format!(
        "{:<width$}  {:>12}  {:>9}  {:>21}  {:>9}  {:>9}  {:>9}  {:>16}  {:>8}\n",
        "model", "PPL", "ΔPPL %", "Mean KLD ± err", "99% KLD", "Med KLD", "Max KLD", "Same top p %", "RMS Δp %"
    );
    for o in order {
        let m = &o.summary;
        s += &format!(
            "{:<width$}  {:>12.4}  {:>+9.3}  {:>10.6} ± {:>8.6}  {:>9.6}  {:>9.6}  {:>9.4}  {:>7.3} ± {:>6.3}  {:>8.3}\n",
            o.candidate.label(),
            m.ppl.0,
            100.0 * (m.ppl.0 / m.base_ppl.0 - 1.0),
            m.kld_mean.0,
            m.kld_mean.1,
            m.kld_at("99.0%"),
            m.kld_median,
            m.kld_max,
            100.0 * m.same_top.0,
            100.0 * m.same_top.1,
            100.0 * m.rms_dp.0,
        );
    }
    s
}

/// One model's entry: the contract's keys, then more.
fn model_json(o: &Outcome) -> Value {
    let m = &o.summary;
    let mut v = json!({
        "path": o.candidate.path(),
        "ppl": m.ppl.0,
        "kld_mean": m.kld_mean.0,
        "kld_mean_err": m.kld_mean.1,
        "kld_max": m.kld_max,
        "kld_p99": m.kld_at("99.0%"),
        "kld_median": m.kld_median,
        "top1_agree": m.same_top.0,
        "top1_agree_err": m.same_top.1,
        "ppl_err": m.ppl.1,
        "base_ppl": m.base_ppl.0,
        "base_ppl_err": m.base_ppl.1,
        "ln_ppl_ratio": m.ln_ppl_ratio.0,
        "ln_ppl_ratio_err": m.ln_ppl_ratio.1,
        "kld_p999": m.kld_at("99.9%"),
        "kld_p95": m.kld_at("95.0%"),
        "kld_p90": m.kld_at("90.0%"),
        "kld_min": m.kld_min,
        "dp_mean": m.dp_mean.0,
        "dp_mean_err": m.dp_mean.1,
        "rms_dp": m.rms_dp.0,
        "rms_dp_err": m.rms_dp.1,
        "tokens": m.count,
        "seconds": o.seconds,
    });
    if let Candidate::KeepMap(p) = &o.candidate {
        v["keep_map"] = json!(p);
    }
    if let Some(x) = &o.in_sample {
        v["in_sample"] = x.clone();
    }
    v
}

/// `{"base": PATH, "models": […]}` plus the run's bookkeeping; models in the order given.
/// `prune_flags`: what `--keep-map`'s prune ran with (`--drop-nextn`, `--hash-remap`), which
/// shape the pruned models as much as the maps do.
pub fn to_json(base: &Path, outcomes: &[Outcome], base_logits: Value, forward_passes: usize, prune_flags: &[&str]) -> Value {
    json!({
        "base": base,
        "base_logits": base_logits,
        "forward_passes": forward_passes,
        "prune_flags": prune_flags,
        "models": outcomes.iter().map(model_json).collect::<Vec<_>>(),
    })
}
