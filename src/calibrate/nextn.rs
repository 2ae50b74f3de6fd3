//! `--nextn`: the model's nextn/MTP block, run as llama.cpp's MTP drafting runs it, over the
//! calibration text, teacher-forced. llama.cpp's forward pass never runs the block (it is a
//! draft head), so calibration has no statistics for it; this pass gives it its own.
//!
//! The pairing is upstream's (`common_speculative_impl_draft_mtp::process` at the pin): the
//! MTP context sees each token at its own position together with the trunk's final hidden
//! state (`h_nextn`, the output norm's result) of the token before it; the first token of a
//! sequence gets the drafter's initial state, zeros. So the block at position p reads t_p and
//! h_{p−1}, as when it drafts t_{p+1}. Every token of a chunk is fed (none is an output: the
//! drafter's head is not computed), the MTP cache cleared with the trunk's at each chunk.
//!
//! Its own observer collects REAP only (no imatrix entries, no trace rows); after each pass
//! the block's sums are copied into the main observer, so every snapshot of the saliency file
//! holds them, listed in `"nextn_blocks"`.

use super::observer::{CalibrationObserver, ReapState};
use crate::collect::imatrix::{Imatrix, ImatrixCollector, ImatrixConfig};
use crate::llama::{Batch, Context, ContextParams, Model};
use anyhow::{bail, Result};

pub struct NextnPass<'m> {
    ctx: Context<'m, CalibrationObserver>,
    batch: Batch,
    n_embd: usize,
    /// per sequence: the trunk's hidden state of the last token fed so far
    pending: Vec<Vec<f32>>,
}

impl<'m> NextnPass<'m> {
    pub fn new(model: &'m Model, trunk: &ContextParams) -> Result<Self> {
        // routing only: the imatrix collector is required by the observer but switched off
        let imatrix = ImatrixCollector::new(ImatrixConfig { chunk_size: 1, out_freq: i32::MAX, save_freq: 0, process_output: false }, Imatrix::default());
        let mut obs = CalibrationObserver::new(imatrix, Some(ReapState::new(None)));
        obs.collect_imatrix = false;
        let p = ContextParams { mtp: true, ..trunk.clone() };
        let ctx = Context::new(model, &p, obs).map_err(|e| anyhow::anyhow!("--nextn: the MTP context: {e:#}"))?;
        let batch = ctx.batch();
        let n_embd = model.n_embd() as usize;
        Ok(NextnPass { ctx, batch, n_embd, pending: vec![vec![0.0; n_embd]; trunk.n_seq_max.max(1) as usize] })
    }

    /// A new batch of chunks: the MTP cache cleared, every sequence at the drafter's start.
    pub fn start_chunk(&mut self, chunk: i32) {
        self.ctx.clear_memory();
        for h in &mut self.pending {
            h.fill(0.0);
        }
        self.ctx.observer_mut().chunk = chunk;
    }

    /// Runs the block over one batch the trunk has just computed: `fed` holds its tokens,
    /// sequence after sequence, `len` per sequence from position `pos0`, and `hidden` the
    /// trunk's final hidden states of those tokens in the same order. Copies the block's sums
    /// into `main`.
    pub fn run(&mut self, fed: &[i32], n_seq: usize, len: usize, pos0: usize, hidden: &[f32], main: &mut CalibrationObserver) -> Result<()> {
        let e = self.n_embd;
        if fed.len() != n_seq * len || hidden.len() != fed.len() * e {
            bail!(
                "--nextn: the trunk gave {} hidden values for {} tokens of width {e} (chunk {}); expected one row per token",
                hidden.len(),
                fed.len(),
                main.chunk
            );
        }
        self.batch.clear();
        for seq in 0..n_seq {
            for k in 0..len {
                let i = seq * len + k;
                let h = if k == 0 { &self.pending[seq][..] } else { &hidden[(i - 1) * e..i * e] };
                self.batch.add_with_state(fed[i], (pos0 + k) as i32, seq as i32, false, h);
            }
            let last = seq * len + len - 1;
            self.pending[seq].copy_from_slice(&hidden[last * e..(last + 1) * e]);
        }
        let done = self.ctx.decode_or_stop(&mut self.batch);
        if let Some(f) = self.ctx.observer_mut().failure.take() {
            bail!("--nextn: {f}");
        }
        if !done? {
            bail!("--nextn: the MTP graph was stopped (chunk {})", main.chunk);
        }
        let sums = &self.ctx.observer().reap.as_ref().expect("the pass collects REAP").sums.layers;
        if sums.is_empty() {
            bail!("--nextn: the MTP graph has no MoE layer the collector recognised (chunk {})", main.chunk);
        }
        if let Some(r) = main.reap.as_mut() {
            r.nextn.clone_from(sums);
        }
        Ok(())
    }
}
