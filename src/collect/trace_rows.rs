//! Routing-trace rows: which token each row of a ubatch is, and the encoded rows.
//!
//! llama.cpp cuts a batch into ubatches itself. With one sequence per batch it takes
//! consecutive slices (`split_simple`); with several (`-b > -c`) it takes the same number of
//! tokens from every sequence and lays them out sequence after sequence (`split_equal`,
//! sequential). `ubatch_rows` reproduces that, and the observer checks every row's token id
//! against the graph's own input tokens, so a different split is an error, never a wrong row.

use crate::collect::reap::LayerRouting;
use crate::formats::trace::{RowData, RowLayout};

/// One sequence of a batch: `len` tokens of chunk `chunk`, positions from `pos0`, taken from
/// the token list at `tok0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    pub chunk: u32,
    pub pos0: u32,
    pub tok0: usize,
    pub len: usize,
}

#[derive(Clone, Debug, Default)]
pub struct BatchLayout {
    pub seqs: Vec<SeqSpan>,
    pub n_ubatch: usize,
}

/// Where a ubatch row comes from: sequence index and offset inside its span.
pub type RowSource = (usize, usize);

impl BatchLayout {
    /// The rows of every ubatch llama.cpp will cut this batch into, in order.
    pub fn ubatches(&self) -> Vec<Vec<RowSource>> {
        let n_seqs = self.seqs.len();
        let mut out = Vec::new();
        if n_seqs == 0 || self.n_ubatch == 0 {
            return out;
        }
        if n_seqs == 1 {
            let len = self.seqs[0].len;
            let mut start = 0;
            while start < len {
                let end = (start + self.n_ubatch).min(len);
                out.push((start..end).map(|o| (0, o)).collect());
                start = end;
            }
            return out;
        }
        // split_equal: every sequence still holding tokens joins; each gets the same count
        let mut used = vec![0usize; n_seqs];
        loop {
            let active: Vec<usize> = (0..n_seqs).filter(|&s| used[s] < self.seqs[s].len).collect();
            if active.is_empty() {
                break;
            }
            let mut per = 0;
            loop {
                if active.iter().any(|&s| used[s] + per >= self.seqs[s].len) {
                    break;
                }
                per += 1;
                if (per + 1) * active.len() > self.n_ubatch {
                    break;
                }
            }
            let mut rows = Vec::with_capacity(per * active.len());
            for &s in &active {
                rows.extend((0..per).map(|i| (s, used[s] + i)));
                used[s] += per;
            }
            out.push(rows);
        }
        out
    }
}

/// Collects encoded rows for the trace writer.
pub struct TraceRows {
    pub top_n: usize,
    /// stop after this many rows (`--trace-tokens`)
    pub limit: u64,
    /// rows encoded so far
    pub rows: u64,
    pub buf: Vec<u8>,
    pub pending_rows: u64,
    /// the phase of the rows being added (the driver sets it before each decode: a batch is
    /// all prompt or one generated token)
    pub phase: u32,
    order: Vec<u16>,
}

impl TraceRows {
    pub fn new(top_n: usize, limit: u64) -> Self {
        TraceRows { top_n, limit, rows: 0, buf: Vec::new(), pending_rows: 0, phase: crate::formats::trace::PHASE_PREFILL, order: Vec::new() }
    }

    pub fn done(&self) -> bool {
        self.rows >= self.limit
    }

    /// Why `routing` cannot give this trace's rows, if it cannot: a layer read on the device
    /// without `top_n` candidates per token.
    pub fn check_routing(&self, routing: &[LayerRouting]) -> Result<(), String> {
        for lr in routing.iter().filter(|lr| lr.on_device) {
            if lr.cand_id.len() != lr.n_tokens * self.top_n {
                return Err(format!(
                    "trace: {} router candidates read on the device for {} tokens, expected {} per token (REAP_ROUTER=host reads the whole probabilities)",
                    lr.cand_id.len(),
                    lr.n_tokens,
                    self.top_n
                ));
            }
        }
        Ok(())
    }

    /// Encodes the rows of one finished ubatch. `sources[r]` says which token row r is.
    pub fn add_ubatch(&mut self, layout: &RowLayout, routing: &[LayerRouting], sources: &[(u32, u32, i32)]) {
        let n_layers = routing.len();
        let k = layout.k;
        let n = self.top_n;
        let (mut sel_w, mut sel_id) = (vec![0f32; n_layers * k], vec![0u16; n_layers * k]);
        let (mut cand_p, mut cand_id) = (vec![0f32; n_layers * n], vec![0u16; n_layers * n]);
        for (r, &(chunk, pos, token)) in sources.iter().enumerate() {
            if self.done() {
                return;
            }
            for (li, lr) in routing.iter().enumerate() {
                sel_w[li * k..(li + 1) * k].copy_from_slice(&lr.sel_weight[r * k..(r + 1) * k]);
                sel_id[li * k..(li + 1) * k].copy_from_slice(&lr.sel_id[r * k..(r + 1) * k]);
                if lr.on_device {
                    // ordered from the device's candidates (patch 0003)
                    cand_id[li * n..(li + 1) * n].copy_from_slice(&lr.cand_id[r * n..(r + 1) * n]);
                    cand_p[li * n..(li + 1) * n].copy_from_slice(&lr.cand_p[r * n..(r + 1) * n]);
                    continue;
                }
                let n_expert = lr.probs.len() / lr.n_tokens.max(1);
                let probs = &lr.probs[r * n_expert..(r + 1) * n_expert];
                top_candidates(probs, n, &mut self.order);
                for (j, &e) in self.order.iter().enumerate() {
                    cand_id[li * n + j] = e;
                    cand_p[li * n + j] = probs[e as usize];
                }
            }
            layout.encode(
                &RowData { chunk, pos, token, phase: self.phase, sel_weight: &sel_w, cand_prob: &cand_p, sel_id: &sel_id, cand_id: &cand_id },
                &mut self.buf,
            );
            self.rows += 1;
            self.pending_rows += 1;
        }
    }
}

/// The `n` most probable experts, best first; ties go to the lower id (probabilities in
/// `f32::total_cmp` order).
pub fn top_candidates(probs: &[f32], n: usize, out: &mut Vec<u16>) {
    KEYS.with_borrow_mut(|keys| {
        keys.clear();
        keys.extend(probs.iter().enumerate().map(|(e, &p)| candidate_key(p, e as u16)));
        if n < keys.len() {
            keys.select_nth_unstable(n);
            keys.truncate(n);
        }
        keys.sort_unstable();
        out.clear();
        out.extend(keys.iter().map(|&k| k as u16));
    });
}

thread_local! {
    /// sort keys of the row being ordered (no allocation per token and layer)
    static KEYS: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A key whose ascending order is the candidates' order: probability descending in
/// `f32::total_cmp` order, then id ascending (sorting plain integers is several times faster
/// than sorting ids through a comparison of their probabilities).
pub fn candidate_key(p: f32, id: u16) -> u64 {
    let b = p.to_bits();
    // the bits in ascending total order: negatives reversed, below the positives
    let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    ((!ascending as u64) << 16) | id as u64
}

/// The probability a [`candidate_key`] was made from, bit for bit.
pub fn key_prob(key: u64) -> f32 {
    let ascending = !((key >> 16) as u32);
    f32::from_bits(if ascending >> 31 == 1 { ascending & 0x7fff_ffff } else { !ascending })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(len: usize) -> SeqSpan {
        SeqSpan { chunk: 0, pos0: 0, tok0: 0, len }
    }

    #[test]
    fn one_sequence_is_cut_into_consecutive_slices() {
        let l = BatchLayout { seqs: vec![span(5)], n_ubatch: 2 };
        assert_eq!(l.ubatches(), vec![vec![(0, 0), (0, 1)], vec![(0, 2), (0, 3)], vec![(0, 4)]]);
    }

    #[test]
    fn several_sequences_are_laid_out_sequence_after_sequence() {
        // 2 sequences of 512 tokens, ubatch 512: 256 of each per ubatch
        let l = BatchLayout { seqs: vec![span(512), span(512)], n_ubatch: 512 };
        let u = l.ubatches();
        assert_eq!(u.len(), 2);
        assert_eq!(u[0][0], (0, 0));
        assert_eq!(u[0][255], (0, 255));
        assert_eq!(u[0][256], (1, 0));
        assert_eq!(u[1][0], (0, 256));
        assert_eq!(u[1][511], (1, 511));
        // ubatch 128 with 3 sequences of 4: 42 tokens each would exceed, so 4 each
        let l = BatchLayout { seqs: vec![span(4), span(4), span(4)], n_ubatch: 128 };
        assert_eq!(l.ubatches().len(), 1);
        assert_eq!(l.ubatches()[0].len(), 12);
    }

    /// The keys order as the plain comparison does: `total_cmp` descending, then id; on
    /// values with ties, ±0, infinities, NaNs of both signs and subnormals.
    #[test]
    fn candidate_keys_order_as_total_cmp_then_id() {
        let vals = [0.5f32, -0.0, 0.0, 1e-40, -1e-40, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, 0.25, 0.5, -3.0, 1.0];
        let mut rng = crate::fixture::rng::Rng::new(3);
        let mut out = Vec::new();
        for _ in 0..200 {
            let row: Vec<f32> = (0..40).map(|_| vals[rng.below(vals.len() as u64) as usize]).collect();
            let mut want: Vec<u16> = (0..row.len() as u16).collect();
            want.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            for n in [1, 7, 39, 40, 50] {
                top_candidates(&row, n, &mut out);
                assert_eq!(out, want[..n.min(40)], "row {row:?} n {n}");
            }
            for (e, &p) in row.iter().enumerate() {
                let k = candidate_key(p, e as u16);
                assert_eq!((key_prob(k).to_bits(), k as u16), (p.to_bits(), e as u16));
            }
        }
    }

    #[test]
    fn candidates_are_best_first_with_ties_to_the_lower_id() {
        let mut o = Vec::new();
        top_candidates(&[0.1, 0.4, 0.4, 0.05, 0.05], 3, &mut o);
        assert_eq!(o, [1, 2, 0]);
        top_candidates(&[0.1, 0.4, 0.4, 0.05, 0.05], 5, &mut o);
        assert_eq!(o, [1, 2, 0, 3, 4]);
    }
}
