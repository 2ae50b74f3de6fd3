//! REAP saliency and routing traces on the generated fixtures: invariants, an independent
//! recomputation of the sums from the GGUF weights, trace round trip, a killed run, and
//! trace-on/off parity.

use super::util::*;
use reap_imatrix::formats::saliency::Saliency;
use reap_imatrix::formats::trace::TraceReader;
use reap_imatrix::llama::{sys, Context, ContextParams, GraphObserver, Model, ModelParams, Node};
use std::path::Path;
use std::process::Command;

fn calibrate(dir: &Path, model: &Path, extra: &[&str]) -> std::process::Output {
    run_ok(Command::new(ours()).current_dir(dir).arg("-m").arg(model).arg("-f").arg(corpus()).args(["-t", "2", "--no-ppl", "-o", "i.gguf"]).args(extra))
}

fn check(dir: &Path, args: &[&str]) -> std::process::Output {
    run(Command::new(ours()).current_dir(dir).arg("check").args(args))
}

#[test]
fn check_passes_on_every_fixture_arch_with_imatrix_and_trace() {
    for arch in ["qwen3moe", "qwen2moe", "gpt-oss", "glm4moe", "deepseek2", "glm-dsa", "deepseek32", "qwen35moe", "qwen3next", "minimax-m2", "nemotron_h_moe", "cohere2moe", "step35", "mimo2", "hy_v3", "bailingmoe3", "gemma4", "deepseek4"] {
        let d = temp_dir(&format!("reap-check-{arch}"));
        // cohere2moe, step35, mimo2, hy_v3, bailingmoe3: glm4moe's block 0 dense too
        let glm_like = ["glm4moe", "deepseek2", "glm-dsa", "deepseek32", "cohere2moe", "step35", "mimo2", "hy_v3", "bailingmoe3"].contains(&arch);
        let nemotron = arch == "nemotron_h_moe";
        // (deepseek4's sqrt(softplus) is no softmax either)
        let sigmoid = glm_like || arch == "minimax-m2" || nemotron || arch == "deepseek4";
        calibrate(&d, &fixture(arch), &[&["-c", "256", "-b", "512", "--chunks", "6", "--trace-out", "t.bin"][..], cpu_flags(arch)].concat());
        let out = check(&d, &["--reap", "i.reap.json", "--imatrix", "i.gguf", "--trace", "t.bin"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{arch}:\n{text}");
        assert!(text.contains("counts recomputed from the trace equal the JSON's"), "{text}");
        assert!(text.contains("count equals the imatrix counts"), "{text}");
        let s = Saliency::read(&d.join("i.reap.json")).unwrap();
        assert_eq!(s.tokens, 6 * 256);
        assert_eq!(s.trace_tokens_written, 6 * 256);
        // the fixture's dead experts are dead here too, and only they
        let dead: usize = s.layers.iter().map(|l| l.count.iter().filter(|&&c| c == 0).count()).sum();
        assert_eq!(dead, 4 * s.layers.len(), "{arch}: each layer has exactly the fixture's 4 dead experts");
        // gpt-oss: the graph's probs are logits; p and the sums from the softmax taken here
        assert_eq!(s.routing().probs_from_logits, Some(arch == "gpt-oss"), "{arch}");
        // glm4moe, deepseek2: blocks 1–3 (0 is dense; the nextn block 4 is never run, nor is
        // qwen35moe's); sigmoid router (and minimax-m2's, in every block)
        let blocks: Vec<u32> = s.layers.iter().map(|l| l.layer).collect();
        // nemotron_h_moe: blocks 1 and 3 (0 is a Mamba2 mixer, 2 attention)
        let want = if glm_like { vec![1, 2, 3] } else if nemotron { vec![1, 3] } else { vec![0, 1, 2, 3] };
        assert_eq!(blocks, want, "{arch}");
        assert_eq!(s.routing().softmax(), Some(!sigmoid), "{arch}");
        if !["qwen2moe", "deepseek2", "glm-dsa", "deepseek32", "cohere2moe", "step35", "hy_v3", "bailingmoe3", "deepseek4"].contains(&arch) && !nemotron {
            // qwen3moe divides by the picks' sum, gpt-oss takes the softmax over the picks
            assert!(text.contains("gate weights sum to 1 over the top-k (normalised gating)"), "{arch}:\n{text}");
        } else {
            // qwen2moe and cohere2moe do not normalise their top-k weights, deepseek2, glm-dsa,
            // deepseek32 and nemotron_h_moe scale them by 2.5 after, step35 by 3, hy_v3 by 2, bailingmoe3 by 2.5
            assert!(!text.contains("(normalised gating)"), "{arch}'s gates do not sum to 1:\n{text}");
        }
    }
}

#[test]
fn check_fails_on_a_tampered_json() {
    let d = temp_dir("reap-tampered");
    calibrate(&d, &fixture("qwen3moe"), &["-c", "256", "-b", "256", "--chunks", "2"]);
    let mut v: serde_json::Value = serde_json::from_slice(&read(&d.join("i.reap.json"))).unwrap();
    let c = v["layers"][1]["count"][0].as_u64().unwrap();
    v["layers"][1]["count"][0] = (c + 1).into();
    std::fs::write(d.join("bad.json"), serde_json::to_vec(&v).unwrap()).unwrap();
    let out = check(&d, &["--reap", "bad.json", "--imatrix", "i.gguf"]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[FAIL] layer 1: Σcount"), "{text}");
    assert!(text.contains("[FAIL] layer 1: count equals the imatrix counts"), "{text}");
    // unreadable input: exit 2, naming the file
    std::fs::write(d.join("junk.json"), "{").unwrap();
    let out = check(&d, &["--reap", "junk.json"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("junk.json"));
}

#[test]
fn check_compares_layers_and_shapes_with_the_imatrix_and_zeros_of_dead_experts() {
    let d = temp_dir("reap-check-shapes");
    calibrate(&d, &fixture("qwen3moe"), &["-c", "256", "-b", "256", "--chunks", "2"]);
    let base: serde_json::Value = serde_json::from_slice(&read(&d.join("i.reap.json"))).unwrap();
    let fails = |args: &[&str], line: &str| {
        let out = check(&d, args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{args:?}:\n{text}");
        assert!(text.contains(&format!("[FAIL] {line}")), "{args:?}: no [FAIL] {line}:\n{text}");
    };
    let write = |name: &str, v: &serde_json::Value| std::fs::write(d.join(name), serde_json::to_vec(v).unwrap()).unwrap();

    // the same run's legacy .dat: no per-expert counts there, so a note instead of a failure
    run_ok(
        Command::new(ours()).current_dir(&d).arg("-m").arg(fixture("qwen3moe")).arg("-f").arg(corpus())
            .args(["-t", "2", "--no-ppl", "-c", "256", "-b", "256", "--chunks", "2", "--output-format", "dat", "-o", "d.dat"]),
    );
    let out = check(&d, &["--reap", "d.reap.json", "--imatrix", "d.dat"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("legacy .dat file") && text.contains("are the JSON's"), "{text}");

    // another model's imatrix (16 experts, other token count): caught by its shapes even though
    // the counts of two moments are not compared
    let other = temp_dir("reap-check-shapes-other");
    let m16 = fixture_with("check-e16", &["--experts", "16", "--experts-used", "4", "--dead", "2"]);
    calibrate(&other, &m16, &["-c", "256", "-b", "256", "--chunks", "3"]);
    let im16 = other.join("i.gguf");
    fails(&["--reap", "i.reap.json", "--imatrix", im16.to_str().unwrap()], "layer 0: blk.0.ffn_down_exps.weight has counts for 16 experts, the JSON 32");

    // a layer dropped, doubled or out of order in the JSON
    let mut v = base.clone();
    v["layers"].as_array_mut().unwrap().remove(3);
    write("dropped.json", &v);
    fails(&["--reap", "dropped.json", "--imatrix", "i.gguf"], "imatrix i.gguf: its MoE layers (ffn_down_exps) [0, 1, 2, 3] are the JSON's [0, 1, 2]");
    let mut v = base.clone();
    v["layers"][3] = v["layers"][2].clone();
    write("doubled.json", &v);
    fails(&["--reap", "doubled.json"], "layers in block order, each once: [0, 1, 2, 2]");
    let mut v = base.clone();
    v["layers"].as_array_mut().unwrap().swap(2, 3);
    write("swapped.json", &v);
    fails(&["--reap", "swapped.json"], "layers in block order, each once: [0, 1, 3, 2]");

    // an expert never routed with something summed into it
    let layer0 = &base["layers"][0];
    let dead = (0..32).find(|&e| layer0["count"][e].as_u64() == Some(0)).expect("the fixture has dead experts in layer 0");
    for key in ["ean_sum", "max_l2", "router_prob_sum"] {
        let mut v = base.clone();
        v["layers"][0][key][dead] = 0.25.into();
        write("dead.json", &v);
        fails(&["--reap", "dead.json"], &format!("layer 0: count = 0 ⇒ every sum = 0 (not: {key})"));
    }
}

#[test]
fn trace_on_or_off_leaves_the_imatrix_and_sums_unchanged() {
    let model = fixture("qwen2moe");
    let (a, b) = (temp_dir("reap-trace-off"), temp_dir("reap-trace-on"));
    calibrate(&a, &model, &["-c", "256", "-b", "256", "--chunks", "4"]);
    calibrate(&b, &model, &["-c", "256", "-b", "256", "--chunks", "4", "--trace-out", "t.bin", "--trace-tokens", "300"]);
    assert_same_bytes(&a.join("i.gguf"), &b.join("i.gguf"));
    let (mut x, mut y): (serde_json::Value, serde_json::Value) =
        (serde_json::from_slice(&read(&a.join("i.reap.json"))).unwrap(), serde_json::from_slice(&read(&b.join("i.reap.json"))).unwrap());
    assert_eq!(y["trace_tokens_written"], 300);
    // the only differences: how many rows were traced, and the flag that asked for it
    for v in [&mut x, &mut y] {
        v["trace_tokens_written"] = 0.into();
        v["metadata"]["run"]["trace_tokens"] = serde_json::Value::Null;
    }
    assert_eq!(x, y);
    assert_eq!(TraceReader::open(&b.join("t.bin")).unwrap().n_rows, 300);
}

#[test]
fn a_killed_run_leaves_a_trace_readable_up_to_its_header_count() {
    let d = temp_dir("reap-killed");
    let mut child = Command::new(ours())
        .current_dir(&d)
        .arg("-m")
        .arg(fixture("qwen3moe"))
        .arg("-f")
        .arg(corpus())
        .args(["-t", "1", "-c", "128", "-b", "128", "--no-ppl", "-o", "i.gguf", "--trace-out", "t.bin"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let trace = d.join("t.bin");
    let started = std::time::Instant::now();
    loop {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let rows = TraceReader::open(&trace).map(|t| t.n_rows).unwrap_or(0);
        if rows >= 256 {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be killed");
        assert!(started.elapsed().as_secs() < 120, "no trace rows after 2 minutes");
    }
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    let t = TraceReader::open(&trace).unwrap();
    assert!(t.n_rows >= 256 && !t.header_count_missing);
    for (i, r) in t.rows().enumerate() {
        assert_eq!(r.pos() as usize, i % 128, "row {i}");
        assert_eq!(r.chunk() as usize, i / 128, "row {i}");
        for li in 0..t.header.n_layers() {
            assert!(r.sel_ids(li).iter().all(|&e| (e as u32) < t.header.n_expert));
        }
    }
    // the checkpoint JSON and imatrix beside it are whole files
    if d.join("i.reap.json").exists() {
        Saliency::read(&d.join("i.reap.json")).unwrap();
    }
}

/// Captures, for one block, the MoE FFN's input (the router's input) of every token.
struct CaptureFfnInput {
    router: String,
    x: Vec<f32>,
    n_embd: usize,
    /// the experts' up projection, whose input (`[n, 1, T]`) goes to `xe`
    experts: String,
    xe: Vec<f32>,
}

impl GraphObserver for CaptureFfnInput {
    fn wants(&mut self, node: Node<'_>) -> bool {
        node.src(0).is_some_and(|s| s.name() == self.router || s.name() == self.experts)
    }
    fn observe(&mut self, node: Node<'_>) -> bool {
        let experts = node.src(0).unwrap().name() == self.experts;
        let src1 = node.src(1).unwrap();
        let t = src1.info();
        let mut scratch = Vec::new();
        let data = src1.bytes(&mut scratch);
        if !experts {
            self.n_embd = t.ne[0] as usize;
        }
        // the router's input is [n, T]; the experts' [n, 1, T] (one input for all picks)
        let tokens = if experts { t.ne[2] } else { t.ne[1] };
        for tok in 0..tokens {
            for j in 0..t.ne[0] {
                let o = if experts { t.offset([j, 0, tok, 0]) } else { t.offset([j, tok, 0, 0]) };
                let v = f32::from_ne_bytes(data[o..o + 4].try_into().unwrap());
                if experts { self.xe.push(v) } else { self.x.push(v) }
            }
        }
        true
    }
}

/// ggml's CPU GELU (`GGML_GELU_FP16`): the input rounded to f16, looked up in a table of the
/// tanh approximation rounded to f16; ±10 and beyond passed through or zeroed.
fn ggml_gelu(x: f64) -> f64 {
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    let h = f16_round(x);
    f16_round(0.5 * h * (1.0 + (0.797_884_560_802_865_4 * h * (1.0 + 0.044715 * h * h)).tanh()))
}

/// `x` rounded to the nearest f16 (ties to even), as f64; the fixture's values are far inside
/// f16's normal range but for the subnormals, handled too.
fn f16_round(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let e = x.abs().log2().floor().max(-14.0);
    let ulp = 2f64.powf(e - 10.0);
    let q = x / ulp;
    let r = q.round();
    // ties to even
    let r = if (q - q.trunc()).abs() == 0.5 && r % 2.0 != 0.0 { r - q.signum() } else { r };
    r * ulp
}

/// A tensor of a GGUF file of type `ty` (4-byte elements), read through the gguf C API.
fn gguf_words(path: &Path, name: &str, ty: sys::ggml_type) -> (Vec<[u8; 4]>, [i64; 4]) {
    let fname = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    let tname = std::ffi::CString::new(name).unwrap();
    unsafe {
        let mut ctx: *mut sys::ggml_context = std::ptr::null_mut();
        let g = sys::gguf_init_from_file(fname.as_ptr(), sys::gguf_init_params { no_alloc: false, ctx: &mut ctx });
        assert!(!g.is_null());
        let t = sys::ggml_get_tensor(ctx, tname.as_ptr());
        assert!(!t.is_null(), "{name} missing");
        assert_eq!((*t).type_, ty, "{name} is not of type {ty}");
        let v = std::slice::from_raw_parts((*t).data as *const [u8; 4], sys::ggml_nelements(t) as usize).to_vec();
        let ne = (*t).ne;
        sys::gguf_free(g);
        sys::ggml_free(ctx);
        (v, ne)
    }
}

/// An I32 tensor of a GGUF file (deepseek4's table of expert ids).
fn gguf_i32(path: &Path, name: &str) -> (Vec<i32>, [i64; 4]) {
    let (w, ne) = gguf_words(path, name, sys::GGML_TYPE_I32);
    (w.into_iter().map(i32::from_ne_bytes).collect(), ne)
}

/// An f32 tensor of a GGUF file.
pub fn gguf_f32(path: &Path, name: &str) -> (Vec<f32>, [i64; 4]) {
    let (w, ne) = gguf_words(path, name, sys::GGML_TYPE_F32);
    (w.into_iter().map(f32::from_ne_bytes).collect(), ne)
}

/// Row `r` of matrix `e` of a `[cols, rows, n_mat]` tensor, times x, in f64.
pub fn dot_row(w: &[f32], cols: usize, rows: usize, e: usize, r: usize, x: &[f64]) -> f64 {
    let row = &w[(e * rows + r) * cols..(e * rows + r + 1) * cols];
    row.iter().zip(x).map(|(&a, &b)| a as f64 * b).sum()
}

/// An f32 tensor of a GGUF file, or None where the model has no tensor of that name.
pub fn gguf_f32_opt(path: &Path, name: &str) -> Option<Vec<f32>> {
    let fname = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    let tname = std::ffi::CString::new(name).unwrap();
    unsafe {
        let g = sys::gguf_init_from_file(fname.as_ptr(), sys::gguf_init_params { no_alloc: true, ctx: std::ptr::null_mut() });
        assert!(!g.is_null());
        let found = sys::gguf_find_tensor(g, tname.as_ptr()) >= 0;
        sys::gguf_free(g);
        found.then(|| gguf_f32(path, name).0)
    }
}

#[test]
fn saliency_sums_equal_an_independent_computation_from_the_weights() {
    // qwen3moe renormalises the top-k gate weights; qwen2moe multiplies by the raw softmax
    independent_computation("qwen3moe", true);
    independent_computation("qwen2moe", false);
    // gpt-oss: the graph's probs are the biased logits, the gates the softmax over the picks'
    // logits (= the renormalised softmax); biases on every projection, the clamped SwiGLU
    independent_computation("gpt-oss", true);
    // glm4moe: p = sigmoid(logit), the choice by p + exp_probs_b, g = p / Σ over the picks of p
    independent_computation("glm4moe", true);
    // deepseek2: the same times 2.5 (the gates do not sum to 1: not "normalised" in the file)
    independent_computation("deepseek2", false);
    // and routed within expert groups as DeepSeek-V3 routes (8 groups, here 2 used): a group
    // scores the sum of its two best p + bias, the top-k come from the best groups only
    independent_computation_grouped("deepseek2", false, Some((8, 2)));
    // glm-dsa (GLM-5): deepseek2's routing and attention, and the lightning indexer of DeepSeek
    // sparse attention in every block (keeping every key at these lengths)
    independent_computation("glm-dsa", false);
    // deepseek32 (DeepSeek-V3.2): the same layout under its own arch
    independent_computation("deepseek32", false);
    // qwen35moe: qwen3moe's renormalised softmax, the shared expert behind its sigmoid gate
    // beside the routed ones, block 1 a gated delta net block
    independent_computation("qwen35moe", true);
    // qwen3next: the same routing; its delta net's beta and alpha in one matrix
    independent_computation("qwen3next", true);
    // minimax-m2: glm4moe's routing in every block (block 1 here; no shared expert)
    independent_computation("minimax-m2", true);
    // nemotron_h_moe: deepseek2's routing (scaled by 2.5), experts without a gate
    // (down·relu²(up·x)), block 1 after a Mamba2 mixer
    independent_computation("nemotron_h_moe", false);
    // and with Nemotron-3-Super's latent MoE: the experts read ffn_latent_down·x and their
    // outputs (whose norms REAP sums) are in that latent space, before ffn_latent_up
    independent_computation_with("nemotron_h_moe", false, None, &["--moe-latent", "24"]);
    // and routed within expert groups (llama.cpp's group-limited choice is the one deepseek2
    // takes, applied to any arch whose header has expert_group_count)
    independent_computation_grouped("nemotron_h_moe", false, Some((8, 2)));
    // cohere2moe: sigmoid gates not renormalised, no selection bias; the block parallel (the
    // router reads attn_norm's output, as attention does), the shared expert averaged in
    independent_computation("cohere2moe", false);
    // step35: glm4moe's routing scaled by 3, and block 1's SwiGLU clamped (the up projection
    // to ±limit, silu(gate) to at most limit)
    independent_computation("step35", false);
    // mimo2: minimax-m2's routing (sigmoid, the router bias, renormalised unconditionally),
    // after attention with sinks and narrower values
    independent_computation("mimo2", true);
    // hy_v3: glm4moe's routing scaled by 2 (its selection bias named exp_probs_b), after
    // attention with per-head q/k norms
    independent_computation("hy_v3", false);
    // bailingmoe3: deepseek2's routing (scaled by 2.5), block 1 after Kimi Delta Attention
    independent_computation("bailingmoe3", false);
    // deepseek4: block 1 by sqrt(softplus) scores with the selection bias, renormalised and
    // scaled by 1.5, behind the hyper-connection mix; block 0's picks and counts by its table
    independent_computation("deepseek4", false);
    // gemma4: a softmax over the router's own scaled RMSNorm of the block's input, renormalised;
    // GEGLU experts on another RMSNorm of it (read from the graph), each output times its
    // ffn_down_exps.scale
    independent_computation("gemma4", true);
}

fn independent_computation(arch: &str, normalised: bool) {
    independent_computation_grouped(arch, normalised, None)
}

fn independent_computation_grouped(arch: &str, normalised: bool, groups: Option<(usize, usize)>) {
    independent_computation_with(arch, normalised, groups, &[])
}

fn independent_computation_with(arch: &str, normalised: bool, groups: Option<(usize, usize)>, fixture_flags: &[&str]) {
    let gpt_oss = arch == "gpt-oss";
    let nemotron = arch == "nemotron_h_moe";
    let sigmoid = ["glm4moe", "deepseek2", "glm-dsa", "deepseek32", "minimax-m2", "nemotron_h_moe", "cohere2moe", "step35", "mimo2", "hy_v3", "bailingmoe3"].contains(&arch);
    // DeepSeek-V4's router: sqrt(softplus(logit))
    let sqrt_softplus = arch == "deepseek4";
    // DeepSeek-V3's (GLM-5's, Nemotron-3's) routed_scaling_factor, on the renormalised gates
    let scale = match arch {
        "deepseek2" | "glm-dsa" | "deepseek32" => reap_imatrix::fixture::DEEPSEEK2_WEIGHTS_SCALE as f64,
        "nemotron_h_moe" => reap_imatrix::fixture::NEMOTRON_WEIGHTS_SCALE as f64,
        "step35" => reap_imatrix::fixture::STEP35_WEIGHTS_SCALE as f64,
        "hy_v3" => reap_imatrix::fixture::HY_V3_WEIGHTS_SCALE as f64,
        "bailingmoe3" => reap_imatrix::fixture::BAILINGMOE3_WEIGHTS_SCALE as f64,
        "deepseek4" => reap_imatrix::fixture::DEEPSEEK4_WEIGHTS_SCALE as f64,
        _ => 1.0,
    };
    // step35's SwiGLU limit in block 1 (the one examined); 0: none
    let limit = if arch == "step35" { reap_imatrix::fixture::STEP35_SWIGLU_LIMIT as f64 } else { 0.0 };
    // f32 weights, so the GGUF holds exactly what the graph multiplies by
    let d = temp_dir(&format!("reap-independent-{arch}{}{}", if groups.is_some() { "-groups" } else { "" }, fixture_flags.join("")));
    let model_path = d.join("m.gguf");
    let group_flags: Vec<String> = groups.map_or_else(Vec::new, |(g, u)| vec!["--expert-groups".into(), g.to_string(), "--expert-groups-used".into(), u.to_string()]);
    // qwen35moe's first full-attention block is block 3, nemotron_h_moe's block 2 (llama.cpp
    // needs one)
    // (bailingmoe3's a whole group of blocks for a KDA block)
    let layers = if arch == "qwen35moe" || arch == "qwen3next" || arch == "bailingmoe3" || nemotron { "4" } else { "2" };
    run_ok(Command::new(ours()).args(["fixture", "--arch", arch, "--wtype", "f32", "--layers", layers, "-o"]).arg(&model_path).args(&group_flags).args(fixture_flags));
    let n_ctx = 64usize;
    calibrate(&d, &model_path, &["-c", &n_ctx.to_string(), "-b", "64", "--chunks", "1", "--trace-out", "t.bin"]);
    let s = Saliency::read(&d.join("i.reap.json")).unwrap();
    let trace = TraceReader::open(&d.join("t.bin")).unwrap();
    let block = 1usize;
    let li = s.layers.iter().position(|l| l.layer as usize == block).unwrap();
    let lay = &s.layers[li];
    let (n_expert, k) = (lay.n_expert, lay.n_expert_used);

    // the same tokens through the same graph, capturing the router input of `block`
    let model = Model::load(&model_path, &ModelParams::default()).unwrap();
    let mut text = std::fs::read(corpus()).unwrap();
    text.pop();
    let tokens = model.vocab().tokenize(&text, true, false).unwrap();
    let obs = CaptureFfnInput {
        router: format!("blk.{block}.ffn_gate_inp.weight"),
        x: Vec::new(),
        n_embd: 0,
        experts: format!("blk.{block}.ffn_up_exps.weight"),
        xe: Vec::new(),
    };
    let p = ContextParams { n_ctx: n_ctx as u32, n_batch: n_ctx as u32, n_ubatch: 512, n_seq_max: 1, n_threads: 2, n_threads_batch: 2, flash_attn: -1, ..Default::default() };
    let mut ctx = Context::new(&model, &p, obs).unwrap();
    let mut batch = ctx.batch();
    for (i, &t) in tokens[..n_ctx].iter().enumerate() {
        batch.add(t, i as i32, 0, true);
    }
    ctx.decode(&mut batch).unwrap();
    let cap = ctx.into_observer();
    let n_embd = cap.n_embd;
    assert_eq!(cap.x.len(), n_ctx * n_embd);
    // gemma4's router reads its own scaled RMSNorm of the block's input, its experts another
    // (pre_ffw_norm_2): the experts' input is read from the graph too
    let gemma4 = arch == "gemma4";
    if gemma4 {
        assert_eq!(cap.xe.len(), n_ctx * n_embd, "{arch}: the experts' input");
        assert!(cap.xe.iter().zip(&cap.x).any(|(a, b)| (a - b).abs() > 1e-3 * a.abs().max(1.0)), "{arch}: the router reads what the experts read");
    }
    // gemma4's per-expert scale on the experts' outputs (Gemma 4's per_expert_scale)
    let down_scale = gguf_f32_opt(&model_path, &format!("blk.{block}.ffn_down_exps.scale"));
    assert_eq!(down_scale.is_some(), gemma4, "{arch}: ffn_down_exps.scale");

    let (router, _) = gguf_f32(&model_path, &format!("blk.{block}.ffn_gate_inp.weight"));
    // nemotron_h_moe's experts have no gate: down·relu²(up·x)
    let gate = gguf_f32_opt(&model_path, &format!("blk.{block}.ffn_gate_exps.weight"));
    assert_eq!(gate.is_none(), nemotron, "{arch}: ffn_gate_exps");
    let (up, une) = gguf_f32(&model_path, &format!("blk.{block}.ffn_up_exps.weight"));
    let (down, _) = gguf_f32(&model_path, &format!("blk.{block}.ffn_down_exps.weight"));
    let n_ff = une[1] as usize;
    // the experts' input and output width: n_embd, or the latent space's
    let latent_down = gguf_f32_opt(&model_path, &format!("blk.{block}.ffn_latent_down.weight"));
    assert_eq!(latent_down.is_some(), !fixture_flags.is_empty(), "{arch}: ffn_latent_down");
    let n_io = une[0] as usize;
    let bias = |t: &str| gguf_f32_opt(&model_path, &format!("blk.{block}.{t}.bias"));
    let (router_b, gate_b, up_b, down_b) = (bias("ffn_gate_inp"), bias("ffn_gate_exps"), bias("ffn_up_exps"), bias("ffn_down_exps"));
    assert_eq!(router_b.is_some() && gate_b.is_some() && up_b.is_some() && down_b.is_some(), gpt_oss, "{arch}: expert biases");
    let b_at = |b: &Option<Vec<f32>>, i: usize| b.as_ref().map_or(0.0, |b| b[i] as f64);
    // the selection bias (glm4moe): moves the choice, not p
    // (hy_v3's loader names it without the suffix)
    let select_b = gguf_f32_opt(&model_path, &format!("blk.{block}.exp_probs_b.bias")).or_else(|| gguf_f32_opt(&model_path, &format!("blk.{block}.exp_probs_b")));
    // (cohere2moe's sigmoid router has none)
    assert_eq!(select_b.is_some(), (sigmoid && arch != "cohere2moe") || sqrt_softplus, "{arch}: exp_probs_b");

    let mut count = vec![0u64; n_expert];
    let (mut reap, mut ean, mut prob) = (vec![0f64; n_expert], vec![0f64; n_expert], vec![0f64; n_expert]);
    // the REAP reference's weighting: the softmax probability p, not the applied gate
    let (mut reap_p, mut reap_p_sq, mut max_act) = (vec![0f64; n_expert], vec![0f64; n_expert], vec![f64::NEG_INFINITY; n_expert]);
    let mut router_p = vec![0f64; n_expert];
    // tokens whose top-k the groups changed
    let mut grouping_mattered = 0usize;
    // expert activations the SwiGLU limit changed
    let mut clamped = 0usize;
    for t in 0..n_ctx {
        let x: Vec<f64> = cap.x[t * n_embd..(t + 1) * n_embd].iter().map(|&v| v as f64).collect();
        // what the experts read: x, or its latent
        let xe: Vec<f64> = match &latent_down {
            Some(w) => (0..n_io).map(|r| dot_row(w, n_embd, n_io, 0, r, &x)).collect(),
            None if gemma4 => cap.xe[t * n_embd..(t + 1) * n_embd].iter().map(|&v| v as f64).collect(),
            None => x.clone(),
        };
        // softmax router, top-k, renormalised or not
        let logits: Vec<f64> = (0..n_expert).map(|e| dot_row(&router, n_embd, n_expert, 0, e, &x) + b_at(&router_b, e)).collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        let probs: Vec<f64> = if sqrt_softplus {
            logits.iter().map(|l| l.exp().ln_1p().sqrt()).collect()
        } else if sigmoid {
            logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect()
        } else {
            logits.iter().map(|l| (l - m).exp() / z).collect()
        };
        let mut choice: Vec<f64> = (0..n_expert).map(|e| probs[e] + b_at(&select_b, e)).collect();
        let mut order: Vec<usize> = (0..n_expert).collect();
        order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]));
        let ungrouped: Vec<usize> = order[..k].to_vec();
        if let Some((g, u)) = groups {
            // llama.cpp's group-limited choice: groups of consecutive ids, each scored by the
            // sum of its two best choice values; the experts of the other groups never chosen
            let per = n_expert / g;
            let mut score: Vec<(usize, f64)> = (0..g)
                .map(|gi| {
                    let mut v = choice[gi * per..(gi + 1) * per].to_vec();
                    v.sort_by(|a, b| b.total_cmp(a));
                    (gi, v[0] + v[1])
                })
                .collect();
            score.sort_by(|a, b| b.1.total_cmp(&a.1));
            let used: Vec<usize> = score[..u].iter().map(|s| s.0).collect();
            for (e, c) in choice.iter_mut().enumerate() {
                if !used.contains(&(e / per)) {
                    *c = f64::NEG_INFINITY;
                }
            }
            order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]));
            let mut a = order[..k].to_vec();
            a.sort();
            let mut b = ungrouped.clone();
            b.sort();
            grouping_mattered += usize::from(a != b);
        }
        let sel = &order[..k];
        // the graph's own choice agrees (read from the trace)
        let mut from_trace: Vec<usize> = trace.row(t as u64).sel_ids(li).iter().map(|&e| e as usize).collect();
        let mut mine = sel.to_vec();
        from_trace.sort();
        mine.sort();
        assert_eq!(mine, from_trace, "{arch} token {t}: top-{k} differs");
        let wsum: f64 = if normalised || scale != 1.0 { sel.iter().map(|&e| probs[e]).sum() } else { 1.0 };
        for &e in sel {
            let g = scale * probs[e] / wsum;
            let h: Vec<f64> = (0..n_ff)
                .map(|i| {
                    let b = dot_row(&up, n_io, n_ff, e, i, &xe) + b_at(&up_b, e * n_ff + i);
                    let Some(gate) = &gate else { return b.max(0.0).powi(2) };
                    let a = dot_row(gate, n_embd, n_ff, e, i, &xe) + b_at(&gate_b, e * n_ff + i);
                    if gemma4 {
                        // GEGLU, ggml's GELU
                        return ggml_gelu(a) * b;
                    }
                    if gpt_oss {
                        // gpt-oss's clamped SwiGLU (alpha 1.702, limit 7)
                        let (a, b) = (a.min(7.0), b.clamp(-7.0, 7.0));
                        a / (1.0 + (-1.702 * a).exp()) * (b + 1.0)
                    } else if limit > 0.0 {
                        let silu = a / (1.0 + (-a).exp());
                        clamped += usize::from(silu > limit || b.abs() > limit);
                        silu.min(limit) * b.clamp(-limit, limit)
                    } else {
                        a / (1.0 + (-a).exp()) * b
                    }
                })
                .collect();
            let sc = down_scale.as_ref().map_or(1.0, |v| v[e] as f64);
            let f: Vec<f64> = (0..n_io).map(|o| sc * dot_row(&down, n_ff, n_io, e, o, &h) + b_at(&down_b, e * n_io + o)).collect();
            let norm = f.iter().map(|v| v * v).sum::<f64>().sqrt();
            count[e] += 1;
            reap[e] += g * norm;
            ean[e] += norm;
            prob[e] += g;
            router_p[e] += probs[e];
            reap_p[e] += probs[e] * norm;
            reap_p_sq[e] += (probs[e] * norm).powi(2);
            max_act[e] = f.iter().copied().fold(max_act[e], f64::max);
        }
    }
    assert_eq!(count, lay.count);
    if sqrt_softplus {
        // block 0 routes by token id: its picks and counts are the table's rows for the tokens
        let (table, ne) = gguf_i32(&model_path, "blk.0.ffn_gate_tid2eid.weight");
        assert_eq!(ne[0] as usize, k);
        let l0 = &s.layers[0];
        assert_eq!(l0.layer, 0);
        let mut hash_count = vec![0u64; n_expert];
        for (t, &tok) in tokens[..n_ctx].iter().enumerate() {
            let mut want: Vec<usize> = table[tok as usize * k..(tok as usize + 1) * k].iter().map(|&e| e as usize).collect();
            want.iter().for_each(|&e| hash_count[e] += 1);
            let mut got: Vec<usize> = trace.row(t as u64).sel_ids(0).iter().map(|&e| e as usize).collect();
            want.sort();
            got.sort();
            assert_eq!(got, want, "{arch} token {t}: block 0's picks are not its table row");
        }
        assert_eq!(hash_count, l0.count, "{arch}: block 0's counts");
    }
    if limit > 0.0 {
        // else the test could not tell a clamped SwiGLU from a plain one
        assert!(clamped * 20 > n_ctx * k * n_ff, "{arch}: the limit changed {clamped} of {} activations", n_ctx * k * n_ff);
    }
    if groups.is_some() {
        // else the test could not tell grouped from plain routing
        assert!(grouping_mattered * 4 > n_ctx, "{arch}: the groups changed the top-{k} of only {grouping_mattered} of {n_ctx} tokens");
        assert_eq!(s.metadata["model"]["expert_group_count"], groups.unwrap().0.to_string());
    }
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs().max(b.abs()).max(1e-30);
    for e in 0..n_expert {
        if count[e] == 0 {
            assert_eq!(lay.reap_l2_sum[e], 0.0);
            continue;
        }
        assert!(rel(reap[e], lay.reap_l2_sum[e]) < 1e-5, "{arch} expert {e}: reap_l2_sum {} vs independent {}", lay.reap_l2_sum[e], reap[e]);
        assert!(rel(ean[e], lay.ean_sum[e]) < 1e-5, "{arch} expert {e}: ean_sum {} vs independent {}", lay.ean_sum[e], ean[e]);
        assert!(rel(prob[e], lay.prob_sum[e]) < 1e-5, "{arch} expert {e}: prob_sum {} vs independent {}", lay.prob_sum[e], prob[e]);
        // p is the softmax over every expert's logit, whatever the graph calls its probs
        assert!(rel(router_p[e], lay.router_prob_sum[e]) < 1e-5, "{arch} expert {e}: router_prob_sum {} vs independent {}", lay.router_prob_sum[e], router_p[e]);
    }
    assert_eq!(s.routing().probs_from_logits, Some(gpt_oss), "{arch}: metadata.routing.probs_from_logits");
    // -b 64 caps the ubatch (512 asked): the effective size is recorded, as ctx and batch are
    assert_eq!((s.metadata["run"]["batch"].as_u64(), s.metadata["run"]["ubatch"].as_u64()), (Some(64), Some(64)), "{arch}");
    assert_eq!(s.routing().probs_op.as_deref() == Some("SOFT_MAX"), !gpt_oss && !sigmoid && !sqrt_softplus, "{arch}: metadata.routing.probs_op");
    assert_eq!(s.routing().normalised, Some(normalised), "{arch}: metadata.routing.normalised");

    // the reference's statistics: Σ p·‖f‖, Σ (p·‖f‖)², the largest element of f
    let r = lay.reference.as_ref().expect("a fresh run writes reap_softmax_l2_sum and max_activation");
    let mut differ = 0;
    for e in 0..n_expert {
        if count[e] == 0 {
            assert_eq!((r.reap_softmax_l2_sum[e], r.reap_softmax_l2_sq_sum[e], r.max_activation[e]), (0.0, 0.0, None), "{arch} dead expert {e}");
            continue;
        }
        let (sum, sq) = (r.reap_softmax_l2_sum[e], r.reap_softmax_l2_sq_sum[e]);
        assert!(rel(reap_p[e], sum) < 1e-5, "{arch} expert {e}: reap_softmax_l2_sum {sum} vs independent {}", reap_p[e]);
        assert!(rel(reap_p_sq[e], sq) < 1e-5, "{arch} expert {e}: reap_softmax_l2_sq_sum {sq} vs independent {}", reap_p_sq[e]);
        // an f32 element of the graph against its f64 recomputation: within 1e-5 of the
        // output's scale (its largest norm)
        let m = r.max_activation[e].expect("a routed expert has a max_activation");
        assert!((m - max_act[e]).abs() <= 1e-5 * lay.max_l2[e], "{arch} expert {e}: max_activation {m} vs independent {}", max_act[e]);
        if rel(sum, lay.reap_l2_sum[e]) > 1e-3 {
            differ += 1;
        }
    }
    let live = count.iter().filter(|&&c| c > 0).count();
    if normalised || scale != 1.0 {
        // g = p / Σ over the picks of p: the two definitions part for most experts
        assert!(differ * 2 > live, "{arch}: softmax and applied-gate sums differ by > 0.1% for only {differ} of {live} live experts");
    } else {
        // the model multiplies by p itself: the two definitions are the same numbers, bit for bit
        assert_eq!(r.reap_softmax_l2_sum, lay.reap_l2_sum, "{arch}");
        assert_eq!(r.reap_softmax_l2_sq_sum, lay.reap_l2_sq_sum, "{arch}");
        assert_eq!(lay.router_prob_sum, lay.prob_sum, "{arch}");
    }
}

/// Patch 0001 over a local `ggml-rpc-server` (`-ngl 99`: the expert outputs live off-host, as
/// on a GPU): reading the device-side `[1, k, T]` norm and max nodes instead of the whole
/// outputs gives the host computation's sums to float rounding (f32 sums on the device, f64 on
/// the host: close, and not all bit-equal, which shows the device path was taken), the same
/// counts, maxima bit for bit, and an unchanged imatrix. Both ways the patch takes the max: in
/// one pass over the row (n_embd 64) and in two (n_embd 192: 64-wide pieces, then the row).
#[test]
fn device_expert_stats_equal_the_host_computation_to_rounding() {
    let server = RpcServer::start();
    // gpt-oss: the statistics are of the biased outputs (ffn_moe_down_biased), gemma4: of the
    // scaled ones (ffn_moe_down_scaled), on both paths; deepseek4: a hash-routed block 0 too
    for (key, model) in [("one-pass", fixture("qwen3moe")), ("two-pass", fixture_with("n-embd-192", &["--n-embd", "192"])), ("gpt-oss", fixture("gpt-oss")), ("gemma4", fixture("gemma4")), ("deepseek4", fixture("deepseek4"))] {
        device_expert_stats_match(&server, key, &model);
    }
}

fn device_expert_stats_match(server: &RpcServer, key: &str, model: &Path) {
    let run_with = |how: &str| {
        let d = temp_dir(&format!("expert-stats-{key}-{how}"));
        let out = run(
            Command::new(ours())
                .current_dir(&d)
                .env("REAP_EXPERT_STATS", how)
                .arg("-m")
                .arg(model)
                .arg("-f")
                .arg(corpus())
                .args(["-t", "2", "--no-ppl", "-o", "i.gguf", "-c", "128", "-b", "128", "--chunks", "4", "-ngl", "99", "--rpc", &server.endpoint]),
        );
        assert!(out.status.success(), "{key} {how}: {}", String::from_utf8_lossy(&out.stderr));
        d
    };
    let (dev, host) = (run_with("device"), run_with("host"));
    assert_same_bytes(&dev.join("i.gguf"), &host.join("i.gguf"));
    let (a, b) = (Saliency::read(&dev.join("i.reap.json")).unwrap(), Saliency::read(&host.join("i.reap.json")).unwrap());
    let mut differing = 0;
    for (la, lb) in a.layers.iter().zip(&b.layers) {
        assert_eq!(la.count, lb.count, "layer {}", la.layer);
        for (what, x, y) in [("reap_l2_sum", &la.reap_l2_sum, &lb.reap_l2_sum), ("ean_sum", &la.ean_sum, &lb.ean_sum), ("max_l2", &la.max_l2, &lb.max_l2)] {
            for (e, (p, q)) in x.iter().zip(y).enumerate() {
                assert!((p - q).abs() <= 1e-5 * q.abs(), "{key}: layer {} {what}[{e}]: device {p}, host {q}", la.layer);
                differing += (p != q) as usize;
            }
        }
        let (ra, rb) = (la.reference.as_ref().unwrap(), lb.reference.as_ref().unwrap());
        assert_eq!(ra.max_activation, rb.max_activation, "{key}: layer {} max_activation", la.layer);
    }
    assert!(differing > 0, "{key}: device and host sums are bit-identical: the device statistics were not read");
}

/// What one run of the deferred-reads test printed.
struct Run {
    read_at_end: u64,
    graphs: Option<u64>,
    /// tensors copied, copies, batches, waits
    copies: (Option<u64>, Option<u64>, Option<u64>, Option<u64>),
    overlapped: Option<u64>,
    by_layer: Option<u64>,
    dir: std::path::PathBuf,
}

/// Patch 0002: offloaded, what the callback reads is kept to the end of the graph and read
/// there, instead of ending a piece of the graph (and waiting for the device) at every node.
/// The files are those of reading node by node (`REAP_DEFER=0`), in both imatrix modes, with
/// two ubatches per chunk and checkpoints on the way, whether the reads at the end are copied
/// all at once with one wait per ubatch (`llama::prefetch`) or one at a time
/// (`REAP_PREFETCH=0`), read as each copy arrives (the default) or once the whole batch has
/// (`REAP_STREAM=0`), and whether `--imatrix-on-device`'s reductions run while REAP's reads
/// are copied and summed (the default) or before them (`REAP_OVERLAP=0`), nearby tensors
/// copied as one (the default) or each alone (`REAP_COALESCE=0`).
#[test]
fn deferred_reads_give_the_files_of_node_by_node_reads() {
    let server = RpcServer::start();
    let model = fixture("qwen3moe");
    for mode in [&[][..], &["--imatrix-on-device"][..]] {
        // a run with these REAP_* variables set (the rest unset: their defaults); besides the
        // REAP_DEFER/PREFETCH/OVERLAP switches, REAP_STREAM, REAP_COALESCE (each tensor copied
        // alone), REAP_WRITER_THREADS (the trace's rows encoded on 1 thread or, the default
        // offloaded, on -t's 2) and REAP_PARALLEL_LAYERS (REAP's reads of the layers made on the
        // callback's thread, or by default on the pool's 2)
        let go = |env: &[(&str, &str)]| {
            let tag: Vec<String> = env.iter().map(|(k, v)| format!("{}{v}", &k[5..7])).collect();
            let d = temp_dir(&format!("deferred-{}-{}", tag.join("-"), mode.len()));
            let mut cmd = Command::new(ours());
            for v in ["REAP_DEFER", "REAP_PREFETCH", "REAP_OVERLAP", "REAP_STREAM", "REAP_COALESCE", "REAP_WRITER_THREADS", "REAP_PARALLEL_LAYERS"] {
                cmd.env_remove(v);
            }
            cmd.envs(env.iter().copied());
            let out = run_ok(
                cmd.current_dir(&d)
                    .arg("-m")
                    .arg(&model)
                    .arg("-f")
                    .arg(corpus())
                    .args(["-t", "2", "--no-ppl", "-o", "i.gguf", "--trace-out", "t.bin", "-c", "128", "-b", "128", "-ub", "64", "--chunks", "6"])
                    .args(["-ofreq", "2", "--save-frequency", "3", "-ngl", "99", "--rpc", &server.endpoint])
                    .args(mode),
            );
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            let count = |after: &str| -> Option<u64> { err.split(after).next().filter(|s| s.len() < err.len())?.rsplit([' ', '(']).next()?.parse().ok() };
            let encoders = count(" writer thread").unwrap_or_else(|| panic!("no writer line:\n{err}"));
            let writers = env.iter().find(|e| e.0 == "REAP_WRITER_THREADS").map_or("2", |e| e.1);
            assert_eq!(encoders.to_string(), writers, "{err}");
            let by_layer = err.split("copied and summed (").nth(1).filter(|s| s.contains(" with REAP's layers summed on 2 threads)"));
            Run {
                read_at_end: count(" nodes read at the end of their graph").unwrap_or_else(|| panic!("no deferred-read count:\n{err}")),
                graphs: count(" reduction graphs run"),
                copies: (count(" tensors copied in"), count(" copies in"), count(" batches, "), count(" waits, ")),
                overlapped: count(" of them while REAP's reads were copied and summed"),
                by_layer: by_layer.map(|s| s.split(' ').next().unwrap().parse::<u64>().unwrap()),
                dir: d,
            }
        };
        let deferred = go(&[]);
        let n = deferred.read_at_end;
        // with the reductions overlapped, REAP's reads of the 12 graph ends were made on 2
        // threads, one layer each; REAP_PARALLEL_LAYERS=0 (in the REAP_STREAM=0 run below) not
        assert_eq!(deferred.by_layer, if mode.is_empty() { None } else { Some(12) }, "{mode:?}");
        let one_at_a_time = go(&[("REAP_PREFETCH", "0")]);
        let by_node = go(&[("REAP_DEFER", "0")]);
        // --imatrix-on-device's reductions computed before REAP's reads, not during them; each
        // tensor copied alone
        let serial = go(&[("REAP_OVERLAP", "0"), ("REAP_COALESCE", "0")]);
        assert!(n > 0 && one_at_a_time.read_at_end == n && serial.read_at_end == n && by_node.read_at_end == 0, "{mode:?}: {n}, {}, {} and {} nodes read at the end", one_at_a_time.read_at_end, serial.read_at_end, by_node.read_at_end);
        // the end-of-graph reads of each of the 12 ubatches copied together, nearby tensors as
        // one copy (fewer copies than tensors), each read waiting for its own copy at most
        let (Some(tensors), Some(copies), Some(batches), Some(waits)) = deferred.copies else { panic!("{mode:?}: no copy counts") };
        assert_eq!((batches, one_at_a_time.copies), (12, (None, None, None, None)), "{mode:?}");
        assert!(copies < tensors && (12..=copies).contains(&waits), "{mode:?}: {tensors} tensors, {copies} copies, {waits} waits");
        // REAP_COALESCE=0: a copy per tensor, read as they arrive: more than one wait per
        // batch (RPC has events) but at most one per tensor
        let (Some(t1), Some(c1), Some(12), Some(w1)) = serial.copies else { panic!("{mode:?}: {:?}", serial.copies) };
        assert!(t1 == tensors && c1 == t1 && w1 > 12 && w1 <= c1, "{mode:?}: {t1} tensors, {c1} copies, {w1} waits");
        // REAP_STREAM=0: each batch waited for whole, before its reads; the trace encoded on
        // one thread, REAP's layers read on the callback's
        let whole = go(&[("REAP_STREAM", "0"), ("REAP_WRITER_THREADS", "1"), ("REAP_PARALLEL_LAYERS", "0")]);
        assert_eq!(whole.by_layer, None, "{mode:?}");
        assert_eq!((whole.read_at_end, whole.copies.2, whole.copies.3), (n, Some(12), Some(12)), "{mode:?}");
        if !mode.is_empty() {
            // 6 chunks of 2 ubatches; per ubatch and layer 5 weights of their own input (q, o,
            // the router, up/gate, down): one graph per ubatch when read at the end, each
            // computed while REAP's reads are copied and summed (every layer is off-host)
            assert_eq!((deferred.graphs, serial.graphs, by_node.graphs), (Some(12), Some(12), Some(12 * 4 * 5)));
            assert_eq!((deferred.overlapped, serial.overlapped, by_node.overlapped), (Some(12), None, None));
        } else {
            assert_eq!(deferred.overlapped, None, "no reductions, nothing to overlap");
        }
        let (deferred, one_at_a_time, by_node, serial, whole) = (deferred.dir, one_at_a_time.dir, by_node.dir, serial.dir, whole.dir);
        for f in ["i.gguf", "i.gguf.at_3", "i.gguf.at_6", "i.reap.json", "t.bin"] {
            assert_same_bytes(&deferred.join(f), &by_node.join(f));
            assert_same_bytes(&one_at_a_time.join(f), &by_node.join(f));
            assert_same_bytes(&serial.join(f), &by_node.join(f));
            assert_same_bytes(&whole.join(f), &by_node.join(f));
        }
    }
}

/// A fixture of 64 experts, 40 of them dead (so a top-25 reaches them), for patch 0003's tests;
/// `--tied-dead`: the dead experts' probabilities are exactly equal.
pub fn candidates_fixture(tied: bool) -> std::path::PathBuf {
    let args = ["--experts", "64", "--experts-used", "4", "--dead", "40", "--tied-dead"];
    if tied {
        fixture_with("candidates-tied", &args)
    } else {
        fixture_with("candidates", &args[..6])
    }
}

/// Patch 0003: offloaded, a layer's router is read through the selected experts' probabilities
/// and the top-(n+1) candidates computed on the device instead of the whole `[n_expert, T]`
/// probabilities. The imatrix, checkpoint, REAP JSON and trace are the bytes of reading the
/// whole probabilities (`REAP_ROUTER=host`): where the dead experts' probabilities differ (no
/// row tied at the boundary, fewer bytes copied) and where they are exactly equal
/// (`--tied-dead`: every row tied, completed from the kept probabilities).
#[test]
fn router_on_device_gives_the_files_of_the_whole_probabilities() {
    let server = RpcServer::start();
    for tied in [false, true] {
        let model = candidates_fixture(tied);
        let go_with = |router: &str, mode: &[&str]| {
            let d = temp_dir(&format!("router-{router}-{tied}-{}", mode.len()));
            let out = run_ok(
                Command::new(ours())
                    .current_dir(&d)
                    .env("REAP_ROUTER", router)
                    .arg("-m")
                    .arg(&model)
                    .arg("-f")
                    .arg(corpus())
                    .args(["-t", "2", "--no-ppl", "-o", "i.gguf", "--trace-out", "t.bin", "--trace-top-n", "25"])
                    .args(["-c", "128", "-b", "128", "-ub", "64", "--chunks", "4", "--save-frequency", "2", "-ngl", "99", "--rpc", &server.endpoint])
                    .args(mode),
            );
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            let line = err.lines().find(|l| l.contains("copied from device buffers")).unwrap_or_else(|| panic!("no copy line:\n{err}")).to_string();
            let per_token: u64 = line.split(" bytes per token").next().and_then(|s| s.rsplit('(').next()?.parse().ok()).unwrap();
            (d, line, per_token, err)
        };
        let go = |router: &str| {
            let r = go_with(router, &[]);
            (r.0, r.1, r.2)
        };
        let ((dev, dev_line, dev_bytes), (host, host_line, host_bytes)) = (go("device"), go("host"));
        assert!(host_line.contains("router probabilities read whole"), "{host_line}");
        // 4 chunks of 128 tokens, 4 MoE layers: every row tied, or none
        let rows = if tied { 4 * 128 * 4 } else { 0 };
        assert!(dev_line.contains(&format!("25 candidates per token read on the device, {rows} rows read whole at ties")), "{dev_line}");
        if !tied {
            assert!(dev_bytes < host_bytes, "{dev_bytes} bytes per token on the device path, {host_bytes} reading the probabilities whole");
        }
        for f in ["i.gguf", "i.gguf.at_2", "i.reap.json", "t.bin"] {
            assert_same_bytes(&dev.join(f), &host.join(f));
        }
        let trace = TraceReader::open(&dev.join("t.bin")).unwrap();
        assert_eq!((trace.header.top_n, trace.header.n_tokens), (25, 512));
        if tied {
            // --imatrix-on-device: REAP's reads made layer by layer on 2 threads, the tied rows
            // read after them; the REAP JSON and trace are still the whole probabilities' bytes
            let (fast, fast_line, _, err) = go_with("device", &["--imatrix-on-device"]);
            assert!(fast_line.contains(&format!("{rows} rows read whole at ties")), "{fast_line}");
            assert!(err.contains("(8 with REAP's layers summed on 2 threads)"), "{err}");
            for f in ["i.reap.json", "t.bin"] {
                assert_same_bytes(&fast.join(f), &host.join(f));
            }
        }
    }
}
