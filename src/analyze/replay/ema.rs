//! The decayed-credit policies: `ema`, `near-pick-ema`, `inverse-router-ema`. Each expert of a
//! layer (resident or not) has a score
//!
//!     score_t(e) = Σ_{s ≤ t} credit_s(e) · d^(t−s)
//!
//! and a miss evicts the resident expert with the lowest score that the token does not use
//! (ties: used longest ago). The credits of token t are added before its picks are fetched.
//!
//! Lazy decay: we store S(e) = Σ credit_s(e) · d^−(s−t0) and never touch the experts a token
//! does not credit; the true score is S·d^(t−t0), a factor shared by every expert at time t, so
//! comparing S compares scores. Before d^−(t−t0) passes 1e100 every S is multiplied by
//! d^(t−t0) and t0 moves to t (before token t's credits are added).

use super::engine::{Family, Shape, SimCounts, Step, NONE};
use super::resident::{self, Resident};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Credit {
    /// each pick: 1
    Pick,
    /// each pick: 1; each candidate among the first `n` in router order that is neither a pick
    /// nor pruned: `w · min(1, p / p_min)`, p its router probability and p_min the smallest
    /// router probability among the token's picks (w when no pick has one)
    NearPick { n: usize, w: f64 },
    /// each pick: its router probability (the candidate list's p; a pick missing from the list
    /// gets the last candidate's p, an upper bound on any unlisted expert's)
    Router,
}

impl Credit {
    pub fn policy_name(self) -> &'static str {
        match self {
            Credit::Pick => "ema",
            Credit::NearPick { .. } => "near-pick-ema",
            Credit::Router => "inverse-router-ema",
        }
    }
}

/// Rescale threshold for the lazy multiplier.
pub const RESCALE_AT: f64 = 1e100;

pub struct Ema {
    ne: usize,
    k: usize,
    credit: Credit,
    /// 1/d
    rd: f64,
    /// d^−(t−t0)
    mult: f64,
    s: Vec<f64>,
    last: Vec<u64>,
    caches: Vec<Resident>,
    /// how often S was rescaled (tests check the path is taken)
    pub rescales: u64,
}

impl Ema {
    pub fn new(shape: Shape, caps: &[Vec<usize>], decay: f64, credit: Credit) -> Self {
        let n = shape.n_layers * shape.n_expert;
        Ema {
            ne: shape.n_expert,
            k: shape.k,
            credit,
            rd: 1.0 / decay,
            mult: 1.0,
            s: vec![0.0; n],
            last: vec![0; n],
            caches: caps.iter().map(|c| Resident::new(shape, c)).collect(),
            rescales: 0,
        }
    }
}

#[inline]
fn add(s: &mut f64, c: f64, mult: f64) {
    // NaN or negative credit (a damaged trace) counts as none
    if c > 0.0 && c.is_finite() {
        *s += c * mult;
    }
}

#[inline]
fn prob_of(s: &Step, j: usize) -> Option<f32> {
    let r = s.pick_ranks.get(j).copied().unwrap_or(NONE);
    (r != NONE).then(|| s.cand_probs[r as usize])
}

impl Family for Ema {
    fn begin_token(&mut self, t: u32) {
        if t == 0 {
            return;
        }
        self.mult *= self.rd;
        if self.mult > RESCALE_AT {
            let f = 1.0 / self.mult;
            for x in &mut self.s {
                *x *= f;
            }
            self.mult = 1.0;
            self.rescales += 1;
            let (ne, sc, last) = (self.ne, &self.s, &self.last);
            for c in &mut self.caches {
                c.refresh(|li, e| (sc[li * ne + e].to_bits(), last[li * ne + e]));
            }
        }
    }

    fn candidate_depth(&self) -> usize {
        match self.credit {
            Credit::Pick => 0,
            Credit::Router => self.k,
            Credit::NearPick { n, .. } => n.max(self.k),
        }
    }

    fn step(&mut self, st: &Step) {
        let base = st.li * self.ne;
        let s = &mut self.s[base..base + self.ne];
        let last = &mut self.last[base..base + self.ne];
        let seq = st.t as u64 * self.k as u64 + 1;
        let mult = self.mult;
        match self.credit {
            Credit::Pick => {
                for (j, &e) in st.picks.iter().enumerate() {
                    s[e as usize] += mult;
                    last[e as usize] = seq + j as u64;
                }
            }
            Credit::Router => {
                for (j, &e) in st.picks.iter().enumerate() {
                    // a pick missing from the candidates: the last candidate's p
                    let p = prob_of(st, j).unwrap_or_else(|| st.cand_probs.last().copied().unwrap_or(0.0));
                    add(&mut s[e as usize], p as f64, mult);
                    last[e as usize] = seq + j as u64;
                }
            }
            Credit::NearPick { n, w } => {
                let mut p_min = f64::INFINITY;
                for (j, &e) in st.picks.iter().enumerate() {
                    s[e as usize] += mult;
                    last[e as usize] = seq + j as u64;
                    if let Some(p) = prob_of(st, j) {
                        p_min = p_min.min(p as f64);
                    }
                }
                let n = n.min(st.cand_ids.len());
                // credit w · min(1, p / p_min), computed as min(p · (w / p_min), w); w when no
                // pick has a probability
                let scale = if p_min > 0.0 && p_min.is_finite() { w / p_min } else { 0.0 };
                let keep = st.keep.unwrap_or(&[]);
                for (&e, &p) in st.cand_ids[..n].iter().zip(&st.cand_probs[..n]) {
                    let e = e as usize;
                    if st.cur[e] == st.stamp || (st.keep.is_some() && !keep.get(e).copied().unwrap_or(false)) {
                        continue;
                    }
                    let c = if scale > 0.0 { (p as f64 * scale).min(w) } else { w };
                    // NaN or non-positive credit (a damaged trace) counts as none
                    if !(c > 0.0 && c < f64::INFINITY) {
                        continue;
                    }
                    s[e] += c * mult;
                    let k = (s[e].to_bits(), last[e]);
                    for c in &mut self.caches {
                        c.update(st.li, e, k);
                    }
                }
            }
        }
        let (s, last) = (&*s, &*last);
        for c in &mut self.caches {
            c.access(st.li, st.picks);
            c.settle(st.li, st.picks, |e| (s[e].to_bits(), last[e]));
        }
    }

    fn counts(&self) -> Vec<SimCounts> {
        resident::counts(self.credit.policy_name(), &self.caches)
    }
}
