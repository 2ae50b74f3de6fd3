//! The statistics of `llama-perplexity --kl-divergence` (tools/perplexity/perplexity.cpp at the
//! pin), computed the same way, in the same precision, so the printed figures agree:
//!
//! - per scored token, from the model's logits `l` and the base's encoded row (scale `s`,
//!   minimum `m`, `q[i]`, see `formats::base_logits`), in f32 unless said: `M = max l`,
//!   `lse = (f32) ln Σ exp(l[i] − M)` (the Σ in f64); `nll = M + lse − l[tok]`;
//!   `nll_base = −(s·q[tok] + m)`; `KLD = Σ_i p_b(i)·(lp_b(i) − l[i] + (M + lse))` over `i` with
//!   `lp_b(i) = s·q[i] + m > −16`, `p_b = exp(lp_b)` (the Σ in f64); `Δp = exp(−nll) −
//!   exp(−nll_base)`; top-1 agrees when the first index of the model's maximum logit equals the
//!   first index of the maximum `lp_b` (the quantized base, not the base's logits);
//! - over tokens, f64 sums of those values, their squares (`nll²`, `Δp²` formed in f32 as
//!   upstream does) and `nll·nll_base`; `mean ± sqrt((Σx²/n − mean²)/(n − 1))` (0 when the
//!   variance is not positive or n ≤ 10); PPL = exp(mean nll) ± PPL·err; RMS Δp =
//!   sqrt(mean Δp²) ± err(Δp²)/(2·RMS); same-top p ± sqrt(p(1 − p)/(n − 1));
//! - percentiles of the per-token KLD and Δp as f32, sorted, linear between neighbours at
//!   `f·(n − 1)`; the median is the middle value (mean of the two middle ones, even n).
//!
//! Upstream adds per-thread partial sums over a dynamic split; these are summed in token
//! order. The difference is in the last bits of f64 sums, far below the printed digits.

/// The running sums (upstream's `kl_divergence_result`).
#[derive(Clone, Debug, Default)]
pub struct Sums {
    pub sum_nll: f64,
    pub sum_nll2: f64,
    pub sum_nll_base: f64,
    pub sum_nll_base2: f64,
    pub sum_nll_nll_base: f64,
    pub sum_kld: f64,
    pub sum_kld2: f64,
    pub sum_p_diff: f64,
    pub sum_p_diff2: f64,
    pub sum_p_diff4: f64,
    pub max_p_diff: f32,
    pub n_same_top: u64,
    pub count: u64,
}

/// Everything kept over a run: the sums and each token's KLD and Δp (for the percentiles).
#[derive(Clone, Debug, Default)]
pub struct Accumulator {
    pub sums: Sums,
    pub kld_values: Vec<f32>,
    pub p_diff_values: Vec<f32>,
}

/// Index of the first maximum (`>`: the first index wins ties).
fn first_argmax(v: impl Iterator<Item = f32>) -> usize {
    let mut best = f32::NEG_INFINITY;
    let mut at = 0;
    for (i, x) in v.enumerate() {
        if i == 0 || x > best {
            best = x;
            at = i;
        }
    }
    at
}

impl Accumulator {
    /// Scores one token: `logits` the model's row (n_vocab), `base_row` the base's encoded row,
    /// `tok` the token that follows.
    pub fn add(&mut self, logits: &[f32], base_row: &[u16], tok: usize) {
        self.add_terms(&token_terms(logits, base_row, tok));
    }

    /// Adds one token's terms (computed elsewhere, e.g. on another thread); tokens must be
    /// added in order for the sums to be reproducible.
    pub fn add_terms(&mut self, t: &Terms) {
        self.sums.add(t);
        self.kld_values.push(t.kld as f32);
        self.p_diff_values.push(t.p_diff);
    }

    /// The summary, or None below 100 scored tokens (upstream prints no statistics then).
    pub fn summary(&self) -> Option<Summary> {
        (self.sums.count >= 100).then(|| Summary::new(&self.sums, self.kld_values.clone(), self.p_diff_values.clone()))
    }
}

/// What one scored token contributes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Terms {
    pub nll: f32,
    pub nll_base: f32,
    pub kld: f64,
    pub p_diff: f32,
    pub same_top: bool,
}

impl Sums {
    /// Adds one token as upstream's `log_softmax(…, kld)` does, squares formed in f32 where it
    /// forms them in f32.
    pub fn add(&mut self, t: &Terms) {
        self.sum_nll += t.nll as f64;
        self.sum_nll2 += (t.nll * t.nll) as f64;
        self.sum_nll_base += t.nll_base as f64;
        self.sum_nll_base2 += (t.nll_base * t.nll_base) as f64;
        self.sum_nll_nll_base += (t.nll * t.nll_base) as f64;
        self.sum_kld += t.kld;
        self.sum_kld2 += t.kld * t.kld;
        self.count += 1;
        self.n_same_top += t.same_top as u64;
        self.sum_p_diff += t.p_diff as f64;
        let p_diff2 = (t.p_diff * t.p_diff) as f64;
        self.sum_p_diff2 += p_diff2;
        self.sum_p_diff4 += p_diff2 * p_diff2;
        self.max_p_diff = self.max_p_diff.max(t.p_diff.abs());
    }
}

/// One token, as upstream's `log_softmax(n_vocab, logits, base_log_prob, tok, kld)`.
pub fn token_terms(logits: &[f32], base_row: &[u16], tok: usize) -> Terms {
    let mut max_logit = logits[0];
    let mut imax = 0;
    for (i, &l) in logits.iter().enumerate().skip(1) {
        if l > max_logit {
            max_logit = l;
            imax = i;
        }
    }
    let mut sum_exp = 0.0f64;
    for &l in logits {
        sum_exp += (l - max_logit).exp() as f64;
    }
    let log_sum_exp = sum_exp.ln() as f32;
    let (scale, min_log_prob) = crate::formats::base_logits::row_scale(base_row);
    let q = &base_row[4..4 + logits.len()];
    let nll = max_logit + log_sum_exp - logits[tok];
    let nll_base = -(scale * q[tok] as f32 + min_log_prob);
    let log_norm = max_logit + log_sum_exp;
    let mut kld = 0.0f64;
    for (&qi, &l) in q.iter().zip(logits) {
        let p_log_base = scale * qi as f32 + min_log_prob;
        if p_log_base > -16.0 {
            let p_base = p_log_base.exp();
            kld += (p_base * (p_log_base - l + log_norm)) as f64;
        }
    }
    let imax_base = first_argmax(q.iter().map(|&qi| scale * qi as f32 + min_log_prob));
    let p_diff = (-nll).exp() - (-nll_base).exp();
    Terms { nll, nll_base, kld, p_diff, same_top: imax == imax_base }
}

impl Sums {
    /// Upstream's per-chunk progress line (running figures after `chunk`, 1-based).
    pub fn chunk_line(&self, chunk: usize) -> String {
        let log_ppl = mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count);
        let ppl = log_ppl.0.exp();
        let log_base = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count);
        let cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, self.count);
        let ratio_unc = (log_ppl.1 * log_ppl.1 + log_base.1 * log_base.1 - 2.0 * cov).sqrt();
        let kld = mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count);
        let mse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count);
        let rms = mse.0.sqrt();
        let top = self.n_same_top as f64 / self.count as f64;
        let top_unc = (top * (1.0 - top) / (self.count as f64 - 1.0)).sqrt();
        format!(
            "{chunk:4}    {:9.4} ± {:9.4}    {:10.5} ± {:10.5}    {:10.5} ± {:10.5}    {:6.3} ± {:6.3} %    {:6.3} ± {:6.3} %",
            c(ppl),
            c(ppl * log_ppl.1),
            c(log_ppl.0 - log_base.0),
            c(ratio_unc),
            c(kld.0),
            c(kld.1),
            c(100.0 * rms),
            c(100.0 * 0.5 / rms * mse.1),
            c(100.0 * top),
            c(100.0 * top_unc)
        )
    }
}

/// The header of the per-chunk lines, as upstream prints it.
pub const CHUNK_HEADER: &str =
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p";

/// Upstream's `mean_and_uncertainty`.
pub fn mean_and_uncertainty(sum: f64, sum2: f64, count: u64) -> (f64, f64) {
    if count < 1 {
        return (0.0, 0.0);
    }
    let n = count as f64;
    let f = sum / n;
    let df = sum2 / n - f * f;
    let df = if df > 0.0 && count > 10 { (df / (n - 1.0)).sqrt() } else { 0.0 };
    (f, df)
}

/// Upstream's `covariance` (of the two means).
pub fn covariance(suma: f64, sumb: f64, sumab: f64, count: u64) -> f64 {
    if count < 10 {
        return 0.0;
    }
    let n = count as f64;
    (sumab / n - (suma / n) * (sumb / n)) / (n - 1.0)
}

/// Upstream's `percentile` over sorted values, in f32.
pub fn percentile(sorted: &[f32], fraction: f32) -> f32 {
    if fraction <= 0.0 {
        return sorted[0];
    }
    if fraction >= 1.0 {
        return sorted[sorted.len() - 1];
    }
    let mut p = fraction * (sorted.len() - 1) as f32;
    let ip = p as usize;
    p -= ip as f32;
    (1.0 - p) * sorted[ip] + p * sorted[(ip + 1).min(sorted.len() - 1)]
}

/// Upstream's median: the middle value, or the mean of the two middle ones (f32).
pub fn median(sorted: &[f32]) -> f32 {
    let n = sorted.len();
    if n % 2 == 0 {
        0.5f32 * (sorted[n / 2] + sorted[n / 2 - 1])
    } else {
        sorted[n / 2]
    }
}

/// The percentile levels upstream prints, top to bottom (the median and extremes apart).
pub const KLD_LEVELS: [(&str, f32); 8] = [
    ("99.9%", 0.999),
    ("99.0%", 0.990),
    ("95.0%", 0.950),
    ("90.0%", 0.900),
    ("10.0%", 0.100),
    (" 5.0%", 0.050),
    (" 1.0%", 0.010),
    (" 0.1%", 0.001),
];
pub const DP_LEVELS: [(&str, f32); 10] = [
    ("99.9%", 0.999),
    ("99.0%", 0.990),
    ("95.0%", 0.950),
    ("90.0%", 0.900),
    ("75.0%", 0.750),
    ("25.0%", 0.250),
    ("10.0%", 0.100),
    (" 5.0%", 0.050),
    (" 1.0%", 0.010),
    (" 0.1%", 0.001),
];

/// A (value, ±) pair.
pub type Pm = (f64, f64);

/// The final statistics of one model against the base.
#[derive(Clone, Debug)]
pub struct Summary {
    pub count: u64,
    pub ppl: Pm,
    pub base_ppl: Pm,
    /// correlation of ln PPL(Q) and ln PPL(base), as a fraction
    pub ln_ppl_cor: f64,
    pub ln_ppl_ratio: Pm,
    pub ppl_ratio: Pm,
    pub ppl_diff: Pm,
    pub kld_mean: Pm,
    pub kld_max: f32,
    pub kld_min: f32,
    pub kld_median: f32,
    /// at `KLD_LEVELS`, in order
    pub kld_percentiles: [f32; 8],
    pub dp_mean: Pm,
    pub dp_max: f32,
    pub dp_min: f32,
    pub dp_median: f32,
    /// at `DP_LEVELS`, in order
    pub dp_percentiles: [f32; 10],
    pub rms_dp: Pm,
    /// same-top-1 share, as a fraction
    pub same_top: Pm,
}

impl Summary {
    pub fn new(s: &Sums, mut kld: Vec<f32>, mut dp: Vec<f32>) -> Summary {
        kld.sort_by(f32::total_cmp);
        dp.sort_by(f32::total_cmp);
        let n = s.count;
        let log_ppl = mean_and_uncertainty(s.sum_nll, s.sum_nll2, n);
        let ppl_val = log_ppl.0.exp();
        let ppl_unc = ppl_val * log_ppl.1;
        let log_base = mean_and_uncertainty(s.sum_nll_base, s.sum_nll_base2, n);
        let base_val = log_base.0.exp();
        let base_unc = base_val * log_base.1;
        let cov = covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, n);
        let ratio_val = log_ppl.0 - log_base.0;
        let ratio_unc = (log_ppl.1 * log_ppl.1 + log_base.1 * log_base.1 - 2.0 * cov).sqrt();
        let ppl_cov = ppl_val * base_val * cov;
        let mse = mean_and_uncertainty(s.sum_p_diff2, s.sum_p_diff4, n);
        let rms = mse.0.sqrt();
        let same = s.n_same_top as f64 / n as f64;
        Summary {
            count: n,
            ppl: (ppl_val, ppl_unc),
            base_ppl: (base_val, base_unc),
            ln_ppl_cor: cov / (log_ppl.1 * log_base.1),
            ln_ppl_ratio: (ratio_val, ratio_unc),
            ppl_ratio: (ratio_val.exp(), ratio_val.exp() * ratio_unc),
            ppl_diff: (ppl_val - base_val, (ppl_unc * ppl_unc + base_unc * base_unc - 2.0 * ppl_cov).sqrt()),
            kld_mean: mean_and_uncertainty(s.sum_kld, s.sum_kld2, n),
            kld_max: kld[kld.len() - 1],
            kld_min: kld[0],
            kld_median: median(&kld),
            kld_percentiles: KLD_LEVELS.map(|(_, f)| percentile(&kld, f)),
            dp_mean: mean_and_uncertainty(s.sum_p_diff, s.sum_p_diff2, n),
            dp_max: dp[dp.len() - 1],
            dp_min: dp[0],
            dp_median: median(&dp),
            dp_percentiles: DP_LEVELS.map(|(_, f)| percentile(&dp, f)),
            rms_dp: (rms, 0.5 / rms * mse.1),
            same_top: (same, (same * (1.0 - same) / (n as f64 - 1.0)).sqrt()),
        }
    }

    /// The KLD percentile printed as `label` (e.g. "99.0%").
    pub fn kld_at(&self, label: &str) -> f32 {
        let i = KLD_LEVELS.iter().position(|(l, _)| l.trim() == label).expect("a printed level");
        self.kld_percentiles[i]
    }

    /// The three statistics blocks, with upstream's labels and number formats.
    pub fn upstream_text(&self) -> String {
        let mut o = String::new();
        let mut line = |s: String| {
            o.push_str(&s);
            o.push('\n');
        };
        line("====== Perplexity statistics ======".into());
        line(format!("Mean PPL(Q)                   : {:10.6} ± {:10.6}", c(self.ppl.0), c(self.ppl.1)));
        line(format!("Mean PPL(base)                : {:10.6} ± {:10.6}", c(self.base_ppl.0), c(self.base_ppl.1)));
        line(format!("Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2}%", c(100.0 * self.ln_ppl_cor)));
        line(format!("Mean ln(PPL(Q)/PPL(base))     : {:10.6} ± {:10.6}", c(self.ln_ppl_ratio.0), c(self.ln_ppl_ratio.1)));
        line(format!("Mean PPL(Q)/PPL(base)         : {:10.6} ± {:10.6}", c(self.ppl_ratio.0), c(self.ppl_ratio.1)));
        line(format!("Mean PPL(Q)-PPL(base)         : {:10.6} ± {:10.6}", c(self.ppl_diff.0), c(self.ppl_diff.1)));
        line(String::new());
        line("====== KL divergence statistics ======".into());
        line(format!("Mean    KLD: {:10.6} ± {:10.6}", c(self.kld_mean.0), c(self.kld_mean.1)));
        line(format!("Maximum KLD: {:10.6}", c(self.kld_max)));
        for (i, (label, _)) in KLD_LEVELS.iter().enumerate() {
            if i == 4 {
                line(format!("Median  KLD: {:10.6}", c(self.kld_median)));
            }
            line(format!("{label}   KLD: {:10.6}", c(self.kld_percentiles[i])));
        }
        line(format!("Minimum KLD: {:10.6}", c(self.kld_min)));
        line(String::new());
        line("====== Token probability statistics ======".into());
        line(format!("Mean    Δp: {:6.3} ± {:5.3} %", c(100.0 * self.dp_mean.0), c(100.0 * self.dp_mean.1)));
        line(format!("Maximum Δp: {:6.3}%", c(100.0 * self.dp_max as f64)));
        for (i, (label, _)) in DP_LEVELS.iter().enumerate() {
            if i == 5 {
                line(format!("Median  Δp: {:6.3}%", c(100.0 * self.dp_median as f64)));
            }
            line(format!("{label}   Δp: {:6.3}%", c(100.0 * self.dp_percentiles[i] as f64)));
        }
        line(format!("Minimum Δp: {:6.3}%", c(100.0 * self.dp_min as f64)));
        line(format!("RMS Δp    : {:6.3} ± {:5.3} %", c(100.0 * self.rms_dp.0), c(100.0 * self.rms_dp.1)));
        line(format!("Same top p: {:6.3} ± {:5.3} %", c(100.0 * self.same_top.0), c(100.0 * self.same_top.1)));
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::base_logits::{encode_row, row_len};

    fn score_token(logits: &[f32], base: &[u16], tok: usize, s: &mut Sums) -> (f64, f32) {
        let t = token_terms(logits, base, tok);
        s.add(&t);
        (t.kld, t.p_diff)
    }

    /// A base row built directly: scale and minimum in the head, then q.
    fn row(scale: f32, min: f32, q: &[u16]) -> Vec<u16> {
        let mut r = vec![0u16; row_len(q.len())];
        for (i, x) in [scale, min].into_iter().enumerate() {
            r[2 * i] = x.to_bits() as u16;
            r[2 * i + 1] = (x.to_bits() >> 16) as u16;
        }
        r[4..4 + q.len()].copy_from_slice(q);
        r
    }

    #[test]
    fn one_token_against_hand_computed_values() {
        // base: log p = (−0.5, −1.5, −2.5) exactly (scale 1/2, min −2.5, q = 4, 2, 0)
        let base = row(0.5, -2.5, &[4, 2, 0]);
        // model: logits ln(0.2), ln(0.3), ln(0.5) → p = 0.2, 0.3, 0.5 (already normalised)
        let logits = [0.2f32.ln(), 0.3f32.ln(), 0.5f32.ln()];
        let mut s = Sums::default();
        let (kld, dp) = score_token(&logits, &base, 0, &mut s);
        // KL(base ‖ model) = Σ p_b (ln p_b − ln p_m)
        let pb = [(-0.5f64).exp(), (-1.5f64).exp(), (-2.5f64).exp()];
        let pm = [0.2f64, 0.3, 0.5];
        let want: f64 = (0..3).map(|i| pb[i] * (pb[i].ln() - pm[i].ln())).sum();
        assert!((kld - want).abs() < 1e-6, "{kld} vs {want}");
        // Δp of token 0: 0.2 − e^−0.5
        assert!((dp as f64 - (0.2 - (-0.5f64).exp())).abs() < 1e-6);
        assert!((s.sum_nll - -(0.2f64.ln())).abs() < 1e-6);
        assert!((s.sum_nll_base - 0.5).abs() < 1e-7);
        // model's top is 2, base's top is 0: no agreement
        assert_eq!((s.n_same_top, s.count), (0, 1));
    }

    #[test]
    fn base_terms_at_or_below_minus_16_are_skipped() {
        // token 1 at log p = −16 exactly: its term is left out of the sum
        let base = row(1.0, -16.0, &[16, 0]);
        let logits = [0.0f32, 0.0];
        let mut s = Sums::default();
        let (kld, _) = score_token(&logits, &base, 0, &mut s);
        // only the i = 0 term: p_b = 1, ln p_b = 0, ln p_m = −ln 2
        assert!((kld - 2f64.ln()).abs() < 1e-6, "{kld}");
    }

    #[test]
    fn top_one_ties_go_to_the_first_index_on_both_sides() {
        // base: q ties at 1 and 2 → base top is 1; model ties at 1 and 2 → top 1: agree
        let base = row(1.0 / 65535.0, -1.0, &[0, 65535, 65535]);
        let mut s = Sums::default();
        score_token(&[0.0, 1.0, 1.0], &base, 0, &mut s);
        assert_eq!(s.n_same_top, 1);
        // model prefers 2 strictly: disagree
        score_token(&[0.0, 1.0, 1.5], &base, 0, &mut s);
        assert_eq!(s.n_same_top, 1);
        // quantization decides: base logits 1.0 and 1.00001 encode to the same q; the first wins
        let mut r = vec![0u16; row_len(3)];
        encode_row(&[-5.0, 1.0, 1.000_001], 0, &mut r);
        assert_eq!(r[5], r[6]);
        score_token(&[-5.0, 1.0, 0.0], &r, 0, &mut s);
        assert_eq!(s.n_same_top, 2);
    }

    #[test]
    fn an_identical_model_has_near_zero_kld_and_full_agreement() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37 % 11) as f32) * 0.3 - 1.0).collect();
        let mut r = vec![0u16; row_len(50)];
        encode_row(&logits, 3, &mut r);
        let mut a = Accumulator::default();
        for _ in 0..120 {
            a.add(&logits, &r, 3);
        }
        let sm = a.summary().unwrap();
        assert!(sm.kld_mean.0.abs() < 1e-4, "{}", sm.kld_mean.0);
        assert_eq!(sm.same_top, (1.0, 0.0));
        assert!((sm.ppl.0 - sm.base_ppl.0).abs() / sm.ppl.0 < 1e-4);
    }

    #[test]
    fn mean_and_uncertainty_and_covariance_by_hand() {
        // 1..=11: mean 6, population variance 10, err sqrt(10/10) = 1
        let xs: Vec<f64> = (1..=11).map(|x| x as f64).collect();
        let (m, e) = mean_and_uncertainty(xs.iter().sum(), xs.iter().map(|x| x * x).sum(), 11);
        assert!((m - 6.0).abs() < 1e-12 && (e - 1.0).abs() < 1e-12, "{m} {e}");
        // ten values: the error is 0 (upstream needs more than 10)
        assert_eq!(mean_and_uncertainty(55.0, 385.0, 10), (5.5, 0.0));
        // covariance of x with 2x over 1..=11: 2·10/10 = 2
        let c = covariance(66.0, 132.0, xs.iter().map(|x| 2.0 * x * x).sum(), 11);
        assert!((c - 2.0).abs() < 1e-12);
        assert_eq!(covariance(1.0, 1.0, 1.0, 9), 0.0);
    }

    #[test]
    fn percentiles_and_median_by_hand() {
        let v = [0.0f32, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), 2.0);
        // 0.9·4 = 3.6: 0.4·3 + 0.6·4 = 3.6
        assert!((percentile(&v, 0.9) - 3.6).abs() < 1e-6);
        assert_eq!(percentile(&v, 0.0), 0.0);
        assert_eq!(percentile(&v, 1.0), 4.0);
        assert_eq!(median(&v), 2.0);
        assert_eq!(median(&[1.0, 2.0, 5.0, 9.0]), 3.5);
    }

    #[test]
    fn summary_of_known_sums() {
        // 100 tokens, 60 agree; KLD values 0.00, 0.01, …, 0.99
        let mut s = Sums { count: 100, n_same_top: 60, ..Default::default() };
        let kld: Vec<f32> = (0..100).map(|i| i as f32 / 100.0).collect();
        s.sum_kld = kld.iter().map(|&x| x as f64).sum();
        s.sum_kld2 = kld.iter().map(|&x| (x as f64) * (x as f64)).sum();
        // nll all 2.0, nll_base all 1.0: PPL e², base e, no variance
        s.sum_nll = 200.0;
        s.sum_nll2 = 400.0;
        s.sum_nll_base = 100.0;
        s.sum_nll_base2 = 100.0;
        s.sum_nll_nll_base = 200.0;
        // Δp all 0.1: RMS 0.1
        s.sum_p_diff = 10.0;
        s.sum_p_diff2 = 1.0;
        s.sum_p_diff4 = 0.01;
        let sm = Summary::new(&s, kld.iter().rev().copied().collect(), vec![0.1; 100]);
        assert!((sm.ppl.0 - 7.38905609893065).abs() < 1e-9, "{}", sm.ppl.0);
        assert!((sm.base_ppl.0 - std::f64::consts::E).abs() < 1e-12);
        assert!((sm.kld_mean.0 - 0.495).abs() < 1e-9);
        // population variance of i/100 for i < 100: (100² − 1)/12 / 10⁴ = 0.083325
        let err = (0.083325f64 / 99.0).sqrt();
        assert!((sm.kld_mean.1 - err).abs() < 1e-9, "{} vs {err}", sm.kld_mean.1);
        assert_eq!(sm.kld_max, 0.99);
        assert_eq!(sm.kld_min, 0.0);
        assert!((sm.kld_median - 0.495).abs() < 1e-6);
        // 0.99·99 = 98.01 → 0.99·0.98 + 0.01·0.99
        assert!((sm.kld_at("99.0%") - 0.9801).abs() < 1e-5);
        assert!((sm.rms_dp.0 - 0.1).abs() < 1e-12);
        assert!((sm.same_top.0 - 0.6).abs() < 1e-12);
        assert!((sm.same_top.1 - (0.24f64 / 99.0).sqrt()).abs() < 1e-12);
        let text = sm.upstream_text();
        assert!(text.contains("Mean    KLD:   0.495000 ±   0.029011"), "{text}");
        assert!(text.contains("Same top p: 60.000 ± 4.924 %"), "{text}");
        assert!(text.contains("Maximum KLD:   0.990000"), "{text}");
    }

    #[test]
    fn fewer_than_100_tokens_give_no_summary() {
        let r = {
            let mut r = vec![0u16; row_len(2)];
            encode_row(&[0.0, 1.0], 0, &mut r);
            r
        };
        let mut a = Accumulator::default();
        for _ in 0..99 {
            a.add(&[0.0, 1.0], &r, 0);
        }
        assert!(a.summary().is_none());
        a.add(&[0.0, 1.0], &r, 0);
        assert!(a.summary().is_some());
    }

    /// `C` against C's own printf (libc's snprintf), for the values upstream's lines can hold:
    /// NaN of either sign (0/0 and √(−0) in the uncertainties), infinities, zeros of either
    /// sign, at the widths and precisions upstream prints.
    #[test]
    fn floats_print_as_c_printf_prints_them_nans_included() {
        let neg_nan = -f64::NAN;
        assert!(neg_nan.is_sign_negative() && f64::NAN.is_sign_positive());
        let values = [f64::NAN, neg_nan, (-0.0f64).sqrt(), f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1.0 / 3.0, -2.5e-6, 18009.332509];
        for v in values {
            for (w, p) in [(10, 5), (10, 6), (6, 3), (0, 4), (8, 0)] {
                let ours = format!("{:w$.p$}", c(v));
                let mut buf = [0u8; 64];
                let fmt = std::ffi::CString::new(format!("%{w}.{p}f")).unwrap();
                // SAFETY: a bounded buffer, a format with one double conversion and one double.
                let n = unsafe { libc::snprintf(buf.as_mut_ptr().cast(), buf.len(), fmt.as_ptr(), v) };
                let theirs = std::str::from_utf8(&buf[..n as usize]).unwrap();
                // Rust prints inf as `inf` too; the one difference is NaN
                assert_eq!(ours, theirs, "value {v:?}, width {w}, precision {p}");
            }
        }
    }
}

/// A float printed as C's printf prints it, as upstream's lines are: NaN as `nan` or `-nan`
/// (by its sign bit), where Rust writes `NaN`; width and precision as given.
struct C(f64);

fn c(x: impl Into<f64>) -> C {
    C(x.into())
}

impl std::fmt::Display for C {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_nan() {
            let s = if self.0.is_sign_negative() { "-nan" } else { "nan" };
            write!(f, "{s:>w$}", w = f.width().unwrap_or(0))
        } else {
            std::fmt::Display::fmt(&self.0, f)
        }
    }
}
