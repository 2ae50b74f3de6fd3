//! Benchmark (not a test): the host work of REAP + trace collection per ubatch, without a
//! model, on the shapes of a large MoE (defaults: 48 layers, 512 experts top-10, -ub 512,
//! --trace-top-n 64). On a GPU this work runs inside the eval callback while the device
//! waits, so it bounds how close a full collection can get to a plain forward pass.
//!
//!     cargo run --release --example bench_host_collection -- [LAYERS EXPERTS K TOKENS TOP_N RUNS [N_EMBD FFN]]
//!
//! Two paths, the same collectors the observer drives:
//! - whole: the router probabilities `[n_expert, T]` read whole (the host path, and offloaded
//!   without patch 0003): the trace's top-n chosen among all of them on the host;
//! - device: patch 0003's selected probabilities and top-(n+1) candidates (as ggml's CPU top-k
//!   leaves them: nearly sorted), ordered on the host.
//!
//! Both get patch 0001's per-slot norms and maxima (offloaded); the device path is also timed
//! without a trace (REAP sums alone), and both on every core: each layer's reads on one of the
//! callback's threads, the rows encoded on the writer's. Prints medians per ubatch of the
//! callback's part (the collectors; the trace's rows are moved out, not encoded) and of the
//! writer thread's part (candidates ordered, rows encoded), and the bytes each path reads per
//! token.
//!
//! Then the exact imatrix's host work per ubatch (offloaded, each collected matmul input is
//! copied and its Σx² summed in the callback): per layer the inputs of q (k and v share it),
//! the attention output, the router, the experts' up (gate shares it; `[N_EMBD, 1, T]`, each
//! token added to its K experts) and down (`[FFN, K, T]`), defaults 2048 and 512; on one
//! thread, and on every core (`collect::pool`, used when layers are offloaded).

use reap_imatrix::collect::imatrix::{Imatrix, ImatrixCollector, ImatrixConfig};
use reap_imatrix::llama::reduce::Reduced;
use reap_imatrix::collect::pool::Pool;
use reap_imatrix::collect::reap::{LayerRead, LayerReadKind, ReapCollector};
use reap_imatrix::collect::trace_rows::{encode_ubatches, top_candidates, TraceRows};
use reap_imatrix::fixture::rng::Rng;
use reap_imatrix::formats::trace::TraceHeader;
use reap_imatrix::llama::{sys, TensorInfo};
use std::time::Instant;

struct Layer {
    probs: Vec<u8>,
    topk: Vec<u8>,
    sel_p: Vec<u8>,
    g: Vec<u8>,
    norms: Vec<u8>,
    maxes: Vec<u8>,
    cand: Vec<u8>,
    cand_p: Vec<u8>,
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn bytes_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn layer(rng: &mut Rng, e: usize, k: usize, t: usize, n: usize) -> Layer {
    let mut probs = Vec::with_capacity(e * t);
    let (mut topk, mut sel_p, mut g, mut norms, mut maxes, mut cand, mut cand_p) = Default::default();
    let bias: Vec<f64> = (0..e).map(|_| rng.normal() * 2.0).collect();
    let mut order = Vec::new();
    for _ in 0..t {
        let logits: Vec<f64> = bias.iter().map(|b| b + rng.normal()).collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let s: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        let row: Vec<f32> = logits.iter().map(|l| ((l - m).exp() / s) as f32).collect();
        top_candidates(&row, n + 1, &mut order);
        let sel: Vec<u16> = order[..k].to_vec();
        let sum: f32 = sel.iter().map(|&i| row[i as usize]).sum();
        for &i in &sel {
            Vec::push(&mut topk, i as i32);
            Vec::push(&mut sel_p, row[i as usize]);
            Vec::push(&mut g, row[i as usize] / sum);
            Vec::push(&mut norms, 1.0 + rng.uniform() as f32);
            Vec::push(&mut maxes, rng.uniform() as f32);
        }
        // ggml's CPU top-k: partially sorted, its first two swapped
        let mut c: Vec<u16> = order.clone();
        c.swap(0, 1);
        for &i in &c {
            Vec::push(&mut cand, i as i32);
            Vec::push(&mut cand_p, row[i as usize]);
        }
        probs.extend_from_slice(&row);
    }
    Layer {
        probs: bytes_f32(&probs),
        topk: bytes_i32(&topk),
        sel_p: bytes_f32(&sel_p),
        g: bytes_f32(&g),
        norms: bytes_f32(&norms),
        maxes: bytes_f32(&maxes),
        cand: bytes_i32(&cand),
        cand_p: bytes_f32(&cand_p),
    }
}

fn info(name: &str, ne: [i64; 4], ty: sys::ggml_type) -> TensorInfo<'_> {
    let nb0 = 4usize;
    let nb = [nb0, nb0 * ne[0] as usize, nb0 * (ne[0] * ne[1]) as usize, nb0 * (ne[0] * ne[1] * ne[2]) as usize];
    TensorInfo { name, op: 0, ty, ne, nb }
}

/// One ubatch's reads, layer after layer, or (`by_layer`, the device path) each layer's on
/// one of the pool's threads, as the observer makes them with `--imatrix-on-device`.
fn ubatch(c: &mut ReapCollector, trace: &mut TraceRows, layers: &[Layer], e: usize, k: usize, t: usize, n: usize, device: bool, by_layer: Option<&Pool>) {
    let (ei, ki, ti, ni) = (e as i64, k as i64, t as i64, n as i64);
    let f32t = sys::GGML_TYPE_F32;
    if let Some(pool) = by_layer {
        let mut reads = Vec::new();
        for (l, d) in layers.iter().enumerate() {
            let s = c.slot_for(l, e, k).unwrap();
            c.on_probs_on_device(s, &info("ffn_moe_probs", [ei, ti, 1, 1], f32t)).unwrap();
            fn read<'a>(kind: LayerReadKind, t: TensorInfo<'a>, data: &'a [u8]) -> LayerRead<'a> {
                LayerRead { kind, t, data: std::borrow::Cow::Borrowed(data), from: "f" }
            }
            let mut r = Vec::new();
            if trace.limit > 0 {
                r.push(read(LayerReadKind::CandIds, info("ffn_moe_cand", [ni + 1, ti, 1, 1], sys::GGML_TYPE_I32), &d.cand));
                r.push(read(LayerReadKind::CandProbs, info("ffn_moe_cand_p", [1, ni + 1, ti, 1], f32t), &d.cand_p));
            }
            r.push(read(LayerReadKind::Topk, info("ffn_moe_topk", [ki, ti, 1, 1], sys::GGML_TYPE_I32), &d.topk));
            r.push(read(LayerReadKind::SelProbs, info("ffn_moe_weights", [1, ki, ti, 1], f32t), &d.sel_p));
            r.push(read(LayerReadKind::Norms, info("n", [1, ki, ti, 1], f32t), &d.norms));
            r.push(read(LayerReadKind::Maxes, info("m", [1, ki, ti, 1], f32t), &d.maxes));
            r.push(read(LayerReadKind::Weighted, info("g", [1, ki, ti, 1], f32t), &d.g));
            reads.push(r);
        }
        assert!(c.read_layers(reads, pool).unwrap().is_empty());
    }
    for (l, d) in layers.iter().enumerate().filter(|_| by_layer.is_none()) {
        let s = c.slot_for(l, e, k).unwrap();
        let p = info("ffn_moe_probs", [ei, ti, 1, 1], f32t);
        if !device {
            c.on_probs(s, &p, &d.probs, false).unwrap();
        } else {
            c.on_probs_on_device(s, &p).unwrap();
            if trace.limit > 0 {
                c.on_cand_ids(s, &info("ffn_moe_cand", [ni + 1, ti, 1, 1], sys::GGML_TYPE_I32), &d.cand).unwrap();
                let undecided = c.on_cand_probs(s, &info("ffn_moe_cand_p", [1, ni + 1, ti, 1], f32t), &d.cand_p).unwrap();
                assert!(undecided.is_empty());
            }
        }
        c.on_topk(s, &info("ffn_moe_topk", [ki, ti, 1, 1], sys::GGML_TYPE_I32), &d.topk).unwrap();
        if device {
            c.on_sel_probs(s, &info("ffn_moe_weights", [1, ki, ti, 1], f32t), &d.sel_p).unwrap();
        }
        c.on_expert_norms(s, &info("n", [1, ki, ti, 1], f32t), &d.norms, "f").unwrap();
        c.on_expert_maxes(s, &info("m", [1, ki, ti, 1], f32t), &d.maxes).unwrap();
        c.on_weighted(s, "f", &info("g", [1, ki, ti, 1], f32t), &d.g).unwrap();
    }
    if trace.limit == 0 {
        return; // REAP sums only
    }
    let header = TraceHeader { layers: (0..layers.len() as u32).collect(), n_expert: e as u32, k: k as u32, top_n: n as u32, n_tokens: 0, flags: 0 };
    let sources: Vec<(u32, u32, i32)> = (0..t as u32).map(|i| (0, i, i as i32)).collect();
    trace.add_ubatch(&header.layout(), &mut c.routing, &sources);
}

/// The writer thread's part: the ubatch's rows ordered and encoded (on `pool`'s threads where
/// given, as where layers are offloaded), its routing set recycled.
fn encode(trace: &mut TraceRows, buf: &mut Vec<u8>, pool: Option<&Pool>) {
    buf.clear();
    let pending = std::mem::take(&mut trace.pending);
    encode_ubatches(&pending, pool, buf).unwrap();
    trace.spare.extend(pending.into_iter().map(|u| u.into_spare()));
    trace.rows = 0;
}

/// The exact imatrix's sums of one ubatch: `inputs` (dense x, its rows), `up` `[n_embd, 1, T]`
/// and `down` `[ffn, k, T]` with `ids` `[k, T]`, for every layer.
fn imatrix_ubatch(c: &mut ImatrixCollector, layers: usize, e: usize, k: usize, t: usize, n_embd: usize, ffn: usize, x: &[u8], down: &[u8], ids: &[u8]) {
    let (ti, ki, d, f) = (t as i64, k as i64, n_embd as i64, ffn as i64);
    let f32t = sys::GGML_TYPE_F32;
    let ids_info = info("ids", [ki, ti, 1, 1], sys::GGML_TYPE_I32);
    for l in 0..layers {
        for w in ["attn_q", "attn_output", "ffn_gate_inp"] {
            c.collect_mul_mat(&format!("blk.{l}.{w}.weight"), [d, d, 1, 1], &info("x", [d, ti, 1, 1], f32t), x).unwrap();
        }
        c.collect_mul_mat_id(&format!("blk.{l}.ffn_up_exps.weight"), e as i64, &info("x", [d, 1, ti, 1], f32t), x, &ids_info, ids).unwrap();
        c.collect_mul_mat_id(&format!("blk.{l}.ffn_down_exps.weight"), e as i64, &info("x", [f, ki, ti, 1], f32t), down, &ids_info, ids).unwrap();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let a: Vec<usize> = std::env::args().skip(1).map(|s| s.parse().expect("numbers: LAYERS EXPERTS K TOKENS TOP_N RUNS")).collect();
    let get = |i: usize, d: usize| a.get(i).copied().unwrap_or(d);
    let (n_layer, e, k, t, n, runs) = (get(0, 48), get(1, 512), get(2, 10), get(3, 512), get(4, 64), get(5, 5));
    let (n_embd, ffn) = (get(6, 2048), get(7, 512));
    assert!(n + 1 < e && k <= n, "need TOP_N + 1 < EXPERTS and K <= TOP_N");
    let mut rng = Rng::new(7);
    let layers: Vec<Layer> = (0..n_layer).map(|_| layer(&mut rng, e, k, t, n)).collect();
    println!("host collection per ubatch: {n_layer} layers, {e} experts top-{k}, {t} tokens, trace top-{n}; medians of {runs}");
    let mut results = Vec::new();
    let mut buf = Vec::new();
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let writer_pool = Pool::new(cores);
    // the callback's pool, as with layers offloaded (-t's threads; these are the cores here)
    let layer_pool = Pool::new(cores);
    let paths = [(false, true, None, None), (true, true, None, None), (true, true, Some(&writer_pool), Some(&layer_pool)), (true, false, None, None), (true, false, None, Some(&layer_pool))];
    for (device, with_trace, pool, by_layer) in paths {
        let mut c = ReapCollector::new();
        let mut trace = TraceRows::new(n, if with_trace { u64::MAX } else { 0 });
        // warm-up, then runs: (in the callback, on the writer thread)
        let times: Vec<(f64, f64)> = (0..=runs)
            .map(|_| {
                let t0 = Instant::now();
                ubatch(&mut c, &mut trace, &layers, e, k, t, n, device, by_layer);
                let t1 = Instant::now();
                encode(&mut trace, &mut buf, pool);
                ((t1 - t0).as_secs_f64(), t1.elapsed().as_secs_f64())
            })
            .skip(1)
            .collect();
        let (cb, wr) = (median(times.iter().map(|x| x.0).collect()), median(times.iter().map(|x| x.1).collect()));
        // bytes read per token: per layer the ids, gates, norms and maxima (4 × k × 4), and
        // the probabilities whole (4 × e) or the selected ones and the candidates (4k + 8(n+1))
        let per_layer = 16 * k + if !device { 4 * e } else if with_trace { 4 * k + 8 * (n + 1) } else { 4 * k };
        println!(
            "  {:<18} callback {:7.2} ms per ubatch ({:5.3} us per token-layer), trace encoding {:7.2} ms; {} bytes read per token",
            match (device, with_trace, by_layer) {
                (false, _, _) => "whole".to_string(),
                (true, true, None) => "device".to_string(),
                (true, true, Some(p)) => format!("device, {} threads", p.threads()),
                (true, false, None) => "device, no trace".to_string(),
                (true, false, Some(p)) => format!("  no trace, {} thr.", p.threads()),
            },
            cb * 1e3,
            cb * 1e6 / (t * n_layer) as f64,
            wr * 1e3,
            per_layer * n_layer
        );
        results.push((cb, wr));
    }
    println!(
        "  callback device / whole: {:.3}; callback + encoding device / whole: {:.3}",
        results[1].0 / results[0].0,
        (results[1].0 + results[1].1) / (results[0].0 + results[0].1)
    );
    println!(
        "  on 1 / {cores} threads (layers in the callback, rows on the writer): callback {:.2}x, trace encoding {:.2}x; no trace, callback {:.2}x",
        results[1].0 / results[2].0,
        results[1].1 / results[2].1,
        results[3].0 / results[4].0
    );

    // the exact imatrix: one layer's inputs (the same for every layer), routed as the
    // probabilities above route layer 0
    let x: Vec<f32> = (0..n_embd * t).map(|_| rng.normal() as f32).collect();
    let down: Vec<f32> = (0..ffn * k * t).map(|_| rng.normal() as f32).collect();
    let (x, down, ids) = (bytes_f32(&x), bytes_f32(&down), layers[0].topk.clone());
    let mut medians = Vec::new();
    for threads in [1, cores] {
        let cfg = ImatrixConfig { chunk_size: i32::MAX, out_freq: 1, save_freq: 0, process_output: false, small_by_rows: false };
        let mut c = ImatrixCollector::new(cfg, Imatrix::default());
        c.pool = (threads > 1).then(|| Pool::new(threads));
        let times: Vec<f64> = (0..=runs)
            .map(|_| {
                let t0 = Instant::now();
                imatrix_ubatch(&mut c, n_layer, e, k, t, n_embd, ffn, &x, &down, &ids);
                t0.elapsed().as_secs_f64()
            })
            .skip(1)
            .collect();
        medians.push(median(times));
    }
    let floats = n_layer * (4 * n_embd * t + k * n_embd * t + ffn * k * t);
    println!(
        "exact imatrix per ubatch (n_embd {n_embd}, expert FFN {ffn}; {:.0} MB of inputs, {:.0} M multiply-adds): 1 thread {:.2} ms, {cores} threads {:.2} ms ({:.2}x)",
        (n_layer * (4 * n_embd * t + ffn * k * t) * 4) as f64 / 1e6,
        floats as f64 / 1e6,
        medians[0] * 1e3,
        medians[1] * 1e3,
        medians[0] / medians[1]
    );

    // --imatrix-on-device: what adding one drain of the device sums into the imatrix costs on
    // the host (the copy from the device comes on top): per layer q (k and v its aliases), the
    // attention output, the router, the experts' up (gate its alias) and down
    let reduced = |name: String, n_in: usize, n_as: usize, same_as: Option<usize>| {
        let (sums, counts) = if same_as.is_some() { (Vec::new(), Vec::new()) } else { (vec![1.0f32; n_in * n_as.max(1)], vec![4.0f32; n_as.max(1)]) };
        Reduced { name, n_in: n_in as i64, n_as: n_as as i64, n_mat: 1, sums, counts, same_as }
    };
    let mut drain = Vec::new();
    for l in 0..n_layer {
        let q = drain.len();
        drain.push(reduced(format!("blk.{l}.attn_q.weight"), n_embd, 0, None));
        for w in ["attn_k", "attn_v"] {
            drain.push(reduced(format!("blk.{l}.{w}.weight"), n_embd, 0, Some(q)));
        }
        drain.push(reduced(format!("blk.{l}.attn_output.weight"), n_embd, 0, None));
        drain.push(reduced(format!("blk.{l}.ffn_gate_inp.weight"), n_embd, 0, None));
        let up = drain.len();
        drain.push(reduced(format!("blk.{l}.ffn_up_exps.weight"), n_embd, e, None));
        drain.push(reduced(format!("blk.{l}.ffn_gate_exps.weight"), n_embd, e, Some(up)));
        drain.push(reduced(format!("blk.{l}.ffn_down_exps.weight"), ffn, e, None));
    }
    let cfg = ImatrixConfig { chunk_size: i32::MAX, out_freq: 1, save_freq: 0, process_output: false, small_by_rows: false };
    let mut c = ImatrixCollector::new(cfg, Imatrix::default());
    let times: Vec<f64> = (0..=runs)
        .map(|_| {
            let t0 = Instant::now();
            c.add_reduced(&drain).unwrap();
            t0.elapsed().as_secs_f64()
        })
        .skip(1)
        .collect();
    let copied: usize = drain.iter().map(|r| 4 * (r.sums.len() + if r.n_as > 0 { r.counts.len() } else { 0 })).sum();
    println!(
        "--imatrix-on-device, one drain added on the host ({:.1} MB copied from the device per drain): {:.2} ms",
        copied as f64 / 1e6,
        median(times) * 1e3
    );
}
