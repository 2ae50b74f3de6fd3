//! REAP saliency, per MoE layer and expert, from four graph nodes of each layer:
//! - `ffn_moe_probs-L`: the router probabilities `[n_expert, T]` (before top-k normalisation);
//! - `ffn_moe_topk-L`: the selected expert ids, a strided view `[k, T]` of the argsort result
//!   (never MUL_MAT_ID's `src[2]`, which an expert cache or remapping rewrites);
//! - `ffn_moe_down-L` (or its `_scaled`/`_biased` successor): the experts' outputs `f`
//!   `[n_embd, k, T]` before weighting. Read in its own callback: by the time the weighting
//!   node runs, ggml's allocator has usually computed the product in place over `f`;
//! - `ffn_moe_weighted-L`: `src[1]` is the gate weights `g` `[1, k, T]` the model multiplies
//!   `f` by (after normalisation and scaling, without any selection bias).
//!
//! Per routed (token, expert), with g the applied gate and ‖f‖₂ computed in f64 over `f`'s
//! elements in order: `count += 1`, `prob_sum += g`, `reap_l2_sum += g·‖f‖`,
//! `reap_l2_sq_sum += (g·‖f‖)²`, `ean_sum += ‖f‖`, `max_l2 = max(‖f‖)`.
//!
//! The REAP reference's statistics (CerebrasResearch/reap, CONTRACT §6) come from the same
//! nodes, with no extra node read: p is the expert's entry of `ffn_moe_probs-L` (the router's
//! softmax over all experts, before any top-k normalisation or scaling; read through the
//! node's strides at `[expert, token]`, in f32, widened to f64):
//! `router_prob_sum += p`, `reap_softmax_l2_sum += p·‖f‖`, `reap_softmax_l2_sq_sum += (p·‖f‖)²`,
//! and `max_activation = max over routed tokens of the largest element of f` (an f32 value, so
//! exact; None until the expert is routed once). Where the graph applies p itself (qwen2moe:
//! `ffn_moe_weighted`'s `src[1]` is `ffn_moe_weights`, a GET_ROWS of the probs) g = p bit for
//! bit, and the softmax sums equal the applied-gate sums exactly.
//!
//! Sums are f64, accumulated token by token in graph order (tokens of the ubatch in order, the
//! k picks of a token in the model's top-k order), so a rerun gives identical bytes.
//! A (token, layer) whose gate, router probability or norm is not finite is left out of every
//! sum and counted.

use crate::formats::saliency::{DomainLayer, LayerSums, ReferenceSums};
use crate::llama::TensorInfo;

/// Routing of one layer for the ubatch in flight, kept for the trace.
#[derive(Clone, Debug, Default)]
pub struct LayerRouting {
    pub n_tokens: usize,
    /// `[T][k]` selected ids, model order
    pub sel_id: Vec<u16>,
    /// `[T][k]` gate weights g
    pub sel_weight: Vec<f32>,
    /// `[T][n_expert]` router probabilities
    pub probs: Vec<f32>,
    /// `[T][k]` ‖f‖₂ of each selected expert's output
    pub norms: Vec<f64>,
    /// `[T][k]` largest element of each selected expert's output
    pub maxes: Vec<f32>,
    /// the node the norms were read from (must be the weighting node's `src[0]`)
    pub norms_from: String,
    /// the probabilities were not read whole: `sel_prob` (and, with a trace, `cand_*`) came
    /// from the device (patch 0003)
    pub on_device: bool,
    /// `[T][k]` router probability of each selected expert (`on_device`)
    pub sel_prob: Vec<f32>,
    /// `[T][top_n + 1]` the most probable experts as ggml's top-k gave them (`ffn_moe_cand`,
    /// in no particular order), and their probabilities (`ffn_moe_cand_p`); ordered into the
    /// trace's candidates by [`LayerRouting::candidates`] (on the writer thread)
    pub raw_cand: Vec<u16>,
    pub raw_cand_p: Vec<f32>,
    /// the whole probability rows of the tokens whose candidates do not decide the top n, by
    /// token, ascending
    pub tie_rows: Vec<(usize, Vec<f32>)>,
}

impl LayerRouting {
    /// Empties every per-ubatch field, keeping the memory (a routing set is reused).
    pub fn clear(&mut self) {
        self.n_tokens = 0;
        self.on_device = false;
        self.sel_id.clear();
        self.sel_weight.clear();
        self.probs.clear();
        self.norms.clear();
        self.maxes.clear();
        self.norms_from.clear();
        self.sel_prob.clear();
        self.raw_cand.clear();
        self.raw_cand_p.clear();
        self.tie_rows.clear();
    }

    /// Token `tok`'s top `out_id.len()` experts, best first (ties to the lower id), and their
    /// probabilities: chosen from its probability row on the host path; ordered from ggml's
    /// top-(n+1) candidates on the device path, or from its whole row where they tie.
    pub fn candidates(&self, tok: usize, out_id: &mut [u16], out_p: &mut [f32], order: &mut Vec<u16>) -> Result<(), String> {
        let n = out_id.len();
        let from_row = |row: &[f32], out_id: &mut [u16], out_p: &mut [f32], order: &mut Vec<u16>| {
            crate::collect::trace_rows::top_candidates(row, n, order);
            for (j, &e) in order.iter().enumerate() {
                out_id[j] = e;
                out_p[j] = row[e as usize];
            }
        };
        if !self.on_device {
            let n_expert = self.probs.len() / self.n_tokens.max(1);
            from_row(&self.probs[tok * n_expert..(tok + 1) * n_expert], out_id, out_p, order);
            return Ok(());
        }
        if let Ok(i) = self.tie_rows.binary_search_by_key(&tok, |r| r.0) {
            from_row(&self.tie_rows[i].1, out_id, out_p, order);
            return Ok(());
        }
        let w = n + 1;
        if self.raw_cand.len() < (tok + 1) * w {
            return Err(format!("token {tok}: {} router candidates read for {} tokens, {w} per token expected", self.raw_cand.len(), self.n_tokens));
        }
        let (ids, p) = (&self.raw_cand[tok * w..(tok + 1) * w], &self.raw_cand_p[tok * w..(tok + 1) * w]);
        if !order_candidates(ids, p, out_id, out_p) {
            return Err(format!("token {tok}: its router candidates tie at the top-{n} boundary but its whole row was not read"));
        }
        Ok(())
    }
}

/// Whether ggml's top-(n+1) candidates (probabilities `p`, any order) decide a token's top n
/// as [`order_candidates`] would find: no probability is not a number, and the two smallest
/// (in `total_cmp` order: the n-th and (n+1)-th) differ as floats. O(n), for the callback.
pub fn candidates_decide(p: &[f32]) -> bool {
    let (mut lo, mut second) = (f32::NAN, f32::NAN);
    for (j, &v) in p.iter().enumerate() {
        if v.is_nan() {
            return false;
        }
        if j == 0 || v.total_cmp(&lo).is_lt() {
            second = lo;
            lo = v;
        } else if j == 1 || v.total_cmp(&second).is_lt() {
            second = v;
        }
    }
    p.len() >= 2 && lo != second
}

/// Orders a token's `n + 1` most probable experts, as ggml's top-k returned them (in no
/// particular order), into its top `n` as [`top_candidates`] would choose them from the whole
/// row: probability descending (`total_cmp`), ties to the lower id. Returns false when the
/// candidates cannot decide that: the n-th and (n+1)-th are equal (as floats: an equal value may
/// also sit outside the candidates, ggml's choice), or a probability is not a number (ggml's
/// comparisons skip it; the host's order does not).
///
/// [`top_candidates`]: crate::collect::trace_rows::top_candidates
pub fn order_candidates(ids: &[u16], p: &[f32], out_id: &mut [u16], out_p: &mut [f32]) -> bool {
    let n = out_id.len();
    debug_assert!(ids.len() == n + 1 && p.len() == n + 1 && out_p.len() == n);
    if p.iter().any(|v| v.is_nan()) {
        return false;
    }
    use crate::collect::trace_rows::{candidate_key, key_prob, with_keys};
    with_keys(|keys| {
        keys.clear();
        keys.extend(ids.iter().zip(p).map(|(&e, &v)| candidate_key(v, e)));
        keys.sort_unstable();
        if key_prob(keys[n - 1]) == key_prob(keys[n]) {
            return false;
        }
        for (j, &k) in keys[..n].iter().enumerate() {
            out_id[j] = k as u16;
            out_p[j] = key_prob(k);
        }
        true
    })
}

/// MoE layers are discovered from the graph (the first `ffn_moe_probs-L` of each block), so any
/// architecture that names its nodes as llama.cpp's `build_moe_ffn` does works unchanged.
#[derive(Default)]
pub struct ReapCollector {
    /// block index → position in `layers` (in discovery order, which is block order)
    slot_of_block: Vec<Option<usize>>,
    pub layers: Vec<LayerSums>,
    pub nonfinite_drops: u64,
    /// tokens that reached the first MoE layer (dropped ones included)
    pub tokens_seen: u64,
    /// routing of the current ubatch, per MoE layer slot
    pub routing: Vec<LayerRouting>,
    /// per-domain sums (`--domains`); None without
    pub domains: Option<DomainSplit>,
}

/// One MoE layer's part of the collector: all that a ubatch's reads of that layer change (the
/// run's token count and drops aside). Layers are independent, so their reads can be made on
/// different threads ([`ReapCollector::read_layers`]).
pub struct LayerPart<'a> {
    pub sums: &'a mut LayerSums,
    pub routing: &'a mut LayerRouting,
}

fn check_slot_stats(t: &TensorInfo, k: usize) -> Result<(), String> {
    if t.ne[0] != 1 || t.ne[1] as usize != k || t.ty != crate::llama::sys::GGML_TYPE_F32 {
        return Err(format!("{}: expected f32 [1, {k}, T], got type {} {:?}", t.name, t.ty, t.ne));
    }
    Ok(())
}

/// A `[1, k, T]` f32 node (any strides) into `out`, token by token, slot by slot.
fn read_slots(t: &TensorInfo, k: usize, data: &[u8], out: &mut Vec<f32>) -> Result<(), String> {
    check_slot_stats(t, k)?;
    out.clear();
    if let Some(all) = dense_slots(t, k) {
        out.extend_from_slice(f32s(data, 0, all));
        return Ok(());
    }
    for tok in 0..t.ne[2] {
        for s in 0..k as i64 {
            out.push(read_f32(data, t.offset([0, s, tok, 0])));
        }
    }
    Ok(())
}

/// The values of a `[1, k, T]` (or `[k, T]`) tensor when they lie densely in token-major order,
/// as the graph makes them: one copy instead of one strided read each.
fn dense_slots(t: &TensorInfo, k: usize) -> Option<usize> {
    let (es, n) = (t.nb[0], (k as i64 * t.ne[2].max(1) * t.ne[3].max(1)) as usize);
    let slots_dense = if t.ne[0] == 1 { t.nb[1] == es && t.nb[2] == es * k } else { t.nb[0] == 4 && t.nb[1] == 4 * k };
    (es == 4 && slots_dense && t.ne[3] == 1).then_some(if t.ne[0] == 1 { n } else { k * t.ne[1] as usize })
}

/// The MoE layer index from a node name such as `ffn_moe_topk-12`.
pub fn layer_of(name: &str, prefix: &str) -> Option<usize> {
    name.strip_prefix(prefix)?.strip_prefix('-')?.parse().ok()
}

impl ReapCollector {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn slot(&self, block: usize) -> Option<usize> {
        self.slot_of_block.get(block).copied().flatten()
    }

    /// The slot of `block`, created on first sight with its shape (`n_expert_used` 0: not
    /// known yet; the topk node sets it).
    pub fn slot_for(&mut self, block: usize, n_expert: usize, n_expert_used: usize) -> Result<usize, String> {
        if let Some(s) = self.slot(block) {
            let l = &self.layers[s];
            if l.n_expert != n_expert || (n_expert_used != 0 && l.n_expert_used != n_expert_used) {
                return Err(format!("layer {block} changed shape: {} experts top-{} became {n_expert} top-{n_expert_used}", l.n_expert, l.n_expert_used));
            }
            return Ok(s);
        }
        if n_expert > u16::MAX as usize + 1 {
            return Err(format!("layer {block}: {n_expert} experts is more than the trace's 16-bit ids can hold"));
        }
        if let Some(&last) = self.layers.last().map(|l| &l.layer) {
            if block as u32 <= last {
                return Err(format!("MoE layer {block} was seen after layer {last}: graph order is not block order"));
            }
        }
        if self.slot_of_block.len() <= block {
            self.slot_of_block.resize(block + 1, None);
        }
        self.slot_of_block[block] = Some(self.layers.len());
        self.layers.push(LayerSums::new(block as u32, n_expert, n_expert_used));
        self.routing.push(LayerRouting::default());
        Ok(self.layers.len() - 1)
    }

    /// `ffn_moe_probs-L`: `[n_expert, T]` f32; with `logits` (the node is the router's logits,
    /// see observer::probs_are_logits) each row is replaced by its softmax, in f64 from the
    /// largest logit, so p is the router's softmax probability over all experts as elsewhere.
    pub fn on_probs(&mut self, slot: usize, t: &TensorInfo, data: &[u8], logits: bool) -> Result<(), String> {
        let n_expert = self.layers[slot].n_expert;
        if t.ne[0] as usize != n_expert || t.ty != crate::llama::sys::GGML_TYPE_F32 {
            return Err(format!("{}: expected f32 [{n_expert}, T], got type {} {:?}", t.name, t.ty, t.ne));
        }
        let n_tokens = t.ne[1] as usize;
        let r = &mut self.routing[slot];
        r.n_tokens = n_tokens;
        r.on_device = false;
        r.probs.clear();
        for tok in 0..n_tokens {
            let row = t.offset([0, tok as i64, 0, 0]);
            if t.nb[0] == 4 {
                // a contiguous row: one copy (n_expert values per token and layer add up)
                r.probs.extend_from_slice(f32s(data, row, n_expert));
            } else {
                r.probs.extend((0..n_expert).map(|e| read_f32(data, row + e * t.nb[0])));
            }
        }
        if logits {
            for row in r.probs.chunks_exact_mut(n_expert) {
                softmax_in_place(row);
            }
        }
        Ok(())
    }

    /// `ffn_moe_probs-L` left on the device (patch 0003): only its shape is taken; the
    /// selected experts' probabilities and the trace's candidates are read from their nodes.
    pub fn on_probs_on_device(&mut self, slot: usize, t: &TensorInfo) -> Result<(), String> {
        let n_expert = self.layers[slot].n_expert;
        if t.ne[0] as usize != n_expert || t.ty != crate::llama::sys::GGML_TYPE_F32 {
            return Err(format!("{}: expected f32 [{n_expert}, T], got type {} {:?}", t.name, t.ty, t.ne));
        }
        let r = &mut self.routing[slot];
        r.n_tokens = t.ne[1] as usize;
        r.on_device = true;
        r.probs.clear();
        r.sel_prob.clear();
        r.raw_cand.clear();
        r.raw_cand_p.clear();
        r.tie_rows.clear();
        Ok(())
    }

    fn part(&mut self, slot: usize) -> LayerPart<'_> {
        LayerPart { sums: &mut self.layers[slot], routing: &mut self.routing[slot] }
    }

    /// Every layer's part, by slot. Not with `--domains` (their sums span the layers).
    fn parts(&mut self) -> Vec<LayerPart<'_>> {
        assert!(self.domains.is_none(), "per-domain sums are added layer after layer");
        self.layers.iter_mut().zip(self.routing.iter_mut()).map(|(sums, routing)| LayerPart { sums, routing }).collect()
    }

    // The reads of layer slot `slot`: [`LayerPart`]'s method of the same name.

    pub fn on_sel_probs(&mut self, slot: usize, t: &TensorInfo, data: &[u8]) -> Result<(), String> {
        self.part(slot).on_sel_probs(t, data)
    }

    pub fn on_cand_ids(&mut self, slot: usize, t: &TensorInfo, data: &[u8]) -> Result<(), String> {
        self.part(slot).on_cand_ids(t, data)
    }

    pub fn on_cand_probs(&mut self, slot: usize, t: &TensorInfo, data: &[u8]) -> Result<Vec<usize>, String> {
        self.part(slot).on_cand_probs(t, data)
    }

    /// A token's whole row of router probabilities, where its candidates do not decide (tokens
    /// in ascending order).
    pub fn on_cand_row(&mut self, slot: usize, tok: usize, row: &[f32]) {
        self.routing[slot].tie_rows.push((tok, row.to_vec()));
    }

    pub fn on_topk(&mut self, slot: usize, t: &TensorInfo, data: &[u8]) -> Result<(), String> {
        self.part(slot).on_topk(t, data)
    }

    pub fn on_expert_out(&mut self, slot: usize, f: &TensorInfo, f_data: &[u8]) -> Result<(), String> {
        self.part(slot).on_expert_out(f, f_data)
    }

    pub fn on_expert_norms(&mut self, slot: usize, t: &TensorInfo, data: &[u8], from: &str) -> Result<(), String> {
        self.part(slot).on_expert_norms(t, data, from)
    }

    pub fn on_expert_maxes(&mut self, slot: usize, t: &TensorInfo, data: &[u8]) -> Result<(), String> {
        self.part(slot).on_expert_maxes(t, data)
    }

    /// `ffn_moe_weighted-L`: `g` = its src1 `[1, k, T]` (any strides); `f_name` its src0.
    pub fn on_weighted(&mut self, slot: usize, f_name: &str, g: &TensorInfo, g_data: &[u8]) -> Result<(), String> {
        let mut part = LayerPart { sums: &mut self.layers[slot], routing: &mut self.routing[slot] };
        let n_tokens = part.check_weighted(f_name, g)?;
        if slot == 0 {
            self.tokens_seen += n_tokens as u64;
            if let Some(d) = self.domains.as_mut() {
                d.count_tokens(n_tokens)?;
            }
        }
        self.nonfinite_drops += part.add_weighted(g, g_data, self.domains.as_mut().map(|d| (d, slot)));
        Ok(())
    }
}

impl LayerPart<'_> {
    /// `ffn_moe_weights-L` (`on_device`): the probabilities at the selected experts, `[1, k, T]`
    /// (a GET_ROWS of the probabilities: the same f32 values the host path picks out).
    pub fn on_sel_probs(&mut self, t: &TensorInfo, data: &[u8]) -> Result<(), String> {
        read_slots(t, self.sums.n_expert_used, data, &mut self.routing.sel_prob)
    }

    /// `ffn_moe_cand-L` (`on_device`): `[top_n + 1, T]` i32 expert ids, in no particular order.
    pub fn on_cand_ids(&mut self, t: &TensorInfo, data: &[u8]) -> Result<(), String> {
        let n_expert = self.sums.n_expert;
        if t.ty != crate::llama::sys::GGML_TYPE_I32 || t.ne[0] < 2 {
            return Err(format!("{}: expected i32 [n, T] with n > 1, got type {} {:?}", t.name, t.ty, t.ne));
        }
        let r = &mut *self.routing;
        r.raw_cand.clear();
        let n = t.ne[0] as usize;
        for tok in 0..t.ne[1] {
            let start = r.raw_cand.len();
            if t.nb[0] == 4 {
                // a contiguous row: one pass the compiler vectorises, checked after
                let row = i32s(data, t.offset([0, tok, 0, 0]), n);
                r.raw_cand.extend(row.iter().map(|&id| id as u16));
                if let Some(&bad) = row.iter().find(|&&id| id < 0 || id as usize >= n_expert) {
                    return Err(format!("{}: expert id {bad} out of range 0..{n_expert}", t.name));
                }
            } else {
                for j in 0..n as i64 {
                    let id = t.read_i32(data, j, tok);
                    if id < 0 || id as usize >= n_expert {
                        return Err(format!("{}: expert id {id} out of range 0..{n_expert}", t.name));
                    }
                    r.raw_cand.push(id as u16);
                }
            }
            debug_assert_eq!(r.raw_cand.len() - start, n);
        }
        Ok(())
    }

    /// `ffn_moe_cand_p-L` (`on_device`): the probabilities at `ffn_moe_cand`'s ids, `[1, n, T]`.
    /// Returns the tokens whose candidates do not decide the top n - 1
    /// ([`candidates_decide`]): each needs [`Self::on_cand_row`] while the graph's probabilities
    /// are still there. The ordering itself is left to the trace's encoder.
    pub fn on_cand_probs(&mut self, t: &TensorInfo, data: &[u8]) -> Result<Vec<usize>, String> {
        let r = &mut *self.routing;
        let n = t.ne[1] as usize;
        let n_tokens = t.ne[2] as usize;
        if t.ne[0] != 1 || t.ty != crate::llama::sys::GGML_TYPE_F32 || n_tokens != r.n_tokens || r.raw_cand.len() != n * n_tokens {
            return Err(format!(
                "{}: expected f32 [1, n, {}] after {} candidate ids, got type {} {:?}",
                t.name,
                r.n_tokens,
                r.raw_cand.len(),
                t.ty,
                t.ne
            ));
        }
        r.raw_cand_p.clear();
        let mut undecided = Vec::new();
        for tok in 0..n_tokens {
            let start = r.raw_cand_p.len();
            if t.nb[1] == 4 {
                r.raw_cand_p.extend_from_slice(f32s(data, t.offset([0, 0, tok as i64, 0]), n));
            } else {
                r.raw_cand_p.extend((0..n).map(|j| read_f32(data, t.offset([0, j as i64, tok as i64, 0]))));
            }
            if !candidates_decide(&r.raw_cand_p[start..]) {
                undecided.push(tok);
            }
        }
        Ok(undecided)
    }

    /// `ffn_moe_topk-L`: `[k, T]` i32, read through its strides.
    pub fn on_topk(&mut self, t: &TensorInfo, data: &[u8]) -> Result<(), String> {
        if self.sums.n_expert_used == 0 {
            self.sums.n_expert_used = t.ne[0] as usize;
        }
        let (n_expert, k) = (self.sums.n_expert, self.sums.n_expert_used);
        if t.ne[0] as usize != k {
            return Err(format!("{}: expected {k} selected experts per token, got {:?}", t.name, t.ne));
        }
        let r = &mut *self.routing;
        r.sel_id.clear();
        if let Some(all) = dense_slots(t, k).filter(|_| t.ne[2] == 1) {
            // patch 0003's contiguous ids: one pass, checked after
            let ids = i32s(data, 0, all);
            r.sel_id.extend(ids.iter().map(|&id| id as u16));
            if let Some(&bad) = ids.iter().find(|&&id| id < 0 || id as usize >= n_expert) {
                return Err(format!("{}: expert id {bad} out of range 0..{n_expert}", t.name));
            }
            return Ok(());
        }
        for tok in 0..t.ne[1] {
            for s in 0..k as i64 {
                let id = t.read_i32(data, s, tok);
                if id < 0 || id as usize >= n_expert {
                    return Err(format!("{}: expert id {id} out of range 0..{n_expert}", t.name));
                }
                r.sel_id.push(id as u16);
            }
        }
        Ok(())
    }

    /// `ffn_moe_down-L` and successors: `f` `[n_embd, k, T]` (any strides): ‖f‖₂ per slot.
    pub fn on_expert_out(&mut self, f: &TensorInfo, f_data: &[u8]) -> Result<(), String> {
        let k = self.sums.n_expert_used;
        if f.ne[1] as usize != k || f.ty != crate::llama::sys::GGML_TYPE_F32 {
            return Err(format!("{}: expected f32 [n_embd, {k}, T], got type {} {:?}", f.name, f.ty, f.ne));
        }
        let (n_embd, n_tokens) = (f.ne[0] as usize, f.ne[2] as usize);
        let r = &mut *self.routing;
        r.norms.clear();
        r.maxes.clear();
        r.norms_from = f.name.to_string();
        // Σx² in f64, in element order (the same bytes on every run), and the largest x, in
        // one pass over the row
        let add = |(ss, mx): (f64, f32), x: f32| (ss + x as f64 * x as f64, mx.max(x));
        for tok in 0..n_tokens {
            for s in 0..k {
                let off = f.offset([0, s as i64, tok as i64, 0]);
                let start = (0.0f64, f32::NEG_INFINITY);
                let (ss, mx) = if f.nb[0] == 4 {
                    f32s(f_data, off, n_embd).iter().fold(start, |a, &x| add(a, x))
                } else {
                    (0..n_embd).map(|j| read_f32(f_data, off + j * f.nb[0])).fold(start, add)
                };
                r.norms.push(ss.sqrt());
                r.maxes.push(mx);
            }
        }
        Ok(())
    }

    /// `ffn_moe_down_norm-L` (patch 0001): ‖f‖₂ per slot, `[1, k, T]` f32, computed on the
    /// device from the outputs named `from` (f32 sums there, so equal to `on_expert_out`'s to
    /// float rounding).
    pub fn on_expert_norms(&mut self, t: &TensorInfo, data: &[u8], from: &str) -> Result<(), String> {
        let k = self.sums.n_expert_used;
        check_slot_stats(t, k)?;
        let r = &mut *self.routing;
        r.norms.clear();
        r.norms_from = from.to_string();
        if let Some(all) = dense_slots(t, k) {
            r.norms.extend(f32s(data, 0, all).iter().map(|&x| x as f64));
            return Ok(());
        }
        for tok in 0..t.ne[2] {
            for s in 0..k as i64 {
                r.norms.push(read_f32(data, t.offset([0, s, tok, 0])) as f64);
            }
        }
        Ok(())
    }

    /// `ffn_moe_down_max-L` (patch 0001): the largest element of each slot's output, `[1, k, T]`.
    pub fn on_expert_maxes(&mut self, t: &TensorInfo, data: &[u8]) -> Result<(), String> {
        read_slots(t, self.sums.n_expert_used, data, &mut self.routing.maxes)
    }

    /// `ffn_moe_weighted-L`, before [`Self::add_weighted`]: whether `g` (its src1) and the
    /// reads before it fit; the ubatch's tokens.
    pub fn check_weighted(&self, f_name: &str, g: &TensorInfo) -> Result<usize, String> {
        let k = self.sums.n_expert_used;
        let n_tokens = g.ne[2] as usize;
        let r = &*self.routing;
        if g.ne[0] != 1 || g.ne[1] as usize != k {
            return Err(format!("ffn_moe_weighted: unexpected gate shape {:?} (k = {k})", g.ne));
        }
        if r.norms_from != f_name || r.norms.len() != n_tokens * k || r.maxes.len() != n_tokens * k {
            return Err(format!(
                "ffn_moe_weighted of layer {} weights {f_name}, but the expert outputs read were {} ({} norms for {n_tokens} tokens)",
                self.sums.layer,
                r.norms_from,
                r.norms.len()
            ));
        }
        let probs_seen = if r.on_device { r.sel_prob.len() == n_tokens * k } else { r.probs.len() == n_tokens * self.sums.n_expert };
        if r.sel_id.len() != n_tokens * k || !probs_seen {
            return Err(format!(
                "ffn_moe_weighted of layer {}: routing of this ubatch was not seen first (topk {} ids, probs {} for {n_tokens} tokens)",
                self.sums.layer,
                r.sel_id.len(),
                if r.on_device { r.sel_prob.len() } else { r.probs.len() }
            ));
        }
        Ok(n_tokens)
    }

    /// `ffn_moe_weighted-L` (checked by [`Self::check_weighted`]): the gates `g` `[1, k, T]` (any
    /// strides) read and every routed token's sums added (to its domain's too, with `domains`:
    /// the split and this layer's slot). Returns the tokens left out as not finite.
    pub fn add_weighted(&mut self, g: &TensorInfo, g_data: &[u8], mut domains: Option<(&mut DomainSplit, usize)>) -> u64 {
        let k = self.sums.n_expert_used;
        let n_tokens = g.ne[2] as usize;
        let r = &mut *self.routing;
        r.sel_weight.clear();
        for tok in 0..n_tokens as i64 {
            for s in 0..k as i64 {
                r.sel_weight.push(read_f32(g_data, g.offset([0, s, tok, 0])));
            }
        }
        let sums = &mut *self.sums;
        let n_expert = sums.n_expert;
        // the router probability of each selected expert, [T][k]: read on the device, or
        // picked out of the whole rows (into `sel_prob`, unused on that path)
        if !r.on_device {
            r.sel_prob.clear();
            r.sel_prob.extend(r.sel_id.iter().enumerate().map(|(i, &e)| r.probs[(i / k) * n_expert + e as usize]));
        }
        let probs: &[f32] = &r.sel_prob;
        let mut reference = sums.reference.take().unwrap_or_else(|| ReferenceSums::new(n_expert));
        let shape = (sums.layer, n_expert);
        // the arrays as slices of one length, so that one check of an id covers every index
        let (count, prob_sum, reap_l2_sum) = (&mut sums.count[..n_expert], &mut sums.prob_sum[..n_expert], &mut sums.reap_l2_sum[..n_expert]);
        let (reap_l2_sq_sum, ean_sum) = (&mut sums.reap_l2_sq_sum[..n_expert], &mut sums.ean_sum[..n_expert]);
        let (router_prob_sum, max_l2) = (&mut sums.router_prob_sum[..n_expert], &mut sums.max_l2[..n_expert]);
        let (sm_l2, sm_l2_sq, max_activation) =
            (&mut reference.reap_softmax_l2_sum[..n_expert], &mut reference.reap_softmax_l2_sq_sum[..n_expert], &mut reference.max_activation[..n_expert]);
        let mut gates = vec![0f64; k];
        let mut drops = 0;
        for tok in 0..n_tokens {
            let at = tok * k..(tok + 1) * k;
            let (ids, g, p, norms, maxes) = (&r.sel_id[at.clone()], &r.sel_weight[at.clone()], &probs[at.clone()], &r.norms[at.clone()], &r.maxes[at]);
            let mut finite = true;
            for s in 0..k {
                gates[s] = g[s] as f64;
                finite &= gates[s].is_finite() && p[s].is_finite() && norms[s].is_finite();
            }
            if !finite {
                drops += 1;
                continue;
            }
            sums.tokens += 1;
            for s in 0..k {
                let e = ids[s] as usize;
                if e >= n_expert {
                    // ids were checked against n_expert when read
                    unreachable!("expert id {e} of {n_expert}");
                }
                let (gv, n, p) = (gates[s], norms[s], p[s] as f64);
                let reap = gv * n;
                count[e] += 1;
                prob_sum[e] += gv;
                reap_l2_sum[e] += reap;
                reap_l2_sq_sum[e] += reap * reap;
                ean_sum[e] += n;
                router_prob_sum[e] += p;
                if n > max_l2[e] {
                    max_l2[e] = n;
                }
                let reap_p = p * n;
                sm_l2[e] += reap_p;
                sm_l2_sq[e] += reap_p * reap_p;
                let m = maxes[s] as f64;
                if max_activation[e].map_or(true, |b| m > b) {
                    max_activation[e] = Some(m);
                }
            }
            if let Some((d, slot)) = domains.as_mut() {
                d.add(*slot, shape, tok, ids, &gates, norms);
            }
        }
        sums.reference = Some(reference);
        drops
    }
}

/// A node of one MoE layer that REAP reads, besides its probabilities: the
/// [`LayerPart`] method it goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerReadKind {
    SelProbs,
    CandIds,
    CandProbs,
    Topk,
    Norms,
    Maxes,
    ExpertOut,
    Weighted,
}

/// One read of a layer: the tensor (the gates for `Weighted`), its bytes, and the name it was
/// computed from (`Norms`: the expert outputs; `Weighted`: its src0, the outputs weighted).
pub struct LayerRead<'a> {
    pub kind: LayerReadKind,
    pub t: TensorInfo<'a>,
    pub data: std::borrow::Cow<'a, [u8]>,
    pub from: &'a str,
}

/// What a layer's reads left for the run, on the thread that made them.
#[derive(Default)]
struct LayerOutcome {
    error: Option<String>,
    /// the tokens whose candidates did not decide the trace's top n
    undecided: Vec<usize>,
    /// the tokens weighted, and those of them left out as not finite
    weighted_tokens: Option<usize>,
    drops: u64,
}

impl LayerOutcome {
    /// Makes `reads` in order on `part`, up to the first error.
    fn of(part: &mut LayerPart<'_>, reads: &[LayerRead<'_>]) -> LayerOutcome {
        let mut out = LayerOutcome::default();
        for rd in reads {
            let (t, data) = (&rd.t, &rd.data[..]);
            let result = match rd.kind {
                LayerReadKind::SelProbs => part.on_sel_probs(t, data),
                LayerReadKind::CandIds => part.on_cand_ids(t, data),
                LayerReadKind::CandProbs => part.on_cand_probs(t, data).map(|u| out.undecided = u),
                LayerReadKind::Topk => part.on_topk(t, data),
                LayerReadKind::Norms => part.on_expert_norms(t, data, rd.from),
                LayerReadKind::Maxes => part.on_expert_maxes(t, data),
                LayerReadKind::ExpertOut => part.on_expert_out(t, data),
                LayerReadKind::Weighted => part.check_weighted(rd.from, t).map(|n| {
                    out.weighted_tokens = Some(n);
                    out.drops += part.add_weighted(t, data, None);
                }),
            };
            if let Err(e) = result {
                out.error = Some(e);
                break;
            }
        }
        out
    }
}

impl ReapCollector {
    /// Makes each layer's `reads` (by slot, each in graph order) on `pool`'s threads, one layer
    /// to a part: the layers touch nothing of each other, so the sums are the bytes of the same
    /// reads made one after the other. Returns the tokens whose candidates did not decide, by
    /// slot (for [`Self::on_cand_row`]), or the first layer's error. Not with `--domains`.
    pub fn read_layers(&mut self, reads: Vec<Vec<LayerRead<'_>>>, pool: &crate::collect::pool::Pool) -> Result<Vec<(usize, Vec<usize>)>, String> {
        let jobs: Vec<_> = self
            .parts()
            .into_iter()
            .zip(reads)
            .enumerate()
            .filter(|(_, (_, reads))| !reads.is_empty())
            .map(|(slot, (part, reads))| std::sync::Mutex::new((slot, part, reads, LayerOutcome::default())))
            .collect();
        pool.run(jobs.len(), &|j| {
            let mut job = jobs[j].lock().unwrap_or_else(|e| e.into_inner());
            let (_, part, reads, out) = &mut *job;
            *out = LayerOutcome::of(part, reads);
        });
        let (mut first_error, mut first_layer_tokens, mut drops, mut undecided) = (None, None, 0, Vec::new());
        for job in jobs {
            let (slot, _, _, out) = job.into_inner().unwrap_or_else(|e| e.into_inner());
            first_error = first_error.or(out.error);
            if slot == 0 {
                first_layer_tokens = out.weighted_tokens;
            }
            drops += out.drops;
            if !out.undecided.is_empty() {
                undecided.push((slot, out.undecided));
            }
        }
        self.tokens_seen += first_layer_tokens.unwrap_or(0) as u64;
        self.nonfinite_drops += drops;
        first_error.map_or(Ok(undecided), Err)
    }
}

// ---------------------------------------------------------------------------------------------
// Per-domain sums (`--domains`, docs/corpus.md). Each token of a ubatch carries the domain of the
// corpus byte its token starts at; the token's contributions to `count`, `prob_sum` and
// `reap_l2_sum` go to that domain's arrays too, in the same order and with the same values as to
// the whole-run arrays, so per layer Σ_domains count = count exactly and the float sums agree up
// to the order of addition. Per-domain `tokens` counts tokens as `tokens_seen` does.

/// Per-domain sums of every MoE layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DomainSplit {
    pub names: Vec<String>,
    /// tokens per domain
    pub tokens: Vec<u64>,
    /// [domain][layer slot]
    pub layers: Vec<Vec<DomainLayer>>,
    /// the domain of each row of the ubatch in flight (set before the ubatch is computed)
    pub rows: Vec<u16>,
}

impl DomainSplit {
    pub fn new(names: Vec<String>) -> Self {
        let n = names.len();
        DomainSplit { names, tokens: vec![0; n], layers: vec![Vec::new(); n], rows: Vec::new() }
    }

    fn count_tokens(&mut self, n_tokens: usize) -> Result<(), String> {
        if self.rows.len() != n_tokens {
            return Err(format!("domains: the ubatch has {n_tokens} tokens but {} rows have a domain", self.rows.len()));
        }
        for &d in &self.rows {
            self.tokens[d as usize] += 1;
        }
        Ok(())
    }

    /// Adds token `tok`'s routed experts (`ids`, gates, norms) of layer `slot` (block `layer`,
    /// `n_expert` experts) to its domain.
    fn add(&mut self, slot: usize, (layer, n_expert): (u32, usize), tok: usize, ids: &[u16], gates: &[f64], norms: &[f64]) {
        let d = self.rows[tok] as usize;
        let layers = &mut self.layers[d];
        while layers.len() <= slot {
            layers.push(DomainLayer { layer: u32::MAX, ..Default::default() });
        }
        let l = &mut layers[slot];
        if l.count.is_empty() {
            *l = DomainLayer { layer, count: vec![0; n_expert], prob_sum: vec![0.0; n_expert], reap_l2_sum: vec![0.0; n_expert] };
        }
        for ((&e, &g), &n) in ids.iter().zip(gates).zip(norms) {
            let e = e as usize;
            l.count[e] += 1;
            l.prob_sum[e] += g;
            l.reap_l2_sum[e] += g * n;
        }
    }

    /// Every domain with every layer of `all` (zeros where a domain saw none of a layer).
    pub fn complete(&self, all: &[LayerSums]) -> Vec<Vec<DomainLayer>> {
        self.layers
            .iter()
            .map(|ls| {
                all.iter()
                    .enumerate()
                    .map(|(slot, a)| match ls.get(slot) {
                        Some(l) if !l.count.is_empty() => l.clone(),
                        _ => DomainLayer { layer: a.layer, count: vec![0; a.n_expert], prob_sum: vec![0.0; a.n_expert], reap_l2_sum: vec![0.0; a.n_expert] },
                    })
                    .collect()
            })
            .collect()
    }
}

/// `row` ← softmax(row): exp(x − max) / Σ, in f64. A non-finite logit makes its row NaN, which
/// the sums then leave out and count (as any non-finite probability).
fn softmax_in_place(row: &mut [f32]) {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let exps: Vec<f64> = row.iter().map(|&x| (x as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    for (p, e) in row.iter_mut().zip(&exps) {
        *p = if max.is_finite() { (e / sum) as f32 } else { f32::NAN };
    }
}

fn read_f32(data: &[u8], off: usize) -> f32 {
    f32::from_ne_bytes(data[off..off + 4].try_into().unwrap())
}

fn f32s(data: &[u8], off: usize, n: usize) -> &[f32] {
    crate::collect::imatrix::f32_row(data, off, n)
}

/// `n` contiguous i32 at byte `off` (graph tensors are aligned).
fn i32s(data: &[u8], off: usize, n: usize) -> &[i32] {
    let bytes = &data[off..off + 4 * n];
    assert!(bytes.as_ptr() as usize % 4 == 0, "unaligned i32 row");
    // SAFETY: bounds checked above, alignment asserted, any bit pattern is a valid i32.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<i32>(), n) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::sys;

    fn info<'a>(name: &'a str, ne: [i64; 4], nb: [usize; 4], ty: sys::ggml_type) -> TensorInfo<'a> {
        TensorInfo { name, op: 0, ty, ne, nb }
    }

    fn bytes_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    /// Two tokens, four experts, top-2; ids read from a strided view whose rows are 4 wide.
    /// Slot statistics and ids read in one copy where they lie densely, one by one through the
    /// strides otherwise: the same values in the same order.
    #[test]
    fn dense_and_strided_slots_read_alike() {
        let (k, t) = (3usize, 4usize);
        let vals: Vec<f32> = (0..k * t).map(|i| i as f32 * 0.5 - 1.0).collect();
        let dense = info("m", [1, k as i64, t as i64, 1], [4, 4, 4 * k, 4 * k * t], sys::GGML_TYPE_F32);
        assert_eq!(dense_slots(&dense, k), Some(k * t));
        // the same values with a gap of one float after each token's slots
        let mut gapped = Vec::new();
        for tok in 0..t {
            gapped.extend_from_slice(&vals[tok * k..(tok + 1) * k]);
            gapped.push(f32::NAN);
        }
        let strided = info("m", [1, k as i64, t as i64, 1], [4, 4, 4 * (k + 1), 4 * (k + 1) * t], sys::GGML_TYPE_F32);
        assert_eq!(dense_slots(&strided, k), None);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        read_slots(&dense, k, &bytes_f32(&vals), &mut a).unwrap();
        read_slots(&strided, k, &bytes_f32(&gapped), &mut b).unwrap();
        assert_eq!(a, vals);
        assert_eq!(b, vals);
        // ids [k, T]: dense, and as a view of wider rows (the argsort's)
        let ids: Vec<i32> = (0..(k * t) as i32).map(|i| i % 5).collect();
        let mut wide = Vec::new();
        for tok in 0..t {
            wide.extend_from_slice(&ids[tok * k..(tok + 1) * k]);
            wide.extend_from_slice(&[7, 7]);
        }
        let ib = |v: &[i32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        let mut c = ReapCollector::new();
        let s = c.slot_for(0, 8, k).unwrap();
        c.on_topk(s, &info("ffn_moe_topk-0", [k as i64, t as i64, 1, 1], [4, 4 * k, 4 * k * t, 4 * k * t], sys::GGML_TYPE_I32), &ib(&ids)).unwrap();
        let from_dense = c.routing[s].sel_id.clone();
        c.on_topk(s, &info("ffn_moe_topk-0", [k as i64, t as i64, 1, 1], [4, 4 * (k + 2), 4 * (k + 2) * t, 4 * (k + 2) * t], sys::GGML_TYPE_I32), &ib(&wide)).unwrap();
        assert_eq!(from_dense, c.routing[s].sel_id);
        assert_eq!(from_dense, ids.iter().map(|&i| i as u16).collect::<Vec<_>>());
        // an id out of range is refused on either path
        let mut bad = ids.clone();
        bad[5] = 8;
        assert!(c.on_topk(s, &info("ffn_moe_topk-0", [k as i64, t as i64, 1, 1], [4, 4 * k, 4 * k * t, 4 * k * t], sys::GGML_TYPE_I32), &ib(&bad)).is_err());
    }

    /// Logits (gpt-oss's SOFTMAX_WEIGHT gating) become the softmax over all experts: rows that
    /// differ by a constant (a router bias shifted) give the same p, within [0, 1], summing to 1.
    #[test]
    fn router_logits_are_turned_into_the_softmax_over_all_experts() {
        let logits = [2.0f32, -1.0, 0.5, 3.0];
        let shifted: Vec<f32> = logits.iter().map(|x| x - 20.0).collect();
        let mut c = ReapCollector::new();
        c.slot_for(0, 4, 2).unwrap();
        let p_info = info("ffn_moe_probs-0", [4, 2, 1, 1], [4, 16, 32, 32], sys::GGML_TYPE_F32);
        c.on_probs(0, &p_info, &bytes_f32(&[logits.as_slice(), &shifted].concat()), true).unwrap();
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        for (e, &x) in logits.iter().enumerate() {
            let want = ((x as f64).exp() / z) as f32;
            assert!((c.routing[0].probs[e] - want).abs() <= 1e-7, "expert {e}: {} vs {want}", c.routing[0].probs[e]);
            assert!((c.routing[0].probs[4 + e] - want).abs() <= 1e-7, "shifted row, expert {e}");
        }
        assert!((c.routing[0].probs[..4].iter().map(|&p| p as f64).sum::<f64>() - 1.0).abs() < 1e-6);
        // the graph's probabilities as they are: untouched
        c.on_probs(0, &p_info, &bytes_f32(&[0.1, 0.2, 0.3, 0.4, 0.5, 0.25, 0.15, 0.1]), false).unwrap();
        assert_eq!(c.routing[0].probs[..4], [0.1, 0.2, 0.3, 0.4]);
    }

    #[test]
    fn sums_match_a_hand_computation() {
        let mut c = ReapCollector::new();
        assert_eq!(c.slot_for(1, 4, 2), Ok(0));
        assert_eq!(c.slot(1), Some(0));
        let probs = [0.1f32, 0.2, 0.3, 0.4, 0.5, 0.25, 0.15, 0.1];
        c.on_probs(0, &info("ffn_moe_probs-1", [4, 2, 1, 1], [4, 16, 32, 32], sys::GGML_TYPE_F32), &bytes_f32(&probs), false).unwrap();
        // argsort storage [4, 2], topk view [2, 2] with nb1 = 16 bytes
        let ids: Vec<u8> = [3i32, 2, 1, 0, 0, 1, 2, 3].iter().flat_map(|x| x.to_ne_bytes()).collect();
        c.on_topk(0, &info("ffn_moe_topk-1", [2, 2, 1, 1], [4, 16, 32, 32], sys::GGML_TYPE_I32), &ids).unwrap();
        assert_eq!(c.routing[0].sel_id, [3, 2, 0, 1]);
        // f: [n_embd 2, k 2, T 2]
        let f = [3.0f32, 4.0, 0.0, 1.0, 6.0, 8.0, 1.0, 0.0];
        let g = [0.6f32, 0.4, 0.7, 0.3];
        let fi = info("f", [2, 2, 2, 1], [4, 8, 16, 32], sys::GGML_TYPE_F32);
        let gi = info("g", [1, 2, 2, 1], [4, 4, 8, 16], sys::GGML_TYPE_F32);
        c.on_expert_out(0, &fi, &bytes_f32(&f)).unwrap();
        c.on_weighted(0, "f", &gi, &bytes_f32(&g)).unwrap();
        let l = &c.layers[0];
        assert_eq!(l.count, [1, 1, 1, 1]);
        assert_eq!(l.tokens, 2);
        // token 0: expert 3 ‖(3,4)‖ = 5, g 0.6; expert 2 ‖(0,1)‖ = 1, g 0.4
        // token 1: expert 0 ‖(6,8)‖ = 10, g 0.7; expert 1 ‖(1,0)‖ = 1, g 0.3
        let g64 = |x: f32| x as f64;
        assert_eq!(l.reap_l2_sum, [g64(0.7) * 10.0, g64(0.3), g64(0.4), g64(0.6) * 5.0]);
        assert_eq!(l.ean_sum, [10.0, 1.0, 1.0, 5.0]);
        assert_eq!(l.prob_sum, [g64(0.7), g64(0.3), g64(0.4), g64(0.6)]);
        assert_eq!(l.router_prob_sum, [g64(0.5), g64(0.25), g64(0.3), g64(0.4)]);
        assert_eq!(l.max_l2, [10.0, 1.0, 1.0, 5.0]);
        assert_eq!(l.reap_l2_sq_sum[0], (g64(0.7) * 10.0).powi(2));
        // the reference's statistics weight by the router probability p instead of g
        let r = l.reference.as_ref().unwrap();
        assert_eq!(r.reap_softmax_l2_sum, [g64(0.5) * 10.0, g64(0.25), g64(0.3), g64(0.4) * 5.0]);
        assert_eq!(r.reap_softmax_l2_sq_sum, [(g64(0.5) * 10.0).powi(2), g64(0.25).powi(2), g64(0.3).powi(2), (g64(0.4) * 5.0).powi(2)]);
        // largest element of f: (6,8) → 8, (1,0) → 1, (0,1) → 1, (3,4) → 4
        assert_eq!(r.max_activation, [Some(8.0), Some(1.0), Some(1.0), Some(4.0)]);
    }

    /// The largest element is a value, not a magnitude: an all-negative output gives a negative
    /// maximum; read through a strided `f` (every other f32); an expert never routed has none.
    #[test]
    fn max_activation_is_the_largest_signed_element() {
        let mut c = ReapCollector::new();
        c.slot_for(0, 3, 2).unwrap();
        let probs = [0.5f32, 0.3, 0.2, 0.6, 0.3, 0.1];
        c.on_probs(0, &info("p", [3, 2, 1, 1], [4, 12, 24, 24], sys::GGML_TYPE_F32), &bytes_f32(&probs), false).unwrap();
        let ids: Vec<u8> = [0i32, 1, 1, 0].iter().flat_map(|x| x.to_ne_bytes()).collect();
        c.on_topk(0, &info("t", [2, 2, 1, 1], [4, 8, 16, 16], sys::GGML_TYPE_I32), &ids).unwrap();
        // f [n_embd 2, k 2, T 2] stored with nb0 = 8: the odd slots are filler
        let f = [-3.0f32, 99.0, -0.5, 99.0, 2.0, 99.0, -7.0, 99.0, -1.0, 99.0, -2.0, 99.0, 0.25, 99.0, -4.0, 99.0];
        let fi = info("f", [2, 2, 2, 1], [8, 16, 32, 64], sys::GGML_TYPE_F32);
        c.on_expert_out(0, &fi, &bytes_f32(&f)).unwrap();
        let g = [0.625f32, 0.375, 0.5, 0.5];
        c.on_weighted(0, "f", &info("g", [1, 2, 2, 1], [4, 4, 8, 16], sys::GGML_TYPE_F32), &bytes_f32(&g)).unwrap();
        let l = &c.layers[0];
        let r = l.reference.as_ref().unwrap();
        // expert 0: (-3,-0.5) then (0.25,-4) → max(-0.5, 0.25); expert 1: (2,-7) then (-1,-2) → 2
        assert_eq!(r.max_activation, [Some(0.25), Some(2.0), None]);
        let n = |a: f64, b: f64| (a * a + b * b).sqrt();
        assert_eq!(r.reap_softmax_l2_sum[0], 0.5 * n(-3.0, -0.5) + 0.6f32 as f64 * n(0.25, -4.0));
        assert_eq!(l.max_l2[1], n(2.0, -7.0));
        assert_eq!(r.reap_softmax_l2_sum[2], 0.0);
        // only an expert that never fires has no maximum; one whose outputs are all negative has
        // a negative one
        let mut c2 = ReapCollector::new();
        c2.slot_for(0, 2, 1).unwrap();
        c2.on_probs(0, &info("p", [2, 1, 1, 1], [4, 8, 8, 8], sys::GGML_TYPE_F32), &bytes_f32(&[0.9, 0.1]), false).unwrap();
        c2.on_topk(0, &info("t", [1, 1, 1, 1], [4, 4, 4, 4], sys::GGML_TYPE_I32), &0i32.to_ne_bytes()).unwrap();
        c2.on_expert_out(0, &info("f", [2, 1, 1, 1], [4, 8, 8, 8], sys::GGML_TYPE_F32), &bytes_f32(&[-2.0, -0.75])).unwrap();
        c2.on_weighted(0, "f", &info("g", [1, 1, 1, 1], [4, 4, 4, 4], sys::GGML_TYPE_F32), &bytes_f32(&[1.0])).unwrap();
        assert_eq!(c2.layers[0].reference.as_ref().unwrap().max_activation, [Some(-0.75), None]);
    }

    #[test]
    fn a_non_finite_token_is_dropped_and_counted() {
        let mut c = ReapCollector::new();
        c.slot_for(0, 2, 1).unwrap();
        c.on_probs(0, &info("p", [2, 2, 1, 1], [4, 8, 16, 16], sys::GGML_TYPE_F32), &bytes_f32(&[0.5, 0.5, 0.5, 0.5]), false).unwrap();
        let ids: Vec<u8> = [0i32, 1].iter().flat_map(|x| x.to_ne_bytes()).collect();
        c.on_topk(0, &info("t", [1, 2, 1, 1], [4, 4, 8, 8], sys::GGML_TYPE_I32), &ids).unwrap();
        let f = [1.0f32, f32::NAN];
        c.on_expert_out(0, &info("f", [1, 1, 2, 1], [4, 4, 4, 8], sys::GGML_TYPE_F32), &bytes_f32(&f)).unwrap();
        c.on_weighted(0, "f", &info("g", [1, 1, 2, 1], [4, 4, 4, 8], sys::GGML_TYPE_F32), &bytes_f32(&[1.0, 1.0])).unwrap();
        assert_eq!(c.nonfinite_drops, 1);
        assert_eq!(c.layers[0].count, [1, 0]);
        assert_eq!(c.layers[0].tokens, 1);
        assert!(c.layers[0].reap_l2_sum.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn out_of_range_ids_are_refused() {
        let mut c = ReapCollector::new();
        c.slot_for(0, 2, 1).unwrap();
        let ids: Vec<u8> = [5i32].iter().flat_map(|x| x.to_ne_bytes()).collect();
        let e = c.on_topk(0, &info("ffn_moe_topk-0", [1, 1, 1, 1], [4, 4, 4, 4], sys::GGML_TYPE_I32), &ids).unwrap_err();
        assert!(e.contains("out of range"), "{e}");
    }

    #[test]
    fn layers_are_discovered_in_block_order_with_a_fixed_shape() {
        let mut c = ReapCollector::new();
        assert_eq!(c.slot_for(2, 8, 2), Ok(0));
        assert_eq!(c.slot_for(5, 8, 2), Ok(1));
        assert_eq!(c.slot_for(2, 8, 2), Ok(0));
        assert!(c.slot_for(2, 16, 2).unwrap_err().contains("changed shape"));
        assert!(c.slot_for(3, 8, 2).unwrap_err().contains("graph order"));
        assert_eq!(c.slot(4), None);
    }

    /// The same two tokens as `sums_match_a_hand_computation`, token 0 in domain 1 and token 1
    /// in domain 0: each domain holds exactly its token's part, and the parts add up.
    #[test]
    fn domain_sums_split_by_token() {
        let mut c = ReapCollector::new();
        c.domains = Some(DomainSplit::new(vec!["a".into(), "b".into()]));
        c.domains.as_mut().unwrap().rows = vec![1, 0];
        c.slot_for(0, 4, 2).unwrap();
        c.on_probs(0, &info("p", [4, 2, 1, 1], [4, 16, 32, 32], sys::GGML_TYPE_F32), &bytes_f32(&[0.1, 0.2, 0.3, 0.4, 0.5, 0.25, 0.15, 0.1]), false).unwrap();
        let ids: Vec<u8> = [3i32, 2, 1, 0, 0, 1, 2, 3].iter().flat_map(|x| x.to_ne_bytes()).collect();
        c.on_topk(0, &info("t", [2, 2, 1, 1], [4, 16, 32, 32], sys::GGML_TYPE_I32), &ids).unwrap();
        let f = [3.0f32, 4.0, 0.0, 1.0, 6.0, 8.0, 1.0, 0.0];
        c.on_expert_out(0, &info("f", [2, 2, 2, 1], [4, 8, 16, 32], sys::GGML_TYPE_F32), &bytes_f32(&f)).unwrap();
        c.on_weighted(0, "f", &info("g", [1, 2, 2, 1], [4, 4, 8, 16], sys::GGML_TYPE_F32), &bytes_f32(&[0.6, 0.4, 0.7, 0.3])).unwrap();
        let d = c.domains.as_ref().unwrap().complete(&c.layers);
        let g64 = |x: f32| x as f64;
        assert_eq!(c.domains.as_ref().unwrap().tokens, [1, 1]);
        // domain b: token 0 (experts 3 and 2); domain a: token 1 (experts 0 and 1)
        assert_eq!(d[1][0].count, [0, 0, 1, 1]);
        assert_eq!(d[1][0].reap_l2_sum, [0.0, 0.0, g64(0.4), g64(0.6) * 5.0]);
        assert_eq!(d[0][0].count, [1, 1, 0, 0]);
        assert_eq!(d[0][0].prob_sum, [g64(0.7), g64(0.3), 0.0, 0.0]);
        for e in 0..4 {
            assert_eq!(d[0][0].count[e] + d[1][0].count[e], c.layers[0].count[e]);
            assert_eq!(d[0][0].reap_l2_sum[e] + d[1][0].reap_l2_sum[e], c.layers[0].reap_l2_sum[e]);
        }
    }

    /// What ggml's top-k may return for `row`: the `n` largest values (IEEE order), any of
    /// equal values at the boundary, in any order (a random pick and a random shuffle).
    fn device_top_k(row: &[f32], n: usize, rng: &mut crate::fixture::rng::Rng) -> Vec<u16> {
        let mut idx: Vec<u16> = (0..row.len() as u16).collect();
        // random order first, then a stable sort by value: ties land in random order
        let perm = rng.permutation(idx.len());
        idx.sort_by_key(|&i| perm[i as usize]);
        idx.sort_by(|&a, &b| row[b as usize].partial_cmp(&row[a as usize]).unwrap());
        idx.truncate(n);
        let perm = rng.permutation(n);
        let mut out = idx.clone();
        for (j, &p) in perm.iter().enumerate() {
            out[j] = idx[p as usize];
        }
        out
    }

    /// Against the host's choice from the whole row, on rows with many equal values (a few
    /// levels, ±0, values far below the rest): where the candidates decide, they give exactly
    /// the host's top n; where they do not, the n-th and (n+1)-th are equal.
    #[test]
    fn ordered_candidates_equal_the_host_choice_or_say_they_cannot() {
        let mut rng = crate::fixture::rng::Rng::new(11);
        let (mut decided, mut undecided) = (0, 0);
        let mut host = Vec::new();
        for case in 0..4000 {
            let n_expert = 4 + rng.below(60) as usize;
            let levels = 1 + rng.below(if case % 2 == 0 { 4 } else { 1000 });
            let row: Vec<f32> = (0..n_expert)
                .map(|_| match rng.below(10) {
                    0 => 0.0,
                    1 => -0.0,
                    _ => rng.below(levels) as f32 / levels as f32,
                })
                .collect();
            let n = 1 + rng.below(n_expert as u64 - 2) as usize;
            let ids = device_top_k(&row, n + 1, &mut rng);
            let p: Vec<f32> = ids.iter().map(|&i| row[i as usize]).collect();
            let (mut out_id, mut out_p) = (vec![0u16; n], vec![0f32; n]);
            crate::collect::trace_rows::top_candidates(&row, n, &mut host);
            if order_candidates(&ids, &p, &mut out_id, &mut out_p) {
                decided += 1;
                assert_eq!(out_id, host, "row {row:?} n {n} candidates {ids:?}");
                let hp: Vec<f32> = host.iter().map(|&e| row[e as usize]).collect();
                assert_eq!(out_p.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), hp.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            } else {
                undecided += 1;
                let mut sorted = p.clone();
                sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
                assert_eq!(sorted[n - 1], sorted[n], "undecided without a boundary tie: {row:?} n {n}");
            }
        }
        // both paths were taken many times
        assert!(decided > 500 && undecided > 500, "decided {decided}, undecided {undecided}");
    }

    /// The callback's O(n) test agrees with the ordering's own verdict.
    #[test]
    fn candidates_decide_exactly_when_the_ordering_does() {
        let mut rng = crate::fixture::rng::Rng::new(5);
        let vals = [0.5f32, 0.25, 0.0, -0.0, 0.125, 1.0, f32::NAN, 0.375];
        for _ in 0..5000 {
            let n = 1 + rng.below(6) as usize;
            // a NaN in one row of four
            let span = if rng.below(4) == 0 { 8 } else { 6 };
            let p: Vec<f32> = (0..=n).map(|_| vals[rng.below(span) as usize]).collect();
            let ids: Vec<u16> = (0..=n as u16).collect();
            let (mut id, mut out) = (vec![0u16; n], vec![0f32; n]);
            assert_eq!(candidates_decide(&p), order_candidates(&ids, &p, &mut id, &mut out), "{p:?}");
        }
    }

    #[test]
    fn a_candidate_that_is_not_a_number_leaves_the_row_undecided() {
        let (mut id, mut p) = (vec![0u16; 2], vec![0f32; 2]);
        assert!(!order_candidates(&[0, 1, 2], &[0.5, f32::NAN, 0.25], &mut id, &mut p));
        assert!(order_candidates(&[2, 0, 1], &[0.25, 0.5, 0.125], &mut id, &mut p));
        assert_eq!((id, p), (vec![0, 2], vec![0.5, 0.25]));
    }

    /// The device path of one layer (probabilities left on the device, the selected experts'
    /// probabilities and top-(n+1) candidates read instead) gives the host path's sums and
    /// candidates, a tied row completed from its whole row.
    #[test]
    fn router_read_on_the_device_gives_the_host_paths_sums_and_candidates() {
        // 3 tokens, 6 experts, top-2; token 2 ties at the top-3 boundary (0.1 twice)
        let probs = [0.05f32, 0.4, 0.3, 0.12, 0.1, 0.03, 0.2, 0.2, 0.1, 0.3, 0.15, 0.05, 0.1, 0.35, 0.1, 0.1, 0.25, 0.1];
        let pi = info("ffn_moe_probs-0", [6, 3, 1, 1], [4, 24, 72, 72], sys::GGML_TYPE_F32);
        let ids: Vec<u8> = [1i32, 2, 0, 1, 1, 4].iter().flat_map(|x| x.to_ne_bytes()).collect();
        let ti = info("ffn_moe_topk-0", [2, 3, 1, 1], [4, 8, 24, 24], sys::GGML_TYPE_I32);
        let f: Vec<f32> = (0..12).map(|i| (i as f32 - 5.0) * 0.5).collect();
        let fi = info("f", [2, 2, 3, 1], [4, 8, 16, 48], sys::GGML_TYPE_F32);
        let g = [0.6f32, 0.4, 0.5, 0.5, 0.7, 0.3];
        let gi = info("g", [1, 2, 3, 1], [4, 4, 8, 24], sys::GGML_TYPE_F32);

        let mut host = ReapCollector::new();
        host.slot_for(0, 6, 0).unwrap();
        host.on_probs(0, &pi, &bytes_f32(&probs), false).unwrap();
        host.on_topk(0, &ti, &ids).unwrap();
        host.on_expert_out(0, &fi, &bytes_f32(&f)).unwrap();
        host.on_weighted(0, "f", &gi, &bytes_f32(&g)).unwrap();

        let mut dev = ReapCollector::new();
        dev.slot_for(0, 6, 0).unwrap();
        dev.on_probs_on_device(0, &pi).unwrap();
        // top-(3+1) per token, unordered, as ggml may return them (token 2 picked expert 5 of
        // the three 0.1s, so the top 3 is undecided)
        let cand = [3u16, 1, 4, 2, 4, 3, 0, 1, 5, 1, 4, 0];
        let cand_b: Vec<u8> = cand.iter().flat_map(|&x| (x as i32).to_ne_bytes()).collect();
        dev.on_cand_ids(0, &info("ffn_moe_cand-0", [4, 3, 1, 1], [4, 16, 48, 48], sys::GGML_TYPE_I32), &cand_b).unwrap();
        let cp: Vec<f32> = cand.iter().enumerate().map(|(j, &e)| probs[(j / 4) * 6 + e as usize]).collect();
        let undecided = dev.on_cand_probs(0, &info("ffn_moe_cand_p-0", [1, 4, 3, 1], [4, 4, 16, 48], sys::GGML_TYPE_F32), &bytes_f32(&cp)).unwrap();
        assert_eq!(undecided, [2]);
        dev.on_cand_row(0, 2, &probs[12..18]);
        dev.on_topk(0, &ti, &ids).unwrap();
        let sel: Vec<f32> = [1usize, 2, 0, 1, 1, 4].iter().enumerate().map(|(j, &e)| probs[(j / 2) * 6 + e]).collect();
        dev.on_sel_probs(0, &info("ffn_moe_weights-0", [1, 2, 3, 1], [4, 4, 8, 24], sys::GGML_TYPE_F32), &bytes_f32(&sel)).unwrap();
        dev.on_expert_out(0, &fi, &bytes_f32(&f)).unwrap();
        dev.on_weighted(0, "f", &gi, &bytes_f32(&g)).unwrap();

        assert_eq!(dev.layers[0], host.layers[0]);
        let (mut order, mut id, mut p) = (Vec::new(), [0u16; 3], [0f32; 3]);
        for tok in 0..3 {
            crate::collect::trace_rows::top_candidates(&probs[tok * 6..(tok + 1) * 6], 3, &mut order);
            for r in [&dev.routing[0], &host.routing[0]] {
                r.candidates(tok, &mut id, &mut p, &mut Vec::new()).unwrap();
                assert_eq!(id[..], order[..], "token {tok}");
                let want: Vec<f32> = order.iter().map(|&e| probs[tok * 6 + e as usize]).collect();
                assert_eq!(p[..], want[..]);
            }
        }
        // token 2's top 3: 0.35 (expert 1), 0.25 (4), then the lowest id of the 0.1s (0)
        dev.routing[0].candidates(2, &mut id, &mut p, &mut order).unwrap();
        assert_eq!(id, [1, 4, 0]);
        // without its whole row, token 2's tie is an error, not a guess
        dev.routing[0].tie_rows.clear();
        let e = dev.routing[0].candidates(2, &mut id, &mut p, &mut order).unwrap_err();
        assert!(e.contains("tie"), "{e}");
    }

    /// One layer's device-path reads of `t` tokens (8 experts top-2, candidates top-3 + 1):
    /// probabilities from few values (ties), a token with a NaN gate in layer 2, and ids out
    /// of range where `bad_ids`.
    fn layer_reads(rng: &mut crate::fixture::rng::Rng, layer: usize, t: usize, bad_ids: bool) -> Vec<(LayerReadKind, Vec<u8>)> {
        let (e, k, n) = (8usize, 2usize, 4usize);
        let (mut topk, mut sel, mut g, mut norms, mut maxes, mut cand, mut cand_p) = Default::default();
        for tok in 0..t {
            let row: Vec<f32> = (0..e).map(|_| rng.below(5) as f32 / 8.0).collect();
            let mut order = Vec::new();
            crate::collect::trace_rows::top_candidates(&row, n, &mut order);
            for (s, &i) in order[..k].iter().enumerate() {
                Vec::<i32>::push(&mut topk, if bad_ids && tok == 1 { 99 } else { i as i32 });
                Vec::<f32>::push(&mut sel, row[i as usize]);
                Vec::<f32>::push(&mut g, if layer == 2 && tok == 3 && s == 1 { f32::NAN } else { 0.5 + rng.uniform() as f32 });
                Vec::<f32>::push(&mut norms, 1.0 + rng.uniform() as f32);
                Vec::<f32>::push(&mut maxes, rng.uniform() as f32);
            }
            for &i in order.iter().rev() {
                Vec::<i32>::push(&mut cand, i as i32);
                Vec::<f32>::push(&mut cand_p, row[i as usize]);
            }
        }
        let i = |v: &[i32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        use LayerReadKind::*;
        vec![(CandIds, i(&cand)), (CandProbs, bytes_f32(&cand_p)), (Topk, i(&topk)), (SelProbs, bytes_f32(&sel)), (Norms, bytes_f32(&norms)), (Maxes, bytes_f32(&maxes)), (Weighted, bytes_f32(&g))]
    }

    fn read_info(kind: LayerReadKind, t: usize) -> TensorInfo<'static> {
        let (k, n, ti) = (2i64, 4i64, t as i64);
        let slots = |name| info(name, [1, k, ti, 1], [4, 4, 8, 8 * t], sys::GGML_TYPE_F32);
        match kind {
            LayerReadKind::CandIds => info("ffn_moe_cand", [n, ti, 1, 1], [4, 16, 16 * t, 16 * t], sys::GGML_TYPE_I32),
            LayerReadKind::CandProbs => info("ffn_moe_cand_p", [1, n, ti, 1], [4, 4, 16, 16 * t], sys::GGML_TYPE_F32),
            LayerReadKind::Topk => info("ffn_moe_topk", [k, ti, 1, 1], [4, 8, 8 * t, 8 * t], sys::GGML_TYPE_I32),
            _ => slots("slots"),
        }
    }

    /// Each layer's reads made on a pool's threads (`read_layers`) give the sums, routing,
    /// token count and drops of the same reads made layer after layer, and the same undecided
    /// tokens; with two layers failing, the first layer's error.
    #[test]
    fn layers_read_on_a_pool_give_the_sums_of_reads_in_turn() {
        let (n_layers, t) = (5usize, 40usize);
        let pool = crate::collect::pool::Pool::new(3);
        for bad in [false, true] {
            let mut rng = crate::fixture::rng::Rng::new(5);
            let layers: Vec<_> = (0..n_layers).map(|l| layer_reads(&mut rng, l, t, bad && l == 3)).collect();
            let pi = info("ffn_moe_probs", [8, t as i64, 1, 1], [4, 32, 32 * t, 32 * t], sys::GGML_TYPE_F32);
            let (mut a, mut b) = (ReapCollector::new(), ReapCollector::new());
            for c in [&mut a, &mut b] {
                for l in 0..n_layers {
                    c.slot_for(l, 8, 0).unwrap();
                    c.on_probs_on_device(l, &pi).unwrap();
                }
            }
            // in turn, as the observer reads node by node
            let (mut undecided_a, mut error_a) = (Vec::new(), None);
            for (slot, reads) in layers.iter().enumerate() {
                for (kind, data) in reads {
                    let ti = read_info(*kind, t);
                    let from = if bad && slot == 1 { "elsewhere" } else { "f" };
                    let r = match kind {
                        LayerReadKind::CandIds => a.on_cand_ids(slot, &ti, data),
                        LayerReadKind::CandProbs => a.on_cand_probs(slot, &ti, data).map(|u| undecided_a.extend(u.iter().map(|&tok| (slot, tok)))),
                        LayerReadKind::Topk => a.on_topk(slot, &ti, data),
                        LayerReadKind::SelProbs => a.on_sel_probs(slot, &ti, data),
                        LayerReadKind::Norms => a.on_expert_norms(slot, &ti, data, "f"),
                        LayerReadKind::Maxes => a.on_expert_maxes(slot, &ti, data),
                        LayerReadKind::ExpertOut => a.on_expert_out(slot, &ti, data),
                        LayerReadKind::Weighted => a.on_weighted(slot, from, &ti, data),
                    };
                    if let Err(e) = r {
                        error_a = error_a.or(Some(e));
                        break;
                    }
                }
            }
            let reads: Vec<Vec<LayerRead>> = layers
                .iter()
                .enumerate()
                .map(|(slot, reads)| {
                    let from = |kind| if bad && slot == 1 && kind == LayerReadKind::Weighted { "elsewhere" } else { "f" };
                    reads.iter().map(|(kind, data)| LayerRead { kind: *kind, t: read_info(*kind, t), data: std::borrow::Cow::Borrowed(&data[..]), from: from(*kind) }).collect()
                })
                .collect();
            let got = b.read_layers(reads, &pool);
            if bad {
                let (want, got) = (error_a.unwrap(), got.unwrap_err());
                assert_eq!(got, want);
                assert!(got.contains("ffn_moe_weighted of layer 1"), "{got}");
                continue;
            }
            assert!(error_a.is_none());
            let undecided_b: Vec<(usize, usize)> = got.unwrap().into_iter().flat_map(|(s, toks)| toks.into_iter().map(move |tok| (s, tok))).collect();
            assert!(!undecided_a.is_empty(), "no ties: the test tests less");
            assert_eq!(undecided_b, undecided_a);
            assert_eq!(b.layers, a.layers);
            assert_eq!((b.tokens_seen, b.nonfinite_drops), (a.tokens_seen, a.nonfinite_drops));
            assert_eq!((a.tokens_seen, a.nonfinite_drops), (t as u64, 1));
            assert_eq!(format!("{:?}", b.routing), format!("{:?}", a.routing));
        }
    }

    #[test]
    fn layer_numbers_come_from_node_names() {
        assert_eq!(layer_of("ffn_moe_topk-12", "ffn_moe_topk"), Some(12));
        assert_eq!(layer_of("ffn_moe_topk_x-1", "ffn_moe_topk"), None);
        assert_eq!(layer_of("ffn_moe_weighted-3", "ffn_moe_weighted"), Some(3));
    }
}
