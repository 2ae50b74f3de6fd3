//! `--nextn`: the model's nextn/MTP block, run as llama.cpp's MTP drafting runs it, over the
//! calibration text, teacher-forced. llama.cpp's forward pass never runs the block (it is a
//! draft head), so calibration has no statistics for it; this pass gives it its own.
//!
//! The pairing is upstream's (`common_speculative_impl_draft_mtp::process` at the pin): the
//! MTP context sees each token at its own position together with the trunk's final hidden
//! state (`h_nextn`, the output norm's result) of the token before it; the first token of a
//! sequence gets the drafter's initial state, zeros. So the block at position p reads t_p and
//! h_{p−1}, as when it drafts t_{p+1}. Every token of a chunk is fed, the MTP cache cleared
//! with the trunk's at each chunk. A model with several MTP blocks (Step-3.5-Flash's three)
//! has each batch fed to each block in turn, as `process` does where it chains heads: the
//! batch's positions dropped from the MTP cache, the graph switched to the next block
//! (`llama_set_nextn_layer_offset`), the same tokens and trunk states decoded again; each block
//! keeps its own layer of the cache. So every block reads t_p and h_{p−1} (the trunk's), not
//! the previous block's output: that is what the drafter's cache holds when it drafts, though
//! its draft steps feed head k the state head k−1 produced. A block without a router
//! (MiMo-V2's three are dense) gets imatrix entries and no REAP sums. None is an output (the drafter's
//! head is not computed) unless the block has its own LM head (`nextn.shared_head_head`, as GLM-4.5's files carry),
//! whose imatrix entry needs the head's input, or the arch's graph needs outputs (see
//! [`FFN_ON_OUTPUTS_ONLY`]).
//!
//! Its own observer collects the block's imatrix entries (upstream's collector, on the MTP
//! graph's matmuls: `blk.N.nextn.eh_proj`, attention, router, experts, shared expert, the
//! block's own head) and its
//! REAP sums (no trace rows; with `--domains`, split by domain as the trunk's are, each token
//! in its own domain). After each pass both are copied into the main observer, and the
//! entries into the imatrix of the checkpoints the trunk queued during the batch: `llama-quantize`
//! then finds entries for the block's tensors (a very-low-bit type refuses a tensor without
//! one), and the JSON lists the block in `"nextn_blocks"`. The trunk's entries are never
//! touched.

use super::observer::{BatchRows, CalibrationObserver, ReapState};
use crate::collect::reap::DomainSplit;
use crate::collect::imatrix::{Imatrix, ImatrixCollector, ImatrixConfig};
use crate::llama::{Batch, Context, ContextParams, Model};
use anyhow::{bail, Result};

pub struct NextnPass<'m> {
    ctx: Context<'m, CalibrationObserver>,
    batch: Batch,
    n_embd: usize,
    /// the nextn blocks, in the order of their offsets (one for most models)
    blocks: Vec<u32>,
    /// per block, `blk.N.`: the names of its imatrix entries begin so
    prefixes: Vec<String>,
    /// per block: it has a router (a dense block, as MiMo-V2's, gets imatrix entries alone)
    moe: Vec<bool>,
    /// per sequence: the trunk's hidden state of the last token fed so far
    pending: Vec<Vec<f32>>,
    /// every token an output: see [`FFN_ON_OUTPUTS_ONLY`] and [`NextnPass::new`]
    all_outputs: bool,
}

/// Architectures whose MTP graph at the pin keeps only the output rows before the block's FFN
/// (qwen3next's and nemotron_h_moe's `graph_mtp` take `ggml_get_rows(cur, inp_out_ids)` after
/// the attention, as drafting needs only the last token's). Fed with no outputs, as the others are, the block's
/// router and experts would see no token; so every token is an output there. That computes
/// the block's LM head for every token too (for Qwen3-Next-80B-A3B, n_embd 2048 and 151936
/// tokens: 311 M multiply-adds a token, about four times the block's own 73 M), which the
/// other archs' passes skip.
pub const FFN_ON_OUTPUTS_ONLY: &[&str] = &["qwen3next", "nemotron_h_moe"];

impl<'m> NextnPass<'m> {
    /// `main` is the trunk's observer: an `--in-file` merged into it may hold entries of the
    /// block already, which this pass goes on adding to (as the trunk's own go on).
    /// `own_head`: the block has its own `nextn.shared_head_head`. Every token is then an
    /// output, so the head multiplies every token's state and the imatrix gets its entry:
    /// `llama-quantize` exempts only `output.weight` (and the token embeddings) by name, and
    /// refuses this head in a very-low-bit type without one. The cost is that head for every
    /// token (n_embd × n_vocab multiply-adds); a block that reads the trunk's `output` keeps
    /// computing no head (its entry would mix with the trunk's, and upstream collects
    /// `output.weight` only with `--process-output`).
    pub fn new(model: &'m Model, trunk: &ContextParams, blocks: Vec<u32>, moe: Vec<bool>, own_head: bool, main: &CalibrationObserver) -> Result<Self> {
        let prefixes: Vec<String> = blocks.iter().map(|b| format!("blk.{b}.")).collect();
        let mut state = Imatrix::default();
        state.stats.extend(main.imatrix.state.stats.iter().filter(|(n, _)| prefixes.iter().any(|p| n.starts_with(p))).map(|(n, s)| (n.clone(), s.clone())));
        // upstream's accumulation; the checkpoints are the trunk's (this collector never saves)
        let cfg = ImatrixConfig { chunk_size: main.imatrix.cfg.chunk_size, out_freq: i32::MAX, save_freq: 0, process_output: false, small_by_rows: true };
        let reap = main.reap.as_ref().map(|_| ReapState::new(None));
        let mut obs = CalibrationObserver::new(ImatrixCollector::new(cfg, state), reap);
        // offloaded (-ngl with a GPU or --rpc), the patches' switches are process-wide, so the
        // MTP graph has the trunk's extra nodes: read it as the trunk's observer reads its graph
        obs.expert_stats_on_device = main.expert_stats_on_device;
        obs.defer = main.defer;
        obs.router_on_device = main.router_on_device;
        obs.router_candidates = main.router_candidates;
        if main.prefetch.is_some() {
            obs.prefetch = Some(crate::llama::prefetch::Prefetcher::new());
        }
        if main.reducer.is_some() {
            // --imatrix-on-device: the block's sums are copied after each of its passes
            obs.reducer = Some(crate::llama::reduce::DeviceReducer::default());
        }
        if let Some(p) = &main.imatrix.pool {
            obs.imatrix.pool = Some(crate::collect::pool::Pool::new(p.threads()));
        }
        let p = ContextParams { mtp: true, ..trunk.clone() };
        let ctx = Context::new(model, &p, obs).map_err(|e| anyhow::anyhow!("--nextn: the MTP context: {e:#}"))?;
        let batch = ctx.batch();
        // the trunk's final hidden state (DeepSeek-V4: its streams, n_embd × 4)
        let n_embd = model.n_embd_out() as usize;
        let all_outputs = own_head || model.meta_str("general.architecture").is_some_and(|a| FFN_ON_OUTPUTS_ONLY.contains(&a.as_str()));
        Ok(NextnPass { ctx, batch, n_embd, blocks, prefixes, moe, pending: vec![vec![0.0; n_embd]; trunk.n_seq_max.max(1) as usize], all_outputs })
    }

    /// A new batch of chunks: the MTP cache cleared, every sequence at the drafter's start.
    pub fn start_chunk(&mut self, chunk: i32) {
        self.ctx.clear_memory();
        for h in &mut self.pending {
            h.fill(0.0);
        }
        self.ctx.observer_mut().chunk = chunk;
    }

    /// Runs the block (each block) over one batch the trunk has just computed: `fed` holds its tokens,
    /// sequence after sequence, `len` per sequence from position `pos0`, and `hidden` the
    /// trunk's final hidden states of those tokens in the same order. Copies the block's
    /// imatrix entries and sums into `main`, and the entries into the imatrix of its queued
    /// checkpoints. A signal does not stop
    /// it: the MTP graph has no `inp_tokens` node, where the observer looks for one, so the
    /// trunk notices the signal at its next ubatch, and the block has every batch the trunk
    /// finished (a trunk stopped inside a batch of several ubatches keeps those, the block not).
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
                self.batch.add_with_state(fed[i], (pos0 + k) as i32, seq as i32, self.all_outputs, h);
            }
            let last = seq * len + len - 1;
            self.pending[seq].copy_from_slice(&hidden[last * e..(last + 1) * e]);
        }
        let chained = self.blocks.len() > 1;
        for head in 0..self.blocks.len() {
            if chained {
                // upstream's process(): the batch's positions out of the MTP cache (the freed
                // cells are reused, so each block's layer of them survives), the next block
                for seq in 0..n_seq {
                    if !self.ctx.seq_rm_from(seq as i32, pos0 as i32) {
                        bail!("--nextn: llama.cpp could not drop positions {pos0}.. of sequence {seq} from the MTP cache (chunk {})", main.chunk);
                    }
                }
                self.ctx.set_nextn_layer_offset(head as i32);
            }
            let done = self.decode_block(head, fed.len(), main);
            if chained {
                self.ctx.set_nextn_layer_offset(0);
            }
            done?;
        }
        let obs = self.ctx.observer();
        if let Some(other) = obs.imatrix.state.stats.keys().find(|n| !self.prefixes.iter().any(|p| n.starts_with(p))) {
            // never added to the trunk's entry of that name: the trunk's file stays upstream's
            bail!(
                "--nextn: the MTP graph multiplies by {other}, which is not a nextn block's ({}); its imatrix entry would mix with the trunk's",
                self.prefixes.iter().map(|p| format!("{p}*")).collect::<Vec<_>>().join(", ")
            );
        }
        let n_moe = self.moe.iter().filter(|&&m| m).count();
        let sums = match &obs.reap {
            Some(r) if r.sums.layers.len() != n_moe => bail!(
                "--nextn: the MTP graphs have {} MoE layers the collector recognised, but {n_moe} of the nextn blocks {:?} have a router (chunk {})",
                r.sums.layers.len(),
                self.blocks,
                main.chunk
            ),
            Some(r) => Some((&r.sums.layers, r.sums.domains.as_ref().map(|d| d.complete(&r.sums.layers)))),
            None => None,
        };
        let stats = &obs.imatrix.state.stats;
        for (name, s) in stats {
            main.imatrix.state.stats.entry(name.clone()).or_default().clone_from(s);
        }
        if let (Some(r), Some((sums, domains))) = (main.reap.as_mut(), sums) {
            r.nextn.clone_from(sums);
            r.nextn_domains = domains.unwrap_or_default();
        }
        // The trunk's checkpoints of this batch were taken inside its graph, before this pass
        // ran. Their imatrix gets the block's entries of the whole batch: upstream labels such a
        // file with the chunk the batch completes. Their JSON keeps the block as of the batch
        // before: it is a snapshot of the trunk's sums from before the ubatch that wrote it,
        // and the block must not count tokens the JSON does not.
        for c in &mut main.checkpoints {
            for (name, s) in stats {
                c.imatrix.state.stats.insert(name.clone(), s.clone());
            }
        }
        Ok(())
    }

    /// One block's decode of the batch built by [`NextnPass::run`]: the trunk's rows set up for
    /// its observer, and every token fed checked to reach the block's router.
    fn decode_block(&mut self, head: usize, n_fed: usize, main: &CalibrationObserver) -> Result<()> {
        // the trunk's rows of this batch, ubatch by ubatch (llama.cpp splits the same batch
        // alike; each ubatch's tokens are checked against the MTP graph's), with their domains
        if let (Some(r), Some(t)) = (self.ctx.observer_mut().reap.as_mut(), main.reap.as_ref()) {
            r.batch = BatchRows { current: None, ..t.batch.clone() };
            if let (None, Some(d)) = (&r.sums.domains, &t.sums.domains) {
                r.sums.domains = Some(DomainSplit::new(d.names.clone()));
            }
        }
        // every token fed must reach the block's router, or a dense block's down projection
        // (an MTP graph that keeps only some rows, as qwen3next's keeps its outputs, would
        // otherwise give the block no statistics; a graph that ran another block than this
        // offset's would give it none)
        let router = format!("{}{}.weight", self.prefixes[head], if self.moe[head] { "ffn_gate_inp" } else { "ffn_down" });
        let routed = |o: &CalibrationObserver| o.imatrix.state.stats.get(&router).map_or(0, |s| s.counts.iter().sum::<i64>());
        let before = routed(self.ctx.observer());
        let done = self.ctx.decode_or_stop(&mut self.batch);
        let obs = self.ctx.observer_mut();
        obs.finish_ubatch();
        if done.is_ok() {
            obs.flush_device_imatrix();
        }
        if let Some(f) = obs.failure.take() {
            bail!("--nextn: {f}");
        }
        if let Some(t) = obs.imatrix.error.take() {
            bail!("--nextn: the imatrix sums of {} are not finite (chunk {})", t.tensor, main.chunk);
        }
        if !done? {
            bail!("--nextn: the MTP graph was stopped (chunk {})", main.chunk);
        }
        let obs = self.ctx.observer();
        if obs.imatrix.state.stats.is_empty() {
            bail!("--nextn: the MTP graph has no matmul the imatrix collector recognised (chunk {})", main.chunk);
        }
        // the rows of the batch (trace checks, --domains) start at the graph's token lookup: a
        // graph whose lookup the observer does not know would leave them unchecked
        if obs.reap.as_ref().is_some_and(|r| r.batch.current.is_none()) {
            bail!("--nextn: no token lookup of the MTP graph was recognised (chunk {}): the block's rows could not be checked against the batch", main.chunk);
        }
        let got = routed(obs) - before;
        if got != n_fed as i64 {
            bail!("--nextn: the MTP graph's {router} saw {got} of the {n_fed} tokens fed (chunk {}): the block's statistics would leave tokens out", main.chunk);
        }
        Ok(())
    }
}
