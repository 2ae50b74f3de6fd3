//! One forward pass over the evaluation tokens, batched exactly as upstream's
//! `llama-perplexity` batches them (`perplexity` and `kl_divergence` at the pin share the loop):
//! `n_seq = max(1, b / c)` chunks per batch in a KV cache of `n_seq · c`, `n_batch = min(b,
//! n_seq · c)`, the KV cache cleared per batch of chunks, BOS in place of each chunk's first
//! token when the vocab adds BOS, logits requested for positions `≥ c/2` only. Same batches,
//! same logits: the comparison with upstream is bit for bit, not approximate.

use crate::llama::eval_callback::NoObserver;
use crate::llama::Context;
use anyhow::{Context as _, Result};

/// How the tokens are cut and fed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// tokens per chunk (-c)
    pub n_ctx: usize,
    pub n_chunk: usize,
    /// sequences (chunks) per batch
    pub n_seq: usize,
    /// tokens per decode call
    pub n_batch: usize,
}

impl Layout {
    pub fn new(n_ctx: usize, batch: usize, n_chunk: usize) -> Layout {
        let n_seq = (batch / n_ctx).max(1);
        Layout { n_ctx, n_chunk, n_seq, n_batch: batch.min(n_seq * n_ctx) }
    }

    /// The KV cache size the context needs.
    pub fn n_kv(&self) -> usize {
        self.n_seq * self.n_ctx
    }

    /// The first scored position of a chunk.
    pub fn first(&self) -> usize {
        self.n_ctx / 2
    }
}

/// Runs every chunk of `tokens` (`n_chunk · n_ctx` of them) through `ctx`; for each chunk, in
/// order, calls `each(chunk, rows, targets)`: `rows` the logits of the scored positions
/// (`n_ctx − 1 − first` rows of n_vocab; position `first + i`), `targets[i]` the token that
/// follows row i.
pub fn run_chunks(
    ctx: &mut Context<'_, NoObserver>,
    layout: Layout,
    tokens: &[i32],
    mut each: impl FnMut(usize, &[f32], &[i32]) -> Result<()>,
) -> Result<()> {
    let vocab = ctx.model().vocab();
    let (add_bos, bos) = (vocab.add_bos(), vocab.bos());
    let n_vocab = vocab.n_tokens() as usize;
    let Layout { n_ctx, n_chunk, n_seq, n_batch } = layout;
    let first = layout.first();
    let num_batches = n_ctx.div_ceil(n_batch);
    let rows_per_seq = n_ctx - first;
    let mut batch = ctx.batch();
    let mut logits: Vec<f32> = Vec::new();
    // chunks of this model, on the progress line once the pass runs longer than about 2 s
    let bar = crate::progress::start(n_chunk as u64, crate::progress::Unit::Chunks { tokens: n_ctx as u64 });
    let mut i = 0;
    while i < n_chunk {
        let start = i * n_ctx;
        let n_seq_batch = n_seq.min(n_chunk - i);
        ctx.clear_memory();
        for j in 0..num_batches {
            let batch_start = start + j * n_batch;
            let batch_size = (start + n_ctx - batch_start).min(n_batch);
            batch.clear();
            let mut n_outputs = 0;
            for seq in 0..n_seq_batch {
                let seq_start = batch_start + seq * n_ctx;
                for k in 0..batch_size {
                    let pos = j * n_batch + k;
                    let tok = if add_bos && j == 0 && k == 0 { bos } else { tokens[seq_start + k] };
                    let out = pos >= first;
                    batch.add(tok, pos as i32, seq as i32, out);
                    n_outputs += out as usize;
                }
            }
            ctx.decode(&mut batch).with_context(|| format!("decoding chunk {}", i + 1))?;
            if num_batches > 1 && n_outputs > 0 {
                logits.extend_from_slice(ctx.logits(n_outputs));
            }
        }
        let all: &[f32] = if num_batches > 1 { &logits } else { ctx.logits(n_seq_batch * rows_per_seq) };
        for seq in 0..n_seq_batch {
            let rows = &all[seq * rows_per_seq * n_vocab..(seq * rows_per_seq + rows_per_seq - 1) * n_vocab];
            let targets = &tokens[start + seq * n_ctx + first + 1..start + (seq + 1) * n_ctx];
            each(i + seq, rows, targets)?;
        }
        logits.clear();
        i += n_seq;
        crate::progress::add(n_seq_batch as u64);
    }
    bar.finish();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_as_upstream_resolves_it() {
        // -c 128 -b 512: four chunks per batch, KV 512
        assert_eq!(Layout::new(128, 512, 10), Layout { n_ctx: 128, n_chunk: 10, n_seq: 4, n_batch: 512 });
        // -c 128 -b 64: one chunk in two batches
        assert_eq!(Layout::new(128, 64, 3), Layout { n_ctx: 128, n_chunk: 3, n_seq: 1, n_batch: 64 });
        // -c 128 -b 200: one chunk per batch, batch clamped to the KV size
        let l = Layout::new(128, 200, 3);
        assert_eq!((l.n_seq, l.n_batch, l.n_kv(), l.first()), (1, 128, 128, 64));
    }
}
