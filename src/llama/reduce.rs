//! The fast imatrix mode (`--imatrix-on-device`): Σx² of a matmul's input, reduced over the
//! tokens where the input lives and accumulated there over the ubatches of a chunk, so the
//! host copies, once per chunk, `[n_in]` (dense) or `[n_in, n_expert]` plus `[n_expert]`
//! counts (MUL_MAT_ID) per weight instead of the whole `[n_in, rows]` input per ubatch.
//!
//! Inside the eval callback the scheduler has finished the node and waits, so a small graph of
//! our own can run on the device that holds the input, in a backend instance of ours for that
//! device. The input and the expert ids enter it as leaves that point at the scheduler's
//! memory (same buffer, data pointer and strides, no sources), so nothing of llama.cpp's graph
//! is pulled in. For MUL_MAT_ID the per-expert sums are one outer product over the rows
//! (`ggml_out_prod`, which contracts the second axis of both, so nothing is transposed): the
//! squared input rows `[n_in, R]` with the one-hot routing `[n_expert, R]` (rows of an identity
//! matrix gathered by the selected ids), R = slots × tokens; the counts are the routing's with
//! a row of ones, and a dense input's sums the squares' with the ones. The result is added in
//! place into the weight's accumulator, a tensor of ours on that device. Few kernels per input
//! (on a GPU each is a launch, several hundred per ubatch): 3 per dense input, 7 for a MoE
//! layer's shared expert input with the layer's routing (one-hot rows and counts, built once
//! per graph for every input routed by the same ids), 4 for its down projection's input; no
//! copy of a tensor that is already contiguous. With `batching` on (the observer's reads at
//! the end of the graph) the reductions are queued and computed as one graph per device by
//! [`DeviceReducer::commit`], one launch and one wait for all of them.
//! [`DeviceReducer::drain`] copies the accumulators back and zeroes them. Sums in f32 in the
//! device's order, so the result is not upstream's bytes: this mode is never the default.

use super::{sys, Node};
use anyhow::{bail, Result};

/// One device's backend, allocator and cached identity matrices.
struct Device {
    dev: sys::ggml_backend_dev_t,
    backend: sys::ggml_backend_t,
    galloc: sys::ggml_gallocr_t,
    /// n_expert → (context, buffer, identity tensor `[n, n]` f32)
    identities: Vec<(i64, *mut sys::ggml_context, sys::ggml_backend_buffer_t, *mut sys::ggml_tensor)>,
    /// length → (context, buffer, `[length]` f32 ones), the longest last; a shorter one stays
    /// allocated (a queued graph may view it)
    ones: Vec<(i64, *mut sys::ggml_context, sys::ggml_backend_buffer_t, *mut sys::ggml_tensor)>,
    /// the context of the last graph computed here, reset and reused by the next: the same
    /// reductions then build the same nodes at the same addresses every ubatch, which is what
    /// lets a backend that records graphs (CUDA graphs, keyed by the first node's address and
    /// checked node by node) replay the batch instead of launching each kernel anew
    spare: Option<Graph>,
}

/// One weight's running sums on its device, for the chunk in flight.
struct Accumulator {
    name: String,
    device: usize,
    n_in: i64,
    /// experts of a MUL_MAT_ID weight; 0 for a dense one
    n_as: i64,
    /// matrices of a dense weight (MLA's per-head `attn_k_b` `[n_in, n_out, n_head]`); 1 else
    n_mat: i64,
    ctx: *mut sys::ggml_context,
    buf: sys::ggml_backend_buffer_t,
    /// `[n_in, max(n_as, n_mat)]`
    sums: *mut sys::ggml_tensor,
    /// `[n_as]` (MUL_MAT_ID only: the routing lives on the device)
    counts: Option<*mut sys::ggml_tensor>,
    /// rows of a dense weight since the last drain (known on the host), per matrix
    rows: f64,
    /// additions since the last drain
    adds: u32,
}

/// A weight whose input is another's (q/k/v, the experts' gate/up: the observer's
/// `LastInput`): its sums are its leader's, as long as it was added with it every time.
struct Alias {
    name: String,
    leader: usize,
    /// times it shared the leader's addition since the last drain
    adds: u32,
}

#[derive(Default)]
pub struct DeviceReducer {
    devices: Vec<Device>,
    /// in order of first sight, which is the graph's order
    accumulators: Vec<Accumulator>,
    aliases: Vec<Alias>,
    /// reductions queued per device, not computed yet
    batches: Vec<Batch>,
    /// queue reductions until `commit` (else each is computed at once)
    pub batching: bool,
    /// graphs computed on devices
    pub graphs_run: u64,
    /// their nodes that compute something (views, reshapes and transposes left out): on a GPU
    /// each is at least one kernel launch
    pub ops_run: u64,
    /// bytes copied back to the host (the drained accumulators)
    pub bytes_out: u64,
    /// the address of the last computed graph's first node (what CUDA keys its graphs by)
    first_node: usize,
    /// graphs [`DeviceReducer::launch`]ed and not yet waited for, by device: their leaves
    /// point at the scheduler's memory, so [`DeviceReducer::wait`] must come before the
    /// callback that launched them returns
    pending: Vec<(usize, Graph)>,
}

/// Reductions queued on one device, computed together by `commit`.
struct Batch {
    device: usize,
    g: Graph,
    outs: Vec<*mut sys::ggml_tensor>,
    /// accumulators written: each at most once per graph
    accs: Vec<usize>,
    /// the routing's one-hot rows and counts built in this graph, by the expert ids they come
    /// from (data, k, T, n_expert): the experts' shared input and the down projection's of a
    /// layer are routed by one tensor
    routings: Vec<((usize, i64, i64, i64), *mut sys::ggml_tensor, *mut sys::ggml_tensor)>,
}

/// Reductions per graph, and a bound on the tensors one creates.
const BATCH_REDUCTIONS: usize = 512;
const TENSORS_PER_REDUCTION: usize = 32;

/// One weight's per-expert (or single) sums and row counts, as drained.
pub struct Reduced {
    pub name: String,
    pub n_in: i64,
    /// 0 for a dense weight
    pub n_as: i64,
    /// matrices of a dense weight (1 for most, and for MUL_MAT_ID)
    pub n_mat: i64,
    /// `[n_mat][n_in]` (dense) or `[n_expert][n_in]` (MUL_MAT_ID)
    pub sums: Vec<f32>,
    /// `[1]` (dense: rows per matrix) or `[n_expert]`
    pub counts: Vec<f32>,
    /// a weight that read another's input: its sums and counts are those of the entry at this
    /// index of the same drain (its own are left empty)
    pub same_as: Option<usize>,
}

impl DeviceReducer {
    /// Adds Σ over rows of x² for a dense MUL_MAT input `x` `[n_in, rows…]` (any strides), a
    /// computed node of the graph whose callback is running, into `wname`'s accumulator.
    /// `n_mat` > 1: the weight holds that many matrices (`ne[2]·ne[3]`, MLA's per-head
    /// `attn_k_b`), each multiplying one plane of x (`x.ne[2]·x.ne[3]` = `n_mat`: see
    /// [`DeviceReducer::plane_per_matrix`]); each gets its own sums, and the rows counted are
    /// a plane's, as upstream counts them.
    pub fn dense(&mut self, wname: &str, x: Node<'_>, n_mat: i64) -> Result<()> {
        let x = x.as_ptr();
        let d = self.device_of(x)?;
        // SAFETY: x is live for the callback; the graph reads it and writes only its own tensors.
        unsafe {
            let n_in = (*x).ne[0];
            let rows = sys::ggml_nrows(x) / n_mat;
            if rows * n_mat != sys::ggml_nrows(x) {
                bail!("{} rows of input for {n_mat} matrices", sys::ggml_nrows(x));
            }
            let a = self.accumulator(wname, d, n_in, 0, n_mat)?;
            let ones = self.ones(d, rows * n_mat)?;
            let ctx = self.batch_for(d, a)?;
            let sq = sys::ggml_sqr(ctx, sys::ggml_reshape_3d(ctx, contiguous(ctx, leaf(ctx, x)), n_in, rows, n_mat));
            // Σ over rows per column and plane: [n_in, rows, n_mat] with ones [1, rows, n_mat]
            // → [n_in, 1, n_mat]
            let sums = sys::ggml_out_prod(ctx, sq, ones_view(ctx, ones, rows, n_mat));
            self.accumulators[a].rows += rows as f64;
            self.add(a, ctx, sums, None)
        }
    }

    /// Whether [`DeviceReducer::dense`] takes the input `x` of a weight with matrices
    /// `w_ne[2]·w_ne[3]`: one plane of x per matrix, in order (no broadcast of a matrix over
    /// several planes, which the host path handles).
    pub fn plane_per_matrix(w_ne: [i64; 4], x_ne: [i64; 4]) -> bool {
        x_ne[2] == w_ne[2] && x_ne[3] == w_ne[3]
    }

    /// Adds per-expert Σ x² and row counts for a MUL_MAT_ID input `x` `[n_in, 1 or k, T]`
    /// routed by `ids` `[k, T]` (i32, any strides) among `n_expert` experts, both computed
    /// nodes of the graph whose callback is running, on one device, into `wname`'s accumulator.
    pub fn by_expert(&mut self, wname: &str, x: Node<'_>, ids: Node<'_>, n_expert: i64) -> Result<()> {
        let (x, ids) = (x.as_ptr(), ids.as_ptr());
        let d = self.device_of(x)?;
        if self.device_of(ids)? != d {
            bail!("the input and the expert ids are on different devices");
        }
        // SAFETY: both are live for the callback; the graph reads them and writes only its own tensors.
        unsafe {
            let (n_in, n11, t) = ((*x).ne[0], (*x).ne[1], (*x).ne[2]);
            let k = (*ids).ne[0];
            if (*ids).ne[1] != t || (n11 != 1 && n11 != k) {
                bail!("input {:?} and ids {:?} do not match", (*x).ne, (*ids).ne);
            }
            let identity = self.identity(d, n_expert)?;
            let acc = self.accumulator(wname, d, n_in, n_expert, 1)?;
            let ones = self.ones(d, k * t)?;
            let ctx = self.batch_for(d, acc)?;
            let key = ((*ids).data as usize, k, t, n_expert);
            let b = self.batches.iter_mut().find(|b| b.device == d).expect("batch_for made it");
            let (onehot, counts) = match b.routings.iter().find(|r| r.0 == key) {
                Some(&(_, onehot, counts)) => (onehot, counts),
                None => {
                    let ids_flat = sys::ggml_reshape_1d(ctx, contiguous(ctx, leaf(ctx, ids)), k * t);
                    // one-hot rows of the routing: [n_expert, k·T]
                    let onehot = sys::ggml_get_rows(ctx, identity, ids_flat);
                    // counts[e] = Σ_r onehot[e, r]: [n_expert, 1]
                    let counts = sys::ggml_out_prod(ctx, onehot, ones_view(ctx, ones, k * t, 1));
                    b.routings.push((key, onehot, counts));
                    (onehot, counts)
                }
            };
            let sq = sys::ggml_sqr(ctx, contiguous(ctx, leaf(ctx, x)));
            let (a, b) = if n11 == 1 {
                // one input row per token, used by each of its k slots: weight it by the number
                // of its slots that chose each expert, Σ over the slots [n_expert, k, T] with
                // ones [1, k, T] → [n_expert, 1, T]
                let per_tok = sys::ggml_reshape_3d(ctx, onehot, n_expert, k, t);
                let picks = sys::ggml_out_prod(ctx, per_tok, ones_view(ctx, ones, k, t));
                (sys::ggml_reshape_2d(ctx, sq, n_in, t), sys::ggml_reshape_2d(ctx, picks, n_expert, t))
            } else {
                (sys::ggml_reshape_2d(ctx, sq, n_in, k * t), onehot)
            };
            // sums[e][j] = Σ_r a[j, r]·b[e, r]: [n_in, n_expert]
            let sums = sys::ggml_out_prod(ctx, a, b);
            self.add(acc, ctx, sums, Some(counts))
        }
    }

    /// The dense weights with sums not yet drained, and their rows since the last drain.
    pub fn pending_dense_rows(&self) -> impl Iterator<Item = (&str, i64)> {
        self.accumulators.iter().filter(|a| a.n_as == 0 && a.adds > 0).map(|a| (a.name.as_str(), a.rows as i64))
    }

    /// Copies every accumulator that received something since the last drain to the host,
    /// in first-seen order, and zeroes it: the chunk's sums and counts.
    pub fn drain(&mut self) -> Result<Vec<Reduced>> {
        self.commit()?;
        let mut out = Vec::new();
        for al in self.aliases.iter().filter(|al| al.adds > 0) {
            let l = &self.accumulators[al.leader];
            if l.adds != al.adds {
                bail!("{} shared {}'s input in {} of its {} ubatches", al.name, l.name, al.adds, l.adds);
            }
        }
        let mut drained = vec![None; self.accumulators.len()];
        for (i, a) in self.accumulators.iter_mut().enumerate().filter(|(_, a)| a.adds > 0) {
            // SAFETY: the accumulators are ours, allocated on their device, and no graph of
            // ours is running (ggml_backend_graph_compute returned).
            unsafe {
                let mut sums = vec![0.0f32; sys::ggml_nelements(a.sums) as usize];
                sys::ggml_backend_tensor_get(a.sums, sums.as_mut_ptr().cast(), 0, sums.len() * 4);
                let counts = match a.counts {
                    Some(c) => {
                        let mut v = vec![0.0f32; sys::ggml_nelements(c) as usize];
                        sys::ggml_backend_tensor_get(c, v.as_mut_ptr().cast(), 0, v.len() * 4);
                        v
                    }
                    None => vec![a.rows as f32],
                };
                let bytes = (sums.len() + a.counts.map_or(0, |_| counts.len())) as u64 * 4;
                self.bytes_out += bytes;
                super::tensor::DEVICE_TO_HOST_BYTES.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                sys::ggml_backend_buffer_clear(a.buf, 0);
                a.rows = 0.0;
                a.adds = 0;
                drained[i] = Some(out.len());
                out.push(Reduced { name: a.name.clone(), n_in: a.n_in, n_as: a.n_as, n_mat: a.n_mat, sums, counts, same_as: None });
            }
        }
        for al in self.aliases.iter_mut().filter(|al| al.adds > 0) {
            let l = drained[al.leader].expect("checked above: the leader was added");
            let alias = Reduced { name: al.name.clone(), n_in: out[l].n_in, n_as: out[l].n_as, n_mat: out[l].n_mat, sums: Vec::new(), counts: Vec::new(), same_as: Some(l) };
            out.push(alias);
            al.adds = 0;
        }
        Ok(out)
    }

    /// The accumulator of `wname`, allocated (zeroed) on device `d` at first sight.
    fn accumulator(&mut self, wname: &str, d: usize, n_in: i64, n_as: i64, n_mat: i64) -> Result<usize> {
        let cols = n_as.max(n_mat);
        if let Some(i) = self.accumulators.iter().position(|a| a.name == wname) {
            let a = &self.accumulators[i];
            if a.device != d || a.n_in != n_in || a.n_as != n_as || a.n_mat != n_mat {
                bail!("{wname} changed shape or device between ubatches ({}×{} → {n_in}×{cols})", a.n_in, a.n_as.max(a.n_mat));
            }
            return Ok(i);
        }
        if self.aliases.iter().any(|a| a.name == wname) {
            bail!("shared another weight's input before, now reduced on its own");
        }
        // SAFETY: a context of two tensors, allocated in one buffer on the device and zeroed.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: sys::ggml_tensor_overhead() * 2, mem_buffer: std::ptr::null_mut(), no_alloc: true });
            if ctx.is_null() {
                bail!("ggml_init failed");
            }
            let sums = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, n_in, cols);
            let counts = (n_as > 0).then(|| sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_F32, n_as));
            let buf = sys::ggml_backend_alloc_ctx_tensors(ctx, self.devices[d].backend);
            if buf.is_null() {
                sys::ggml_free(ctx);
                bail!("could not allocate {wname}'s {n_in}×{cols} sums on the device");
            }
            sys::ggml_backend_buffer_clear(buf, 0);
            self.accumulators.push(Accumulator { name: wname.to_string(), device: d, n_in, n_as, n_mat, ctx, buf, sums, counts, rows: 0.0, adds: 0 });
        }
        Ok(self.accumulators.len() - 1)
    }

    /// Queues, in `ctx` (the batch of the accumulator's device), the in-place addition of
    /// `sums` (as many elements as the accumulator's) and `counts` into accumulator `a`;
    /// computes it now unless batching.
    unsafe fn add(&mut self, a: usize, ctx: *mut sys::ggml_context, sums: *mut sys::ggml_tensor, counts: Option<*mut sys::ggml_tensor>) -> Result<()> {
        let acc = &self.accumulators[a];
        let d = acc.device;
        unsafe {
            let mut outs = Vec::with_capacity(2);
            let s = leaf(ctx, acc.sums);
            outs.push(sys::ggml_add_inplace(ctx, s, sys::ggml_reshape(ctx, contiguous(ctx, sums), s)));
            if let (Some(c), Some(acc_c)) = (counts, acc.counts) {
                let cl = leaf(ctx, acc_c);
                outs.push(sys::ggml_add_inplace(ctx, cl, sys::ggml_reshape(ctx, contiguous(ctx, c), cl)));
            }
            let b = self.batches.iter_mut().find(|b| b.device == d).expect("batch_for made it");
            b.outs.extend(outs);
            b.accs.push(a);
        }
        self.accumulators[a].adds += 1;
        if !self.batching {
            self.commit()?;
        }
        Ok(())
    }

    /// The context to build a reduction into `a` on device `d`: that device's batch, which is
    /// computed first if it already writes `a` or is full.
    fn batch_for(&mut self, d: usize, a: usize) -> Result<*mut sys::ggml_context> {
        // a launched graph's context becomes the spare when it is done
        self.wait();
        if self.batches.iter().any(|b| b.device == d && (b.accs.contains(&a) || b.accs.len() >= BATCH_REDUCTIONS)) {
            self.commit()?;
        }
        if let Some(b) = self.batches.iter().find(|b| b.device == d) {
            return Ok(b.g.ctx);
        }
        // room for a whole batch only when batching: otherwise it holds one reduction
        let capacity = TENSORS_PER_REDUCTION * if self.batching { BATCH_REDUCTIONS } else { 1 };
        let g = match self.devices[d].spare.take() {
            Some(g) if g.capacity == capacity => g.reset(),
            _ => Graph::new(capacity)?,
        };
        let ctx = g.ctx;
        self.batches.push(Batch { device: d, g, outs: Vec::new(), accs: Vec::new(), routings: Vec::new() });
        Ok(ctx)
    }

    /// Computes every queued reduction: one graph per device.
    pub fn commit(&mut self) -> Result<()> {
        self.wait();
        for b in std::mem::take(&mut self.batches) {
            // SAFETY: the batch's leaves point at tensors live for the callback that queued them,
            // which is still running (the observer commits before it returns).
            unsafe {
                self.run(b.device, &b.g, &b.outs)?;
                sys::ggml_backend_synchronize(self.devices[b.device].backend);
            }
            self.graphs_run += 1;
            self.devices[b.device].spare = Some(b.g);
        }
        Ok(())
    }

    /// Starts every queued reduction on its device (one graph per device) without waiting, so
    /// the host can do other work meanwhile; [`Self::wait`] must follow before the tensors they
    /// read are released (before the callback returns). Every other method waits first.
    pub fn launch(&mut self) -> Result<()> {
        self.wait();
        for b in std::mem::take(&mut self.batches) {
            // SAFETY: as in commit; the graph and its allocation stay untouched until wait().
            unsafe { self.run(b.device, &b.g, &b.outs)? };
            self.pending.push((b.device, b.g));
        }
        Ok(())
    }

    /// Waits for the launched reductions.
    pub fn wait(&mut self) {
        for (d, g) in std::mem::take(&mut self.pending) {
            // SAFETY: our backend instance, which computes the graph launched on it.
            unsafe { sys::ggml_backend_synchronize(self.devices[d].backend) };
            self.graphs_run += 1;
            self.devices[d].spare = Some(g);
        }
    }

    /// Drops the queued reductions (the run is failing); launched ones are waited for.
    pub fn discard(&mut self) {
        self.wait();
        self.batches.clear();
    }

    /// `wname` read the input `leader` was just reduced from: it gets the leader's sums.
    pub fn alias(&mut self, wname: &str, leader: &str) -> Result<()> {
        let Some(l) = self.accumulators.iter().position(|a| a.name == leader) else { bail!("{leader} was not reduced on the device") };
        if self.accumulators.iter().any(|a| a.name == wname) {
            bail!("reduced on its own before, now sharing {leader}'s input");
        }
        match self.aliases.iter_mut().find(|a| a.name == wname) {
            Some(a) if a.leader != l => bail!("shares {leader}'s input now, {}'s before", self.accumulators[a.leader].name),
            Some(a) => a.adds += 1,
            None => self.aliases.push(Alias { name: wname.to_string(), leader: l, adds: 1 }),
        }
        Ok(())
    }

    fn device_of(&mut self, x: *mut sys::ggml_tensor) -> Result<usize> {
        // SAFETY: reading a live tensor's buffer and registry objects.
        unsafe {
            let buf = (*x).buffer;
            if buf.is_null() {
                bail!("tensor without a buffer");
            }
            let mut dev = sys::ggml_backend_buft_get_device(sys::ggml_backend_buffer_get_type(buf));
            if dev.is_null() && sys::ggml_backend_buffer_is_host(buf) {
                // ggml's plain host buffers name no device: the CPU's
                dev = sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU);
            }
            if dev.is_null() {
                bail!("the tensor's buffer type has no device");
            }
            if let Some(i) = self.devices.iter().position(|d| d.dev == dev) {
                return Ok(i);
            }
            let backend = sys::ggml_backend_dev_init(dev, std::ptr::null());
            if backend.is_null() {
                bail!("could not start a backend on the tensor's device");
            }
            let galloc = sys::ggml_gallocr_new(sys::ggml_backend_get_default_buffer_type(backend));
            self.devices.push(Device { dev, backend, galloc, identities: Vec::new(), ones: Vec::new(), spare: None });
            Ok(self.devices.len() - 1)
        }
    }

    fn identity(&mut self, d: usize, n: i64) -> Result<*mut sys::ggml_tensor> {
        let dev = &mut self.devices[d];
        if let Some(&(_, _, _, t)) = dev.identities.iter().find(|e| e.0 == n) {
            return Ok(t);
        }
        // SAFETY: a context of one tensor, allocated on the device and filled once.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: sys::ggml_tensor_overhead() * 2, mem_buffer: std::ptr::null_mut(), no_alloc: true });
            let t = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, n, n);
            let buf = sys::ggml_backend_alloc_ctx_tensors(ctx, dev.backend);
            if buf.is_null() {
                sys::ggml_free(ctx);
                bail!("could not allocate a {n}×{n} identity on the device");
            }
            let mut eye = vec![0.0f32; (n * n) as usize];
            for i in 0..n as usize {
                eye[i * n as usize + i] = 1.0;
            }
            sys::ggml_backend_tensor_set(t, eye.as_ptr().cast(), 0, eye.len() * 4);
            dev.identities.push((n, ctx, buf, t));
            Ok(t)
        }
    }

    /// At least `n` ones on device `d` (`[len]` f32, len ≥ n), allocated and filled once per
    /// length that outgrows the last.
    fn ones(&mut self, d: usize, n: i64) -> Result<*mut sys::ggml_tensor> {
        let dev = &mut self.devices[d];
        if let Some(&(_, _, _, t)) = dev.ones.last().filter(|e| e.0 >= n) {
            return Ok(t);
        }
        let len = (n.max(1) as u64).next_power_of_two() as i64;
        // SAFETY: a context of one tensor, allocated on the device and filled once.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: sys::ggml_tensor_overhead() * 2, mem_buffer: std::ptr::null_mut(), no_alloc: true });
            let t = sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_F32, len);
            let buf = sys::ggml_backend_alloc_ctx_tensors(ctx, dev.backend);
            if buf.is_null() {
                sys::ggml_free(ctx);
                bail!("could not allocate {len} ones on the device");
            }
            let v = vec![1.0f32; len as usize];
            sys::ggml_backend_tensor_set(t, v.as_ptr().cast(), 0, v.len() * 4);
            dev.ones.push((len, ctx, buf, t));
            Ok(t)
        }
    }

    /// Allocates `g` on device `d` and starts computing it (the caller waits).
    unsafe fn run(&mut self, d: usize, g: &Graph, outs: &[*mut sys::ggml_tensor]) -> Result<()> {
        let dev = &self.devices[d];
        unsafe {
            let gf = sys::ggml_new_graph_custom(g.ctx, g.capacity as usize, false);
            for &o in outs {
                sys::ggml_build_forward_expand(gf, o);
            }
            self.first_node = sys::ggml_graph_node(gf, 0) as usize;
            for i in 0..sys::ggml_graph_n_nodes(gf) {
                let op = (*sys::ggml_graph_node(gf, i)).op;
                let view = [sys::GGML_OP_NONE, sys::GGML_OP_RESHAPE, sys::GGML_OP_VIEW, sys::GGML_OP_PERMUTE, sys::GGML_OP_TRANSPOSE].contains(&op);
                self.ops_run += u64::from(!view);
            }
            if !sys::ggml_gallocr_alloc_graph(dev.galloc, gf) {
                bail!("could not allocate the reduction on the device");
            }
            // started, not waited for: commit waits at once, launch later
            let st = sys::ggml_backend_graph_compute_async(dev.backend, gf);
            if st != sys::GGML_STATUS_SUCCESS {
                bail!("the reduction failed on the device (status {st})");
            }
            Ok(())
        }
    }
}

impl Drop for DeviceReducer {
    fn drop(&mut self) {
        self.wait();
        // SAFETY: each object was created here and is freed once.
        unsafe {
            for a in self.accumulators.drain(..) {
                sys::ggml_backend_buffer_free(a.buf);
                sys::ggml_free(a.ctx);
            }
            for d in self.devices.drain(..) {
                for (_, ctx, buf, _) in d.identities.into_iter().chain(d.ones) {
                    sys::ggml_backend_buffer_free(buf);
                    sys::ggml_free(ctx);
                }
                drop(d.spare);
                sys::ggml_gallocr_free(d.galloc);
                sys::ggml_backend_free(d.backend);
            }
        }
    }
}

/// A metadata-only context for one reduction graph.
struct Graph {
    ctx: *mut sys::ggml_context,
    /// tensors (and graph nodes) it has room for
    capacity: usize,
}

impl Graph {
    fn new(capacity: usize) -> Result<Graph> {
        // SAFETY: a no_alloc context for `capacity` tensors and one graph of as many nodes.
        let ctx = unsafe {
            sys::ggml_init(sys::ggml_init_params {
                mem_size: sys::ggml_tensor_overhead() * capacity + sys::ggml_graph_overhead_custom(capacity, false),
                mem_buffer: std::ptr::null_mut(),
                no_alloc: true,
            })
        };
        if ctx.is_null() {
            bail!("ggml_init failed");
        }
        Ok(Graph { ctx, capacity })
    }

    /// The same context emptied, for the next graph.
    fn reset(self) -> Graph {
        // SAFETY: nothing built in it is used any more (its graph was computed).
        unsafe { sys::ggml_reset(self.ctx) };
        self
    }
}

/// A leaf in `ctx` with `x`'s type, shape, strides, buffer and data, and no sources.
unsafe fn leaf(ctx: *mut sys::ggml_context, x: *mut sys::ggml_tensor) -> *mut sys::ggml_tensor {
    unsafe {
        let l = sys::ggml_new_tensor(ctx, (*x).type_, 4, (*x).ne.as_ptr());
        (*l).nb = (*x).nb;
        (*l).buffer = (*x).buffer;
        (*l).data = (*x).data;
        l
    }
}

/// `x` itself where it is contiguous, else a contiguous copy (a copy is a kernel on a GPU).
unsafe fn contiguous(ctx: *mut sys::ggml_context, x: *mut sys::ggml_tensor) -> *mut sys::ggml_tensor {
    unsafe {
        if sys::ggml_is_contiguous(x) {
            x
        } else {
            sys::ggml_cont(ctx, x)
        }
    }
}

/// `[1, a, b]` of the ones (`a·b` of them, contiguous): the second operand of an outer product
/// that sums over the first operand's rows.
unsafe fn ones_view(ctx: *mut sys::ggml_context, ones: *mut sys::ggml_tensor, a: i64, b: i64) -> *mut sys::ggml_tensor {
    unsafe { sys::ggml_view_3d(ctx, ones, 1, a, b, 4, 4 * a as usize, 0) }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created in new().
        unsafe { sys::ggml_free(self.ctx) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dense input's Σx² per column and its rows, accumulated over ubatches; each ubatch's
    /// graph is built at the last one's addresses even when other memory was allocated in
    /// between (as the observer does), so a backend that records graphs can replay it.
    #[test]
    fn batches_reuse_their_context_and_sum_squares() {
        // SAFETY: a CPU tensor of ours, live for the reducer's use of it.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: sys::ggml_tensor_overhead() * 2, mem_buffer: std::ptr::null_mut(), no_alloc: true });
            let x = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, 3, 2);
            let buf = sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx, sys::ggml_backend_cpu_buffer_type());
            assert!(!buf.is_null());
            let vals = [1.0f32, 2.0, 3.0, -1.0, 0.5, 2.0];
            sys::ggml_backend_tensor_set(x, vals.as_ptr().cast(), 0, 24);
            let mut r = DeviceReducer::default();
            r.batching = true;
            let (mut firsts, mut held) = (Vec::new(), Vec::new());
            for _ in 0..3 {
                r.dense("w", Node::from_raw(x).unwrap(), 1).unwrap();
                r.commit().unwrap();
                firsts.push(r.first_node);
                // what a freed context's memory would be handed to next
                held.push(vec![1u8; 16 << 20]);
            }
            assert!(firsts[0] != 0 && firsts.iter().all(|&f| f == firsts[0]), "first nodes at {firsts:x?}");
            let out = r.drain().unwrap();
            assert_eq!(out[0].sums, vec![6.0, 12.75, 39.0]);
            assert_eq!(out[0].counts, vec![6.0]);
            drop(r);
            sys::ggml_backend_buffer_free(buf);
            sys::ggml_free(ctx);
        }
    }

    /// Per-expert sums and counts of MUL_MAT_ID inputs, both kinds (one row per slot, and one
    /// row per token shared by its slots), against the host's, over two ubatches: values are
    /// multiples of 1/2, so every square and sum is exact in f32 and the comparison is exact.
    /// The ids are a strided view (as the argsort view is without patch 0003).
    #[test]
    fn expert_sums_and_counts_equal_the_hosts() {
        let (n_in, k, t, n_expert, stride) = (5i64, 3i64, 4i64, 6i64, 8i64);
        // token t's slots: skewed, expert 5 never chosen
        let ids: Vec<i32> = (0..t).flat_map(|tok| [0, (1 + tok % 2) as i32, (2 + tok % 3) as i32]).collect();
        // SAFETY: CPU tensors of ours, live for the reducer's use of them.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: sys::ggml_tensor_overhead() * 8, mem_buffer: std::ptr::null_mut(), no_alloc: true });
            let per_slot = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, n_in, k, t);
            let per_tok = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, n_in, 1, t);
            let wide = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_I32, stride, t);
            let buf = sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx, sys::ggml_backend_cpu_buffer_type());
            assert!(!buf.is_null());
            let val = |i: i64| ((i * 7) % 11 - 5) as f32 * 0.5;
            let xs: Vec<f32> = (0..n_in * k * t).map(val).collect();
            let xt: Vec<f32> = (0..n_in * t).map(|i| val(i + 3)).collect();
            sys::ggml_backend_tensor_set(per_slot, xs.as_ptr().cast(), 0, xs.len() * 4);
            sys::ggml_backend_tensor_set(per_tok, xt.as_ptr().cast(), 0, xt.len() * 4);
            let mut w = vec![-1i32; (stride * t) as usize];
            for tok in 0..t as usize {
                w[tok * stride as usize..][..k as usize].copy_from_slice(&ids[tok * k as usize..][..k as usize]);
            }
            sys::ggml_backend_tensor_set(wide, w.as_ptr().cast(), 0, w.len() * 4);
            // the first k of each row of `wide`: [k, T], rows `stride` apart
            let sel = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_I32, k, t);
            (*sel).nb[1] = (*wide).nb[1];
            (*sel).nb[2] = (*wide).nb[2];
            (*sel).nb[3] = (*wide).nb[3];
            (*sel).buffer = (*wide).buffer;
            (*sel).data = (*wide).data;
            assert!(!sys::ggml_is_contiguous(sel));
            let mut r = DeviceReducer::default();
            r.batching = true;
            for _ in 0..2 {
                r.by_expert("down", Node::from_raw(per_slot).unwrap(), Node::from_raw(sel).unwrap(), n_expert).unwrap();
                r.by_expert("up", Node::from_raw(per_tok).unwrap(), Node::from_raw(sel).unwrap(), n_expert).unwrap();
                r.commit().unwrap();
            }
            let out = r.drain().unwrap();
            // the host's sums, twice (two ubatches)
            let (mut down, mut up, mut counts) = (vec![0f32; (n_in * n_expert) as usize], vec![0f32; (n_in * n_expert) as usize], vec![0f32; n_expert as usize]);
            for _ in 0..2 {
                for tok in 0..t {
                    for s in 0..k {
                        let e = ids[(tok * k + s) as usize] as i64;
                        counts[e as usize] += 1.0;
                        for j in 0..n_in {
                            let a = xs[(j + n_in * (s + k * tok)) as usize];
                            let b = xt[(j + n_in * tok) as usize];
                            down[(e * n_in + j) as usize] += a * a;
                            up[(e * n_in + j) as usize] += b * b;
                        }
                    }
                }
            }
            assert_eq!(counts[5], 0.0);
            let names: Vec<&str> = out.iter().map(|o| o.name.as_str()).collect();
            assert_eq!(names, ["down", "up"]);
            assert_eq!((out[0].n_in, out[0].n_as), (n_in, n_expert));
            assert_eq!(out[0].sums, down);
            assert_eq!(out[1].sums, up);
            assert_eq!(out[0].counts, counts);
            assert_eq!(out[1].counts, counts);
            drop(r);
            sys::ggml_backend_buffer_free(buf);
            sys::ggml_free(ctx);
        }
    }

    /// A weight of several matrices (MLA's per-head `attn_k_b` `[n_in, n_out, n_head]`), its
    /// input a permuted view `[n_in, T, n_head]` of `[n_in, n_head, T]` (as the graph permutes
    /// q): per-matrix sums and the rows of one plane, equal to the host collector's entry
    /// (values multiples of 1/2: exact in f32).
    #[test]
    fn per_matrix_sums_of_a_permuted_input_equal_the_hosts() {
        let (n_in, n_head, t) = (4i64, 3i64, 5i64);
        // SAFETY: CPU tensors of ours, live for the reducer's and the collector's use of them.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: sys::ggml_tensor_overhead() * 4, mem_buffer: std::ptr::null_mut(), no_alloc: true });
            let raw = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, n_in, n_head, t);
            let buf = sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx, sys::ggml_backend_cpu_buffer_type());
            assert!(!buf.is_null());
            let vals: Vec<f32> = (0..n_in * n_head * t).map(|i| ((i * 5) % 9 - 4) as f32 * 0.5).collect();
            sys::ggml_backend_tensor_set(raw, vals.as_ptr().cast(), 0, vals.len() * 4);
            let x = sys::ggml_permute(ctx, raw, 0, 2, 1, 3);
            // a view made after the allocation: in the tensor it views, as the scheduler's are
            (*x).buffer = (*raw).buffer;
            (*x).data = (*raw).data;
            assert!(!sys::ggml_is_contiguous(x));
            assert_eq!((*x).ne, [n_in, t, n_head, 1]);
            let w_ne = [n_in, 7, n_head, 1];
            assert!(DeviceReducer::plane_per_matrix(w_ne, (*x).ne));
            assert!(!DeviceReducer::plane_per_matrix([n_in, 7, 1, 1], (*x).ne));
            let mut r = DeviceReducer::default();
            r.batching = true;
            let mut host = crate::collect::imatrix::ImatrixCollector::new(
                crate::collect::imatrix::ImatrixConfig { chunk_size: 1 << 20, out_freq: 1 << 20, save_freq: 0, process_output: false, small_by_rows: false },
                Default::default(),
            );
            for _ in 0..2 {
                r.dense("kb", Node::from_raw(x).unwrap(), n_head).unwrap();
                r.commit().unwrap();
                let node = Node::from_raw(x).unwrap();
                let mut scratch = Vec::new();
                host.collect_mul_mat("kb", w_ne, &node.info(), node.bytes(&mut scratch)).unwrap();
            }
            let out = r.drain().unwrap();
            let e = &host.state.stats["kb"];
            assert_eq!((out[0].n_in, out[0].n_as, out[0].n_mat), (n_in, 0, n_head));
            assert_eq!(out[0].sums, e.values);
            assert_eq!(out[0].counts, vec![(2 * t) as f32]);
            assert_eq!(e.counts, vec![2 * t]);
            // and the imatrix entry made from the drain is the host's
            let mut dev = crate::collect::imatrix::ImatrixCollector::new(host.cfg.clone(), Default::default());
            dev.add_reduced(&out).unwrap();
            assert_eq!((&dev.state.stats["kb"].values, &dev.state.stats["kb"].counts), (&e.values, &e.counts));
            drop(r);
            sys::ggml_backend_buffer_free(buf);
            sys::ggml_free(ctx);
        }
    }
}
