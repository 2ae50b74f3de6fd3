//! Perplexity over the second half of each chunk, computed as upstream's `process_logits`
//! (float max, double Σexp, double NLL), so the printed figures match.

#[derive(Default)]
pub struct Accumulator {
    nll: f64,
    nll2: f64,
    count: usize,
}

/// −log p(tok) from one row of logits, as upstream's `log_softmax`.
pub fn neg_log_prob(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().copied().fold(logits[0], f32::max);
    let sum_exp: f64 = logits.iter().map(|&l| (l - max).exp() as f64).sum();
    -((logits[tok] - max) as f64 - sum_exp.ln())
}

impl Accumulator {
    /// `logits` starts at the row of the first scored position; `tokens[i + 1]` is the target
    /// of row i; `n` rows are scored.
    pub fn add_chunk(&mut self, logits: &[f32], tokens: &[i32], n: usize, n_vocab: usize) {
        for i in 0..n {
            let v = neg_log_prob(&logits[i * n_vocab..(i + 1) * n_vocab], tokens[i + 1] as usize);
            self.nll += v;
            self.nll2 += v * v;
        }
        self.count += n;
    }

    /// One scored token's −log p, computed elsewhere (the base pass of `eval`).
    pub fn add_value(&mut self, v: f64) {
        self.nll += v;
        self.nll2 += v * v;
        self.count += 1;
    }

    pub fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// (PPL, its standard error), or None when the variance came out negative.
    pub fn final_estimate(&self) -> Option<(f64, f64)> {
        let n = self.count as f64;
        let nll = self.nll / n;
        let nll2 = self.nll2 / n - nll * nll;
        let ppl = nll.exp();
        (nll2 > 0.0).then(|| (ppl, (nll2 / (n - 1.0)).sqrt() * ppl))
    }
}
