//! `--nextn`: the nextn/MTP block's own pass (llama.cpp's MTP graph, teacher-forced as its MTP
//! drafting feeds it). The block's REAP sums against an independent computation from the
//! weights, fed by this test as upstream's drafter pairs tokens with hidden states; the trunk's
//! files unchanged; check, select, prune and replay with the block in the files.

use super::reap::{dot_row, gguf_f32};
use super::util::*;
use reap_imatrix::formats::imatrix;
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

/// In the MTP graph: the router's input of `block`, the normed hidden-state input and the
/// residual stream the FFN adds to (`mtp_ffn_inp`, qwen35moe's and qwen3next's
/// `mtp_attn_residual`; in cohere2moe's parallel block the sum of `mtp_eh_proj` and
/// `mtp_attn_out`): the sum of whichever of `residual` the graph has.
struct BlockInputs {
    router: String,
    hnorm: String,
    residual: Vec<String>,
    x: Vec<f32>,
    h: Vec<f32>,
    /// per residual node: its rows, ubatch after ubatch
    res: Vec<(String, Vec<f32>)>,
}

/// Each nextn block's inputs; `cur` is the block the graph runs now (its offset).
struct MtpInputs {
    blocks: Vec<BlockInputs>,
    cur: usize,
}

impl BlockInputs {
    /// The residual stream: the sum of the parts the graph has, row after row.
    fn residual(&self) -> Vec<f32> {
        let mut sum = self.res.first().map_or_else(Vec::new, |r| vec![0f32; r.1.len()]);
        for (name, part) in &self.res {
            assert_eq!(part.len(), sum.len(), "{name}: a residual part of another length");
            for (a, b) in sum.iter_mut().zip(part) {
                *a += b;
            }
        }
        sum
    }
}

impl GraphObserver for MtpInputs {
    fn wants(&mut self, node: Node<'_>) -> bool {
        let b = &self.blocks[self.cur];
        node.src(0).is_some_and(|s| s.name() == b.router) || node.name() == b.hnorm || b.residual.iter().any(|r| node.name() == r)
    }
    fn observe(&mut self, node: Node<'_>) -> bool {
        let b = &mut self.blocks[self.cur];
        let mut s = Vec::new();
        let (dst, t) = if node.name() == b.hnorm {
            (&mut b.h, node)
        } else if b.residual.iter().any(|r| node.name() == r) {
            let name = node.name().to_string();
            let i = b.res.iter().position(|r| r.0 == name).unwrap_or_else(|| {
                b.res.push((name, Vec::new()));
                b.res.len() - 1
            });
            (&mut b.res[i].1, node)
        } else {
            (&mut b.x, node.src(1).unwrap())
        };
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

/// On glm4moe (GLM-4.5) and deepseek2 (DeepSeek-V3: multi-head latent attention, the gates
/// scaled by 2.5), each through its own MTP graph at the pin.
#[test]
fn the_nextn_block_gets_the_sums_of_an_independent_computation_and_the_trunk_is_unchanged() {
    independent("glm4moe", false);
    independent("deepseek2", false);
    // GLM-5: deepseek2's block after a trunk with DeepSeek sparse attention; the MTP graph runs
    // dense MLA and never reads the block's own lightning indexer
    independent("glm-dsa", false);
    // DeepSeek-V3.2: the same, under its own arch and MTP graph
    independent("deepseek32", false);
    // Qwen3.5-MoE: a gated delta net trunk, the block's softmax router (renormalised, no
    // selection bias) and its shared expert behind a sigmoid gate
    independent("qwen35moe", false);
    // Qwen3-Next: the same block, but its MTP graph keeps only the output rows before the FFN,
    // so every token is fed as an output (ours does the same)
    independent("qwen3next", false);
    // Nemotron-3-Super: after a Mamba2/MoE/attention trunk, attention without rotary embedding
    // and a MoE of gateless relu² experts (sigmoid, selection bias, gates scaled by 2.5); its
    // MTP graph too keeps only the output rows before the FFN
    independent("nemotron_h_moe", false);
    // North-Mini-Code (cohere2moe): a parallel block (attention and FFN read one LayerNorm's
    // output), sigmoid gates not renormalised, routed and shared expert averaged
    independent("cohere2moe", false);
    // Step-3.5-Flash: three MTP blocks (one global, two sliding), each fed every batch in turn
    // through the graph's block offset; gated attention, gates scaled by 3
    independent("step35", false);
    // MiMo-V2-Flash: three dense MTP blocks (q, k, v in one attn_qkv), each fed in turn; the
    // imatrix entries alone, every token through each block's FFN
    independent("mimo2", false);
    // Hy3 (hy_v3): glm4moe's block without q/k/v biases, with per-head q/k norms, gates scaled
    // by 2; its MTP graph norms the block's output before its head, and the trunk's state it
    // reads is the output norm's result, as the others'
    independent("hy_v3", false);
    // Ling-3.0 (bailingmoe3): after a Kimi Delta Attention trunk, MLA behind a head-wise gate
    // and a MoE (sigmoid, selection bias, gates scaled by 2.5); its MTP graph names neither the
    // normed state nor the FFN's residual input, so the fed states are checked through
    // eh_proj's entry alone
    independent("bailingmoe3", false);
}

/// A block with its own token embedding and LM head (`nextn.embed_tokens`,
/// `nextn.shared_head_head`, as GLM-4.5's converted files carry): the graph reads the block's
/// embedding, and every token is fed as an output so the head's imatrix entry (Σx² of the
/// normed block output, recomputed here from the residual stream and the block's FFN in f64)
/// counts every token. On glm4moe, deepseek2 and qwen35moe (whose graphs otherwise compute no
/// head), qwen3next (which computes it for every token anyway) and cohere2moe (whose head reads
/// the block's output through a LayerNorm).
#[test]
fn a_block_with_its_own_head_gets_the_heads_entry() {
    independent("glm4moe", true);
    independent("deepseek2", true);
    independent("qwen35moe", true);
    independent("qwen3next", true);
    independent("cohere2moe", true);
}

fn independent(arch: &str, own_head: bool) {
    let d = temp_dir(&format!("nextn-independent-{arch}{}", if own_head { "-own-head" } else { "" }));
    let model_path = d.join("m.gguf");
    let ds = arch == "deepseek2" || arch == "glm-dsa" || arch == "deepseek32";
    // bailingmoe3: deepseek2's MLA behind a head-wise gate; the graph names no mtp_hnorm or
    // mtp_ffn_inp (nothing to capture there)
    let bailing = arch == "bailingmoe3";
    let q35 = arch == "qwen35moe" || arch == "qwen3next";
    let nemotron = arch == "nemotron_h_moe";
    // cohere2moe: a parallel block under LayerNorms, sigmoid gates not renormalised, no
    // selection bias, routed and shared expert averaged
    let cohere = arch == "cohere2moe";
    // step35: three nextn blocks, each fed every batch (the cache's positions of the batch
    // dropped, the graph's block offset set, as upstream's drafter chains them)
    let step35 = arch == "step35";
    // mimo2: three dense nextn blocks (no router: imatrix entries, no REAP sums), chained so
    let dense = arch == "mimo2";
    let n_nextn = if step35 { reap_imatrix::fixture::STEP35_NEXTN_BLOCKS as usize } else if dense { reap_imatrix::fixture::MIMO2_NEXTN_BLOCKS as usize } else { 1 };
    // where every token fed must arrive: the block's router, a dense block's down projection
    let witness = if dense { "ffn_down" } else { "ffn_gate_inp" };
    // the residual the FFN's output adds to (the parts the graph names)
    let residual_parts: &[&str] = if cohere {
        &["mtp_eh_proj", "mtp_attn_out"]
    } else if bailing {
        &[]
    } else {
        &["mtp_ffn_inp", "mtp_attn_residual"]
    };
    // the fixtures' norms: RMSNorm (ε 1e-6), cohere2moe's LayerNorm without bias (ε 1e-5)
    let norm = |v: &[f64], w: &[f32]| -> Vec<f64> {
        let n = v.len() as f64;
        let mean = if cohere { v.iter().sum::<f64>() / n } else { 0.0 };
        let eps = if cohere { 1e-5 } else { 1e-6 };
        let s = (v.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / n + eps).sqrt();
        v.iter().zip(w).map(|(a, &g)| (a - mean) / s * g as f64).collect()
    };
    // the MTP graphs that keep only their output rows before the FFN, and a block with its own
    // head (whose input the imatrix collects)
    let all_outputs = arch == "qwen3next" || nemotron || own_head;
    // f32 weights: the GGUF holds exactly what the graph multiplies by; blocks 0 (dense), 1, 2
    // (nextn); qwen35moe: 0–2 gated delta net, 3 full attention (llama.cpp needs one), 4 (nextn)
    // bailingmoe3: 0–2 Kimi Delta Attention, 3 full attention (a whole group), 4 (nextn)
    let n_layer = if q35 || nemotron || bailing { 4 } else { 2 };
    let own: &[&str] = if own_head { &["--nextn-own-head"] } else { &[] };
    run_ok(Command::new(ours()).args(["fixture", "--arch", arch, "--wtype", "f32", "--layers", &n_layer.to_string()]).args(own).arg("-o").arg(&model_path));
    let scale = match arch {
        "deepseek2" | "glm-dsa" | "deepseek32" => reap_imatrix::fixture::DEEPSEEK2_WEIGHTS_SCALE as f64,
        "nemotron_h_moe" => reap_imatrix::fixture::NEMOTRON_WEIGHTS_SCALE as f64,
        "step35" => reap_imatrix::fixture::STEP35_WEIGHTS_SCALE as f64,
        "hy_v3" => reap_imatrix::fixture::HY_V3_WEIGHTS_SCALE as f64,
        "bailingmoe3" => reap_imatrix::fixture::BAILINGMOE3_WEIGHTS_SCALE as f64,
        _ => 1.0,
    };
    let blocks: Vec<usize> = (n_layer..n_layer + n_nextn).collect();
    let block_ids: Vec<u32> = blocks.iter().map(|&b| b as u32).collect();
    let (n_ctx, n_batch, n_chunk) = (64usize, 32usize, 2usize);
    // .at_N copies every chunk: a checkpoint holds the block as of the trunk's batch
    let flags = ["-c", "64", "-b", "32", "--chunks", "2", "--trace-out", "t.bin", "--save-frequency", "1"];
    std::fs::create_dir_all(d.join("plain")).unwrap();
    std::fs::create_dir_all(d.join("nextn")).unwrap();
    let plain = calibrate(&d.join("plain"), &model_path, &flags);
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let out = calibrate(&d.join("nextn"), &model_path, &[&flags[..], &["--nextn"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // the trunk's files are the run's without --nextn: the trace byte for byte, every imatrix
    // entry bit for bit (the block's entries come on top), its layers' sums
    assert_same_bytes(&d.join("plain/t.bin"), &d.join("nextn/t.bin"));
    let block_entries = |plain: &str, with: &str| {
        let (a, b) = (imatrix::load(&d.join(plain)).unwrap(), imatrix::load(&d.join(with)).unwrap());
        assert_eq!((a.chunk_count, a.chunk_size, &a.datasets), (b.chunk_count, b.chunk_size, &b.datasets), "{with}");
        for (name, e) in &a.entries {
            let f = &b.entries[name];
            assert!(e.counts == f.counts && e.sums.iter().map(|v| v.to_bits()).eq(f.sums.iter().map(|v| v.to_bits())), "{with}: {name} differs from the run without --nextn");
        }
        let mut b = b.entries;
        b.retain(|n, _| !a.entries.contains_key(n));
        assert!(b.keys().all(|n| blocks.iter().any(|k| n.starts_with(&format!("blk.{k}.")))), "{with}: {:?}", b.keys().collect::<Vec<_>>());
        b
    };
    // --no-reap: the imatrix alone, the same bytes
    std::fs::create_dir_all(d.join("no-reap")).unwrap();
    let out = calibrate(&d.join("no-reap"), &model_path, &["-c", "64", "-b", "32", "--chunks", "2", "--nextn", "--no-reap"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_same_bytes(&d.join("nextn/i.gguf"), &d.join("no-reap/i.gguf"));
    assert!(!d.join("no-reap/i.reap.json").exists());
    let at1 = block_entries("plain/i.gguf.at_1", "nextn/i.gguf.at_1");
    for b in &blocks {
        assert_eq!(at1[&format!("blk.{b}.{witness}.weight")].counts, vec![n_ctx as i64], "the first chunk's checkpoint holds block {b}'s whole chunk");
    }
    let entries = block_entries("plain/i.gguf", "nextn/i.gguf");
    let a = Saliency::read(&d.join("plain/i.reap.json")).unwrap();
    let s = Saliency::read(&d.join("nextn/i.reap.json")).unwrap();
    // the JSON lists the blocks with REAP sums: a dense block has none
    let moe_ids: Vec<u32> = if dense { Vec::new() } else { block_ids.clone() };
    assert_eq!(s.nextn_blocks, moe_ids);
    assert_eq!(s.trunk(), &a.layers[..]);
    assert_eq!(s.layers.len(), a.layers.len() + moe_ids.len());
    let (n_expert, k) = (s.layers.last().unwrap().n_expert, s.layers.last().unwrap().n_expert_used);

    // --domains: two domains split inside chunk 1 (token `split` starts domain b)
    let model = Model::load(&model_path, &ModelParams { load_mtp: true, ..Default::default() }).unwrap();
    let mut text = std::fs::read(corpus()).unwrap();
    let text_len = text.len();
    text.pop();
    let tokens = model.vocab().tokenize(&text, true, false).unwrap();
    let offsets = model.vocab().token_offsets(&text, &tokens).unwrap();
    let split = n_ctx + 10;
    std::fs::create_dir_all(d.join("domains")).unwrap();
    let tsv = format!("start\tend\tdomain\n0\t{b}\ta\n{b}\t{text_len}\tb\n", b = offsets[split]);
    std::fs::write(d.join("domains/mix.tsv"), tsv).unwrap();
    let out = calibrate(&d.join("domains"), &model_path, &[&flags[..], &["--nextn", "--domains", "mix.tsv"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let sd = Saliency::read(&d.join("domains/i.reap.json")).unwrap();
    // the whole run's sums are the run's without --domains, the block's among them
    assert_eq!(sd.layers, s.layers);
    assert_eq!(sd.nextn_blocks, moe_ids);
    assert_same_bytes(&d.join("nextn/i.gguf"), &d.join("domains/i.gguf"));
    let names: Vec<&str> = sd.domains.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(sd.domains.iter().map(|x| x.tokens).collect::<Vec<_>>(), [split as u64, (n_ctx * n_chunk - split) as u64]);
    let dom_of = |r: usize| usize::from(offsets[r] >= offsets[split]);

    // the same tokens through the trunk, then the MTP graph fed as upstream's drafter feeds it
    let p = ContextParams { n_ctx: n_ctx as u32, n_batch: n_batch as u32, n_ubatch: n_batch as u32, n_seq_max: 1, n_threads: 2, n_threads_batch: 2, flash_attn: -1, ..Default::default() };
    let mut trunk = Context::new(&model, &p, Hidden(Vec::new())).unwrap();
    let obs = MtpInputs {
        blocks: blocks
            .iter()
            .map(|block| BlockInputs {
                // the FFN's input: what the router reads, or a dense block's up projection
                router: format!("blk.{block}.{}.weight", if dense { "ffn_up" } else { "ffn_gate_inp" }),
                hnorm: if bailing { String::new() } else { format!("mtp_hnorm-{block}") },
                residual: residual_parts.iter().map(|n| format!("{n}-{block}")).collect(),
                x: Vec::new(),
                h: Vec::new(),
                res: Vec::new(),
            })
            .collect(),
        cur: 0,
    };
    let mut mtp = Context::new(&model, &ContextParams { mtp: true, ..p.clone() }, obs).unwrap();
    let n_embd = model.n_embd() as usize;
    let mut fed_h: Vec<f32> = Vec::new();
    let mut fed_t: Vec<usize> = Vec::new();
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
                m.add_with_state(chunk[j * n_batch + i], (j * n_batch + i) as i32, 0, all_outputs, &prev);
                fed_h.extend_from_slice(&prev);
                fed_t.push(chunk[j * n_batch + i] as usize);
                prev.copy_from_slice(&hidden[i * n_embd..(i + 1) * n_embd]);
            }
            // each block in turn (upstream's process() where the model has several)
            for head in 0..n_nextn {
                if n_nextn > 1 {
                    assert!(mtp.seq_rm_from(0, (j * n_batch) as i32));
                    mtp.set_nextn_layer_offset(head as i32);
                }
                mtp.observer_mut().cur = head;
                mtp.decode(&mut m).unwrap();
            }
        }
    }
    let caps = mtp.into_observer();
    let rows = n_ctx * n_chunk;
    for (bi, &block) in blocks.iter().enumerate() {
        let cap = &caps.blocks[bi];
        let residual = cap.residual();
        let named = usize::from(!bailing) * rows * n_embd;
        assert_eq!((cap.x.len(), cap.h.len(), residual.len(), cap.res.len()), (rows * n_embd, named, named, residual_parts.len().min(if cohere { 2 } else { 1 })), "the residual's parts: {:?}", cap.res.iter().map(|r| &r.0).collect::<Vec<_>>());
        // what the graph normed is the state this test fed: the norm × nextn.hnorm, zeros at each chunk's start
        let (hw, _) = gguf_f32(&model_path, &format!("blk.{block}.nextn.hnorm.weight"));
        for r in 0..rows {
            let h = &fed_h[r * n_embd..(r + 1) * n_embd];
            let normed = norm(&h.iter().map(|&v| v as f64).collect::<Vec<_>>(), &hw);
            for j in (0..n_embd).filter(|_| !bailing) {
                let want = normed[j];
                let got = cap.h[r * n_embd + j] as f64;
                assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "row {r} element {j}: mtp_hnorm {got}, expected {want}");
            }
            if r % n_ctx == 0 {
                assert!(h.iter().all(|&v| v == 0.0));
            }
        }

        let w = |t: &str| gguf_f32(&model_path, &format!("blk.{block}.{t}")).0;
        let all = vec![rows as i64];
        // eh_proj's input and attention's (attn_norm's result), recomputed in f64 from the tokens
        // and states fed: [enorm(embedding); hnorm(state)], and eh_proj's product normed; the
        // block's own embedding where it has one (the trunk's otherwise)
        let eh_and_attn_sq = || {
            let token_embd = if own_head { w("nextn.embed_tokens.weight") } else { gguf_f32(&model_path, "token_embd.weight").0 };
            let (enorm, eh, attn_norm) = (w("nextn.enorm.weight"), w("nextn.eh_proj.weight"), w("attn_norm.weight"));
            let (mut cat_sq, mut attn_sq) = (vec![0f64; 2 * n_embd], vec![0f64; n_embd]);
            for r in 0..rows {
                let e: Vec<f64> = token_embd[fed_t[r] * n_embd..(fed_t[r] + 1) * n_embd].iter().map(|&v| v as f64).collect();
                let h: Vec<f64> = fed_h[r * n_embd..(r + 1) * n_embd].iter().map(|&v| v as f64).collect();
                let cat: Vec<f64> = norm(&e, &enorm).into_iter().chain(norm(&h, &hw)).collect();
                let y: Vec<f64> = (0..n_embd).map(|o| dot_row(&eh, 2 * n_embd, n_embd, 0, o, &cat)).collect();
                for (a, v) in cat_sq.iter_mut().zip(&cat).chain(attn_sq.iter_mut().zip(&norm(&y, &attn_norm))) {
                    *a += v * v;
                }
            }
            (cat_sq, attn_sq)
        };
        let check_entries = |want: &[(&str, &[f64], &[i64])]| {
            for &(weight, sums, counts) in want {
                let name = format!("blk.{block}.{weight}.weight");
                let got = entries.get(&name).unwrap_or_else(|| panic!("no imatrix entry {name}: {:?}", entries.keys().collect::<Vec<_>>()));
                assert_eq!(got.counts, counts, "{name}: counts");
                assert_eq!(got.sums.len(), sums.len(), "{name}: columns");
                let scale = sums.iter().sum::<f64>() / sums.len() as f64;
                for (j, (&a, &b)) in got.sums.iter().zip(sums).enumerate() {
                    assert!((a as f64 - b).abs() <= 1e-4 * b.abs() + 1e-6 * scale, "{name} column {j}: Σx² {a}, independent {b}");
                }
            }
            entries.keys().filter(|n| n.starts_with(&format!("blk.{block}."))).count()
        };
        if dense {
            // a dense block: its FFN reads the captured input x (gate, up) and down
            // silu(gate·x)·(up·x); attention reads attn_norm's result through one attn_qkv
            let (gate, up) = (w("ffn_gate.weight"), w("ffn_up.weight"));
            let n_ff = up.len() / n_embd;
            let (mut x_sq, mut h_sq) = (vec![0f64; n_embd], vec![0f64; n_ff]);
            for r in 0..rows {
                let x: Vec<f64> = cap.x[r * n_embd..(r + 1) * n_embd].iter().map(|&v| v as f64).collect();
                for (a, v) in x_sq.iter_mut().zip(&x) {
                    *a += v * v;
                }
                for (i, a) in h_sq.iter_mut().enumerate() {
                    let g = dot_row(&gate, n_embd, n_ff, 0, i, &x);
                    *a += (g / (1.0 + (-g).exp()) * dot_row(&up, n_embd, n_ff, 0, i, &x)).powi(2);
                }
            }
            let (cat_sq, attn_sq) = eh_and_attn_sq();
            let want: [(&str, &[f64], &[i64]); 5] = [("ffn_gate", &x_sq, &all), ("ffn_up", &x_sq, &all), ("ffn_down", &h_sq, &all), ("nextn.eh_proj", &cat_sq, &all), ("attn_qkv", &attn_sq, &all)];
            // and attn_output, one count per token fed
            assert_eq!(check_entries(&want), 6, "{:?}", entries.keys().collect::<Vec<_>>());
            assert_eq!(entries[&format!("blk.{block}.attn_output.weight")].counts, all);
            continue;
        }
        let lay = &s.layers[a.layers.len() + bi];
        assert_eq!((lay.layer, lay.tokens), (block as u32, rows as u64));
        // REAP of the block from its router input and weights, in f64 (sigmoid, choice by p + bias,
        // gates renormalised over the picks; qwen35moe: softmax, choice by p, renormalised)
        // nemotron_h_moe's experts and shared expert have no gate: down·relu²(up·x)
        let (router, gate, up, down) = (w("ffn_gate_inp.weight"), (!nemotron).then(|| w("ffn_gate_exps.weight")), w("ffn_up_exps.weight"), w("ffn_down_exps.weight"));
        let act = |g: Option<f64>, u: f64| match g {
            Some(a) => a / (1.0 + (-a).exp()) * u,
            None => u.max(0.0).powi(2),
        };
        // hy_v3's loader names the selection bias without the `.bias` suffix
        let sel_b = if q35 || cohere { vec![0f32; n_expert] } else if arch == "hy_v3" { w("exp_probs_b") } else { w("exp_probs_b.bias") };
        // cohere2moe: (routed + shared) / 2
        let avg = if cohere { 0.5 } else { 1.0 };
        let n_ff = gguf_f32(&model_path, &format!("blk.{block}.ffn_up_exps.weight")).1[1] as usize;
        let mut count = vec![0u64; n_expert];
        let (mut reap, mut ean, mut prob) = (vec![0f64; n_expert], vec![0f64; n_expert], vec![0f64; n_expert]);
        // per domain: count, reap, prob
        let mut by_dom = vec![(vec![0u64; n_expert], vec![0f64; n_expert], vec![0f64; n_expert]); 2];
        // the imatrix's Σx² of the block's matmul inputs: the router's input x (router, experts'
        // gate and up, shared expert's gate and up), per expert the SwiGLU the down projection reads
        let mut x_sq = vec![0f64; n_embd];
        let (mut x_sq_e, mut h_sq_e) = (vec![0f64; n_expert * n_embd], vec![0f64; n_expert * n_ff]);
        let (sh_gate, sh_up, sh_down) = ((!nemotron).then(|| w("ffn_gate_shexp.weight")), w("ffn_up_shexp.weight"), w("ffn_down_shexp.weight"));
        let n_sh = sh_up.len() / n_embd;
        let sh_gate_inp = q35.then(|| w("ffn_gate_inp_shexp.weight"));
        // the own head's input: the block's output (residual + routed + shared expert), RMS-normed
        // × nextn.shared_head_norm; Σ of its squares per column
        let head_norm = own_head.then(|| w("nextn.shared_head_norm.weight"));
        let mut head_sq = vec![0f64; n_embd];
        for t in 0..rows {
            let x: Vec<f64> = cap.x[t * n_embd..(t + 1) * n_embd].iter().map(|&v| v as f64).collect();
            for (a, v) in x_sq.iter_mut().zip(&x) {
                *a += v * v;
            }
            // (the block's output, for its own head; bailingmoe3 has none, nor a named residual)
            let mut y: Vec<f64> = if residual.is_empty() { vec![0.0; n_embd] } else { residual[t * n_embd..(t + 1) * n_embd].iter().map(|&v| v as f64).collect() };
            let logits: Vec<f64> = (0..n_expert).map(|e| dot_row(&router, n_embd, n_expert, 0, e, &x)).collect();
            let probs: Vec<f64> = if q35 {
                let m = logits.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
                logits.iter().map(|l| (l - m).exp() / z).collect()
            } else {
                logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect()
            };
            let mut order: Vec<usize> = (0..n_expert).collect();
            order.sort_by(|&a, &b| (probs[b] + sel_b[b] as f64).total_cmp(&(probs[a] + sel_b[a] as f64)));
            let sel = &order[..k];
            let wsum: f64 = if cohere { 1.0 } else { sel.iter().map(|&e| probs[e]).sum() };
            for &e in sel {
                let h: Vec<f64> = (0..n_ff)
                    .map(|i| act(gate.as_ref().map(|g| dot_row(g, n_embd, n_ff, e, i, &x)), dot_row(&up, n_embd, n_ff, e, i, &x)))
                    .collect();
                let out: Vec<f64> = (0..n_embd).map(|o| dot_row(&down, n_ff, n_embd, e, o, &h)).collect();
                let norm = out.iter().map(|v| v * v).sum::<f64>().sqrt();
                for (a, v) in y.iter_mut().zip(&out) {
                    *a += avg * scale * probs[e] / wsum * v;
                }
                for j in 0..n_embd {
                    x_sq_e[e * n_embd + j] += x[j] * x[j];
                }
                for i in 0..n_ff {
                    h_sq_e[e * n_ff + i] += h[i] * h[i];
                }
                count[e] += 1;
                reap[e] += scale * probs[e] / wsum * norm;
                ean[e] += norm;
                prob[e] += scale * probs[e] / wsum;
                let dm = &mut by_dom[dom_of(t)];
                dm.0[e] += 1;
                dm.1[e] += scale * probs[e] / wsum * norm;
                dm.2[e] += scale * probs[e] / wsum;
            }
            if let Some(hn) = &head_norm {
                let hs: Vec<f64> = (0..n_sh).map(|i| act(sh_gate.as_ref().map(|g| dot_row(g, n_embd, n_sh, 0, i, &x)), dot_row(&sh_up, n_embd, n_sh, 0, i, &x))).collect();
                // qwen35moe's and qwen3next's shared expert behind its sigmoid gate
                let g = sh_gate_inp.as_ref().map_or(1.0, |gw| 1.0 / (1.0 + (-gw.iter().zip(&x).map(|(&a, b)| a as f64 * b).sum::<f64>()).exp()));
                for (o, a) in y.iter_mut().enumerate() {
                    *a += avg * g * dot_row(&sh_down, n_sh, n_embd, 0, o, &hs);
                }
                for (a, v) in head_sq.iter_mut().zip(norm(&y, hn)) {
                    *a += v * v;
                }
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
        // each domain's part of the block: its own tokens' sums (the trunk's layers come first)
        for (dm, (want_count, want_reap, want_prob)) in sd.domains.iter().zip(&by_dom) {
            assert_eq!(dm.layers.len(), sd.layers.len(), "domain {}", dm.name);
            let got = &dm.layers[dm.layers.len() - n_nextn + bi];
            assert_eq!(got.layer, block as u32);
            assert_eq!(&got.count, want_count, "domain {}: the block's counts", dm.name);
            for e in 0..n_expert {
                assert!(rel(want_reap[e], got.reap_l2_sum[e]) < 1e-5 || want_reap[e] == got.reap_l2_sum[e], "domain {} expert {e}: reap_l2_sum {} vs independent {}", dm.name, got.reap_l2_sum[e], want_reap[e]);
                assert!(rel(want_prob[e], got.prob_sum[e]) < 1e-5 || want_prob[e] == got.prob_sum[e], "domain {} expert {e}: prob_sum {} vs independent {}", dm.name, got.prob_sum[e], want_prob[e]);
            }
        }
        assert!(by_dom.iter().all(|x| x.0.iter().sum::<u64>() > 0), "both domains route tokens through the block");

        // the block's imatrix entries against the same tokens and states, recomputed in f64
        let (cat_sq, attn_sq) = eh_and_attn_sq();
        let mut sh_sq = vec![0f64; n_sh];
        for r in 0..rows {
            let x: Vec<f64> = cap.x[r * n_embd..(r + 1) * n_embd].iter().map(|&v| v as f64).collect();
            for (i, a) in sh_sq.iter_mut().enumerate() {
                *a += act(sh_gate.as_ref().map(|g| dot_row(g, n_embd, n_sh, 0, i, &x)), dot_row(&sh_up, n_embd, n_sh, 0, i, &x)).powi(2);
            }
        }
        let routed: Vec<i64> = count.iter().map(|&c| c as i64).collect();
        // the matmuls that read attn_norm's result: q, k and v (glm4moe); MLA's two down-projections
        // (deepseek2: the rest of its attention reads latents); step35's head-wise gate besides
        let attn: &[&str] = if bailing {
            &["attn_q_a", "attn_kv_a_mqa", "attn_gate"]
        } else if ds {
            &["attn_q_a", "attn_kv_a_mqa"]
        } else if step35 {
            &["attn_q", "attn_k", "attn_v", "attn_gate"]
        } else {
            &["attn_q", "attn_k", "attn_v"]
        };
        let mut want: Vec<(&str, &[f64], &[i64])> = vec![
            ("ffn_gate_inp", &x_sq, &all),
            // qwen35moe's shared-expert gate reads the router's input too
            ("ffn_gate_inp_shexp", &x_sq, &all),
            ("ffn_gate_shexp", &x_sq, &all),
            ("ffn_up_shexp", &x_sq, &all),
            ("ffn_down_shexp", &sh_sq, &all),
            ("ffn_gate_exps", &x_sq_e, &routed),
            ("ffn_up_exps", &x_sq_e, &routed),
            ("ffn_down_exps", &h_sq_e, &routed),
            ("nextn.eh_proj", &cat_sq, &all),
        ];
        want.extend(attn.iter().map(|&a| (a, &attn_sq[..], &all[..])));
        if own_head {
            want.push(("nextn.shared_head_head", &head_sq, &all));
        }
        if !q35 {
            want.retain(|w| w.0 != "ffn_gate_inp_shexp");
        }
        if nemotron {
            want.retain(|w| !w.0.starts_with("ffn_gate_") || w.0 == "ffn_gate_inp");
        }
        let of_block = check_entries(&want);
        // and attn_output, whose input is the attention's result (deepseek2 also attn_q_b, attn_k_b,
        // attn_v_b, reading latents; step35 also attn_gate): one count per token fed
        let n_entries = if bailing { 15 } else if ds { 14 } else if q35 || step35 { 13 } else if nemotron { 10 } else { 12 };
        assert_eq!(of_block, own_head as usize + n_entries, "{:?}", entries.keys().collect::<Vec<_>>());
        assert_eq!(entries[&format!("blk.{block}.attn_output.weight")].counts, all);
    }

    // check: every invariant, the trunk and the block against the imatrix, the trunk against the trace
    let c = run(Command::new(ours()).current_dir(d.join("nextn")).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf", "--trace", "t.bin"]));
    let text = String::from_utf8_lossy(&c.stdout);
    assert!(c.status.success(), "{text}");
    for b in &moe_ids {
        assert!(text.contains(&format!("layer {b}: a nextn/MTP block")), "{text}");
        assert!(text.contains(&format!("[ok] layer {b}: count equals the imatrix counts of blk.{b}.ffn_down_exps.weight")), "{text}");
    }
    // and the per-domain parts, the block's among them, add up to the whole
    let c = run(Command::new(ours()).current_dir(d.join("domains")).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf", "--trace", "t.bin"]));
    let text = String::from_utf8_lossy(&c.stdout);
    assert!(c.status.success(), "{text}");
    assert!(text.contains("domains: Σ tokens over 2 domains"), "{text}");
}

/// The whole path with the block in the files: `select` keeps K of its experts like any
/// layer's, `prune` takes the map without `--drop-nextn` and writes a model stock llama.cpp
/// runs, whose nextn block `--nextn` calibrates again; `replay` leaves the block out (no trace
/// holds it) and says so. On glm4moe and deepseek2.
#[test]
fn select_prune_and_replay_take_a_map_with_the_nextn_block() {
    nextn_path("glm4moe");
    nextn_path("deepseek2");
    nextn_path("glm-dsa");
    nextn_path("deepseek32");
    nextn_path("qwen35moe");
    nextn_path("qwen3next");
    nextn_path("nemotron_h_moe");
    nextn_path("cohere2moe");
    // three blocks, each with its own map entry, pruned and calibrated again
    nextn_path("step35");
    // three dense blocks: no map entry (nothing to prune), kept by prune, calibrated again
    nextn_path("mimo2");
    // its selection bias without the `.bias` suffix, sliced by prune as any other's
    nextn_path("hy_v3");
    // after a Kimi Delta Attention trunk
    nextn_path("bailingmoe3");
}

fn nextn_path(arch: &str) {
    let d = temp_dir(&format!("nextn-path-{arch}"));
    let model = fixture(arch);
    let out = calibrate(&d, &model, &[&["-c", "128", "-b", "128", "--chunks", "4", "--trace-out", "t.bin", "--nextn"][..], cpu_flags(arch)].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let s = Saliency::read(&d.join("i.reap.json")).unwrap();
    // after the fixture's four trunk blocks: one nextn block, step35's three; mimo2's three are
    // dense, so no JSON layer lists them
    let nextn: Vec<u32> = match arch {
        "step35" => vec![4, 5, 6],
        "mimo2" => Vec::new(),
        _ => vec![4],
    };
    assert_eq!(s.nextn_blocks, nextn);
    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "i.reap.json", "--method", "reap_mean", "--k", "24", "--out-dir", "maps"]));
    let map = d.join("maps/keep_reap_mean_k24.json");
    let m: serde_json::Value = serde_json::from_slice(&read(&map)).unwrap();
    let blocks: Vec<u64> = m["layers"].as_array().unwrap().iter().map(|l| l["layer"].as_u64().unwrap()).collect();
    // glm4moe's and deepseek2's block 0 is dense; nemotron_h_moe's MoE blocks are 1 and 3
    let want = match arch {
        a if a.starts_with("qwen3") => vec![0, 1, 2, 3, 4],
        "nemotron_h_moe" => vec![1, 3, 4],
        "step35" => vec![1, 2, 3, 4, 5, 6],
        "mimo2" => vec![1, 2, 3],
        _ => vec![1, 2, 3, 4],
    };
    assert_eq!(blocks, want);
    // a block's dead experts are not kept while live ones are left out
    for (i, nx) in s.layers[s.layers.len() - nextn.len()..].iter().enumerate() {
        let kept: Vec<u64> = m["layers"][blocks.len() - nextn.len() + i]["keep"].as_array().unwrap().iter().map(|e| e.as_u64().unwrap()).collect();
        assert!(kept.iter().all(|&e| nx.count[e as usize] > 0) || nx.count.iter().filter(|&&c| c > 0).count() < 24, "block {}: {kept:?} {:?}", nx.layer, nx.count);
    }

    let pruned = d.join("p.gguf");
    run_ok(Command::new(ours()).current_dir(&d).args(["prune", "-m"]).arg(&model).arg("--keep-map").arg(&map).arg("-o").arg(&pruned));
    assert!(super::prune::upstream_ppl(&pruned).is_finite());
    let again = d.join("again");
    std::fs::create_dir_all(&again).unwrap();
    let out = calibrate(&again, &pruned, &[&["-c", "128", "-b", "128", "--chunks", "2", "--nextn"][..], cpu_flags(arch)].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let p = Saliency::read(&again.join("i.reap.json")).unwrap();
    assert_eq!((p.nextn_blocks.clone(), p.layers.last().unwrap().n_expert), (nextn.clone(), 24));
    let c = run(Command::new(ours()).current_dir(&again).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf"]));
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stdout));
    if arch == "mimo2" {
        // the dense blocks came through prune whole and have their entries again
        let m = imatrix::load(&again.join("i.gguf")).unwrap();
        for b in 4..7 {
            assert_eq!(m.entries[&format!("blk.{b}.ffn_down.weight")].counts, vec![256], "block {b}");
        }
    }

    let r = run(Command::new(ours()).current_dir(&d).args(["replay", "--trace", "t.bin", "--policy", "lru", "--capacity", "16", "--keep-map"]).arg(&map));
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{err}");
    if nextn.is_empty() {
        assert!(!err.contains("come after the trace's last block"), "{err}");
    } else {
        assert!(err.contains(&format!("{nextn:?} come after the trace's last block 3")), "{err}");
    }
}

/// What the block's imatrix entries are for: a very-low-bit type (IQ2_XXS) needs an entry for
/// every tensor it quantizes, and upstream llama-quantize stops at the nextn block's first
/// tensor without one ("Missing importance matrix ... bailing out"). The imatrix of a run with
/// `--nextn` quantizes the model, and, sliced by `prune --imatrix`, its pruned copy; both run
/// in upstream llama-perplexity.
#[test]
fn a_very_low_bit_quantization_needs_and_takes_the_nextn_entries() {
    let d = temp_dir("nextn-iq2");
    // rows 256 wide (IQ2_XXS's block), so no tensor falls back to a type that needs no imatrix
    let model = fixture_with(
        "glm4moe-256",
        &["--arch", "glm4moe", "--layers", "2", "--n-embd", "256", "--expert-ffn", "256", "--shared-ffn", "256", "--heads", "4", "--head-dim", "64"],
    );
    let calib = ["-c", "128", "-b", "128", "--chunks", "2"];
    let plain = calibrate(&d, &model, &[&calib[..], &["-o", "plain.gguf", "--no-reap"]].concat());
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let out = calibrate(&d, &model, &[&calib[..], &["--nextn"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let quantize = |imatrix: &str, m: &Path, q: &str| run(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", imatrix]).arg(m).args([q, "IQ2_XXS", "2"]));

    let refused = quantize("plain.gguf", &model, "plain-iq2.gguf");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("Missing importance matrix for tensor blk.2."), "{err}");
    let q = quantize("i.gguf", &model, "iq2.gguf");
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert!(super::prune::upstream_ppl(&d.join("iq2.gguf")).is_finite());

    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "i.reap.json", "--method", "reap_mean", "--k", "16", "--out-dir", "maps"]));
    run_ok(Command::new(ours()).current_dir(&d).args(["prune", "-m"]).arg(&model).args(["--keep-map", "maps/keep_reap_mean_k16.json", "-o", "p.gguf", "--imatrix", "i.gguf", "--imatrix-out", "p.imatrix.gguf"]));
    let q = quantize("p.imatrix.gguf", &d.join("p.gguf"), "p-iq2.gguf");
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert!(super::prune::upstream_ppl(&d.join("p-iq2.gguf")).is_finite());

    // A block with its own embedding and LM head (GLM-4.5's converted files): llama-quantize
    // exempts only token_embd and output by name, so both get IQ2_XXS and need an entry. The
    // head gets one from --nextn (every token's state goes through it); the embedding is a
    // lookup table no matmul reads, so no imatrix has one: upstream refuses it by name, and
    // takes the model once --tensor-type gives it token_embd's type here (Q2_K).
    let own = fixture_with(
        "glm4moe-256-own-head",
        &["--arch", "glm4moe", "--layers", "2", "--n-embd", "256", "--expert-ffn", "256", "--shared-ffn", "256", "--heads", "4", "--head-dim", "64", "--nextn-own-head"],
    );
    let out = calibrate(&d, &own, &[&calib[..], &["--nextn", "-o", "own.gguf"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let refused = quantize("own.gguf", &own, "own-iq2.gguf");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("Missing importance matrix for tensor blk.2.nextn.embed_tokens.weight"), "{err}");
    let q = run(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", "own.gguf", "--tensor-type", "nextn\\.embed_tokens=q2_K"]).arg(&own).args(["own-iq2.gguf", "IQ2_XXS", "2"]));
    let log = String::from_utf8_lossy(&q.stderr).to_string() + &String::from_utf8_lossy(&q.stdout);
    assert!(q.status.success(), "{log}");
    let line = |t: &str| log.lines().find(|l| l.contains(t)).unwrap_or_else(|| panic!("no line for {t} in {log}")).to_string();
    let head = line("blk.2.nextn.shared_head_head.weight");
    assert!(head.contains("iq2_xxs"), "the block's head quantized as IQ2_XXS, with its entry: {head}");
    assert!(line("blk.2.nextn.embed_tokens.weight").contains("q2_K"));
    assert!(super::prune::upstream_ppl(&d.join("own-iq2.gguf")).is_finite());
    // and pruned: the block's embedding and head are copied, its head's entry with them
    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "own.reap.json", "--method", "reap_mean", "--k", "16", "--out-dir", "own-maps"]));
    run_ok(Command::new(ours()).current_dir(&d).args(["prune", "-m"]).arg(&own).args(["--keep-map", "own-maps/keep_reap_mean_k16.json", "-o", "own-p.gguf", "--imatrix", "own.gguf", "--imatrix-out", "own-p.imatrix.gguf"]));
    let q = run(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", "own-p.imatrix.gguf", "--tensor-type", "nextn\\.embed_tokens=q2_K", "own-p.gguf", "own-p-iq2.gguf", "IQ2_XXS", "2"]));
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert!(super::prune::upstream_ppl(&d.join("own-p-iq2.gguf")).is_finite());

    // GLM-5 (glm-dsa): its nextn block carries a lightning indexer that llama.cpp's MTP graph
    // never reads (dense MLA), so no pass gives it entries; upstream refuses it by name, and
    // takes the model once --tensor-type gives the block's indexer a type that needs none
    let dsa = fixture_with(
        "glm-dsa-256",
        &["--arch", "glm-dsa", "--layers", "2", "--n-embd", "256", "--expert-ffn", "256", "--shared-ffn", "256", "--heads", "4", "--head-dim", "64"],
    );
    let out = calibrate(&d, &dsa, &[&calib[..], &["--nextn", "-o", "dsa.gguf"], cpu_flags("glm-dsa")].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let refused = quantize("dsa.gguf", &dsa, "dsa-iq2.gguf");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("Missing importance matrix for tensor blk.2.indexer."), "{err}");
    let q = run(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", "dsa.gguf", "--tensor-type", "blk\\.2\\.indexer\\.=q8_0"]).arg(&dsa).args(["dsa-iq2.gguf", "IQ2_XXS", "2"]));
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert!(super::prune::upstream_ppl(&d.join("dsa-iq2.gguf")).is_finite());

    // MiMo-V2 (mimo2): three dense MTP blocks, no router to prune; their entries (attn_qkv,
    // the dense FFN) are what IQ2_XXS needs, in the model and in its pruned copy
    let mimo = fixture_with("mimo2-256", &["--arch", "mimo2", "--layers", "2", "--n-embd", "256", "--expert-ffn", "256", "--shared-ffn", "256", "--heads", "8", "--head-dim", "64"]);
    let plain = calibrate(&d, &mimo, &[&calib[..], &["-o", "mimo-plain.gguf", "--no-reap"]].concat());
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let refused = quantize("mimo-plain.gguf", &mimo, "mimo-plain-iq2.gguf");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("Missing importance matrix for tensor blk.2."), "{err}");
    let out = calibrate(&d, &mimo, &[&calib[..], &["--nextn", "-o", "mimo.gguf"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let q = quantize("mimo.gguf", &mimo, "mimo-iq2.gguf");
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert!(super::prune::upstream_ppl(&d.join("mimo-iq2.gguf")).is_finite());
    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "mimo.reap.json", "--method", "reap_mean", "--k", "16", "--out-dir", "mimo-maps"]));
    run_ok(Command::new(ours()).current_dir(&d).args(["prune", "-m"]).arg(&mimo).args(["--keep-map", "mimo-maps/keep_reap_mean_k16.json", "-o", "mimo-p.gguf", "--imatrix", "mimo.gguf", "--imatrix-out", "mimo-p.imatrix.gguf"]));
    let q = quantize("mimo-p.imatrix.gguf", &d.join("mimo-p.gguf"), "mimo-p-iq2.gguf");
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert!(super::prune::upstream_ppl(&d.join("mimo-p-iq2.gguf")).is_finite());
}

/// `--nextn` with the layers offloaded (`-ngl 99` to a local `ggml-rpc-server`, as on a GPU:
/// the MTP graph then has the trunk's device-side nodes, patches 0001-0003): the imatrix is
/// the CPU run's byte for byte, the block's entries included; the block's sums agree with the
/// CPU's (norms on the device in f32); with `--imatrix-on-device` the same counts and sums to
/// f32 rounding; with `--domains` the block's sums split by domain; `check` passes on each. On
/// glm4moe, deepseek2 (MLA's per-head attn_k_b and attn_v_b on the server) and qwen3next (its
/// MTP graph fed every token as an output), the others with an MTP graph, and deepseek4's block
/// in its own file (`--nextn-model`).
#[test]
fn offloaded_through_rpc_the_block_agrees_with_the_cpu() {
    let server = RpcServer::start();
    for arch in ["glm4moe", "deepseek2", "glm-dsa", "qwen3next", "nemotron_h_moe", "cohere2moe", "step35", "mimo2", "hy_v3", "bailingmoe3"] {
        offloaded(&server, arch, &["--arch", arch], &["--nextn"]);
    }
    // a block with its own LM head, fed every token as an output: its entry comes off-host too
    offloaded(&server, "glm4moe-own-head", &["--arch", "glm4moe", "--nextn-own-head"], &["--nextn"]);
    // DeepSeek-V4's block in its own file, loaded off-host beside the trunk, fed the streams
    // read from the server
    let mtp = temp_dir("nextn-rpc-deepseek4-mtp-file").join("mtp.gguf");
    let mtp = mtp.to_str().unwrap();
    offloaded(&server, "deepseek4-mtp", &["--arch", "deepseek4", "--mtp-out", mtp], &["--nextn-model", mtp]);
}

fn offloaded(server: &RpcServer, key: &str, fixture_args: &[&str], nextn: &[&str]) {
    let d = temp_dir(&format!("nextn-rpc-{key}"));
    let model = fixture_with(key, fixture_args);
    let go = |dir: &str, extra: &[&str]| {
        std::fs::create_dir_all(d.join(dir)).unwrap();
        let out = calibrate(&d.join(dir), &model, &[&["-c", "128", "-b", "128", "--chunks", "4"][..], nextn, extra].concat());
        assert!(out.status.success(), "{dir}: {}", String::from_utf8_lossy(&out.stderr));
        let c = run(Command::new(ours()).current_dir(d.join(dir)).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf"]));
        assert!(c.status.success(), "{dir}: {}", String::from_utf8_lossy(&c.stdout));
        (imatrix::load(&d.join(dir).join("i.gguf")).unwrap(), Saliency::read(&d.join(dir).join("i.reap.json")).unwrap())
    };
    // -nr: the server's CPU backend has no extra buffer types, so the local run goes without
    // them too (on a CPU with AMX its f16 products would go through AMX, another rounding)
    let (cpu, cpu_s) = go("cpu", &["-nr"]);
    let rpc = ["-ngl", "99", "--rpc", &server.endpoint];
    let (_, off_s) = go("rpc", &rpc);
    assert_same_bytes(&d.join("cpu/i.gguf"), &d.join("rpc/i.gguf"));
    assert!(cpu.entries.contains_key("blk.4.nextn.eh_proj.weight"));
    let head = cpu.entries.get("blk.4.nextn.shared_head_head.weight");
    assert_eq!(head.is_some(), fixture_args.contains(&"--nextn-own-head"), "{key}: the own head's entry");
    if let Some(h) = head {
        assert_eq!(h.counts, vec![512], "{key}: the own head counts every token");
    }
    // mimo2's dense blocks have entries, no sums
    let with_sums = match key {
        "step35" => 3,
        "mimo2" => 0,
        _ => 1,
    };
    assert_eq!((cpu_s.nextn_blocks.len(), &cpu_s.nextn_blocks), (with_sums, &off_s.nextn_blocks));
    let n = cpu_s.layers.len() - cpu_s.nextn_blocks.len();
    for (a, b) in cpu_s.layers[n..].iter().zip(&off_s.layers[n..]) {
        assert_eq!((a.layer, &a.count, a.tokens), (b.layer, &b.count, b.tokens));
        for (x, y) in a.reap_l2_sum.iter().zip(&b.reap_l2_sum).chain(a.ean_sum.iter().zip(&b.ean_sum)) {
            assert!((x - y).abs() <= 1e-5 * x.abs().max(1e-9), "block {}'s sums: {x} on the CPU, {y} off-host", a.layer);
        }
    }
    let b = off_s.layers.last().unwrap();
    let (dev, _) = go("on-device", &[&rpc[..], &["--imatrix-on-device"]].concat());
    same_entries_to_rounding(&cpu, &dev, "exact, --imatrix-on-device");
    // with --domains (split at byte 1000, inside the first chunk): the same whole-run sums,
    // the block's among them, split over both domains (check adds the parts up)
    let len = std::fs::metadata(corpus()).unwrap().len();
    std::fs::create_dir_all(d.join("domains")).unwrap();
    std::fs::write(d.join("domains/mix.tsv"), format!("start\tend\tdomain\n0\t1000\ta\n1000\t{len}\tb\n")).unwrap();
    let (_, dom_s) = go("domains", &[&rpc[..], &["--domains", "mix.tsv"]].concat());
    assert_eq!(dom_s.layers, off_s.layers);
    for dm in &dom_s.domains {
        let l = dm.layers.last().unwrap();
        assert_eq!(l.layer, b.layer);
        assert!(dm.tokens > 0 && l.count.iter().sum::<u64>() == dm.tokens * b.n_expert_used as u64, "domain {}: {} tokens, the block's counts {:?}", dm.name, dm.tokens, l.count);
    }
}

/// `a` and `b` hold the same entries with the same counts, and sums within 1e-5 relative
/// (f32 sums added in another order).
fn same_entries_to_rounding(a: &imatrix::Loaded, b: &imatrix::Loaded, what: &str) {
    assert_eq!(a.entries.keys().collect::<Vec<_>>(), b.entries.keys().collect::<Vec<_>>(), "{what}");
    for (name, e) in &a.entries {
        let f = &b.entries[name];
        assert_eq!(e.counts, f.counts, "{name} ({what})");
        for (x, y) in e.sums.iter().zip(&f.sums) {
            assert!((x - y).abs() <= 1e-5 * x.abs().max(y.abs()), "{name} ({what}): {x}, {y}");
        }
    }
}

/// A `--nextn` run killed (SIGKILL) at several moments leaves checkpoints `check` accepts: the
/// JSON's block never counts more tokens than the JSON (its snapshot is the trunk's, taken
/// before the ubatch that wrote it), and the imatrix and JSON agree where they are of the
/// same moment.
#[test]
fn a_killed_run_leaves_checkpoints_that_check_accepts() {
    for ms in [0u64, 40, 120, 250, 400] {
        let d = temp_dir(&format!("nextn-kill-{ms}"));
        let mut child = Command::new(ours())
            .current_dir(&d)
            .arg("-m")
            .arg(fixture("glm4moe"))
            .arg("-f")
            .arg(corpus())
            .args(["-t", "1", "--no-ppl", "-o", "i.gguf", "-c", "64", "-b", "64", "-ofreq", "1", "--nextn"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_for_file(&mut child, &d.join("i.reap.json"));
        std::thread::sleep(std::time::Duration::from_millis(ms));
        signal(&child, libc::SIGKILL);
        child.wait().unwrap();
        let c = run(Command::new(ours()).current_dir(&d).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf"]));
        assert!(c.status.success(), "killed {ms} ms after the first checkpoint:\n{}", String::from_utf8_lossy(&c.stdout));
    }
}

/// `--in-file` with `--nextn`: the block's entries of the merged file are added to, as the
/// trunk's are: chunk 1, then chunk 2 on top of its file, counts as one run over both chunks
/// and sums equal up to the order of the float additions.
#[test]
fn an_in_file_merge_adds_to_the_blocks_entries() {
    let d = temp_dir("nextn-in-file");
    let model = fixture("glm4moe");
    let c = ["-c", "64", "-b", "64", "--nextn", "--no-reap"];
    for extra in [&["--chunks", "1", "-o", "a.gguf"][..], &["--chunks", "1", "--chunk", "1", "--in-file", "a.gguf", "-o", "b.gguf"], &["--chunks", "2", "-o", "c.gguf"]] {
        let out = calibrate(&d, &model, &[&c[..], extra].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let (a, b, c) = (imatrix::load(&d.join("a.gguf")).unwrap(), imatrix::load(&d.join("b.gguf")).unwrap(), imatrix::load(&d.join("c.gguf")).unwrap());
    assert_eq!(a.entries["blk.4.ffn_gate_inp.weight"].counts, vec![64]);
    same_entries_to_rounding(&b, &c, "merged, in one run");
}

/// A signal stops a `--nextn` run at the trunk's next ubatch, never inside the block's pass
/// (the MTP graph has no node where the observer looks for a signal): the block then holds
/// every batch the trunk finished, and the files agree with each other, the block's imatrix
/// entries with its sums included.
#[test]
fn a_signal_leaves_the_block_with_every_batch_the_trunk_finished() {
    let d = temp_dir("nextn-interrupt");
    // two ubatches per batch, so the signal can land inside one
    let mut c = Command::new(ours());
    c.current_dir(&d).arg("-m").arg(fixture("glm4moe")).arg("-f").arg(corpus());
    c.args(["-t", "1", "--no-ppl", "-o", "i.gguf", "-c", "128", "-b", "128", "-ub", "64", "-ofreq", "2", "--nextn"]);
    let mut child = default_signals(&mut c).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    wait_for_file(&mut child, &d.join("i.reap.json"));
    signal(&child, libc::SIGINT);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    let m = reap_imatrix::formats::manifest::Manifest::read(&d.join("i.manifest.json")).unwrap();
    let tokens = m.interrupted.expect("the manifest records the interruption").tokens;
    let s = Saliency::read(&d.join("i.reap.json")).unwrap();
    let block = s.layers.last().unwrap();
    assert_eq!((s.tokens, block.layer, block.tokens), (tokens, 4, tokens / 128 * 128), "{err}");
    let im = imatrix::load(&d.join("i.gguf")).unwrap();
    assert_eq!(im.entries["blk.4.ffn_gate_inp.weight"].counts, vec![block.tokens as i64]);
    let c = run(Command::new(ours()).current_dir(&d).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf"]));
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stdout));
}

/// What `--nextn` refuses, before the model loads: a model without the block's NextN tensors,
/// an architecture whose MTP graph it does not drive.
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
    // pruned with --drop-nextn: no block left
    let map = d.join("all.json");
    let all: Vec<serde_json::Value> = (1..=3).map(|b| serde_json::json!({"layer": b, "keep": (0..32).collect::<Vec<u32>>()})).collect();
    std::fs::write(&map, serde_json::to_vec(&serde_json::json!({"format": "reap-keep-map", "version": 1, "method": "all", "k": 32, "layers": all})).unwrap()).unwrap();
    let trunk = d.join("trunk.gguf");
    run_ok(Command::new(ours()).args(["prune", "-m"]).arg(fixture("glm4moe")).arg("--keep-map").arg(&map).arg("-o").arg(&trunk).arg("--drop-nextn"));
    refused(&trunk, &[], "has no nextn/MTP block with its own tensors");
}

/// A node's rows, ubatch after ubatch (the trunk's `l_last-N`: DeepSeek-V4's hyper-connection
/// streams after the last block, what its MTP block reads).
struct RowsOf(&'static str, Vec<f32>);

impl GraphObserver for RowsOf {
    fn wants(&mut self, node: Node<'_>) -> bool {
        node.name() == self.0
    }
    fn observe(&mut self, node: Node<'_>) -> bool {
        let mut s = Vec::new();
        self.1.extend(node.bytes(&mut s).chunks_exact(4).map(|b| f32::from_ne_bytes(b.try_into().unwrap())));
        true
    }
}

/// The MTP graph's router input (contiguous rows of n_embd).
struct RouterInput(String, Vec<f32>);

impl GraphObserver for RouterInput {
    fn wants(&mut self, node: Node<'_>) -> bool {
        node.src(0).is_some_and(|s| s.name() == self.0)
    }
    fn observe(&mut self, node: Node<'_>) -> bool {
        let t = node.src(1).unwrap();
        let info = t.info();
        let mut s = Vec::new();
        let data = t.bytes(&mut s);
        for tok in 0..info.ne[1] {
            for j in 0..info.ne[0] {
                let o = info.offset([j, tok, 0, 0]);
                self.1.push(f32::from_ne_bytes(data[o..o + 4].try_into().unwrap()));
            }
        }
        true
    }
}

/// DeepSeek-V4's MTP block comes in a file of its own (convert_hf_to_gguf.py --mtp):
/// `--nextn-model` runs it beside the trunk, fed the trunk's hyper-connection streams (n_embd ×
/// 4 per token) of the token before, as upstream's drafter feeds it. The trunk's files are the
/// run's without it; the block's REAP sums (sqrt-softplus scores, selection bias, renormalised
/// gates × 1.5, the SwiGLU limit) and its experts' and router's imatrix entries equal an f64
/// computation from its router input, captured in the MTP graph this test feeds itself; check
/// accepts the files. And what it refuses: a deepseek4 model without the file, a file that is
/// not the model's, the flag on an arch whose block is in the model's file.
#[test]
fn a_deepseek4_mtp_file_gets_the_sums_of_an_independent_computation() {
    let d = temp_dir("nextn-deepseek4-mtp-file");
    let (model_path, mtp_path) = (d.join("m.gguf"), d.join("mtp-m.gguf"));
    run_ok(Command::new(ours()).args(["fixture", "--arch", "deepseek4", "--wtype", "f32", "--layers", "2", "-o"]).arg(&model_path).arg("--mtp-out").arg(&mtp_path));
    let block = 2usize;
    let (n_ctx, n_batch, n_chunk) = (64usize, 32usize, 2usize);
    let flags = ["-c", "64", "-b", "32", "--chunks", "2", "--trace-out", "t.bin", "--save-frequency", "1"];
    for sub in ["plain", "nextn"] {
        std::fs::create_dir_all(d.join(sub)).unwrap();
    }
    let plain = calibrate(&d.join("plain"), &model_path, &flags);
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let out = calibrate(&d.join("nextn"), &model_path, &[&flags[..], &["--nextn-model", mtp_path.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // the trunk's files are the run's without the block
    assert_same_bytes(&d.join("plain/t.bin"), &d.join("nextn/t.bin"));
    let (a, b) = (imatrix::load(&d.join("plain/i.gguf")).unwrap(), imatrix::load(&d.join("nextn/i.gguf")).unwrap());
    for (name, e) in &a.entries {
        let f = &b.entries[name];
        assert!(e.counts == f.counts && e.sums.iter().map(|v| v.to_bits()).eq(f.sums.iter().map(|v| v.to_bits())), "{name} differs from the run without the block");
    }
    let mut entries = b.entries;
    entries.retain(|n, _| !a.entries.contains_key(n));
    assert!(!entries.is_empty() && entries.keys().all(|n| n.starts_with(&format!("blk.{block}."))), "{:?}", entries.keys().collect::<Vec<_>>());
    let sp = Saliency::read(&d.join("plain/i.reap.json")).unwrap();
    let s = Saliency::read(&d.join("nextn/i.reap.json")).unwrap();
    assert_eq!(s.nextn_blocks, [block as u32]);
    assert_eq!(s.trunk(), &sp.layers[..]);
    let lay = s.layers.last().unwrap();
    assert_eq!((lay.layer, lay.tokens), (block as u32, (n_ctx * n_chunk) as u64));
    // the manifest records the block's file beside the model
    let m = reap_imatrix::formats::manifest::Manifest::read(&d.join("nextn/i.manifest.json")).unwrap();
    let rec = m.inputs.iter().find(|r| r.role == "nextn_model").expect("the manifest lists the MTP file");
    assert_eq!((rec.path.as_path(), rec.size), (mtp_path.as_path(), std::fs::metadata(&mtp_path).unwrap().len()));
    let want = serde_json::json!({"path": mtp_path.to_str(), "size": rec.size, "sha256": rec.sha256});
    assert_eq!(s.metadata["model"]["nextn_model"], want);
    // and reproduce re-runs it, the MTP file checked as an input
    let r = run(Command::new(ours()).current_dir(d.join("nextn")).args(["reproduce", "i.manifest.json"]));
    let text = String::from_utf8_lossy(&r.stdout).to_string() + &String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success() && text.contains("input nextn_model") && text.contains("every output is byte-identical"), "{text}");

    // the same tokens through the trunk, then the MTP graph fed as upstream's drafter feeds it
    let trunk_model = Model::load(&model_path, &ModelParams::default()).unwrap();
    let mtp_model = Model::load(&mtp_path, &ModelParams { load_mtp: true, ..Default::default() }).unwrap();
    let n_embd = trunk_model.n_embd() as usize;
    let width = trunk_model.n_embd_out() as usize;
    assert_eq!(width, 4 * n_embd, "DeepSeek-V4's four streams");
    let mut text = std::fs::read(corpus()).unwrap();
    text.pop();
    let tokens = trunk_model.vocab().tokenize(&text, true, false).unwrap();
    let p = ContextParams { n_ctx: n_ctx as u32, n_batch: n_batch as u32, n_ubatch: n_batch as u32, n_seq_max: 1, n_threads: 2, n_threads_batch: 2, flash_attn: -1, ..Default::default() };
    let mut trunk = Context::new(&trunk_model, &p, RowsOf("l_last-1", Vec::new())).unwrap();
    let mut mtp = Context::new(&mtp_model, &ContextParams { mtp: true, ..p.clone() }, RouterInput(format!("blk.{block}.ffn_gate_inp.weight"), Vec::new())).unwrap();
    // what was fed: each row's token and state
    let (mut fed_t, mut fed_h) = (Vec::new(), Vec::new());
    for c in 0..n_chunk {
        trunk.clear_memory();
        mtp.clear_memory();
        let chunk = &tokens[c * n_ctx..(c + 1) * n_ctx];
        let mut prev = vec![0f32; width];
        for j in 0..n_ctx / n_batch {
            trunk.observer_mut().1.clear();
            let mut b = trunk.batch();
            for i in 0..n_batch {
                b.add(chunk[j * n_batch + i], (j * n_batch + i) as i32, 0, true);
            }
            trunk.decode(&mut b).unwrap();
            let hidden = trunk.observer().1.clone();
            assert_eq!(hidden.len(), n_batch * width);
            let mut m = mtp.batch();
            for i in 0..n_batch {
                m.add_with_state(chunk[j * n_batch + i], (j * n_batch + i) as i32, 0, false, &prev);
                fed_t.push(chunk[j * n_batch + i] as usize);
                fed_h.extend_from_slice(&prev);
                prev.copy_from_slice(&hidden[i * width..(i + 1) * width]);
            }
            mtp.decode(&mut m).unwrap();
        }
    }
    let rows = n_ctx * n_chunk;
    let xs = mtp.into_observer().1;
    assert_eq!(xs.len(), rows * n_embd);

    let w = |t: &str| gguf_f32(&mtp_path, &format!("blk.{block}.{t}")).0;
    let (router, sel_b, gate, up, down) = (w("ffn_gate_inp.weight"), w("exp_probs_b.bias"), w("ffn_gate_exps.weight"), w("ffn_up_exps.weight"), w("ffn_down_exps.weight"));
    let (sh_gate, sh_up) = (w("ffn_gate_shexp.weight"), w("ffn_up_shexp.weight"));
    let (n_expert, k) = (lay.n_expert, lay.n_expert_used);
    let n_ff = up.len() / n_embd / n_expert;
    let n_sh = sh_up.len() / n_embd;
    let scale = reap_imatrix::fixture::DEEPSEEK4_WEIGHTS_SCALE as f64;
    let limit = reap_imatrix::fixture::DEEPSEEK4_SWIGLU_LIMIT as f64;
    let swiglu = |a: f64, b: f64| (a / (1.0 + (-a).exp())).min(limit) * b.clamp(-limit, limit);
    let mut count = vec![0u64; n_expert];
    let (mut reap, mut ean, mut prob) = (vec![0f64; n_expert], vec![0f64; n_expert], vec![0f64; n_expert]);
    let (mut x_sq, mut sh_sq) = (vec![0f64; n_embd], vec![0f64; n_sh]);
    let (mut x_sq_e, mut h_sq_e) = (vec![0f64; n_expert * n_embd], vec![0f64; n_expert * n_ff]);
    for t in 0..rows {
        let x: Vec<f64> = xs[t * n_embd..(t + 1) * n_embd].iter().map(|&v| v as f64).collect();
        for (a, v) in x_sq.iter_mut().zip(&x) {
            *a += v * v;
        }
        for (i, a) in sh_sq.iter_mut().enumerate() {
            *a += swiglu(dot_row(&sh_gate, n_embd, n_sh, 0, i, &x), dot_row(&sh_up, n_embd, n_sh, 0, i, &x)).powi(2);
        }
        // sqrt(softplus(logit)), the choice by score + selection bias, gates renormalised × 1.5
        let probs: Vec<f64> = (0..n_expert).map(|e| dot_row(&router, n_embd, n_expert, 0, e, &x).exp().ln_1p().sqrt()).collect();
        let mut order: Vec<usize> = (0..n_expert).collect();
        order.sort_by(|&a, &b| (probs[b] + sel_b[b] as f64).total_cmp(&(probs[a] + sel_b[a] as f64)));
        let sel = &order[..k];
        let wsum: f64 = sel.iter().map(|&e| probs[e]).sum();
        for &e in sel {
            let h: Vec<f64> = (0..n_ff).map(|i| swiglu(dot_row(&gate, n_embd, n_ff, e, i, &x), dot_row(&up, n_embd, n_ff, e, i, &x))).collect();
            let f: Vec<f64> = (0..n_embd).map(|o| dot_row(&down, n_ff, n_embd, e, o, &h)).collect();
            let norm = f.iter().map(|v| v * v).sum::<f64>().sqrt();
            let g = scale * probs[e] / wsum;
            count[e] += 1;
            reap[e] += g * norm;
            ean[e] += norm;
            prob[e] += g;
            for j in 0..n_embd {
                x_sq_e[e * n_embd + j] += x[j] * x[j];
            }
            for i in 0..n_ff {
                h_sq_e[e * n_ff + i] += h[i] * h[i];
            }
        }
    }
    assert_eq!(count, lay.count, "the MTP block's selection counts");
    assert!(count.iter().filter(|&&c| c > 0).count() > k, "the block routes to more than k experts");
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs().max(b.abs()).max(1e-30);
    for e in 0..n_expert {
        assert!(rel(reap[e], lay.reap_l2_sum[e]) < 1e-5, "expert {e}: reap_l2_sum {} vs independent {}", lay.reap_l2_sum[e], reap[e]);
        assert!(rel(ean[e], lay.ean_sum[e]) < 1e-5, "expert {e}: ean_sum {} vs independent {}", lay.ean_sum[e], ean[e]);
        assert!(rel(prob[e], lay.prob_sum[e]) < 1e-5, "expert {e}: prob_sum {} vs independent {}", lay.prob_sum[e], prob[e]);
    }
    let all = vec![rows as i64];
    let routed: Vec<i64> = count.iter().map(|&c| c as i64).collect();
    let want: [(&str, &[f64], &[i64]); 7] = [
        ("ffn_gate_inp", &x_sq, &all),
        ("ffn_gate_shexp", &x_sq, &all),
        ("ffn_up_shexp", &x_sq, &all),
        ("ffn_down_shexp", &sh_sq, &all),
        ("ffn_gate_exps", &x_sq_e, &routed),
        ("ffn_up_exps", &x_sq_e, &routed),
        ("ffn_down_exps", &h_sq_e, &routed),
    ];
    for (weight, sums, counts) in want {
        let name = format!("blk.{block}.{weight}.weight");
        let got = entries.get(&name).unwrap_or_else(|| panic!("no imatrix entry {name}: {:?}", entries.keys().collect::<Vec<_>>()));
        assert_eq!(got.counts, counts, "{name}: counts");
        let mean = sums.iter().sum::<f64>() / sums.len() as f64;
        for (j, (&a, &b)) in got.sums.iter().zip(sums).enumerate() {
            assert!((a as f64 - b).abs() <= 1e-4 * b.abs() + 1e-6 * mean, "{name} column {j}: Σx² {a}, independent {b}");
        }
    }
    // the block's other matmuls have entries too: its attention's, and eh_proj's, whose input
    // holds a row per stream ([2·n_embd, 4, T]: upstream's collector, whose rule skips an input
    // of under 16 rows by ne[1], would leave it out; llama-quantize then refuses a very-low-bit
    // type for it): Σx² over the four rows of each token, counted so
    for weight in ["attn_q_a", "attn_kv", "attn_output_b"] {
        assert!(entries.contains_key(&format!("blk.{block}.{weight}.weight")), "{weight}: {:?}", entries.keys().collect::<Vec<_>>());
    }
    let eh = &entries[&format!("blk.{block}.nextn.eh_proj.weight")];
    assert_eq!((eh.counts.clone(), eh.sums.len()), (vec![4 * rows as i64], 2 * n_embd));
    // its input per stream: [enorm(the token's embedding); hnorm(the stream of the state fed)]
    let rms = |v: &[f32], g: &[f32]| -> Vec<f64> {
        let s = (v.iter().map(|&a| a as f64 * a as f64).sum::<f64>() / v.len() as f64 + 1e-6).sqrt();
        v.iter().zip(g).map(|(&a, &b)| a as f64 / s * b as f64).collect()
    };
    let (embd, enorm, hnorm) = (gguf_f32(&mtp_path, "token_embd.weight").0, w("nextn.enorm.weight"), w("nextn.hnorm.weight"));
    let mut cat_sq = vec![0f64; 2 * n_embd];
    for r in 0..rows {
        let e = rms(&embd[fed_t[r] * n_embd..(fed_t[r] + 1) * n_embd], &enorm);
        for stream in fed_h[r * width..(r + 1) * width].chunks(n_embd) {
            for (a, v) in cat_sq.iter_mut().zip(e.iter().chain(&rms(stream, &hnorm))) {
                *a += v * v;
            }
        }
    }
    let mean = cat_sq.iter().sum::<f64>() / cat_sq.len() as f64;
    for (j, (&a, &b)) in eh.sums.iter().zip(&cat_sq).enumerate() {
        assert!((a as f64 - b).abs() <= 1e-4 * b.abs() + 1e-6 * mean, "eh_proj column {j}: Σx² {a}, independent {b}");
    }
    // the states fed are the trunk's: zeros at each chunk's start only
    assert!((0..rows).all(|r| fed_h[r * width..(r + 1) * width].iter().all(|&v| v == 0.0) == (r % n_ctx == 0)));
    let c = run(Command::new(ours()).current_dir(d.join("nextn")).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf", "--trace", "t.bin"]));
    let text = String::from_utf8_lossy(&c.stdout);
    assert!(c.status.success(), "{text}");
    assert!(text.contains(&format!("[ok] layer {block}: count equals the imatrix counts of blk.{block}.ffn_down_exps.weight")), "{text}");

    // refused: the model without its file, a file that is not its block's, the flag elsewhere
    let refused = |model: &Path, extra: &[&str], want: &str| {
        let out = calibrate(&d, model, &[&["-c", "64", "--chunks", "1"][..], extra].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{extra:?}: {err}");
    };
    refused(&model_path, &["--nextn"], "whose MTP block comes in a file of its own (convert_hf_to_gguf.py --mtp writes mtp-NAME.gguf): name it with --nextn-model");
    refused(&model_path, &["--nextn-model", model_path.to_str().unwrap()], "has no nextn/MTP block with its own tensors");
    let other = d.join("m3.gguf");
    let other_mtp = d.join("mtp-m3.gguf");
    run_ok(Command::new(ours()).args(["fixture", "--arch", "deepseek4", "--wtype", "f32", "--layers", "3", "-o"]).arg(&other).arg("--mtp-out").arg(&other_mtp));
    refused(&model_path, &["--nextn-model", other_mtp.to_str().unwrap()], "its MTP block is block 3, but -m");
    refused(&fixture("glm4moe"), &["--nextn-model", mtp_path.to_str().unwrap()], "whose nextn/MTP block is in the model's own file at the pin");
}

/// DeepSeek-V4's MTP file through the rest of the path, at rows 256 wide (IQ2_XXS's block):
/// upstream llama-quantize refuses the file in IQ2_XXS without the block's entries and takes it
/// with them (its eh_proj among them); `select`'s map covers the trunk and the block and
/// records the MTP file; `prune` takes that one map for both files, each its own part, and
/// slices each file's imatrix entries; both pruned files quantize; and the pruned pair,
/// calibrated again on the same text, routes every block as before (the experts left out
/// were never picked), with the same sums for the experts kept. What it refuses: an MTP file
/// the map was not made with, a map without an entry for the file's block.
#[test]
fn a_deepseek4_mtp_file_is_pruned_and_quantized_with_the_trunk() {
    let d = temp_dir("nextn-deepseek4-mtp-path");
    let (model, mtp) = (d.join("m.gguf"), d.join("mtp-m.gguf"));
    // head size 32: a head of the indexer's key size (64) would have the pin rotate the main
    // cache's keys too, and stop on it
    run_ok(Command::new(ours()).args(["fixture", "--arch", "deepseek4", "--layers", "2", "--n-embd", "256", "--expert-ffn", "256", "--heads", "8", "--head-dim", "32", "-o"]).arg(&model).arg("--mtp-out").arg(&mtp));
    let calib = ["-c", "128", "-b", "128", "--chunks", "2"];
    let plain = calibrate(&d, &model, &[&calib[..], &["-o", "plain.gguf", "--no-reap"]].concat());
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let out = calibrate(&d, &model, &[&calib[..], &["--nextn-model", mtp.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // DeepSeek-V4's final stream mix (output_hc_fn) is a weight llama-quantize quantizes, and no
    // imatrix has it (upstream collects blk.* and, asked to, output.weight): it is given a type
    let quantize = |imatrix: &str, m: &Path, q: &str| {
        let o = run(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", imatrix, "--tensor-type", "output_hc_fn=q8_0"]).arg(m).args([q, "IQ2_XXS", "2"]));
        (o.status.success(), String::from_utf8_lossy(&o.stderr).to_string() + &String::from_utf8_lossy(&o.stdout))
    };
    let (ok, log) = quantize("plain.gguf", &mtp, "mtp-plain-iq2.gguf");
    assert!(!ok && log.contains("Missing importance matrix for tensor blk.2."), "{log}");
    let (ok, log) = quantize("i.gguf", &mtp, "mtp-iq2.gguf");
    assert!(ok, "{log}");
    let eh = log.lines().find(|l| l.contains("blk.2.nextn.eh_proj.weight")).unwrap_or_default();
    assert!(eh.contains("iq2_xxs"), "eh_proj quantized with its entry: {eh}");

    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "i.reap.json", "--method", "reap_mean", "--k", "28", "--out-dir", "maps"]));
    let map = d.join("maps/keep_reap_mean_k28.json");
    let m: serde_json::Value = serde_json::from_slice(&read(&map)).unwrap();
    let layers: Vec<u64> = m["layers"].as_array().unwrap().iter().map(|l| l["layer"].as_u64().unwrap()).collect();
    assert_eq!(layers, [0, 1, 2]);
    let sha = reap_imatrix::formats::sha256::sha256_file(&mtp).unwrap();
    assert_eq!((m["model"]["nextn_model"]["path"].as_str(), m["model"]["nextn_model"]["sha256"].as_str()), (mtp.to_str(), Some(sha.as_str())));

    let prune = |m: &Path, map: &Path, out: &str| {
        run(Command::new(ours()).current_dir(&d).args(["prune", "-m"]).arg(m).arg("--keep-map").arg(map).args(["-o", out, "--imatrix", "i.gguf", "--imatrix-out", &format!("{out}.imatrix")]))
    };
    let o = prune(&model, &map, "p.gguf");
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("the map's entry for block [2] is the MTP file's"), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let o = prune(&mtp, &map, "mtp-p.gguf");
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("the MTP block alone"), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    // each sliced imatrix holds its file's entries only
    let (pi, mi) = (imatrix::load(&d.join("p.gguf.imatrix")).unwrap(), imatrix::load(&d.join("mtp-p.gguf.imatrix")).unwrap());
    assert!(!pi.entries.is_empty() && pi.entries.keys().all(|n| !n.starts_with("blk.2.")));
    assert!(!mi.entries.is_empty() && mi.entries.keys().all(|n| n.starts_with("blk.2.")));
    assert_eq!(mi.entries["blk.2.ffn_down_exps.weight"].counts.len(), 28);
    let (ok, log) = quantize("p.gguf.imatrix", &d.join("p.gguf"), "p-iq2.gguf");
    assert!(ok, "{log}");
    assert!(super::prune::upstream_ppl(&d.join("p-iq2.gguf")).is_finite());
    let (ok, log) = quantize("mtp-p.gguf.imatrix", &d.join("mtp-p.gguf"), "mtp-p-iq2.gguf");
    assert!(ok, "{log}");

    // the pruned pair, calibrated again: every block routes as before
    let again = d.join("again");
    std::fs::create_dir_all(&again).unwrap();
    let out = calibrate(&again, &d.join("p.gguf"), &[&calib[..], &["--nextn-model", d.join("mtp-p.gguf").to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (s, p) = (Saliency::read(&d.join("i.reap.json")).unwrap(), Saliency::read(&again.join("i.reap.json")).unwrap());
    assert_eq!(p.nextn_blocks, [2]);
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs().max(b.abs()).max(1e-30);
    for (li, (a, b)) in s.layers.iter().zip(&p.layers).enumerate() {
        let keep: Vec<usize> = m["layers"][li]["keep"].as_array().unwrap().iter().map(|e| e.as_u64().unwrap() as usize).collect();
        assert_eq!((b.layer, b.n_expert, a.tokens), (a.layer, 28, b.tokens));
        assert_eq!(a.count.iter().sum::<u64>(), b.count.iter().sum::<u64>(), "block {}: a token went to an expert left out", a.layer);
        for (new, &old) in keep.iter().enumerate() {
            assert_eq!(b.count[new], a.count[old], "block {} expert {old}", a.layer);
            assert!(rel(b.reap_l2_sum[new], a.reap_l2_sum[old]) < 1e-5, "block {} expert {old}: {} vs {}", a.layer, b.reap_l2_sum[new], a.reap_l2_sum[old]);
        }
    }

    // refused: a map made with another MTP file, a map without the file's block
    let mut other = m.clone();
    other["model"]["nextn_model"]["sha256"] = serde_json::json!("0".repeat(64));
    std::fs::write(d.join("other.json"), other.to_string()).unwrap();
    let o = prune(&mtp, &d.join("other.json"), "x.gguf");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("made for the MTP file with sha256 0000"), "{}", String::from_utf8_lossy(&o.stderr));
    let mut trunk_only = m.clone();
    trunk_only["layers"].as_array_mut().unwrap().pop();
    std::fs::write(d.join("trunk-only.json"), trunk_only.to_string()).unwrap();
    let o = prune(&mtp, &d.join("trunk-only.json"), "x.gguf");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("no entry for block 2, the nextn/MTP block"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!d.join("x.gguf").exists());
}
