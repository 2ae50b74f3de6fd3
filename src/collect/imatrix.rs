//! The importance matrix, accumulated exactly as upstream's `llama-imatrix` does
//! (tools/imatrix/imatrix.cpp at the pin): per weight matrix, Σx² of every input column in
//! f32, in the same order, so the output file is byte-identical.
//!
//! The collector never writes: when upstream would save a checkpoint (inside the callback,
//! mid-graph), it takes a snapshot of exactly that state and queues it for the writer.


use crate::llama::sys;
use crate::llama::TensorInfo;

pub use crate::formats::imatrix::{Imatrix, Stats};

/// How the run was configured, as far as collection and checkpoints care.
#[derive(Clone, Debug)]
pub struct ImatrixConfig {
    /// tokens per chunk: n_ctx / n_parallel (upstream's `chunk_size`)
    pub chunk_size: i32,
    pub out_freq: i32,
    pub save_freq: i32,
    pub process_output: bool,
}

/// A checkpoint upstream would write at this moment: `at` is `Some(n)` for `.at_n` files.
#[derive(Clone, Debug)]
pub struct SaveRequest {
    pub at: Option<i32>,
    pub state: Imatrix,
}

/// A value that is not finite, found after accumulating into `tensor`.
#[derive(Clone, Debug)]
pub struct NonFinite {
    pub tensor: String,
}

pub struct ImatrixCollector {
    pub cfg: ImatrixConfig,
    pub state: Imatrix,
    pub pending_saves: Vec<SaveRequest>,
    pub error: Option<NonFinite>,
}

/// `CUDA0#blk.0.attn_k.weight#0` → `blk.0.attn_k.weight`, as upstream's `filter_tensor_name`.
pub fn filter_tensor_name(name: &str) -> &str {
    match name.split_once('#') {
        Some((_, rest)) => rest.split_once('#').map_or(rest, |(w, _)| w),
        None => name,
    }
}

/// Whether upstream asks for this node: every MUL_MAT_ID, and MUL_MAT on `blk.*` weights
/// (or `output.weight` with --process-output) with at least 16 rows of F32 input.
pub fn wants(op: sys::ggml_op, weight_name: &str, src1: &TensorInfo, process_output: bool) -> bool {
    if op == sys::GGML_OP_MUL_MAT_ID {
        return true;
    }
    if op != sys::GGML_OP_MUL_MAT {
        return false;
    }
    if src1.ne[1] < 16 || src1.ty != sys::GGML_TYPE_F32 {
        return false;
    }
    weight_name.starts_with("blk.") || (process_output && weight_name == "output.weight")
}

impl ImatrixCollector {
    pub fn new(cfg: ImatrixConfig, state: Imatrix) -> Self {
        ImatrixCollector { cfg, state, pending_saves: Vec::new(), error: None }
    }

    /// Accumulates one MUL_MAT_ID: `src1` `[cols, n_used or 1, tokens]`, `ids` `[n_used, tokens]`
    /// (read through its strides), `n_as` experts in the weight. Returns false on failure.
    pub fn collect_mul_mat_id(
        &mut self,
        wname: &str,
        n_as: i64,
        src1: &TensorInfo,
        data: &[u8],
        ids: &TensorInfo,
        ids_data: &[u8],
    ) -> Result<(), String> {
        let n_ids = ids.ne[0];
        if ids.ne[1] != src1.ne[2] {
            return Err(format!("{wname}: ids rows {} != input tokens {}", ids.ne[1], src1.ne[2]));
        }
        if src1.nrows() != src1.ne[1] * src1.ne[2] {
            return Err(format!("{wname}: tensor has more than 3 dimensions"));
        }
        let ne0 = src1.ne[0];
        let n_tokens = src1.ne[2];
        let e = self.state.stats.entry(wname.to_string()).or_default();
        if e.counts.len() == 1 && n_as > 1 {
            // broadcast, when loading an old imatrix
            let c = e.counts[0];
            e.counts.resize(n_as as usize, c);
        }
        if e.values.is_empty() {
            e.values = vec![0.0; (ne0 * n_as) as usize];
            e.counts = vec![0; n_as as usize];
        } else if e.values.len() != (ne0 * n_as) as usize {
            return Err(format!("inconsistent size for {wname} ({} vs {})", e.values.len(), ne0 * n_as));
        } else if e.counts.len() != n_as as usize {
            return Err(format!("inconsistent expert count for {wname} ({} vs {n_as})", e.counts.len()));
        }
        let mut touched = vec![false; n_as as usize];
        for idx in 0..n_ids {
            for row in 0..n_tokens {
                let ex = ids.read_i32(ids_data, idx, row) as i64;
                if ex < 0 || ex >= n_as {
                    return Err(format!("{wname}: expert id {ex} out of range 0..{n_as}"));
                }
                let i11 = idx % src1.ne[1];
                let x = f32_row(data, src1.offset([0, i11, row, 0]), ne0 as usize);
                let acc = &mut e.values[(ex * ne0) as usize..((ex + 1) * ne0) as usize];
                e.counts[ex as usize] += 1;
                touched[ex as usize] = true;
                accumulate_sq(acc, x);
            }
        }
        let finite = (0..n_as as usize).all(|ex| !touched[ex] || e.values[ex * ne0 as usize..(ex + 1) * ne0 as usize].iter().all(|v| v.is_finite()));
        self.after_update(wname, finite);
        Ok(())
    }

    /// Accumulates one dense MUL_MAT: `src0` has `n_mat = ne2·ne3` matrices, `src1` the input.
    pub fn collect_mul_mat(&mut self, wname: &str, src0_ne: [i64; 4], src1: &TensorInfo, data: &[u8]) -> Result<(), String> {
        let n_mat = src0_ne[2] * src0_ne[3];
        let ne0 = src1.ne[0];
        let e = self.state.stats.entry(wname.to_string()).or_default();
        // a single count per dense tensor (merging older files with 3-D tensors)
        if e.counts.len() > 1 && e.counts.iter().all(|&c| c == e.counts[0]) {
            e.counts.truncate(1);
        }
        if e.values.is_empty() {
            e.values = vec![0.0; (ne0 * n_mat) as usize];
            e.counts.resize(1, 0);
        } else if e.values.len() != (ne0 * n_mat) as usize {
            return Err(format!("inconsistent size for {wname} ({} vs {})", e.values.len(), ne0 * n_mat));
        }
        for i3 in 0..src1.ne[3] {
            for i2 in 0..src1.ne[2] {
                let mat_id = (i3 % src0_ne[3]) * src0_ne[2] + (i2 % src0_ne[2]);
                let acc = &mut e.values[(mat_id * ne0) as usize..((mat_id + 1) * ne0) as usize];
                for row in 0..src1.ne[1] {
                    let x = f32_row(data, src1.offset([0, row, i2, i3]), ne0 as usize);
                    accumulate_sq(acc, x);
                }
            }
        }
        if !e.values.iter().all(|v| v.is_finite()) {
            self.error = Some(NonFinite { tensor: wname.to_string() });
            return Ok(());
        }
        let add = src1.nrows() / n_mat;
        for i in 0..e.counts.len() {
            let e = self.state.stats.get_mut(wname).unwrap();
            e.counts[i] += add;
            let c = e.counts[i];
            self.maybe_checkpoint(c);
        }
        Ok(())
    }

    /// Adds one chunk's sums reduced on the device (`--imatrix-on-device`), per weight:
    /// `n_as` 0 for a dense matmul (`sums` `[n_in]`, `counts` `[rows]`), else `sums`
    /// `[n_as][n_in]` and `counts` `[n_as]`. The same entries and counts as the exact path,
    /// only the order of the f32 additions differs; the checkpoint rule runs once every weight
    /// is updated, so a checkpoint holds whole chunks (upstream's, taken mid-graph, holds the
    /// weights collected so far in the chunk's last ubatch).
    pub fn add_reduced(&mut self, chunk: &[crate::llama::reduce::Reduced]) -> Result<(), String> {
        for r in chunk {
            self.update_reduced(r)?;
        }
        for r in chunk {
            let finite = self.state.stats[&r.name].values.iter().all(|v| v.is_finite());
            self.after_update(&r.name, finite);
            if self.error.is_some() {
                break;
            }
        }
        Ok(())
    }

    fn update_reduced(&mut self, r: &crate::llama::reduce::Reduced) -> Result<(), String> {
        let (wname, n_in, n_as, sums, counts) = (&r.name, r.n_in, r.n_as, &r.sums, &r.counts);
        let n_rows = n_as.max(1);
        if sums.len() as i64 != n_in * n_rows || counts.len() as i64 != n_rows {
            return Err(format!("{wname}: reduced shapes {} and {} for {n_in} × {n_rows}", sums.len(), counts.len()));
        }
        let e = self.state.stats.entry(wname.to_string()).or_default();
        if n_as > 0 && e.counts.len() == 1 && n_as > 1 {
            let c = e.counts[0];
            e.counts.resize(n_as as usize, c);
        }
        if n_as == 0 && e.counts.len() > 1 && e.counts.iter().all(|&c| c == e.counts[0]) {
            e.counts.truncate(1);
        }
        if e.values.is_empty() {
            e.values = vec![0.0; sums.len()];
            e.counts = vec![0; n_rows as usize];
        } else if e.values.len() != sums.len() || e.counts.len() != n_rows as usize {
            return Err(format!("inconsistent size for {wname} ({} vs {})", e.values.len(), sums.len()));
        }
        for (v, s) in e.values.iter_mut().zip(sums) {
            *v += s;
        }
        for (c, &n) in e.counts.iter_mut().zip(counts) {
            *c += n.round() as i64;
        }
        Ok(())
    }

    /// After `wname`'s sums and counts were updated: a non-finite sum stops collection (the
    /// caller reports it); otherwise upstream's checkpoint rule runs on each of its counts.
    fn after_update(&mut self, wname: &str, finite: bool) {
        if !finite {
            self.error = Some(NonFinite { tensor: wname.to_string() });
            return;
        }
        let counts = self.state.stats[wname].counts.clone();
        for c in counts {
            self.maybe_checkpoint(c);
        }
    }

    /// Upstream's checkpoint rule, evaluated after each count update.
    fn maybe_checkpoint(&mut self, count: i64) {
        let n_chunk = (count / self.cfg.chunk_size as i64) as i32;
        if n_chunk > self.state.last_chunk {
            let step = n_chunk - self.state.last_chunk;
            self.state.last_chunk = n_chunk;
            let last = self.state.last_chunk;
            if (last % self.cfg.out_freq) / step == 0 {
                self.pending_saves.push(SaveRequest { at: None, state: self.state.clone() });
            }
            if self.cfg.save_freq > 0 && (last % self.cfg.save_freq) / step == 0 {
                self.pending_saves.push(SaveRequest { at: Some(last), state: self.state.clone() });
            }
        }
    }

    /// Adds a loaded imatrix file into the state (upstream's `load_imatrix`).
    pub fn merge(&mut self, loaded: &crate::formats::imatrix::Loaded) -> Result<(), String> {
        let chunk_size = self.cfg.chunk_size as i64;
        for (name, entry) in &loaded.entries {
            let e = self.state.stats.entry(name.clone()).or_default();
            if loaded.is_legacy {
                // legacy sums hold (raw_sum/raw_count)·ncall and counts {ncall}
                if e.values.is_empty() {
                    e.values = vec![0.0; entry.sums.len()];
                    e.counts = vec![0];
                }
                for (v, s) in e.values.iter_mut().zip(&entry.sums) {
                    *v += s * chunk_size as f32;
                }
                for c in e.counts.iter_mut() {
                    *c += entry.counts[0] * chunk_size;
                }
            } else {
                let (nval, ncounts) = (entry.sums.len(), entry.counts.len());
                if e.values.is_empty() {
                    e.values = vec![0.0; nval];
                } else if nval != e.values.len() {
                    return Err(format!("mismatched sums size for {name}: {nval} != {}", e.values.len()));
                }
                if e.counts.is_empty() {
                    e.counts = vec![0; ncounts];
                } else if e.counts.len() == 1 && ncounts > 1 {
                    let c = e.counts[0];
                    e.counts.resize(ncounts, c);
                } else if ncounts != e.counts.len() {
                    return Err(format!("mismatched counts size for {name}: {ncounts} != {}", e.counts.len()));
                }
                for (v, s) in e.values.iter_mut().zip(&entry.sums) {
                    *v += *s;
                }
                for (c, n) in e.counts.iter_mut().zip(&entry.counts) {
                    *c += *n;
                }
            }
        }
        self.state.datasets.extend(loaded.datasets.iter().cloned());
        let max_count = self.state.stats.values().flat_map(|s| s.counts.iter().copied()).max().unwrap_or(0).max(0);
        self.state.last_chunk = (max_count / chunk_size) as i32;
        Ok(())
    }
}

/// `acc[j] += x[j]·x[j]`: a multiply then an add, never fused, as upstream compiles it.
#[inline]
pub fn accumulate_sq(acc: &mut [f32], x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v * v;
    }
}

/// `n` f32 values starting at byte `off` of `data`.
#[inline]
pub fn f32_row(data: &[u8], off: usize, n: usize) -> &[f32] {
    let bytes = &data[off..off + 4 * n];
    assert!(bytes.as_ptr() as usize % 4 == 0, "unaligned f32 row");
    // SAFETY: bounds checked above, alignment asserted, any bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), n) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_name_strips_backend_prefix_and_suffix() {
        assert_eq!(filter_tensor_name("CUDA0#blk.0.attn_k.weight#0"), "blk.0.attn_k.weight");
        assert_eq!(filter_tensor_name("CUDA0#blk.0.attn_k.weight"), "blk.0.attn_k.weight");
        assert_eq!(filter_tensor_name("blk.0.attn_k.weight"), "blk.0.attn_k.weight");
    }
}
