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

/// Collects the trace's rows for the writer: each finished ubatch's routing is moved, not
/// encoded, into `pending` (the callback's cost is a swap of buffers); the writer thread
/// orders the candidates and encodes the rows ([`PendingUbatch::encode`]) while the next
/// ubatch computes.
pub struct TraceRows {
    pub top_n: usize,
    /// stop after this many rows (`--trace-tokens`)
    pub limit: u64,
    /// rows taken so far
    pub rows: u64,
    /// ubatches taken since the last hand-over to the writer, and their rows
    pub pending: Vec<PendingUbatch>,
    pub pending_rows: u64,
    /// the phase of the rows being added (the driver sets it before each decode: a batch is
    /// all prompt or one generated token)
    pub phase: u32,
    /// routing sets back from the writer, emptied, for the collectors to fill again
    pub spare: Vec<Vec<LayerRouting>>,
}

/// One ubatch's rows, as the collectors left them.
pub struct PendingUbatch {
    pub layout: RowLayout,
    pub top_n: usize,
    pub phase: u32,
    /// per MoE layer
    pub routing: Vec<LayerRouting>,
    /// (chunk, pos, token) of each row taken (the first rows of the ubatch, within the limit)
    pub sources: Vec<(u32, u32, i32)>,
}

impl TraceRows {
    pub fn new(top_n: usize, limit: u64) -> Self {
        TraceRows { top_n, limit, rows: 0, pending: Vec::new(), pending_rows: 0, phase: crate::formats::trace::PHASE_PREFILL, spare: Vec::new() }
    }

    pub fn done(&self) -> bool {
        self.rows >= self.limit
    }

    /// Why `routing` cannot give this trace's rows, if it cannot: a layer read on the device
    /// without `top_n + 1` candidates per token.
    pub fn check_routing(&self, routing: &[LayerRouting]) -> Result<(), String> {
        let w = self.top_n + 1;
        for lr in routing.iter().filter(|lr| lr.on_device) {
            if lr.raw_cand.len() != lr.n_tokens * w || lr.raw_cand_p.len() != lr.n_tokens * w {
                return Err(format!(
                    "trace: {} router candidates read on the device for {} tokens, expected {w} per token (REAP_ROUTER=host reads the whole probabilities)",
                    lr.raw_cand.len(),
                    lr.n_tokens,
                ));
            }
        }
        Ok(())
    }

    /// Takes the rows of one finished ubatch (`sources[r]` says which token row r is): moves
    /// `routing` out, leaving an emptied set of the same length in its place.
    pub fn add_ubatch(&mut self, layout: &RowLayout, routing: &mut Vec<LayerRouting>, sources: &[(u32, u32, i32)]) {
        let take = (sources.len() as u64).min(self.limit.saturating_sub(self.rows)) as usize;
        if take == 0 {
            return;
        }
        let mut fresh = self.spare.pop().unwrap_or_default();
        fresh.resize_with(routing.len(), LayerRouting::default);
        let routing = std::mem::replace(routing, fresh);
        self.pending.push(PendingUbatch { layout: *layout, top_n: self.top_n, phase: self.phase, routing, sources: sources[..take].to_vec() });
        self.rows += take as u64;
        self.pending_rows += take as u64;
    }
}

impl PendingUbatch {
    /// Appends the encoded rows to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), String> {
        let (n_layers, k, n) = (self.routing.len(), self.layout.k, self.top_n);
        let (mut sel_w, mut sel_id) = (vec![0f32; n_layers * k], vec![0u16; n_layers * k]);
        let (mut cand_p, mut cand_id) = (vec![0f32; n_layers * n], vec![0u16; n_layers * n]);
        let mut order = Vec::new();
        for (r, &(chunk, pos, token)) in self.sources.iter().enumerate() {
            for (li, lr) in self.routing.iter().enumerate() {
                sel_w[li * k..(li + 1) * k].copy_from_slice(&lr.sel_weight[r * k..(r + 1) * k]);
                sel_id[li * k..(li + 1) * k].copy_from_slice(&lr.sel_id[r * k..(r + 1) * k]);
                let c = li * n..(li + 1) * n;
                lr.candidates(r, &mut cand_id[c.clone()], &mut cand_p[c], &mut order).map_err(|e| format!("trace, MoE layer slot {li}: {e}"))?;
            }
            self.layout.encode(&RowData { chunk, pos, token, phase: self.phase, sel_weight: &sel_w, cand_prob: &cand_p, sel_id: &sel_id, cand_id: &cand_id }, out);
        }
        Ok(())
    }

    /// The routing set, emptied for reuse.
    pub fn into_spare(self) -> Vec<LayerRouting> {
        let mut r = self.routing;
        r.iter_mut().for_each(LayerRouting::clear);
        r
    }
}

/// The `n` most probable experts, best first; ties go to the lower id (probabilities in
/// `f32::total_cmp` order).
pub fn top_candidates(probs: &[f32], n: usize, out: &mut Vec<u16>) {
    with_keys(|keys| {
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

/// Runs `f` with this thread's sort-key buffer ([`candidate_key`]s; its contents are `f`'s).
pub(crate) fn with_keys<R>(f: impl FnOnce(&mut Vec<u64>) -> R) -> R {
    KEYS.with_borrow_mut(f)
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
