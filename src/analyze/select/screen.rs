//! The substitution screen: one pass over a routing trace, for every keep map at once, per
//! layer: how many of the model's top-k slots pick a pruned expert and how much gate weight
//! and router probability those slots carried.

use crate::analyze::replay::engine::check_ids;
use crate::formats::trace::TraceReader;
use anyhow::Result;

/// Sums for one keep map and one layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScreenLayer {
    pub tokens: u64,
    /// selected slots (tokens × k)
    pub slots: u64,
    /// selected slots whose expert the map prunes
    pub pruned_slots: u64,
    /// tokens with at least one pruned selected expert
    pub tokens_hit: u64,
    /// tokens where fewer than k of the top-N candidates survive (the re-routed token would
    /// need an expert the trace does not name)
    pub tokens_short: u64,
    /// Σ gate weight over all selected slots, and over the pruned ones
    pub gate_weight: f64,
    pub gate_weight_pruned: f64,
    /// Σ router probability (softmax, before top-k normalisation) of the pruned selected experts;
    /// a selected expert missing from the candidates adds 0 and is counted in `picks_not_in_candidates`
    pub router_prob_pruned: f64,
    pub picks_not_in_candidates: u64,
}

impl ScreenLayer {
    pub fn slot_share_pruned(&self) -> f64 {
        ratio(self.pruned_slots as f64, self.slots as f64)
    }
    pub fn gate_share_lost(&self) -> f64 {
        ratio(self.gate_weight_pruned, self.gate_weight)
    }
    /// mean router probability mass lost per token
    pub fn router_prob_lost_per_token(&self) -> f64 {
        ratio(self.router_prob_pruned, self.tokens as f64)
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// `keeps[m]` is map m's keep flags, `n_layers × n_expert`, layer-major. Returns `[m][layer]`,
/// or an error for a damaged trace (an expert id ≥ n_expert), as `replay` gives.
pub fn screen(trace: &TraceReader, keeps: &[Vec<bool>]) -> Result<Vec<Vec<ScreenLayer>>> {
    let h = &trace.header;
    let (nl, ne, k) = (h.n_layers(), h.n_expert as usize, h.k as usize);
    let mut out = vec![vec![ScreenLayer::default(); nl]; keeps.len()];
    let mut probs = vec![0f32; k];
    for (t, row) in trace.rows().enumerate() {
        for li in 0..nl {
            let (sel, w, cid, cp) = (row.sel_ids(li), row.sel_weights(li), row.cand_ids(li), row.cand_probs(li));
            // an id past n_expert would read as pruned and skew the shares without a word
            check_ids(sel, ne, t as u64, li)?;
            check_ids(cid, ne, t as u64, li)?;
            let mut missing = 0;
            for (j, &e) in sel.iter().enumerate() {
                // picks are usually the first candidates: start the search there
                probs[j] = match cid.iter().position(|&c| c == e) {
                    Some(r) => cp[r],
                    None => {
                        missing += 1;
                        0.0
                    }
                };
            }
            let wsum: f64 = w.iter().map(|&x| x as f64).sum();
            for (m, keep) in keeps.iter().enumerate() {
                let keep = &keep[li * ne..(li + 1) * ne];
                let s = &mut out[m][li];
                s.tokens += 1;
                s.slots += sel.len() as u64;
                s.gate_weight += wsum;
                s.picks_not_in_candidates += missing;
                let mut pruned = 0;
                for (j, &e) in sel.iter().enumerate() {
                    if !keep[e as usize] {
                        pruned += 1;
                        s.gate_weight_pruned += w[j] as f64;
                        s.router_prob_pruned += probs[j] as f64;
                    }
                }
                s.pruned_slots += pruned;
                s.tokens_hit += (pruned > 0) as u64;
                let survivors = cid.iter().filter(|&&c| keep[c as usize]).take(k).count();
                s.tokens_short += (survivors < k) as u64;
            }
        }
    }
    Ok(out)
}
