//! The importance matrix, accumulated exactly as upstream's `llama-imatrix` does
//! (tools/imatrix/imatrix.cpp at the pin): per weight matrix, Σx² of every input column in
//! f32, in the same order, so the output file is byte-identical.
//!
//! The collector never writes: when upstream would save a checkpoint (inside the callback,
//! mid-graph), it takes a snapshot of exactly that state and queues it for the writer.
//!
//! A large input is accumulated on several threads ([`ImatrixCollector::pool`]), each over a
//! range of columns and every row in upstream's order: each sum sees the same additions in
//! the same order, so the bytes do not depend on the thread count.


use crate::collect::pool::Pool;
use crate::llama::sys;
use crate::llama::TensorInfo;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

pub use crate::formats::imatrix::{Imatrix, Stats};

/// How the run was configured, as far as collection and checkpoints care.
#[derive(Clone, Debug)]
pub struct ImatrixConfig {
    /// tokens per chunk: n_ctx / n_parallel (upstream's `chunk_size`)
    pub chunk_size: i32,
    pub out_freq: i32,
    pub save_freq: i32,
    pub process_output: bool,
    /// a MUL_MAT input is a small batch (not collected, as upstream skips batches under 16
    /// tokens) by all its rows, not by ne[1]: the `--nextn` pass's, whose entries have no
    /// upstream counterpart, so DeepSeek-V4's MTP `nextn.eh_proj`, which reads [2·n_embd, 4
    /// streams, T], gets one (llama-quantize refuses a very-low-bit type without it). Upstream's
    /// rule, and so parity, elsewhere.
    pub small_by_rows: bool,
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
    /// threads for large inputs (offloaded runs: the prompt's); None: the calling thread alone
    pub pool: Option<Pool>,
}

/// `CUDA0#blk.0.attn_k.weight#0` → `blk.0.attn_k.weight`, as upstream's `filter_tensor_name`.
pub fn filter_tensor_name(name: &str) -> &str {
    match name.split_once('#') {
        Some((_, rest)) => rest.split_once('#').map_or(rest, |(w, _)| w),
        None => name,
    }
}

/// Whether upstream asks for this node: every MUL_MAT_ID, and MUL_MAT on `blk.*` weights
/// (or `output.weight` with --process-output) with at least 16 rows of F32 input (ne[1], or
/// all rows with `small_by_rows`).
pub fn wants(op: sys::ggml_op, weight_name: &str, src1: &TensorInfo, cfg: &ImatrixConfig) -> bool {
    if op == sys::GGML_OP_MUL_MAT_ID {
        return true;
    }
    if op != sys::GGML_OP_MUL_MAT {
        return false;
    }
    let rows = if cfg.small_by_rows { src1.ne[1] * src1.ne[2] * src1.ne[3] } else { src1.ne[1] };
    if rows < 16 || src1.ty != sys::GGML_TYPE_F32 {
        return false;
    }
    weight_name.starts_with("blk.") || (cfg.process_output && weight_name == "output.weight")
}

impl ImatrixCollector {
    pub fn new(cfg: ImatrixConfig, state: Imatrix) -> Self {
        ImatrixCollector { cfg, state, pending_saves: Vec::new(), error: None, pool: None }
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
        // the routing first (ids checked, counts), then the sums
        let mut routed = Vec::with_capacity((n_ids * n_tokens) as usize);
        for idx in 0..n_ids {
            for row in 0..n_tokens {
                let ex = ids.read_i32(ids_data, idx, row) as i64;
                if ex < 0 || ex >= n_as {
                    return Err(format!("{wname}: expert id {ex} out of range 0..{n_as}"));
                }
                routed.push((ex as usize, src1.offset([0, idx % src1.ne[1], row, 0])));
            }
        }
        let mut touched = vec![false; n_as as usize];
        for &(ex, _) in &routed {
            e.counts[ex] += 1;
            touched[ex] = true;
        }
        // each expert's sums: its rows in upstream's order (slot by slot, token by token)
        let finite = by_columns(self.pool.as_ref(), &mut e.values, ne0 as usize, routed.len(), |c0, accs| {
            for &(ex, off) in &routed {
                accumulate_sq(accs[ex], f32_row(data, off + 4 * c0, accs[ex].len()));
            }
            accs.iter().zip(&touched).all(|(a, &t)| !t || a.iter().all(|v| v.is_finite()))
        });
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
        let finite = by_columns(self.pool.as_ref(), &mut e.values, ne0 as usize, src1.nrows() as usize, |c0, accs| {
            for i3 in 0..src1.ne[3] {
                for i2 in 0..src1.ne[2] {
                    let acc = &mut *accs[((i3 % src0_ne[3]) * src0_ne[2] + (i2 % src0_ne[2])) as usize];
                    for row in 0..src1.ne[1] {
                        accumulate_sq(acc, f32_row(data, src1.offset([0, row, i2, i3]) + 4 * c0, acc.len()));
                    }
                }
            }
            accs.iter().all(|a| a.iter().all(|v| v.is_finite()))
        });
        if !finite {
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
        let mut finite = Vec::with_capacity(chunk.len());
        for r in chunk {
            // an alias (a weight that read its leader's input) adds the leader's sums
            let (sums, counts) = match r.same_as {
                Some(l) => (&chunk[l].sums, &chunk[l].counts),
                None => (&r.sums, &r.counts),
            };
            finite.push(self.update_reduced(&r.name, r.n_in, r.n_as, r.n_mat, sums, counts)?);
        }
        for (r, finite) in chunk.iter().zip(finite) {
            self.after_update(&r.name, finite);
            if self.error.is_some() {
                break;
            }
        }
        Ok(())
    }

    /// Whether upstream's checkpoint rule would fire once a weight's count (as the rule reads
    /// counts: the rows collected) reaches `count`: `--imatrix-on-device` adds its device sums
    /// into the imatrix only then (and at the end), so a checkpoint holds what it would.
    pub fn save_due(&self, count: i64) -> bool {
        let n_chunk = (count / self.cfg.chunk_size as i64) as i32;
        if n_chunk <= self.state.last_chunk {
            return false;
        }
        let step = n_chunk - self.state.last_chunk;
        (n_chunk % self.cfg.out_freq) / step == 0 || (self.cfg.save_freq > 0 && (n_chunk % self.cfg.save_freq) / step == 0)
    }

    /// Adds reduced sums and counts into `wname`'s entry; returns whether every sum is finite
    /// after it (each is updated, so this checks the whole entry, as the exact path does).
    /// A dense weight of `n_mat` matrices has sums per matrix and one count (rows per matrix).
    fn update_reduced(&mut self, wname: &str, n_in: i64, n_as: i64, n_mat: i64, sums: &[f32], counts: &[f32]) -> Result<bool, String> {
        let n_rows = n_as.max(1);
        let n_cols = if n_as > 0 { n_as } else { n_mat };
        if sums.len() as i64 != n_in * n_cols || counts.len() as i64 != n_rows {
            return Err(format!("{wname}: reduced shapes {} and {} for {n_in} × {n_cols}", sums.len(), counts.len()));
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
        let mut finite = true;
        for (v, s) in e.values.iter_mut().zip(sums) {
            *v += s;
            finite &= v.is_finite();
        }
        for (c, &n) in e.counts.iter_mut().zip(counts) {
            *c += n.round() as i64;
        }
        Ok(finite)
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

/// `acc[j] += x[j]·x[j]`: a multiply then an add, never fused, as upstream compiles it. With
/// AVX2 where the CPU has it: 8 lanes instead of SSE2's 4, the same two roundings per element.
#[inline]
pub fn accumulate_sq(acc: &mut [f32], x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { accumulate_sq_avx2(acc, x) };
    }
    accumulate_sq_plain(acc, x);
}

#[inline(always)]
fn accumulate_sq_plain(acc: &mut [f32], x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v * v;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn accumulate_sq_avx2(acc: &mut [f32], x: &[f32]) {
    // the same loop, compiled for AVX2 (no FMA: Rust never fuses a * b + c by itself)
    accumulate_sq_plain(acc, x);
}

/// Inputs below this many multiply-adds are summed on the calling thread alone (a job on the
/// pool costs microseconds; this is tens of microseconds of summing).
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// Runs `sum(c0, accs)` over `values` (`[mats][ne0]` sums): `accs[m]` is mat `m`'s sums of a
/// range of columns from `c0` on. One range, the whole rows, on the calling thread; where
/// `rows` rows of `ne0` make enough work, one range per thread of `pool` (narrower ranges, to
/// keep the sums in L2, measured slower: docs/gpu.md). Returns whether every call returned
/// true.
fn by_columns(pool: Option<&Pool>, values: &mut [f32], ne0: usize, rows: usize, sum: impl Fn(usize, &mut [&mut [f32]]) -> bool + Sync) -> bool {
    let ne0 = ne0.max(1);
    let threads = pool.map_or(1, |p| p.threads());
    let parallel = threads > 1 && ne0 >= 32 && ne0 * rows >= PARALLEL_MIN_WORK;
    if !parallel {
        let mut accs: Vec<&mut [f32]> = values.chunks_mut(ne0).collect();
        return sum(0, &mut accs);
    }
    let bounds = column_cuts(ne0, threads, (values.as_ptr() as usize / 4) % 16);
    let mut cut: Vec<Vec<&mut [f32]>> = (1..bounds.len()).map(|_| Vec::new()).collect();
    for mut mat in values.chunks_mut(ne0) {
        for (p, w) in bounds.windows(2).enumerate() {
            let (piece, rest) = mat.split_at_mut(w[1] - w[0]);
            cut[p].push(piece);
            mat = rest;
        }
    }
    let cut: Vec<Mutex<Vec<&mut [f32]>>> = cut.into_iter().map(Mutex::new).collect();
    let ok = AtomicBool::new(true);
    pool.expect("parallel needs a pool").run(cut.len(), &|p| {
        let mut accs = cut[p].lock().unwrap_or_else(|e| e.into_inner());
        if !sum(bounds[p], &mut accs) {
            ok.store(false, Ordering::Relaxed);
        }
    });
    ok.into_inner()
}

/// The column ranges of `by_columns`, one per thread: `[0, c1, …, ne0]`, each cut where a
/// cache line of memory starts. `lead` is the f32 sums' offset within a line (in values): where
/// each matrix's sums are whole lines (ne0 a multiple of 16) every matrix has that offset, so
/// shifting the cuts by it leaves no line written by two threads (cut at multiples of 16 from
/// the row's start, one line per matrix was: measured slower, docs/gpu.md).
fn column_cuts(ne0: usize, threads: usize, lead: usize) -> Vec<usize> {
    let lead = if ne0 % 16 == 0 { lead % 16 } else { 0 };
    let mut cuts: Vec<usize> = (0..=threads).map(|i| ((i * ne0 / threads + lead).next_multiple_of(16) - lead).min(ne0)).collect();
    cuts[0] = 0;
    cuts.dedup();
    cuts
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

    fn info(ne: [i64; 4], ty: sys::ggml_type) -> TensorInfo<'static> {
        let nb0 = 4usize;
        let nb = [nb0, nb0 * ne[0] as usize, nb0 * (ne[0] * ne[1]) as usize, nb0 * (ne[0] * ne[1] * ne[2]) as usize];
        TensorInfo { name: "x", op: 0, ty, ne, nb }
    }

    fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
        // SAFETY: plain values viewed as bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }.to_vec()
    }

    fn collector(threads: usize) -> ImatrixCollector {
        let cfg = ImatrixConfig { chunk_size: 1 << 30, out_freq: 1, save_freq: 0, process_output: false, small_by_rows: false };
        let mut c = ImatrixCollector::new(cfg, Imatrix::default());
        c.pool = (threads > 1).then(|| Pool::new(threads));
        c
    }

    /// The ranges cover every column once, in order, and each inner cut starts a cache line
    /// of memory wherever the sums start within one.
    #[test]
    fn column_ranges_start_at_cache_lines() {
        for ne0 in [32, 48, 144, 200, 2048, 4096 + 8] {
            for threads in [2, 3, 7, 16] {
                for lead in 0..16 {
                    let cuts = column_cuts(ne0, threads, lead);
                    assert_eq!((cuts[0], *cuts.last().unwrap()), (0, ne0), "{ne0} {threads} {lead}");
                    assert!(cuts.windows(2).all(|w| w[0] < w[1]), "{cuts:?}");
                    assert!(cuts.len() - 1 <= threads, "{cuts:?}");
                    let line = if ne0 % 16 == 0 { lead } else { 0 };
                    for &c in &cuts[1..cuts.len() - 1] {
                        assert_eq!((line + c) % 16, 0, "ne0 {ne0} threads {threads} lead {lead}: {cuts:?}");
                    }
                }
            }
        }
        // a misaligned start: the first range is shortened to reach the next line
        assert_eq!(column_cuts(2048, 2, 12), vec![0, 1028, 2048]);
        assert_eq!(column_cuts(2048, 2, 0), vec![0, 1024, 2048]);
    }

    /// Large inputs are summed on several threads, by ranges of columns (here not multiples of
    /// the 16-column pieces, over several matrices, routed to skewed experts): every sum and
    /// count is bit for bit the one thread's, over three ubatches.
    #[test]
    fn sums_on_several_threads_equal_one_threads_bit_for_bit() {
        let mut rng = crate::fixture::rng::Rng::new(11);
        let (one, three) = (&mut collector(1), &mut collector(3));
        for _ in 0..3 {
            // dense: [200, 700, 2] input to a weight of 2 matrices (280,000 values)
            let x: Vec<f32> = (0..200 * 700 * 2).map(|_| (rng.normal() * 3.0) as f32).collect();
            for c in [&mut *one, &mut *three] {
                c.collect_mul_mat("d", [200, 50, 2, 1], &info([200, 700, 2, 1], sys::GGML_TYPE_F32), &bytes(&x)).unwrap();
            }
            // experts: [144, 4, 512] input, 4 of 32 experts per token, a few experts heavy
            let x: Vec<f32> = (0..144 * 4 * 512).map(|_| (rng.normal() * 2.0) as f32).collect();
            let ids: Vec<i32> = (0..4 * 512).map(|i| if i % 3 == 0 { (i % 4) as i32 } else { (rng.next_u64() % 32) as i32 }).collect();
            for c in [&mut *one, &mut *three] {
                c.collect_mul_mat_id("e", 32, &info([144, 4, 512, 1], sys::GGML_TYPE_F32), &bytes(&x), &info([4, 512, 1, 1], sys::GGML_TYPE_I32), &bytes(&ids)).unwrap();
            }
        }
        for w in ["d", "e"] {
            let (a, b) = (&one.state.stats[w], &three.state.stats[w]);
            assert_eq!(a.counts, b.counts, "{w}");
            assert!(a.values.iter().zip(&b.values).all(|(x, y)| x.to_bits() == y.to_bits()), "{w}: sums differ");
            assert!(a.values.iter().any(|&v| v > 0.0));
        }
        assert!(one.error.is_none() && three.error.is_none());
    }

    /// The AVX2 loop (where this CPU has it) rounds as the plain one: x·x, then the add.
    #[test]
    fn the_vector_loop_sums_as_the_plain_one() {
        let mut rng = crate::fixture::rng::Rng::new(5);
        for n in [1, 7, 8, 9, 63, 64, 1000, 2053] {
            let x: Vec<f32> = (0..n).map(|_| (rng.normal() * 10.0) as f32).collect();
            let (mut a, mut b) = (vec![0.0f32; n], vec![0.0f32; n]);
            for _ in 0..5 {
                accumulate_sq(&mut a, &x);
                accumulate_sq_plain(&mut b, &x);
            }
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()), "n = {n}");
        }
    }

    #[test]
    fn a_non_finite_sum_is_found_in_any_part() {
        let mut c = collector(3);
        let mut x = vec![1.0f32; 200 * 2000];
        x[199 * 1 + 200 * 1500] = f32::INFINITY; // the last column, in the last part
        c.collect_mul_mat("d", [200, 10, 1, 1], &info([200, 2000, 1, 1], sys::GGML_TYPE_F32), &bytes(&x)).unwrap();
        assert_eq!(c.error.as_ref().map(|e| e.tensor.as_str()), Some("d"));
    }

    #[test]
    fn filter_name_strips_backend_prefix_and_suffix() {
        assert_eq!(filter_tensor_name("CUDA0#blk.0.attn_k.weight#0"), "blk.0.attn_k.weight");
        assert_eq!(filter_tensor_name("CUDA0#blk.0.attn_k.weight"), "blk.0.attn_k.weight");
        assert_eq!(filter_tensor_name("blk.0.attn_k.weight"), "blk.0.attn_k.weight");
    }
}
