//! `--nextn`: the nextn/MTP block's own pass (llama.cpp's MTP graph, teacher-forced as its MTP
//! drafting feeds it). The block's REAP sums against an independent computation from the
//! weights, fed by this test as upstream's drafter pairs tokens with hidden states; the trunk's
//! files unchanged; check, select, prune and replay with the block in the files.

use super::reap::{dot_row, gguf_f32};
use super::util::*;
use reap_imatrix::formats::saliency::Saliency;
use reap_imatrix::llama::{Context, ContextParams, GraphObserver, Model, ModelParams, Node};
use std::path::Path;
use std::process::Command;

/// The trunk's final hidden states (`result_norm`), row after row.
struct Hidden(Vec<f32>);

impl GraphObserver for Hidden {
    fn wants(&mut self, node: Node<'_>) -> bool {
        node.name() == "result_norm"
    }
    fn observe(&mut self, node: Node<'_>) -> bool {
        let mut s = Vec::new();
        self.0.extend(node.bytes(&mut s).chunks_exact(4).map(|b| f32::from_ne_bytes(b.try_into().unwrap())));
        true
    }
}

/// In the MTP graph: the router's input of `block` and the normed hidden-state input.
struct MtpInputs {
    router: String,
    hnorm: String,
    x: Vec<f32>,
    h: Vec<f32>,
}

impl GraphObserver for MtpInputs {
    fn wants(&mut self, node: Node<'_>) -> bool {
        node.src(0).is_some_and(|s| s.name() == self.router) || node.name() == self.hnorm
    }
    fn observe(&mut self, node: Node<'_>) -> bool {
        let mut s = Vec::new();
        let (dst, t) = if node.name() == self.hnorm { (&mut self.h, node) } else { (&mut self.x, node.src(1).unwrap()) };
        let info = t.info();
        let data = t.bytes(&mut s);
        for tok in 0..info.ne[1] {
            for j in 0..info.ne[0] {
                let o = info.offset([j, tok, 0, 0]);
                dst.push(f32::from_ne_bytes(data[o..o + 4].try_into().unwrap()));
            }
        }
        true
    }
}

fn calibrate(dir: &Path, model: &Path, extra: &[&str]) -> std::process::Output {
    run(Command::new(ours()).current_dir(dir).arg("-m").arg(model).arg("-f").arg(corpus()).args(["-t", "2", "--no-ppl", "-o", "i.gguf"]).args(extra))
}

#[test]
fn the_nextn_block_gets_the_sums_of_an_independent_computation_and_the_trunk_is_unchanged() {
    let d = temp_dir("nextn-independent");
    let model_path = d.join("m.gguf");
    // f32 weights: the GGUF holds exactly what the graph multiplies by; blocks 0 (dense), 1, 2 (nextn)
    run_ok(Command::new(ours()).args(["fixture", "--arch", "glm4moe", "--wtype", "f32", "--layers", "2", "-o"]).arg(&model_path));
    let (n_ctx, n_batch, n_chunk) = (64usize, 32usize, 2usize);
    let flags = ["-c", "64", "-b", "32", "--chunks", "2", "--trace-out", "t.bin"];
    std::fs::create_dir_all(d.join("plain")).unwrap();
    std::fs::create_dir_all(d.join("nextn")).unwrap();
    let plain = calibrate(&d.join("plain"), &model_path, &flags);
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let out = calibrate(&d.join("nextn"), &model_path, &[&flags[..], &["--nextn"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // the trunk's files are the run's without --nextn: imatrix and trace byte for byte, its layers' sums
    assert_same_bytes(&d.join("plain/i.gguf"), &d.join("nextn/i.gguf"));
    assert_same_bytes(&d.join("plain/t.bin"), &d.join("nextn/t.bin"));
    let a = Saliency::read(&d.join("plain/i.reap.json")).unwrap();
    let s = Saliency::read(&d.join("nextn/i.reap.json")).unwrap();
    assert_eq!(s.nextn_blocks, vec![2]);
    assert_eq!(s.trunk(), &a.layers[..]);
    assert_eq!(s.layers.len(), a.layers.len() + 1);
    let lay = s.layers.last().unwrap();
    assert_eq!((lay.layer, lay.tokens), (2, (n_ctx * n_chunk) as u64));
    let (n_expert, k) = (lay.n_expert, lay.n_expert_used);

    // the same tokens through the trunk, then the MTP graph fed as upstream's drafter feeds it
    let model = Model::load(&model_path, &ModelParams { load_mtp: true, ..Default::default() }).unwrap();
    let mut text = std::fs::read(corpus()).unwrap();
    text.pop();
    let tokens = model.vocab().tokenize(&text, true, false).unwrap();
    let p = ContextParams { n_ctx: n_ctx as u32, n_batch: n_batch as u32, n_ubatch: n_batch as u32, n_seq_max: 1, n_threads: 2, n_threads_batch: 2, flash_attn: -1, ..Default::default() };
    let mut trunk = Context::new(&model, &p, Hidden(Vec::new())).unwrap();
    let block = 2usize;
    let obs = MtpInputs { router: format!("blk.{block}.ffn_gate_inp.weight"), hnorm: format!("mtp_hnorm-{block}"), x: Vec::new(), h: Vec::new() };
    let mut mtp = Context::new(&model, &ContextParams { mtp: true, ..p.clone() }, obs).unwrap();
    let n_embd = model.n_embd() as usize;
    let mut fed_h: Vec<f32> = Vec::new();
    for c in 0..n_chunk {
        trunk.clear_memory();
        mtp.clear_memory();
        let chunk = &tokens[c * n_ctx..(c + 1) * n_ctx];
        let mut prev = vec![0f32; n_embd]; // the drafter's state before a sequence's first token
        for j in 0..n_ctx / n_batch {
            trunk.observer_mut().0.clear();
            let mut b = trunk.batch();
            for i in 0..n_batch {
                b.add(chunk[j * n_batch + i], (j * n_batch + i) as i32, 0, true);
            }
            trunk.decode(&mut b).unwrap();
            let hidden = trunk.observer().0.clone();
            assert_eq!(hidden.len(), n_batch * n_embd);
            let mut m = mtp.batch();
            for i in 0..n_batch {
                // token p with the trunk's state at p − 1
                m.add_with_state(chunk[j * n_batch + i], (j * n_batch + i) as i32, 0, false, &prev);
                fed_h.extend_from_slice(&prev);
                prev.copy_from_slice(&hidden[i * n_embd..(i + 1) * n_embd]);
            }
            mtp.decode(&mut m).unwrap();
        }
    }
    let cap = mtp.into_observer();
    let rows = n_ctx * n_chunk;
    assert_eq!((cap.x.len(), cap.h.len()), (rows * n_embd, rows * n_embd));
    // what the graph normed is the state this test fed: RMS norm × nextn.hnorm, zeros at each chunk's start
    let (hw, _) = gguf_f32(&model_path, &format!("blk.{block}.nextn.hnorm.weight"));
    for r in 0..rows {
        let h = &fed_h[r * n_embd..(r + 1) * n_embd];
        let ms = h.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n_embd as f64;
        for j in 0..n_embd {
            let want = h[j] as f64 / (ms + 1e-5).sqrt() * hw[j] as f64;
            let got = cap.h[r * n_embd + j] as f64;
            assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "row {r} element {j}: mtp_hnorm {got}, expected {want}");
        }
        if r % n_ctx == 0 {
            assert!(h.iter().all(|&v| v == 0.0));
        }
    }

    // REAP of the block from its router input and weights, in f64 (sigmoid, choice by p + bias,
    // gates renormalised over the picks)
    let w = |t: &str| gguf_f32(&model_path, &format!("blk.{block}.{t}")).0;
    let (router, gate, up, down, sel_b) = (w("ffn_gate_inp.weight"), w("ffn_gate_exps.weight"), w("ffn_up_exps.weight"), w("ffn_down_exps.weight"), w("exp_probs_b.bias"));
    let n_ff = gguf_f32(&model_path, &format!("blk.{block}.ffn_gate_exps.weight")).1[1] as usize;
    let mut count = vec![0u64; n_expert];
    let (mut reap, mut ean, mut prob) = (vec![0f64; n_expert], vec![0f64; n_expert], vec![0f64; n_expert]);
    for t in 0..rows {
        let x: Vec<f64> = cap.x[t * n_embd..(t + 1) * n_embd].iter().map(|&v| v as f64).collect();
        let probs: Vec<f64> = (0..n_expert).map(|e| 1.0 / (1.0 + (-dot_row(&router, n_embd, n_expert, 0, e, &x)).exp())).collect();
        let mut order: Vec<usize> = (0..n_expert).collect();
        order.sort_by(|&a, &b| (probs[b] + sel_b[b] as f64).total_cmp(&(probs[a] + sel_b[a] as f64)));
        let sel = &order[..k];
        let wsum: f64 = sel.iter().map(|&e| probs[e]).sum();
        for &e in sel {
            let h: Vec<f64> = (0..n_ff)
                .map(|i| {
                    let (a, b) = (dot_row(&gate, n_embd, n_ff, e, i, &x), dot_row(&up, n_embd, n_ff, e, i, &x));
                    a / (1.0 + (-a).exp()) * b
                })
                .collect();
            let norm = (0..n_embd).map(|o| dot_row(&down, n_ff, n_embd, e, o, &h).powi(2)).sum::<f64>().sqrt();
            count[e] += 1;
            reap[e] += probs[e] / wsum * norm;
            ean[e] += norm;
            prob[e] += probs[e] / wsum;
        }
    }
    assert_eq!(count, lay.count, "the nextn block's selection counts");
    assert!(count.iter().filter(|&&c| c > 0).count() > k, "the block routes to more than k experts");
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs().max(b.abs()).max(1e-30);
    for e in 0..n_expert {
        assert!(rel(reap[e], lay.reap_l2_sum[e]) < 1e-5, "expert {e}: reap_l2_sum {} vs independent {}", lay.reap_l2_sum[e], reap[e]);
        assert!(rel(ean[e], lay.ean_sum[e]) < 1e-5, "expert {e}: ean_sum {} vs independent {}", lay.ean_sum[e], ean[e]);
        assert!(rel(prob[e], lay.prob_sum[e]) < 1e-5, "expert {e}: prob_sum {} vs independent {}", lay.prob_sum[e], prob[e]);
    }

    // check: every invariant, the trunk against the imatrix and the trace, the block noted
    let c = run(Command::new(ours()).current_dir(d.join("nextn")).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf", "--trace", "t.bin"]));
    let text = String::from_utf8_lossy(&c.stdout);
    assert!(c.status.success(), "{text}");
    assert!(text.contains("layer 2: a nextn/MTP block"), "{text}");
}

/// The whole path with the block in the files: `select` keeps K of its experts like any
/// layer's, `prune` takes the map without `--drop-nextn` and writes a model stock llama.cpp
/// runs, whose nextn block `--nextn` calibrates again; `replay` leaves the block out (no trace
/// holds it) and says so.
#[test]
fn select_prune_and_replay_take_a_map_with_the_nextn_block() {
    let d = temp_dir("nextn-path");
    let model = fixture("glm4moe");
    let out = calibrate(&d, &model, &["-c", "128", "-b", "128", "--chunks", "4", "--trace-out", "t.bin", "--nextn"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let s = Saliency::read(&d.join("i.reap.json")).unwrap();
    assert_eq!(s.nextn_blocks, vec![4]);
    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "i.reap.json", "--method", "reap_mean", "--k", "24", "--out-dir", "maps"]));
    let map = d.join("maps/keep_reap_mean_k24.json");
    let m: serde_json::Value = serde_json::from_slice(&read(&map)).unwrap();
    let blocks: Vec<u64> = m["layers"].as_array().unwrap().iter().map(|l| l["layer"].as_u64().unwrap()).collect();
    assert_eq!(blocks, vec![1, 2, 3, 4]);
    // the block's dead experts are not kept while live ones are left out
    let nx = s.layers.last().unwrap();
    let kept: Vec<u64> = m["layers"][3]["keep"].as_array().unwrap().iter().map(|e| e.as_u64().unwrap()).collect();
    assert!(kept.iter().all(|&e| nx.count[e as usize] > 0) || nx.count.iter().filter(|&&c| c > 0).count() < 24, "{kept:?} {:?}", nx.count);

    let pruned = d.join("p.gguf");
    run_ok(Command::new(ours()).current_dir(&d).args(["prune", "-m"]).arg(&model).arg("--keep-map").arg(&map).arg("-o").arg(&pruned));
    assert!(super::prune::upstream_ppl(&pruned).is_finite());
    let again = d.join("again");
    std::fs::create_dir_all(&again).unwrap();
    let out = calibrate(&again, &pruned, &["-c", "128", "-b", "128", "--chunks", "2", "--nextn"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let p = Saliency::read(&again.join("i.reap.json")).unwrap();
    assert_eq!((p.nextn_blocks.clone(), p.layers.last().unwrap().n_expert), (vec![4], 24));
    let c = run(Command::new(ours()).current_dir(&again).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf"]));
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stdout));

    let r = run(Command::new(ours()).current_dir(&d).args(["replay", "--trace", "t.bin", "--policy", "lru", "--capacity", "16", "--keep-map"]).arg(&map));
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{err}");
    assert!(err.contains("[4] come after the trace's last block 3"), "{err}");
}

/// What `--nextn` refuses, before the model loads: a model without the block's NextN tensors,
/// an architecture whose MTP graph it does not drive, `--no-reap`, `--domains`.
#[test]
fn nextn_refuses_what_it_cannot_run() {
    let d = temp_dir("nextn-refused");
    let refused = |model: &Path, extra: &[&str], what: &str| {
        let out = calibrate(&d, model, &[&["-c", "64", "--chunks", "1", "--nextn"][..], extra].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(what), "{what}: {err}");
        assert!(!d.join("i.gguf").exists());
    };
    refused(&fixture("qwen3moe"), &[], "is qwen3moe; the nextn/MTP pass is implemented for glm4moe");
    refused(&fixture("glm4moe"), &["--no-reap"], "cannot go with --no-reap");
    refused(&fixture("glm4moe"), &["--domains", "x.tsv"], "--domains x.tsv");
    // pruned with --drop-nextn: no block left
    let map = d.join("all.json");
    let all: Vec<serde_json::Value> = (1..=3).map(|b| serde_json::json!({"layer": b, "keep": (0..32).collect::<Vec<u32>>()})).collect();
    std::fs::write(&map, serde_json::to_vec(&serde_json::json!({"format": "reap-keep-map", "version": 1, "method": "all", "k": 32, "layers": all})).unwrap()).unwrap();
    let trunk = d.join("trunk.gguf");
    run_ok(Command::new(ours()).args(["prune", "-m"]).arg(fixture("glm4moe")).arg("--keep-map").arg(&map).arg("-o").arg(&trunk).arg("--drop-nextn"));
    refused(&trunk, &[], "has no nextn/MTP block with its own tensors");
}
