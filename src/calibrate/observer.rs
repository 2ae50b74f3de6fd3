//! The graph observer of a calibration run: decides which nodes to read and hands their data
//! to the collectors (imatrix always; REAP and the trace rows unless `--no-reap`).

use crate::collect::imatrix::{self, ImatrixCollector, SaveRequest};
use crate::collect::reap::{layer_of, LayerRead, LayerReadKind, ReapCollector};
use crate::collect::trace_rows::TraceRows;
use crate::llama::{sys, GraphObserver, Node};

/// A checkpoint taken inside the graph, at the moment upstream would write one.
pub struct Checkpoint {
    pub imatrix: SaveRequest,
    /// REAP sums at the same moment (only for the rolling checkpoint, not `.at_N` copies)
    pub reap: Option<crate::formats::saliency::Saliency>,
}

/// What REAP collection knows about the batch in flight.
#[derive(Clone, Default)]
pub struct BatchRows {
    /// per ubatch, per row: (chunk, pos, token id)
    pub ubatches: Vec<Vec<(u32, u32, i32)>>,
    /// per ubatch, per row: the row's domain (`--domains`; empty without)
    pub domains: Vec<Vec<u16>>,
    /// index of the ubatch being computed (None before the ubatch's first node)
    pub current: Option<usize>,
}

pub struct ReapState {
    pub sums: ReapCollector,
    pub trace: Option<TraceRows>,
    pub batch: BatchRows,
    /// the node the gate weights come from (`ffn_moe_weights_norm-0`, …), for the metadata
    pub weights_node: Option<String>,
    /// the op that turns router logits into probabilities (SOFT_MAX, UNARY for sigmoid, …)
    pub gating_op: Option<String>,
    /// `ffn_moe_probs` are the router's logits, turned into the softmax on the host
    /// ([probs_are_logits])
    pub probs_from_logits: bool,
    /// rows handed to the trace writer so far
    pub rows_handed: u64,
    /// `--nextn`: the nextn blocks' sums, collected by the MTP context's own observer and
    /// copied here after each of its passes, so every snapshot of the file holds them
    pub nextn: Vec<crate::formats::saliency::LayerSums>,
    /// `--nextn` with `--domains`: per domain, the nextn blocks' part of the sums (copied with
    /// `nextn`); empty otherwise
    pub nextn_domains: Vec<Vec<crate::formats::saliency::DomainLayer>>,
}

pub struct CalibrationObserver {
    pub imatrix: ImatrixCollector,
    pub reap: Option<ReapState>,
    /// the chunk being computed (1-based), for error messages
    pub chunk: i32,
    /// the first failure; the graph is stopped when it is set
    pub failure: Option<String>,
    pub checkpoints: Vec<Checkpoint>,
    /// stop the graph after the final norm: the output projection's result is not needed
    pub stop_before_logits: bool,
    /// set when the graph was stopped that way
    pub stopped_before_logits: bool,
    /// time spent inside `observe` (the graph waits for it)
    pub busy: std::time::Duration,
    /// a signal asked the run to stop, and the graph was stopped at the start of a ubatch
    pub interrupted: bool,
    /// tokens of the ubatches started so far (all of them complete when the run is interrupted)
    pub tokens_begun: u64,
    /// graphs carry the device-side expert statistics (patch 0001, `llama::expert_stats`):
    /// a layer whose expert outputs are off-host is read through them
    pub expert_stats_on_device: bool,
    /// `--imatrix-on-device`: inputs of off-host matmuls are reduced where they live
    pub reducer: Option<crate::llama::reduce::DeviceReducer>,
    /// read the matmul inputs for the imatrix (true for calibration; `trace-decode` wants
    /// routing only)
    pub collect_imatrix: bool,
    /// the matmul input collected by the last node observed, if that node read nothing else
    last_input: Option<LastInput>,
    /// matmuls collected from the previous one's input without a callback of their own
    pub shared_inputs: u64,
    /// patch 0002 keeps what we read to the end of the graph: wanted nodes are skipped as they
    /// pass (no graph split, no device wait) and read there, in the same order
    pub defer: bool,
    /// the nodes skipped so far in this graph
    deferred: Vec<*mut sys::ggml_tensor>,
    /// nodes read at the end of their graph
    pub deferred_reads: u64,
    /// patch 0003 (with `defer`): a layer whose router probabilities are off-host is read
    /// through the selected experts' probabilities and, with a trace, `router_candidates`
    /// candidates per token computed there, instead of the whole `[n_expert, T]` probabilities
    pub router_on_device: bool,
    /// the candidates per token the graphs were built with (the trace's top-n + 1; 0: none)
    pub router_candidates: usize,
    /// per MoE layer slot, this ubatch's probabilities node (left on the device, kept): the
    /// rows the candidates do not decide are read from it
    probs_nodes: Vec<*mut sys::ggml_tensor>,
    /// router probability rows read whole because the candidates did not decide them
    pub candidate_rows_read: u64,
    /// with `defer`: the end-of-graph reads copied all at once, one wait per device
    /// (`REAP_PREFETCH=0`: one copy and wait per tensor)
    pub prefetch: Option<crate::llama::prefetch::Prefetcher>,
    /// with `reducer` and `defer`: where every imatrix input of a graph's end is reduced on its
    /// device, the reductions run there while the host copies and sums REAP's reads
    /// (`REAP_OVERLAP=0`: one after the other)
    pub overlap: bool,
    /// graph ends read that way
    pub overlapped_reads: u64,
    /// with `overlap`, where the exact imatrix's pool is there and no `--domains`: REAP's reads
    /// of a graph's end made layer by layer on the pool's threads (`REAP_PARALLEL_LAYERS=0`:
    /// on the callback's thread); graph ends read so
    pub reap_by_layer: bool,
    pub reap_by_layer_reads: u64,
    /// `--imatrix-on-device`: times the device sums were added into the imatrix, and the time
    pub drains: u64,
    pub drain_busy: std::time::Duration,
    /// `--imatrix-on-device` collected some weight on the host (a layer left there): its
    /// counts run the checkpoint rule mid-graph, so the device sums are added every chunk
    pub imatrix_on_host: bool,
    /// `--nextn`: read the final hidden states (`result_norm`, llama.cpp's `h_nextn`) into
    /// `hidden`, row after row over the ubatches of a batch: the MTP pass's input
    pub capture_hidden: bool,
    pub hidden: Vec<f32>,
    /// the node `capture_hidden` reads: `result_norm`, DeepSeek-V4's `l_last-{n_layer − 1}`
    pub hidden_node: String,
    scratch_a: Vec<u8>,
    scratch_b: Vec<u8>,
}

/// A matmul input the imatrix just collected. q, k and v read one tensor, and so do the
/// experts' gate and up (with one routing): the later ones are collected when ggml asks
/// whether we want them, from this input (in place on the host, else the copy still in the
/// scratch buffers, or on the device as an alias of this weight's sums), so they cost no
/// graph split, synchronisation or copy. The same rows in the same order: the same bytes.
struct LastInput {
    weight: String,
    op: sys::ggml_op,
    input: *mut sys::ggml_tensor,
    ids: Option<*mut sys::ggml_tensor>,
    /// matrices in the weight (ne2, ne3): the input rows map to them by these
    mats: [i64; 2],
    /// collected through `--imatrix-on-device`'s reducer (else bytes in `scratch_a/b` or in place)
    reduced: bool,
}

const PROBS: &str = "ffn_moe_probs";
/// the router probabilities at the selected experts (upstream's GET_ROWS; kept by patch 0003)
const SEL_PROBS: &str = "ffn_moe_weights";
/// patch 0003's router candidates: top-k ids of the probabilities, and their probabilities
const CAND: &str = "ffn_moe_cand";
const CAND_P: &str = "ffn_moe_cand_p";
const TOPK: &str = "ffn_moe_topk";
const WEIGHTED: &str = "ffn_moe_weighted";
/// the final norm: after it only the output projection (the logits) remains
const RESULT_NORM: &str = "result_norm";
/// the logits, the graph's last node: where deferred reads are made
const RESULT_OUTPUT: &str = "result_output";
/// patch 0001's per-slot statistics of the experts' outputs, computed on the device
const EXPERT_NORM: &str = "ffn_moe_down_norm";
const EXPERT_MAX: &str = "ffn_moe_down_max";
/// the experts' outputs, under whichever name the graph gave them last
const EXPERT_OUT: [&str; 3] = ["ffn_moe_down", "ffn_moe_down_scaled", "ffn_moe_down_biased"];

fn expert_out_layer(name: &str) -> Option<usize> {
    EXPERT_OUT.iter().find_map(|p| layer_of(name, p))
}

/// The expert outputs a patch-0001 statistics node was computed from (a few `src[0]` steps up).
fn stats_source(node: Node<'_>) -> Option<Node<'_>> {
    let mut n = node.src(0)?;
    for _ in 0..3 {
        if expert_out_layer(n.name()).is_some() {
            return Some(n);
        }
        n = n.src(0)?;
    }
    expert_out_layer(n.name()).is_some().then_some(n)
}
/// Reads skipped in a graph that ended before they were made (it has no logits node).
fn leftover_reads(n: usize, chunk: i32) -> String {
    format!("{n} reads were left for the end of a graph that has no {RESULT_OUTPUT} node; run with REAP_DEFER=0 (chunk {chunk})")
}

/// The token-embedding lookup (`GET_ROWS` of `inp_tokens` from `token_embd`) opens every
/// ubatch's graph. Other lookups by token id come later in the graph and are not a new
/// ubatch: DeepSeek-V4's hash-routed blocks read each token's experts from
/// `blk.N.ffn_gate_tid2eid` by `inp_tokens` (taken for a new ubatch before, which failed the
/// run: the rows did not match).
fn is_ubatch_start(node: Node<'_>) -> bool {
    node.info().op == sys::GGML_OP_GET_ROWS && node.src(1).is_some_and(|s| s.name() == "inp_tokens") && node.src(0).is_some_and(|t| t.name() == TOKEN_EMBD)
}

/// The token embedding table (`LLM_TENSOR_TOKEN_EMBD`).
const TOKEN_EMBD: &str = "token_embd.weight";

/// The MTP graph's token-embedding lookup (a `GET_ROWS` of its unnamed token input, named
/// `mtp_tok_embd-N` by most graphs; bailingmoe3's leaves it unnamed, so it is known by the
/// table it reads: `token_embd` or the block's own `nextn.embed_tokens`): where the
/// `--nextn` pass's observer starts a ubatch's rows. Not a place to stop at a signal (the trunk
/// stops at its own next ubatch, whose lookup [is_ubatch_start] takes first).
fn is_mtp_ubatch_start(node: Node<'_>) -> bool {
    node.info().op == sys::GGML_OP_GET_ROWS
        && (node.name().starts_with("mtp_tok_embd")
            || node.src(0).is_some_and(|t| {
                let n = t.name();
                n == TOKEN_EMBD || (n.starts_with("blk.") && n.ends_with(".nextn.embed_tokens.weight"))
            }))
}

impl CalibrationObserver {
    pub fn new(imatrix: ImatrixCollector, reap: Option<ReapState>) -> Self {
        CalibrationObserver {
            imatrix,
            reap,
            chunk: 0,
            failure: None,
            checkpoints: Vec::new(),
            stop_before_logits: false,
            stopped_before_logits: false,
            busy: std::time::Duration::ZERO,
            interrupted: false,
            tokens_begun: 0,
            collect_imatrix: true,
            expert_stats_on_device: false,
            reducer: None,
            last_input: None,
            shared_inputs: 0,
            defer: false,
            deferred: Vec::new(),
            deferred_reads: 0,
            router_on_device: false,
            router_candidates: 0,
            probs_nodes: Vec::new(),
            candidate_rows_read: 0,
            prefetch: None,
            overlap: false,
            overlapped_reads: 0,
            reap_by_layer: false,
            reap_by_layer_reads: 0,
            drains: 0,
            drain_busy: std::time::Duration::ZERO,
            imatrix_on_host: false,
            capture_hidden: false,
            hidden: Vec::new(),
            hidden_node: RESULT_NORM.to_string(),
            scratch_a: Vec::new(),
            scratch_b: Vec::new(),
        }
    }

    /// A snapshot of the REAP sums in file form.
    pub fn saliency(&self) -> Option<crate::formats::saliency::Saliency> {
        let r = self.reap.as_ref()?;
        Some(crate::formats::saliency::Saliency {
            tokens: r.sums.tokens_seen,
            nonfinite_drops: r.sums.nonfinite_drops,
            // rows of the tokens these sums cover (rows run ahead of a checkpoint taken
            // mid-ubatch); a whole run's trace has them all
            trace_tokens_written: r.trace.as_ref().map_or(0, |t| t.rows.min(r.sums.tokens_seen)),
            metadata: Default::default(),
            layers: r.sums.layers.iter().chain(&r.nextn).cloned().collect(),
            nextn_blocks: r.nextn.iter().map(|l| l.layer).collect(),
            coverage: None,
            domains: r.sums.domains.as_ref().map_or_else(Vec::new, |d| {
                // the nextn blocks saw the trunk's tokens: the trunk's count per domain
                let mut nextn = r.nextn_domains.iter();
                d.names
                    .iter()
                    .zip(&d.tokens)
                    .zip(d.complete(&r.sums.layers))
                    .map(|((name, &tokens), mut layers)| {
                        layers.extend(nextn.next().into_iter().flatten().cloned());
                        crate::formats::saliency::DomainSums { name: name.clone(), tokens, layers }
                    })
                    .collect()
            }),
        })
    }

    /// Moves the imatrix collector's save requests into checkpoints, with REAP state attached.
    fn take_saves(&mut self) {
        if self.imatrix.pending_saves.is_empty() {
            return;
        }
        let saves: Vec<SaveRequest> = self.imatrix.pending_saves.drain(..).collect();
        for s in saves {
            let reap = if s.at.is_none() { self.saliency() } else { None };
            self.checkpoints.push(Checkpoint { imatrix: s, reap });
        }
    }

    fn fail(&mut self, msg: String) -> bool {
        self.failure.get_or_insert(msg);
        false
    }

    /// Encodes the trace rows of the ubatch that just finished.
    pub fn finish_ubatch(&mut self) {
        if !self.deferred.is_empty() {
            // the graph ended without a result_output node, or was stopped early
            if self.failure.is_none() && !self.interrupted && !self.stopped_before_logits {
                self.fail(leftover_reads(self.deferred.len(), self.chunk));
            }
            self.deferred.clear();
        }
        let Some(r) = self.reap.as_mut() else { return };
        let (Some(t), Some(u)) = (r.trace.as_mut(), r.batch.current) else { return };
        if t.done() || r.sums.layers.is_empty() {
            return;
        }
        // --trace-top-n is at most n_expert
        t.top_n = t.top_n.min(r.sums.layers[0].n_expert);
        let Some(header) = r.trace_header() else { return };
        if let Err(e) = r.trace.as_ref().unwrap().check_routing(&r.sums.routing) {
            let msg = format!("{e} (chunk {})", self.chunk);
            self.fail(msg);
            return;
        }
        let t = r.trace.as_mut().unwrap();
        // (a ubatch the plan does not have has already failed the run: check_ubatch_tokens)
        let Some(sources) = r.batch.ubatches.get(u) else { return };
        t.add_ubatch(&header.layout(), &mut r.sums.routing, sources);
    }

    fn observe_reap(&mut self, node: Node<'_>) -> bool {
        let name = node.name();
        let Some(r) = self.reap.as_mut() else { return true };
        let result = if is_ubatch_start(node) || is_mtp_ubatch_start(node) {
            // a new ubatch: the previous one is complete
            let next = r.batch.current.map_or(0, |c| c + 1);
            if r.batch.current.is_some() {
                self.finish_ubatch();
            }
            let r = self.reap.as_mut().unwrap();
            r.batch.current = Some(next);
            if let (Some(d), Some(rows)) = (r.sums.domains.as_mut(), r.batch.domains.get(next)) {
                d.rows.clone_from(rows);
            }
            check_ubatch_tokens(&r.batch, next, node, &mut self.scratch_a)
        } else if let Some(block) = layer_of(name, PROBS) {
            let t = node.info();
            if r.gating_op.is_none() {
                // SAFETY: ggml_op_name returns a static string for any op value.
                let op = unsafe { std::ffi::CStr::from_ptr(sys::ggml_op_name(t.op)) };
                r.gating_op = Some(op.to_string_lossy().into_owned());
            }
            let logits = probs_are_logits(t.op);
            r.probs_from_logits |= logits;
            // the softmax is taken here, on the host, over the whole rows
            let on_device = !logits && self.router_read_on_device(node, t.ne[0]);
            let r = self.reap.as_mut().unwrap();
            match r.sums.slot_for(block, t.ne[0] as usize, 0) {
                Err(e) => Err(e),
                Ok(s) if on_device => {
                    if self.probs_nodes.len() <= s {
                        self.probs_nodes.resize(s + 1, std::ptr::null_mut());
                    }
                    self.probs_nodes[s] = node.as_ptr();
                    r.sums.on_probs_on_device(s, &t)
                }
                Ok(s) => r.sums.on_probs(s, &t, node.bytes(&mut self.scratch_a), logits),
            }
        } else if let Some(block) = layer_of(name, SEL_PROBS) {
            let data = node.bytes(&mut self.scratch_a);
            routed_slot(&r.sums, name, block).and_then(|s| r.sums.on_sel_probs(s, &node.info(), data))
        } else if let Some(block) = layer_of(name, CAND) {
            let data = node.bytes(&mut self.scratch_a);
            routed_slot(&r.sums, name, block).and_then(|s| r.sums.on_cand_ids(s, &node.info(), data))
        } else if let Some(block) = layer_of(name, CAND_P) {
            let data = node.bytes(&mut self.scratch_a);
            match routed_slot(&r.sums, name, block).and_then(|s| Ok((s, r.sums.on_cand_probs(s, &node.info(), data)?))) {
                Ok((s, undecided)) => self.read_candidate_rows(s, &undecided),
                Err(e) => Err(e),
            }
        } else if let Some(block) = layer_of(name, TOPK) {
            let t = node.info();
            let data = node.bytes(&mut self.scratch_a);
            match r.sums.slot(block) {
                None => Err(format!("{name} came before ffn_moe_probs-{block}")),
                Some(s) => r.sums.on_topk(s, &t, data),
            }
        } else if let Some(block) = layer_of(name, EXPERT_NORM) {
            let t = node.info();
            let Some(f) = stats_source(node) else { return self.fail(format!("{name}: not computed from an expert output")) };
            let data = node.bytes(&mut self.scratch_a);
            match r.sums.slot(block) {
                None => Err(format!("{name}: routing of layer {block} was not seen first")),
                Some(s) => r.sums.on_expert_norms(s, &t, data, imatrix::filter_tensor_name(f.name())),
            }
        } else if let Some(block) = layer_of(name, EXPERT_MAX) {
            let t = node.info();
            let data = node.bytes(&mut self.scratch_a);
            match r.sums.slot(block) {
                None => Err(format!("{name}: routing of layer {block} was not seen first")),
                Some(s) => r.sums.on_expert_maxes(s, &t, data),
            }
        } else if let Some(block) = expert_out_layer(name) {
            let t = node.info();
            let data = node.bytes(&mut self.scratch_a);
            match r.sums.slot(block) {
                None => Err(format!("{name}: routing of layer {block} was not seen first")),
                Some(s) => r.sums.on_expert_out(s, &t, data),
            }
        } else if let Some(block) = layer_of(name, WEIGHTED) {
            let (f, g) = match weighting_sources(r, node) {
                Ok(fg) => fg,
                Err(e) => return self.fail(e),
            };
            match r.sums.slot(block) {
                None => Err(format!("{name}: routing of layer {block} was not seen first")),
                Some(s) => {
                    let gd = g.bytes(&mut self.scratch_b);
                    // where the weighting runs on another backend than the experts (a layer
                    // split by -ngl), its src0 is the scheduler's copy, `BACKEND#name#N`
                    r.sums.on_weighted(s, imatrix::filter_tensor_name(f.name()), &g.info(), gd)
                }
            }
        } else {
            Ok(())
        };
        match result {
            Ok(()) => true,
            Err(e) => self.fail(format!("{e} (chunk {})", self.chunk)),
        }
    }
}

/// Undecided candidate rows of a layer read one copy each up to this many, else the whole
/// probabilities in one copy.
const ROWS_READ_ONE_BY_ONE: usize = 4;

impl CalibrationObserver {
    /// How the router was read, for the run's summary.
    pub fn router_summary(&self) -> String {
        let trace = self.reap.as_ref().is_some_and(|r| r.trace.is_some());
        match (self.router_on_device, self.router_candidates) {
            (false, _) => "probabilities read whole".into(),
            (true, 0) if trace => "probabilities read whole (the trace's top-n is over half the experts)".into(),
            (true, 0) => "selected probabilities read on the device".into(),
            (true, n) => format!(
                "selected probabilities and {} candidates per token read on the device, {} rows read whole at ties",
                n - 1,
                self.candidate_rows_read
            ),
        }
    }

    /// Whether a layer's router is read through patch 0003's nodes: its probabilities
    /// (`probs`, `n_expert` wide) are off-host, and a trace, if any, gets its candidates there.
    fn router_read_on_device(&self, probs: Node<'_>, n_expert: i64) -> bool {
        if !self.router_on_device || probs.is_host() {
            return false;
        }
        let trace = self.reap.as_ref().is_some_and(|r| r.trace.is_some());
        !trace || (self.router_candidates > 0 && (self.router_candidates as i64) < n_expert)
    }

    /// The rows of `slot`'s probabilities whose candidates did not decide the trace's top n
    /// ([`crate::collect::reap::order_candidates`]): read from the probabilities node, kept to
    /// the end of the graph by patch 0002, and chosen from as on the host.
    fn read_candidate_rows(&mut self, slot: usize, tokens: &[usize]) -> Result<(), String> {
        if tokens.is_empty() {
            return Ok(());
        }
        // SAFETY: this ubatch's probabilities node (observed before its candidates, in this
        // graph), kept by patch 0002.
        let probs = self.probs_nodes.get(slot).and_then(|&p| unsafe { Node::from_raw(p) });
        let Some(probs) = probs.filter(|p| p.is_kept()) else {
            return Err(format!("router candidates of MoE layer slot {slot}: the probabilities are not kept to the end of the graph"));
        };
        let t = probs.info();
        if t.nb[0] != 4 {
            return Err(format!("{}: rows are not contiguous f32 (nb0 {})", t.name, t.nb[0]));
        }
        let n_expert = t.ne[0] as usize;
        let mut row = Vec::with_capacity(n_expert);
        let r = self.reap.as_mut().unwrap();
        let fill = |row: &mut Vec<f32>, bytes: &[u8]| {
            row.clear();
            row.extend(bytes.chunks_exact(4).map(|b| f32::from_ne_bytes(b.try_into().unwrap())));
        };
        // a copy costs a device round trip: a few rows one by one, more in one copy of all
        if tokens.len() >= ROWS_READ_ONE_BY_ONE {
            let all = probs.bytes(&mut self.scratch_b);
            for &tok in tokens {
                let off = t.offset([0, tok as i64, 0, 0]);
                fill(&mut row, &all[off..off + n_expert * 4]);
                r.sums.on_cand_row(slot, tok, &row);
            }
        } else {
            for &tok in tokens {
                fill(&mut row, probs.bytes_at(t.offset([0, tok as i64, 0, 0]), n_expert * 4, &mut self.scratch_b));
                r.sums.on_cand_row(slot, tok, &row);
            }
        }
        self.candidate_rows_read += tokens.len() as u64;
        Ok(())
    }
}

/// The slot of MoE layer `block`, whose routing must have been seen before `name`.
fn routed_slot(sums: &ReapCollector, name: &str, block: usize) -> Result<usize, String> {
    sums.slot(block).ok_or_else(|| format!("{name}: routing of layer {block} was not seen first"))
}

/// The graph's own input tokens for ubatch `u` must be the ones we expect in each row.
fn check_ubatch_tokens(batch: &BatchRows, u: usize, node: Node<'_>, scratch: &mut Vec<u8>) -> Result<(), String> {
    let Some(expected) = batch.ubatches.get(u) else {
        return Err(format!("llama.cpp computed more ubatches than expected ({})", batch.ubatches.len()));
    };
    let Some(ids) = node.src(1) else { return Ok(()) };
    let t = ids.info();
    if t.ty != sys::GGML_TYPE_I32 {
        return Ok(()); // embeddings input: nothing to check against
    }
    let data = ids.bytes(scratch);
    if t.ne[0] as usize != expected.len() {
        return Err(format!("ubatch {u} has {} tokens, expected {}: llama.cpp split the batch differently", t.ne[0], expected.len()));
    }
    for (r, &(_, pos, tok)) in expected.iter().enumerate() {
        let got = t.read_i32(data, r as i64, 0);
        if got != tok {
            return Err(format!("ubatch {u} row {r} (pos {pos}) holds token {got}, expected {tok}: llama.cpp split the batch differently"));
        }
    }
    Ok(())
}

impl ReapState {
    pub fn new(trace: Option<TraceRows>) -> Self {
        ReapState { sums: ReapCollector::new(), trace, batch: BatchRows::default(), weights_node: None, gating_op: None, probs_from_logits: false, rows_handed: 0, nextn: Vec::new(), nextn_domains: Vec::new() }
    }

    /// The trace header for what the graph has shown so far (0 rows, flags: normalised gating);
    /// None before the first MoE layer was seen or without a trace.
    pub fn trace_header(&self) -> Option<crate::formats::trace::TraceHeader> {
        let (t, first) = (self.trace.as_ref()?, self.sums.layers.first()?);
        let normalised = self.weights_node.as_deref().is_some_and(super::is_normalised_node);
        Some(crate::formats::trace::TraceHeader {
            layers: self.sums.layers.iter().map(|l| l.layer).collect(),
            n_expert: first.n_expert as u32,
            k: first.n_expert_used as u32,
            top_n: t.top_n.min(first.n_expert) as u32,
            n_tokens: 0,
            flags: if normalised { crate::formats::trace::FLAG_NORMALISED } else { 0 },
        })
    }
}

/// Whether `ffn_moe_probs` is the router's logits themselves (llama.cpp's SOFTMAX_WEIGHT
/// gating, gpt-oss: `probs = logits`, a MUL_MAT or, with the router's bias, an ADD; the gates
/// are a softmax over the selected experts only). REAP's p, the router's softmax over all
/// experts, is then taken from them on the host.
pub fn probs_are_logits(op: sys::ggml_op) -> bool {
    op == sys::GGML_OP_MUL_MAT || op == sys::GGML_OP_ADD
}

/// `ffn_moe_weighted-L`'s expert outputs and gates (src0, src1), where the architecture weights
/// the outputs; the gates' node is noted for the metadata.
fn weighting_sources<'a>(r: &mut ReapState, node: Node<'a>) -> Result<(Node<'a>, Node<'a>), String> {
    let name = node.name();
    let (Some(f), Some(g)) = (node.src(0), node.src(1)) else { return Err(format!("{name}: no sources")) };
    if f.info().op == sys::GGML_OP_REPEAT {
        return Err(format!(
            "{name}: this architecture weights the experts' inputs, not their outputs; REAP saliency is not defined for it here (run with --no-reap)"
        ));
    }
    if r.weights_node.is_none() {
        r.weights_node = Some(imatrix::filter_tensor_name(g.name()).to_string());
    }
    Ok((f, g))
}

/// The kind and MoE layer (block) of a node REAP reads at a graph's end, from its name (the
/// probabilities aside).
fn layer_read_kind(name: &str) -> Option<(LayerReadKind, usize)> {
    use LayerReadKind::*;
    let by_prefix = [(SEL_PROBS, SelProbs), (CAND, CandIds), (CAND_P, CandProbs), (TOPK, Topk), (EXPERT_NORM, Norms), (EXPERT_MAX, Maxes), (WEIGHTED, Weighted)];
    by_prefix.iter().find_map(|&(p, k)| Some((k, layer_of(name, p)?))).or_else(|| Some((ExpertOut, expert_out_layer(name)?)))
}

fn is_reap_node(node: Node<'_>) -> bool {
    let name = node.name();
    layer_of(name, PROBS).is_some()
        || layer_of(name, TOPK).is_some()
        || expert_out_layer(name).is_some()
        || layer_of(name, WEIGHTED).is_some()
        || is_ubatch_start(node)
        || is_mtp_ubatch_start(node)
}

impl GraphObserver for CalibrationObserver {
    fn wants(&mut self, node: Node<'_>) -> bool {
        if (self.stop_before_logits && node.name() == RESULT_NORM) || (self.capture_hidden && node.name() == self.hidden_node) {
            return true;
        }
        // where a signal can stop the run with every collector at a ubatch boundary
        if is_ubatch_start(node) {
            return true;
        }
        // (read at once, never deferred: its rows are the ubatch's)
        if self.reap.is_some() && is_mtp_ubatch_start(node) {
            return true;
        }
        if self.defer && node.name() == RESULT_OUTPUT {
            return true; // the deferred reads are made there
        }
        let want = self.wants_now(node);
        if want && self.defer && self.failure.is_none() && self.reads(node).iter().all(|t| t.is_kept()) {
            self.deferred.push(node.as_ptr());
            return false;
        }
        want
    }

    fn observe(&mut self, node: Node<'_>) -> bool {
        let t0 = std::time::Instant::now();
        let r = self.observe_timed(node);
        self.busy += t0.elapsed();
        r
    }
}

impl CalibrationObserver {
    /// The tensors whose data reading `node` takes: its input and expert ids (matmuls), the
    /// gate weights (`ffn_moe_weighted`), its own (REAP's small nodes; the expert outputs
    /// where REAP reads them).
    fn reads<'a>(&self, node: Node<'a>) -> Vec<Node<'a>> {
        let name = node.name();
        let op = node.info().op;
        let matmul = op == sys::GGML_OP_MUL_MAT || op == sys::GGML_OP_MUL_MAT_ID;
        let mut v = Vec::new();
        if matmul {
            v.extend(node.src(1));
            v.extend(node.src(2));
        }
        if layer_of(name, WEIGHTED).is_some() {
            v.extend(node.src(1));
        } else if layer_of(name, PROBS).is_some() && self.router_read_on_device(node, node.info().ne[0]) {
            // only its shape now; rows the candidates do not decide at the end (kept)
        } else if !matmul || (expert_out_layer(name).is_some() && self.reap.is_some() && self.reap_reads(node)) {
            v.push(node);
        }
        v
    }

    /// The tensors reading `node` copies to the host: [`Self::reads`] less the inputs of the
    /// matmuls whose imatrix rows are not collected on the host (reduced on their device by
    /// `--imatrix-on-device`, or not wanted).
    fn host_reads<'a>(&self, node: Node<'a>) -> Vec<Node<'a>> {
        let mut v = self.reads(node);
        let op = node.info().op;
        if op == sys::GGML_OP_MUL_MAT || op == sys::GGML_OP_MUL_MAT_ID {
            let on_host = self.collect_imatrix
                && self.reducer.is_none()
                && match (node.src(0), node.src(1)) {
                    (Some(w), Some(x)) => imatrix::wants(op, imatrix::filter_tensor_name(w.name()), &x.info(), &self.imatrix.cfg),
                    _ => false,
                };
            if !on_host {
                v.retain(|t| t.as_ptr() == node.as_ptr());
            }
        }
        v
    }

    /// Whether this node is read (collected now or, with `defer`, at the end of the graph).
    fn wants_now(&mut self, node: Node<'_>) -> bool {
        if self.reap.is_some() && self.reap_reads(node) {
            return true;
        }
        if !self.collect_imatrix || self.failure.is_some() {
            return false;
        }
        let (Some(src0), Some(src1)) = (node.src(0), node.src(1)) else { return false };
        let t = node.info();
        if !imatrix::wants(t.op, imatrix::filter_tensor_name(src0.name()), &src1.info(), &self.imatrix.cfg) {
            return false;
        }
        // (not while reads wait for the end of the graph: they would come after this one)
        if self.deferred.is_empty() && self.shares_last_input(node) {
            // collected now, from the input already read; a failure is reported by observing
            // the node, which stops the graph
            return !self.collect_shared(node);
        }
        true
    }

    /// Reads the nodes skipped as they passed, in graph order, as if each had been observed
    /// then (a matmul sharing the input of the one before collected from it, as at ask time).
    /// `--imatrix-on-device` reductions are queued meanwhile and computed as one graph per
    /// device before this returns (while the tensors they read are still the graph's).
    fn read_deferred(&mut self) -> bool {
        let nodes = std::mem::take(&mut self.deferred);
        if self.overlap_fits(&nodes) {
            return self.read_deferred_overlapped(nodes);
        }
        if !self.prefetch_reads(&nodes) {
            return false;
        }
        if let Some(r) = self.reducer.as_mut() {
            r.batching = true;
        }
        let mut ok = true;
        for p in nodes {
            // SAFETY: nodes of the graph being computed, their data kept by patch 0002.
            let Some(node) = (unsafe { Node::from_raw(p) }) else { continue };
            let shared = !(self.reap.is_some() && self.reap_reads(node)) && self.shares_last_input(node);
            ok = if shared { self.collect_shared(node) } else { self.observe_timed(node) };
            self.deferred_reads += 1;
            if !ok {
                break;
            }
        }
        if let Some(pf) = self.prefetch.as_mut() {
            pf.release();
        }
        let Some(r) = self.reducer.as_mut() else { return ok };
        r.batching = false;
        if !ok {
            r.discard();
            return false;
        }
        match r.commit() {
            Ok(()) => true,
            Err(e) => self.fail(format!("--imatrix-on-device: {e:#} (chunk {})", self.chunk)),
        }
    }
}

impl CalibrationObserver {
    /// With `prefetch`: every host copy the reads of `nodes` take, at once, one wait per device
    /// (released after the reads). False (with `failure` set) on error.
    fn prefetch_reads(&mut self, nodes: &[*mut sys::ggml_tensor]) -> bool {
        let Some(mut pf) = self.prefetch.take() else { return true };
        // SAFETY: nodes of the graph being computed, their data kept by patch 0002.
        let live = nodes.iter().filter_map(|&p| unsafe { Node::from_raw(p) });
        let tensors: Vec<*mut sys::ggml_tensor> = live.flat_map(|n| self.host_reads(n)).map(|t| t.as_ptr()).collect();
        // SAFETY: as above, read before the graph's memory is reused; the caller releases them.
        let fetched = unsafe { pf.fetch(&tensors) };
        self.prefetch = Some(pf);
        match fetched {
            Ok(()) => true,
            Err(e) => self.fail(format!("reading the end of the graph: {e:#} (chunk {}; REAP_PREFETCH=0 reads one tensor at a time)", self.chunk)),
        }
    }

    /// Whether the end of a graph can be read with the reductions running meanwhile: every
    /// matmul input the imatrix wants there is off-host (reduced on its device), so nothing of
    /// the imatrix is collected on the host, where a checkpoint taken mid-graph would carry
    /// REAP's sums up to that node.
    fn overlap_fits(&self, nodes: &[*mut sys::ggml_tensor]) -> bool {
        if !self.overlap || self.reducer.is_none() {
            return false;
        }
        nodes.iter().all(|&p| {
            // SAFETY: nodes of the graph being computed, their data kept by patch 0002.
            let Some(node) = (unsafe { Node::from_raw(p) }) else { return true };
            let op = node.info().op;
            if !self.collect_imatrix || (op != sys::GGML_OP_MUL_MAT && op != sys::GGML_OP_MUL_MAT_ID) {
                return true;
            }
            match (node.src(0), node.src(1)) {
                (Some(w), Some(x)) => !imatrix::wants(op, imatrix::filter_tensor_name(w.name()), &x.info(), &self.imatrix.cfg) || !x.is_host(),
                _ => true,
            }
        })
    }

    /// [`Self::read_deferred`] where [`Self::overlap_fits`]: the imatrix's part of every node
    /// first, in graph order (the same reductions, queued in the same order, with the same
    /// shared inputs), launched on the devices; then the copies REAP reads and REAP's part of
    /// each node in graph order, while they compute; then the wait. The collectors end in the
    /// state the node-by-node order gives: REAP and the reductions touch nothing of each other.
    fn read_deferred_overlapped(&mut self, nodes: Vec<*mut sys::ggml_tensor>) -> bool {
        self.overlapped_reads += 1;
        self.reducer.as_mut().unwrap().batching = true;
        let mut ok = true;
        let mut reap_nodes = Vec::new();
        for p in nodes {
            // SAFETY: nodes of the graph being computed, their data kept by patch 0002.
            let Some(node) = (unsafe { Node::from_raw(p) }) else { continue };
            let reap_reads = self.reap.is_some() && self.reap_reads(node);
            if reap_reads {
                reap_nodes.push(p);
            }
            ok = if !reap_reads && self.shares_last_input(node) { self.collect_shared(node) } else { self.observe_imatrix_part(node, reap_reads) };
            self.deferred_reads += 1;
            if !ok {
                break;
            }
        }
        let red = self.reducer.as_mut().unwrap();
        red.batching = false;
        if !ok {
            red.discard();
            return false;
        }
        if let Err(e) = red.launch() {
            red.discard();
            return self.fail(format!("--imatrix-on-device: {e:#} (chunk {})", self.chunk));
        }
        if !self.prefetch_reads(&reap_nodes) {
            self.reducer.as_mut().unwrap().wait();
            return false;
        }
        let by_layer = self.reap_by_layer
            && self.imatrix.pool.as_ref().is_some_and(|p| p.threads() > 1)
            && self.reap.as_ref().is_some_and(|r| r.sums.domains.is_none())
            && reap_nodes.iter().all(|&p| {
                // SAFETY: as above.
                unsafe { Node::from_raw(p) }.is_none_or(|n| layer_read_kind(n.name()).is_some() || layer_of(n.name(), PROBS).is_some())
            });
        if by_layer {
            ok = self.observe_reap_by_layer(&reap_nodes);
        } else {
            for p in reap_nodes {
                // SAFETY: as above.
                let Some(node) = (unsafe { Node::from_raw(p) }) else { continue };
                if !self.observe_reap(node) {
                    ok = false;
                    break;
                }
            }
        }
        if let Some(pf) = self.prefetch.as_mut() {
            pf.release();
        }
        // before the callback returns: the reductions read the graph's tensors
        self.reducer.as_mut().unwrap().wait();
        ok
    }

    /// REAP's part of [`Self::read_deferred_overlapped`] on the pool's threads, one MoE layer
    /// each: the layers' collectors touch nothing of each other, and each layer's reads are
    /// made in graph order, so the sums and rows are the bytes of [`Self::observe_reap`] node
    /// by node. On this thread first, in graph order: each layer's probabilities node (it makes
    /// the layer's slot), the checks that need the graph, and the bytes (staged copies are found
    /// on this thread); after: the rows the candidates did not decide, read from the device.
    /// Only which error is reported can differ from reads in turn: a graph check failing in a
    /// later layer is named before a bad value in an earlier one (the run stops either way).
    fn observe_reap_by_layer(&mut self, nodes: &[*mut sys::ggml_tensor]) -> bool {
        let mut reads: Vec<Vec<LayerRead<'_>>> = Vec::new();
        for &p in nodes {
            // SAFETY: nodes of the graph being computed, their data kept by patch 0002 and
            // staged until the caller releases the batch.
            let Some(node) = (unsafe { Node::from_raw(p) }) else { continue };
            let name = node.name();
            if layer_of(name, PROBS).is_some() {
                if !self.observe_reap(node) {
                    return false;
                }
                continue;
            }
            let Some((kind, block)) = layer_read_kind(name) else {
                // not reached: the caller reads a graph end with any other node in turn (the
                // ubatch's start, the other node REAP reads, is never left for the end)
                if !self.observe_reap(node) {
                    return false;
                }
                continue;
            };
            let r = self.reap.as_mut().unwrap();
            let Some(slot) = r.sums.slot(block) else {
                let e = if kind == LayerReadKind::Topk { format!("{name} came before ffn_moe_probs-{block}") } else { format!("{name}: routing of layer {block} was not seen first") };
                return self.fail(format!("{e} (chunk {})", self.chunk));
            };
            let (mut t, mut data_of, mut from) = (node, node, "");
            if kind == LayerReadKind::Norms {
                let Some(f) = stats_source(node) else { return self.fail(format!("{name}: not computed from an expert output")) };
                from = imatrix::filter_tensor_name(f.name());
            } else if kind == LayerReadKind::Weighted {
                let (f, g) = match weighting_sources(r, node) {
                    Ok(fg) => fg,
                    Err(e) => return self.fail(e),
                };
                (t, data_of, from) = (g, g, imatrix::filter_tensor_name(f.name()));
            }
            let data = match data_of.resident_bytes() {
                Some(b) => std::borrow::Cow::Borrowed(b),
                None => std::borrow::Cow::Owned(data_of.bytes(&mut self.scratch_a).to_vec()),
            };
            if reads.len() <= slot {
                reads.resize_with(slot + 1, Vec::new);
            }
            reads[slot].push(LayerRead { kind, t: t.info(), data, from });
        }
        let pool = self.imatrix.pool.as_ref().unwrap();
        let undecided = self.reap.as_mut().unwrap().sums.read_layers(reads, pool);
        self.reap_by_layer_reads += 1;
        let undecided = match undecided {
            Ok(u) => u,
            Err(e) => return self.fail(format!("{e} (chunk {})", self.chunk)),
        };
        for (slot, tokens) in undecided {
            if let Err(e) = self.read_candidate_rows(slot, &tokens) {
                return self.fail(format!("{e} (chunk {})", self.chunk));
            }
        }
        true
    }

    /// The imatrix's part of [`Self::observe_timed`] for a node read at the end of its graph
    /// (`reap_reads`: REAP reads it too, which ends any input sharing there).
    fn observe_imatrix_part(&mut self, node: Node<'_>, reap_reads: bool) -> bool {
        if self.failure.is_some() {
            return false;
        }
        self.last_input = None;
        let op = node.info().op;
        if self.collect_imatrix && (op == sys::GGML_OP_MUL_MAT || op == sys::GGML_OP_MUL_MAT_ID) && !self.observe_imatrix(node) {
            return false;
        }
        if reap_reads {
            self.last_input = None;
        }
        true
    }

    fn observe_timed(&mut self, node: Node<'_>) -> bool {
        if self.failure.is_some() {
            return false;
        }
        // whatever is observed now comes after the nodes skipped before it: read those first
        // (their data is kept), so the collectors see the graph's order
        if !self.deferred.is_empty() {
            if is_ubatch_start(node) || is_mtp_ubatch_start(node) {
                // skipped in the previous graph, whose memory this one reuses: never read them
                let n = self.deferred.len();
                self.deferred.clear();
                return self.fail(leftover_reads(n, self.chunk));
            }
            if !self.read_deferred() {
                return false;
            }
        }
        // anything observed may overwrite the scratch buffers, and a new ubatch reuses memory
        self.last_input = None;
        if is_ubatch_start(node) {
            if crate::interrupt::requested().is_some() {
                // before anything of this ubatch is collected: the previous ones are whole
                self.interrupted = true;
                return false;
            }
            self.tokens_begun += node.src(1).map_or(0, |s| s.info().ne[0].max(0) as u64);
        }
        if self.capture_hidden && node.name() == self.hidden_node {
            let t = node.info();
            if t.ty != sys::GGML_TYPE_F32 || t.nb[0] != 4 || t.nb[1] != 4 * t.ne[0] as usize || t.nb[2] != t.nb[1] * t.ne[1] as usize {
                return self.fail(format!("{} is not a contiguous f32 tensor of one row per token (chunk {})", self.hidden_node, self.chunk));
            }
            let data = node.bytes(&mut self.scratch_a);
            self.hidden.extend(data.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])));
        }
        if self.stop_before_logits && node.name() == RESULT_NORM {
            self.stopped_before_logits = true;
            return false;
        }
        let op = node.info().op;
        if self.collect_imatrix && (op == sys::GGML_OP_MUL_MAT || op == sys::GGML_OP_MUL_MAT_ID) {
            if !self.observe_imatrix(node) {
                return false;
            }
        }
        // ffn_moe_down is a MUL_MAT_ID: its input feeds the imatrix, its output REAP
        if self.reap.is_some() && self.reap_reads(node) {
            self.last_input = None;
            return self.observe_reap(node);
        }
        true
    }

    /// Whether `node` (a matmul the imatrix wants) reads exactly what the last observed node's
    /// imatrix collection read: the same input tensor, the same routing, the same matrix layout.
    fn shares_last_input(&self, node: Node<'_>) -> bool {
        let Some(l) = &self.last_input else { return false };
        let (Some(src0), Some(src1)) = (node.src(0), node.src(1)) else { return false };
        let w = src0.info();
        node.info().op == l.op
            && src1.as_ptr() == l.input
            && node.src(2).map(|n| n.as_ptr()) == l.ids
            && [w.ne[2], w.ne[3]] == l.mats
    }

    /// Collects a matmul whose input the last observed node read ([`LastInput`]). Returns
    /// false on failure (`failure` set).
    fn collect_shared(&mut self, node: Node<'_>) -> bool {
        let l = self.last_input.as_ref().unwrap();
        let (src0, src1) = (node.src(0).unwrap(), node.src(1).unwrap());
        let wname = imatrix::filter_tensor_name(src0.name()).to_string();
        let (s1, w) = (src1.info(), src0.info());
        let result = if l.reduced {
            let red = self.reducer.as_mut().unwrap();
            red.alias(&wname, &l.weight).map_err(|e| format!("{wname}: {e:#}"))
        } else {
            // in place on the host or staged, else the leader's copy, untouched since (nothing
            // observed)
            let data = src1.resident_bytes().unwrap_or_else(|| &self.scratch_a[..s1.nbytes()]);
            if node.info().op == sys::GGML_OP_MUL_MAT_ID {
                let ids = node.src(2).unwrap();
                let ids_data = ids.resident_bytes().unwrap_or_else(|| &self.scratch_b[..ids.info().nbytes()]);
                self.imatrix.collect_mul_mat_id(&wname, w.ne[2], &s1, data, &ids.info(), ids_data)
            } else {
                self.imatrix.collect_mul_mat(&wname, w.ne, &s1, data)
            }
        };
        self.shared_inputs += 1;
        self.after_collect(result)
    }

    /// Whether REAP reads this node. A layer's expert outputs are read in place on the host;
    /// off-host, with the device statistics in the graph, their `[1, k, T]` norm and max
    /// nodes are read instead of the whole `[n_embd, k, T]` outputs.
    fn reap_reads(&self, node: Node<'_>) -> bool {
        let name = node.name();
        if layer_of(name, EXPERT_NORM).is_some() || layer_of(name, EXPERT_MAX).is_some() {
            return self.expert_stats_on_device && stats_source(node).is_some_and(|f| !f.is_host());
        }
        if expert_out_layer(name).is_some() {
            return !(self.expert_stats_on_device && !node.is_host());
        }
        // patch 0003's nodes, read where the layer's router is: ffn_moe_cand from the
        // [n_expert, T] probabilities, the others from their [1, n_expert, T] view
        if layer_of(name, CAND).is_some() {
            return node.src(0).is_some_and(|p| self.router_read_on_device(p, p.info().ne[0]));
        }
        if layer_of(name, CAND_P).is_some() || layer_of(name, SEL_PROBS).is_some() {
            return node.src(0).is_some_and(|p| self.router_read_on_device(p, p.info().ne[1]));
        }
        is_reap_node(node)
    }
}

impl CalibrationObserver {
    fn observe_imatrix(&mut self, node: Node<'_>) -> bool {
        let op = node.info().op;
        let (Some(src0), Some(src1)) = (node.src(0), node.src(1)) else { return true };
        let wname = imatrix::filter_tensor_name(src0.name()).to_string();
        if !imatrix::wants(op, &wname, &src1.info(), &self.imatrix.cfg) {
            return true; // asked for REAP only
        }
        let s1 = src1.info();
        let w_ne = src0.info().ne;
        // a dense input the device reduction does not take (not f32; a matrix broadcast over
        // several planes) is collected on the host below, as in the exact mode
        let on_device = op == sys::GGML_OP_MUL_MAT_ID || (s1.ty == sys::GGML_TYPE_F32 && crate::llama::reduce::DeviceReducer::plane_per_matrix(w_ne, s1.ne));
        if let Some(red) = self.reducer.as_mut().filter(|_| !src1.is_host() && on_device) {
            // accumulated on the device; added to the imatrix per chunk (flush_device_imatrix)
            let result = if op == sys::GGML_OP_MUL_MAT_ID {
                let Some(ids) = node.src(2) else { return self.fail(format!("{wname}: MUL_MAT_ID without ids")) };
                red.by_expert(&wname, src1, ids, w_ne[2]).map_err(|e| format!("{wname}: {e:#}"))
            } else {
                red.dense(&wname, src1, w_ne[2] * w_ne[3]).map_err(|e| format!("{wname}: {e:#}"))
            };
            self.remember_input(node, wname, true);
            return self.after_collect(result);
        }
        if s1.nb[0] != 4 || s1.ty != sys::GGML_TYPE_F32 {
            return self.fail(format!("{wname}: input is not contiguous f32 (type {}, nb0 {})", s1.ty, s1.nb[0]));
        }
        self.imatrix_on_host |= self.reducer.is_some();
        let data = src1.bytes(&mut self.scratch_a);
        let result = if op == sys::GGML_OP_MUL_MAT_ID {
            let Some(ids) = node.src(2) else { return self.fail(format!("{wname}: MUL_MAT_ID without ids")) };
            let ids_data = ids.bytes(&mut self.scratch_b);
            self.imatrix.collect_mul_mat_id(&wname, src0.info().ne[2], &s1, data, &ids.info(), ids_data)
        } else {
            self.imatrix.collect_mul_mat(&wname, src0.info().ne, &s1, data)
        };
        self.remember_input(node, wname, false);
        self.after_collect(result)
    }

    fn remember_input(&mut self, node: Node<'_>, weight: String, reduced: bool) {
        let (Some(src0), Some(src1)) = (node.src(0), node.src(1)) else { return };
        let w = src0.info();
        self.last_input = Some(LastInput {
            weight,
            op: node.info().op,
            input: src1.as_ptr(),
            ids: node.src(2).map(|n| n.as_ptr()),
            mats: [w.ne[2], w.ne[3]],
            reduced,
        });
    }

    /// `--imatrix-on-device`: whether the device sums must enter the imatrix at the end of
    /// this chunk: where upstream's checkpoint rule fires once they do (read from the dense
    /// weights' rows, which the host knows), so a checkpoint holds what it would; always where
    /// a weight is collected on the host (its counts run the rule mid-graph) or no dense weight
    /// is pending (nothing to tell by).
    pub fn device_imatrix_due(&self) -> bool {
        let Some(red) = &self.reducer else { return false };
        if self.imatrix_on_host {
            return true;
        }
        let mut pending = false;
        for (name, rows) in red.pending_dense_rows() {
            pending = true;
            let count = self.imatrix.state.stats.get(name).and_then(|e| e.counts.first().copied()).unwrap_or(0) + rows;
            if self.imatrix.save_due(count) {
                return true;
            }
        }
        !pending
    }

    /// `--imatrix-on-device`: copies the device accumulators (the ubatches since the last
    /// flush) into the imatrix, then applies upstream's checkpoint rule to the whole update.
    /// Called at the end of a chunk where [`Self::device_imatrix_due`], at the end of the run,
    /// and before the outputs of an interrupted run are written. Returns false (with `failure`
    /// set) on error.
    pub fn flush_device_imatrix(&mut self) -> bool {
        let Some(red) = self.reducer.as_mut() else { return true };
        let t0 = std::time::Instant::now();
        let mut drained = false;
        let result = red.drain().map_err(|e| format!("--imatrix-on-device: {e:#}")).and_then(|chunk| {
            drained = !chunk.is_empty();
            self.imatrix.add_reduced(&chunk)
        });
        if drained {
            self.drains += 1;
            self.drain_busy += t0.elapsed();
        }
        self.after_collect(result)
    }

    fn after_collect(&mut self, result: Result<(), String>) -> bool {
        if let Err(e) = result {
            return self.fail(e);
        }
        if let Some(nf) = &self.imatrix.error {
            let msg = format!("non-finite values detected in {} (chunk {})", nf.tensor, self.chunk);
            return self.fail(msg);
        }
        self.take_saves();
        true
    }
}
