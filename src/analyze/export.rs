//! `reap-imatrix export`: the saliency JSON in another tool's terms. One format so far,
//! `cerebras-reap`: the per-layer observer state of CerebrasResearch/reap (`src/reap/observer.py`),
//! which its pruning step reads (CONTRACT §6; `scripts/to-reap-pt` turns it into their `.pt`).
//!
//! Per MoE layer, keyed by block index, with p the router's softmax probability of the expert
//! (`--renormalize`: the applied top-k-normalised gate g) and f its output, over routed tokens:
//! `total_tokens` = the layer's tokens, `expert_frequency` = count, `ean_sum` = Σ‖f‖₂,
//! `weighted_ean_sum` = Σ p·‖f‖₂, `weighted_expert_frequency_sum` = Σ p,
//! `reap` = weighted_ean_sum / expert_frequency (0 where that is 0), `max_activations` = the
//! largest element of f, floored at 0 as the reference's zero-initialised running maximum is
//! (0 for an expert never routed).

use crate::error::UsageError;
use crate::formats::atomic;
use crate::formats::saliency::{AppliedGate, LayerSums, Saliency};
use anyhow::{anyhow, Result};
use serde_json::{json, Map, Value};
use std::path::PathBuf;

pub const CEREBRAS_REAP: &str = "cerebras-reap";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    /// CerebrasResearch/reap's observer state (expert_frequency, ean_sum, weighted_ean_sum, reap,
    /// weighted_expert_frequency_sum, max_activations, total_tokens per layer)
    #[value(name = "cerebras-reap")]
    CerebrasReap,
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Definitions in docs/select.md (\"Two gate definitions\"); scripts/to-reap-pt turns the output into the .pt file\n\
CerebrasResearch/reap's pruning step loads.")]
pub struct ExportArgs {
    /// Saliency JSON (--reap-out of a calibration run)
    #[arg(long, value_name = "FILE")]
    pub reap: PathBuf,
    /// Output format
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub format: ExportFormat,
    /// Weight by the applied top-k-normalised gate instead of the softmax probability (the
    /// reference's renormalize_router_weights; no effect on a model that does not normalise)
    #[arg(long)]
    pub renormalize: bool,
    /// Output JSON (written atomically)
    #[arg(short = 'o', long = "output", value_name = "OUT.json")]
    pub output: PathBuf,
}

fn usage(msg: String) -> anyhow::Error {
    anyhow!(UsageError(msg))
}

/// Which gate the weighted sums use, from the file's `metadata.routing`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weighting {
    /// the weighted sums come from the applied gate (prob_sum, reap_l2_sum)
    pub applied_gate: bool,
    /// what the reference's flag would have been: renormalisation asked for and the model
    /// normalises (the reference ignores the flag otherwise)
    pub renormalize_router_weights: bool,
}

/// Decides the weighting, or says why the file cannot give the reference's numbers.
pub fn weighting(s: &Saliency, renormalize: bool) -> std::result::Result<Weighting, String> {
    let routing = s.routing();
    // the reference always takes a softmax over the router logits
    if routing.softmax() == Some(false) {
        return Err(format!(
            "the model's router probabilities come from {}, not a softmax: the reference's weights cannot be derived (CerebrasResearch/reap takes a softmax of the raw logits and its own top-k of them, without a selection bias such as exp_probs_b; where that bias moves a token's top-k, the reference weighs experts the model never ran for that token, whose outputs no llama.cpp pass computes)",
            routing.probs_op.as_deref().unwrap_or("?")
        ));
    }
    if !renormalize {
        return Ok(Weighting { applied_gate: false, renormalize_router_weights: false });
    }
    match routing.applied_gate() {
        Some(AppliedGate::Normalised) => Ok(Weighting { applied_gate: true, renormalize_router_weights: true }),
        // the model does not normalise: its gate is p itself, the reference ignores the flag
        Some(AppliedGate::Probability) => Ok(Weighting { applied_gate: true, renormalize_router_weights: false }),
        // e.g. ffn_moe_weights_scaled: g carries a scale the reference's renormalised weight has not
        _ => Err(format!(
            "--renormalize: the gate the model applies ({}) is not the plain top-k-normalised softmax, so the reference's renormalised weight cannot be derived from it",
            routing.weights_node.as_deref().unwrap_or("unknown: no metadata.routing.weights_node")
        )),
    }
}

/// One layer's observer state.
fn layer_state(l: &LayerSums, w: Weighting) -> Value {
    let r = l.reference.as_ref().expect("checked by the caller");
    let (weighted_ean, weighted_freq) = if w.applied_gate { (&l.reap_l2_sum, &l.prob_sum) } else { (&r.reap_softmax_l2_sum, &l.router_prob_sum) };
    let reap: Vec<f64> = (0..l.n_expert).map(|e| if l.count[e] > 0 { weighted_ean[e] / l.count[e] as f64 } else { 0.0 }).collect();
    let max_activations: Vec<f64> = r.max_activation.iter().map(|m| m.unwrap_or(0.0).max(0.0)).collect();
    json!({
        "total_tokens": l.tokens,
        "expert_frequency": l.count,
        "ean_sum": l.ean_sum,
        "weighted_ean_sum": weighted_ean,
        "reap": reap,
        "weighted_expert_frequency_sum": weighted_freq,
        "max_activations": max_activations,
    })
}

/// The whole export.
pub fn cerebras_reap(s: &Saliency, w: Weighting) -> Value {
    let mut layers = Map::new();
    for l in &s.layers {
        layers.insert(l.layer.to_string(), layer_state(l, w));
    }
    json!({
        "format": CEREBRAS_REAP,
        "renormalize_router_weights": w.renormalize_router_weights,
        "layers": layers,
    })
}

pub fn run(args: &ExportArgs) -> Result<i32> {
    let name = args.reap.display();
    let s = Saliency::read(&args.reap).map_err(|e| usage(format!("--reap: {e:#}")))?;
    if s.layers.is_empty() {
        return Err(usage(format!("--reap {name}: no MoE layers")));
    }
    if let Some(why) = s.value_problem() {
        return Err(usage(format!("--reap {name}: {why}")));
    }
    if s.layers.iter().any(|l| l.reference.is_none()) {
        return Err(usage(format!(
            "--reap {name}: no reap_softmax_l2_sum / max_activation (written before reap-imatrix collected them); calibrate again to export"
        )));
    }
    let w = weighting(&s, args.renormalize).map_err(|e| usage(format!("--reap {name}: {e}")))?;
    if args.renormalize && !w.renormalize_router_weights {
        eprintln!("note: {name}: the model does not normalise its top-k weights; --renormalize changes nothing (as in the reference)");
    }
    atomic::check_writable(&args.output).map_err(|e| usage(format!("-o {e}")))?;
    let v = match args.format {
        ExportFormat::CerebrasReap => cerebras_reap(&s, w),
    };
    atomic::write_json(&args.output, &v, "export")?;
    eprintln!("wrote {} ({} MoE layers, {CEREBRAS_REAP}, renormalize_router_weights {})", args.output.display(), s.layers.len(), w.renormalize_router_weights);
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saliency(weights_node: &str, probs_op: &str) -> Saliency {
        let mut l = LayerSums::new(5, 3, 1);
        l.tokens = 4;
        l.count = vec![3, 1, 0];
        l.prob_sum = vec![3.0, 1.0, 0.0];
        l.reap_l2_sum = vec![6.0, 0.5, 0.0];
        l.ean_sum = vec![6.0, 0.5, 0.0];
        l.router_prob_sum = vec![1.5, 0.25, 0.0];
        let r = l.reference.as_mut().unwrap();
        r.reap_softmax_l2_sum = vec![3.0, 0.125, 0.0];
        r.max_activation = vec![Some(2.5), Some(-0.5), None];
        let mut s = Saliency { tokens: 4, layers: vec![l], ..Default::default() };
        s.metadata.insert("routing".into(), json!({"weights_node": weights_node, "probs_op": probs_op}));
        s
    }

    #[test]
    fn the_observer_state_by_hand() {
        let s = saliency("ffn_moe_weights_norm-0 (reshaped)", "SOFT_MAX");
        let w = weighting(&s, false).unwrap();
        let v = cerebras_reap(&s, w);
        assert_eq!(v["renormalize_router_weights"], false);
        let l = &v["layers"]["5"];
        assert_eq!(l["total_tokens"], 4);
        assert_eq!(l["expert_frequency"], json!([3, 1, 0]));
        assert_eq!(l["ean_sum"], json!([6.0, 0.5, 0.0]));
        assert_eq!(l["weighted_ean_sum"], json!([3.0, 0.125, 0.0]));
        assert_eq!(l["weighted_expert_frequency_sum"], json!([1.5, 0.25, 0.0]));
        assert_eq!(l["reap"], json!([1.0, 0.125, 0.0]));
        // the reference's running maximum starts at 0
        assert_eq!(l["max_activations"], json!([2.5, 0.0, 0.0]));
        // renormalised: the applied gate
        let w = weighting(&s, true).unwrap();
        assert_eq!(w, Weighting { applied_gate: true, renormalize_router_weights: true });
        let l = &cerebras_reap(&s, w)["layers"]["5"];
        assert_eq!(l["weighted_ean_sum"], json!([6.0, 0.5, 0.0]));
        assert_eq!(l["weighted_expert_frequency_sum"], json!([3.0, 1.0, 0.0]));
        assert_eq!(l["reap"], json!([2.0, 0.5, 0.0]));
    }

    #[test]
    fn what_cannot_be_derived_is_refused() {
        // sigmoid (or any non-softmax) routers: the reference's softmax weights are not in the file
        assert!(weighting(&saliency("ffn_moe_weights-0", "UNARY"), false).unwrap_err().contains("not a softmax"));
        // a scaled gate is not the plain renormalised weight
        assert!(weighting(&saliency("ffn_moe_weights_scaled-0", "SOFT_MAX"), true).unwrap_err().contains("ffn_moe_weights_scaled-0"));
        assert!(weighting(&saliency("ffn_moe_weights_scaled-0", "SOFT_MAX"), false).is_ok());
        // an unnormalised model: --renormalize is a no-op, as in the reference
        let w = weighting(&saliency("ffn_moe_weights-0", "SOFT_MAX"), true).unwrap();
        assert_eq!(w, Weighting { applied_gate: true, renormalize_router_weights: false });
    }
}
