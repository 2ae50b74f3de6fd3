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
        let start = out.len();
        out.resize(start + self.sources.len() * self.layout.size, 0);
        self.encode_rows(0..self.sources.len(), &mut out[start..])
    }

    /// Encodes rows `rows` over `out` (`rows.len()` rows' bytes): each row depends on its own
    /// token's routing alone, so parts of a ubatch can be encoded on different threads.
    pub fn encode_rows(&self, rows: std::ops::Range<usize>, out: &mut [u8]) -> Result<(), String> {
        let (n_layers, k, n) = (self.routing.len(), self.layout.k, self.top_n);
        let (mut sel_w, mut sel_id) = (vec![0f32; n_layers * k], vec![0u16; n_layers * k]);
        let (mut cand_p, mut cand_id) = (vec![0f32; n_layers * n], vec![0u16; n_layers * n]);
        let mut order = Vec::new();
        let row_out = out.chunks_exact_mut(self.layout.size);
        for (r, out) in rows.zip(row_out) {
            let (chunk, pos, token) = self.sources[r];
            for (li, lr) in self.routing.iter().enumerate() {
                sel_w[li * k..(li + 1) * k].copy_from_slice(&lr.sel_weight[r * k..(r + 1) * k]);
                sel_id[li * k..(li + 1) * k].copy_from_slice(&lr.sel_id[r * k..(r + 1) * k]);
                let c = li * n..(li + 1) * n;
                lr.candidates(r, &mut cand_id[c.clone()], &mut cand_p[c], &mut order).map_err(|e| format!("trace, MoE layer slot {li}: {e}"))?;
            }
            self.layout.encode_into(&RowData { chunk, pos, token, phase: self.phase, sel_weight: &sel_w, cand_prob: &cand_p, sel_id: &sel_id, cand_id: &cand_id }, out);
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

/// Rows encoded per part of [`encode_ubatches`]' job: enough to outweigh handing a part out.
const ROWS_PER_PART: usize = 64;

/// Appends the encoded rows of `ubatches`, in order, to `out`: on `pool`'s threads where there
/// is one (parts of [`ROWS_PER_PART`] rows, each written to its own place: the same bytes as
/// one thread writes). The first error in row order is returned.
pub fn encode_ubatches(ubatches: &[PendingUbatch], pool: Option<&crate::collect::pool::Pool>, out: &mut Vec<u8>) -> Result<(), String> {
    let Some(pool) = pool.filter(|p| p.threads() > 1) else {
        return ubatches.iter().try_for_each(|u| u.encode(out));
    };
    let start = out.len();
    out.resize(start + ubatches.iter().map(|u| u.sources.len() * u.layout.size).sum::<usize>(), 0);
    // (ubatch, its rows, their bytes), in row order
    let mut parts = Vec::new();
    let mut rest = &mut out[start..];
    for (ui, u) in ubatches.iter().enumerate() {
        for first in (0..u.sources.len()).step_by(ROWS_PER_PART) {
            let rows = first..(first + ROWS_PER_PART).min(u.sources.len());
            let (bytes, tail) = std::mem::take(&mut rest).split_at_mut(rows.len() * u.layout.size);
            rest = tail;
            parts.push(std::sync::Mutex::new((ui, rows, bytes, Ok(()))));
        }
    }
    pool.run(parts.len(), &|p| {
        let mut part = parts[p].lock().unwrap_or_else(|e| e.into_inner());
        let (ui, rows) = (part.0, part.1.clone());
        part.3 = ubatches[ui].encode_rows(rows, part.2);
    });
    parts.into_iter().map(|p| p.into_inner().unwrap_or_else(|e| e.into_inner()).3).find(Result::is_err).unwrap_or(Ok(()))
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

    /// A ubatch of `t` rows over `layers` MoE layers (8 experts top-2, trace top-3), the odd
    /// layers read as on the device (candidates, tied rows read whole), with ties and repeats.
    fn pending(rng: &mut crate::fixture::rng::Rng, t: usize, layers: usize, drop_tie_row: Option<usize>) -> PendingUbatch {
        let (e, k, n) = (8usize, 2usize, 3usize);
        let header = crate::formats::trace::TraceHeader { layers: (0..layers as u32).collect(), n_expert: e as u32, k: k as u32, top_n: n as u32, n_tokens: 0, flags: 0 };
        let mut routing = Vec::new();
        for l in 0..layers {
            let mut lr = LayerRouting { n_tokens: t, on_device: l % 2 == 1, ..Default::default() };
            for tok in 0..t {
                // few distinct values: many ties
                let row: Vec<f32> = (0..e).map(|_| rng.below(4) as f32 / 4.0).collect();
                let mut order = Vec::new();
                top_candidates(&row, n + 1, &mut order);
                lr.sel_id.extend(order[..k].iter().copied());
                lr.sel_weight.extend(order[..k].iter().map(|&i| row[i as usize]));
                if !lr.on_device {
                    lr.probs.extend_from_slice(&row);
                    continue;
                }
                // in ggml's order (any): reversed
                lr.raw_cand.extend(order.iter().rev().copied());
                lr.raw_cand_p.extend(order.iter().rev().map(|&i| row[i as usize]));
                let p = &lr.raw_cand_p[lr.raw_cand_p.len() - (n + 1)..];
                if !crate::collect::reap::candidates_decide(p) && drop_tie_row != Some(tok) {
                    lr.tie_rows.push((tok, row));
                }
            }
            routing.push(lr);
        }
        let sources = (0..t as u32).map(|i| (i / 7, i, 1000 + i as i32)).collect();
        PendingUbatch { layout: header.layout(), top_n: n, phase: 0, routing, sources }
    }

    /// Rows encoded in parts on a pool are the bytes one thread writes, across ubatches of
    /// sizes around the part size; and the first error in row order is the one returned.
    #[test]
    fn rows_encoded_on_a_pool_are_the_serial_bytes() {
        let mut rng = crate::fixture::rng::Rng::new(11);
        let ubatches: Vec<PendingUbatch> = [1, 63, 64, 65, 200, 3].iter().map(|&t| pending(&mut rng, t, 3, None)).collect();
        assert!(ubatches.iter().flat_map(|u| &u.routing).any(|lr| !lr.tie_rows.is_empty()), "no tied rows: the test tests less");
        let mut serial = vec![9u8; 5];
        for u in &ubatches {
            u.encode(&mut serial).unwrap();
        }
        let rows: usize = ubatches.iter().map(|u| u.sources.len()).sum();
        assert_eq!(serial.len(), 5 + rows * ubatches[0].layout.size);
        let pool = crate::collect::pool::Pool::new(3);
        for p in [None, Some(&pool)] {
            let mut out = vec![9u8; 5];
            encode_ubatches(&ubatches, p, &mut out).unwrap();
            assert!(out == serial, "pool {}", p.is_some());
        }
        // a tied row not read whole, late in the second ubatch and in the fourth: the first wins
        let mut rng = crate::fixture::rng::Rng::new(11);
        let mut bad: Vec<PendingUbatch> = Vec::new();
        for (i, t) in [1usize, 63, 64, 65].into_iter().enumerate() {
            let probe = pending(&mut rng.clone(), t, 3, None);
            let tied = probe.routing[1].tie_rows.iter().map(|r| r.0).last();
            bad.push(pending(&mut rng, t, 3, if i == 1 || i == 3 { tied } else { None }));
        }
        let mut one = Vec::new();
        let want = bad.iter().try_for_each(|u| u.encode(&mut one)).unwrap_err();
        let mut out = Vec::new();
        assert_eq!(encode_ubatches(&bad, Some(&pool), &mut out).unwrap_err(), want);
        assert!(want.contains("tie"), "{want}");
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
