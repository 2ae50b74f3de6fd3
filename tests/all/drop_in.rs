//! Drop-in parity: our binary and upstream's `llama-imatrix` (same pin, unpatched) run with the
//! same flags on the generated fixtures; output files must be byte-identical and the
//! perplexity lines equal.

use super::util::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use reap_imatrix::formats::imatrix as imatrix_file;

struct Pair {
    ours_dir: PathBuf,
    ref_dir: PathBuf,
    ours: Output,
    upstream: Output,
}

/// Runs both tools with `args`; `-o` names a file inside each tool's own folder.
fn run_both(name: &str, model: &Path, out_name: &str, args: &[&str]) -> Pair {
    run_both_on(name, model, &corpus(), out_name, args)
}

fn run_both_on(name: &str, model: &Path, corpus: &Path, out_name: &str, args: &[&str]) -> Pair {
    let ours_dir = temp_dir(&format!("{name}-ours"));
    let ref_dir = temp_dir(&format!("{name}-ref"));
    let go = |bin: PathBuf, dir: &Path| {
        run_ok(
            Command::new(bin)
                .current_dir(dir)
                .arg("-m")
                .arg(model)
                .arg("-f")
                .arg(corpus)
                .args(["-o", out_name])
                .args(args),
        )
    };
    let upstream = go(reference_bin("llama-imatrix"), &ref_dir);
    let ours = go(super::util::ours(), &ours_dir);
    Pair { ours_dir, ref_dir, ours, upstream }
}

impl Pair {
    fn assert_same_file(&self, name: &str) {
        assert_same_bytes(&self.ours_dir.join(name), &self.ref_dir.join(name));
    }

    fn assert_same_ppl(&self) {
        let (a, b) = (ppl_lines(&self.ours), ppl_lines(&self.upstream));
        assert!(!b.is_empty(), "upstream printed no perplexity");
        assert_eq!(a, b, "perplexity lines differ");
    }

    /// upstream's save_imatrix warnings about entries some experts never reached (its log
    /// prefix, a timestamp and level, stripped; sorted, as upstream prints them in the order
    /// of an unordered_map)
    fn assert_same_partial_data_warnings(&self) {
        let lines = |o: &Output| -> Vec<String> {
            let mut v: Vec<String> =
                String::from_utf8_lossy(&o.stderr).lines().filter_map(|l| l.find("save_imatrix").map(|i| l[i..].to_string())).filter(|l| l.contains("data")).collect();
            v.sort();
            v
        };
        let (a, b) = (lines(&self.ours), lines(&self.upstream));
        assert!(!b.is_empty(), "upstream warned of no partial data (the fixture has dead experts)");
        assert_eq!(a, b);
    }

    /// Every file upstream wrote, we wrote too (ours adds only the REAP outputs).
    fn assert_same_file_set(&self) -> Vec<String> {
        let names = |d: &Path| {
            let mut v: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
            v.sort();
            v
        };
        let (a, b) = (names(&self.ours_dir), names(&self.ref_dir));
        let extra: Vec<&String> = a.iter().filter(|f| !b.contains(f)).collect();
        assert!(b.iter().all(|f| a.contains(f)), "upstream wrote {b:?}, we wrote {a:?}");
        assert!(extra.iter().all(|f| f.ends_with(".reap.json") || f.ends_with(".manifest.json")), "unexpected files {extra:?}");
        b
    }
}

const BASE: &[&str] = &["--chunks", "6", "-t", "2"];

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    BASE.iter().copied().chain(extra.iter().copied()).collect()
}

#[test]
fn qwen3moe_c512_b512_is_byte_identical() {
    let p = run_both("q3-c512", &fixture("qwen3moe"), "imatrix.gguf", &args(&["-c", "512", "-b", "512", "--parse-special"]));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
    p.assert_same_partial_data_warnings();
}

#[test]
fn the_audited_command_line_runs_unchanged() {
    // the command of the audited pipeline, verbatim but for the file names (-ngl 99 on a CPU
    // build is ignored by both, with upstream's warning); the first 48 KB of the corpus
    // (about 5 chunks of 2048 tokens) keep upstream's all-logits pass short
    let d = temp_dir("audited-corpus");
    let text = read(&corpus());
    let cut = text[..48 * 1024].iter().rposition(|&b| b == b'\n').unwrap() + 1;
    let short = d.join("calibration_mix_v2.txt");
    std::fs::write(&short, &text[..cut]).unwrap();
    let p = run_both_on(
        "audited",
        &fixture("qwen3moe"),
        &short,
        "imatrix.gguf",
        &["--parse-special", "-c", "2048", "-b", "512", "-ngl", "99", "--chunks", "64", "--output-frequency", "5", "--no-ppl"],
    );
    p.assert_same_file("imatrix.gguf");
}

#[test]
fn qwen2moe_c512_b512_is_byte_identical() {
    let p = run_both("q2-c512", &fixture("qwen2moe"), "imatrix.gguf", &args(&["-c", "512", "-b", "512"]));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
}

/// gpt-oss: biases on every projection, attention sinks, a 32-token sliding window in every
/// other layer (so -c 256 reaches past it), the router's logits as the graph's probs.
#[test]
fn gpt_oss_is_byte_identical() {
    let p = run_both("oss-c256", &fixture("gpt-oss"), "imatrix.gguf", &args(&["-c", "256", "-b", "256"]));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
}

/// glm4moe: a sigmoid router with a selection bias, renormalised gates, a shared expert, a dense
/// block 0, and a nextn/MTP block llama.cpp loads and never runs.
#[test]
fn glm4moe_is_byte_identical() {
    let p = run_both("glm-c256", &fixture("glm4moe"), "imatrix.gguf", &args(&["-c", "256", "-b", "256"]));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
}

/// minimax-m2 (MiniMax-M2's layout): glm4moe's sigmoid router with a selection bias in every
/// block, one q and one k RMSNorm over all heads, half of each head rotated, heads wider than
/// n_embd / n_head (4 × 32 against n_embd 64, as MiniMax-M2's 48 × 128 against 3072); one
/// sequence per batch and two.
#[test]
fn minimax_m2_is_byte_identical() {
    let model = fixture_with("minimax-m2-hd32", &["--arch", "minimax-m2", "--head-dim", "32"]);
    for (key, c, b) in [("mm2-c256", "256", "256"), ("mm2-c128-b256", "128", "256")] {
        let p = run_both(key, &model, "imatrix.gguf", &args(&["-c", c, "-b", b]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        assert_eq!(m.entries["blk.0.attn_output.weight"].sums.len(), 128);
        assert_eq!(m.entries["blk.0.ffn_down_exps.weight"].sums.len(), 32 * 32);
    }
}

/// cohere2moe (Cohere's North-Mini-Code layout): parallel blocks (attention and FFN both read
/// one LayerNorm's output), three sliding-window blocks to one global block without rotary
/// embedding, a dense block 0, sigmoid gates not renormalised, the shared expert averaged in;
/// one sequence per batch and two, and with the experts' gate and up fused.
#[test]
fn cohere2moe_is_byte_identical() {
    let fused = fixture_with("cohere2moe-fused", &["--arch", "cohere2moe", "--fuse-gate-up"]);
    for (key, model, c, b) in [("c2m-c256", fixture("cohere2moe"), "256", "256"), ("c2m-c128-b256", fixture("cohere2moe"), "128", "256"), ("c2m-fused", fused, "256", "256")] {
        let p = run_both(key, &model, "imatrix.gguf", &args(&["-c", c, "-b", b]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // block 0 dense, 1–3 MoE with a shared expert; the MTP block 4 never runs
        assert!(m.entries.contains_key("blk.0.ffn_down.weight") && m.entries.contains_key("blk.3.ffn_down_shexp.weight"));
        assert!(!m.entries.keys().any(|n| n.starts_with("blk.4.")), "{key}");
        assert!(!m.entries.keys().any(|n| n.contains("ffn_norm")), "{key}");
    }
}

/// step35 (Step-3.5-Flash's layout): a head-wise sigmoid gate on the attention, per-head q/k
/// norms, sliding blocks with twice the query heads of the global ones (which rotate half of
/// each head), a dense block 0, sigmoid routing with the router bias, renormalised and scaled,
/// a shared expert, the SwiGLU clamped in the odd blocks; one sequence per batch and two.
#[test]
fn step35_is_byte_identical() {
    for (key, c, b) in [("s35-c256", "256", "256"), ("s35-c128-b256", "128", "256")] {
        let p = run_both(key, &fixture("step35"), "imatrix.gguf", &args(&["-c", c, "-b", b]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // block 0 dense, 1–3 MoE with a shared expert; the MTP blocks 4–6 never run
        assert!(m.entries.contains_key("blk.0.ffn_down.weight") && m.entries.contains_key("blk.3.ffn_down_shexp.weight"));
        assert!(!m.entries.keys().any(|n| ["blk.4.", "blk.5.", "blk.6."].iter().any(|b| n.starts_with(b))), "{key}");
        // the gate reads attn_norm's output, per query head: 4 in the global block 0, 8 in the sliding 1
        assert_eq!((m.entries["blk.0.attn_gate.weight"].sums.len(), m.entries["blk.1.attn_output.weight"].sums.len()), (64, 8 * 16));
    }
}

/// mimo2 (MiMo-V2-Flash's layout): sliding blocks with an attention sink per head and twice the
/// global blocks' key/value heads, values half as wide as keys and scaled, half of each head
/// rotated with the sliding blocks' own base, a dense block 0, sigmoid routing with the router
/// bias, renormalised; one sequence per batch and two.
#[test]
fn mimo2_is_byte_identical() {
    for (key, c, b) in [("mimo2-c256", "256", "256"), ("mimo2-c128-b256", "128", "256")] {
        let p = run_both(key, &fixture("mimo2"), "imatrix.gguf", &args(&["-c", c, "-b", b]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // block 0 dense, 1–3 MoE; the MTP blocks 4–6 never run
        assert!(m.entries.contains_key("blk.0.ffn_down.weight") && m.entries.contains_key("blk.3.ffn_down_exps.weight"));
        assert!(!m.entries.keys().any(|n| ["blk.4.", "blk.5.", "blk.6."].iter().any(|b| n.starts_with(b))), "{key}");
        // attn_output reads 4 heads' values of 8 (half of the 16-wide keys)
        assert_eq!(m.entries["blk.1.attn_output.weight"].sums.len(), 4 * 8);
    }
}

/// hy_v3 (Hy3's layout): per-head q/k norms, the whole head rotated, a dense block 0, sigmoid
/// routing with the selection bias (`exp_probs_b`, no suffix), renormalised and scaled, a
/// shared expert; one sequence per batch and two.
#[test]
fn hy_v3_is_byte_identical() {
    for (key, c, b) in [("hy_v3-c256", "256", "256"), ("hy_v3-c128-b256", "128", "256")] {
        let p = run_both(key, &fixture("hy_v3"), "imatrix.gguf", &args(&["-c", c, "-b", b]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // block 0 dense, 1–3 MoE with a shared expert; the MTP block 4 never runs
        assert!(m.entries.contains_key("blk.0.ffn_down.weight") && m.entries.contains_key("blk.3.ffn_down_shexp.weight"));
        assert!(!m.entries.keys().any(|n| n.starts_with("blk.4.")), "{key}");
    }
}

/// gemma4 (Gemma 4 26B-A4B's layout): sliding blocks and global ones (proportional RoPE
/// through `rope_freqs`), q/k/v norms, every sublayer's output normalised, a dense GELU MLP
/// beside the experts in every block, the router on its own scaled RMSNorm of the block's
/// input (the graph's `probs_in`), GELU experts each scaled by `ffn_down_exps.scale` (so the
/// experts' output is `ffn_moe_down_scaled`), softcapped logits; one sequence per batch and two.
#[test]
fn gemma4_is_byte_identical() {
    for (key, c, b) in [("gemma4-c256", "256", "256"), ("gemma4-c128-b256", "128", "256")] {
        let p = run_both(key, &fixture("gemma4"), "imatrix.gguf", &args(&["-c", c, "-b", b]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // every block has the dense MLP, the router and the experts
        for t in ["ffn_down", "ffn_gate_inp", "ffn_down_exps", "ffn_up_exps"] {
            assert!(m.entries.contains_key(&format!("blk.3.{t}.weight")), "{key}: {t}");
        }
    }
}

/// deepseek4 (DeepSeek-V4's layout): four hyper-connection streams mixed around every
/// sublayer, q through a normed latent, one k/v head, sinks, grouped low-rank output, the
/// sliding window, compressed sparse attention with the lightning indexer in the last block;
/// block 0 routed by token id (`ffn_gate_tid2eid`: the graph's second lookup of `inp_tokens`,
/// once taken for a new ubatch), the others by sqrt(softplus) scores with the selection bias,
/// renormalised and scaled; one sequence per batch and two.
#[test]
fn deepseek4_is_byte_identical() {
    for (key, c, b) in [("deepseek4-c256", "256", "256"), ("deepseek4-c128-b256", "128", "256")] {
        let p = run_both(key, &fixture("deepseek4"), "imatrix.gguf", &args(&["-c", c, "-b", b]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // the hyper-connection mixes are matmuls too; the hash block's experts have entries
        for t in ["blk.0.hc_attn_fn", "blk.0.ffn_down_exps", "blk.3.attn_compressor_kv", "blk.3.indexer.proj"] {
            assert!(m.entries.contains_key(&format!("{t}.weight")), "{key}: {t}");
        }
    }
}

/// bailingmoe3 (Ling-3.0's layout): Kimi Delta Attention blocks (three causal convolutions, the
/// per-channel decay bounded below, the delta rule, the gated per-head norm) with full
/// attention every fourth block (multi-head latent attention behind a head-wise gate), a dense
/// block 0, sigmoid routing with the selection bias, renormalised and scaled by 2.5, a shared
/// expert; one sequence per batch and two (each its own recurrent state).
#[test]
fn bailingmoe3_is_byte_identical() {
    for (key, c, b) in [("bailingmoe3-c256", "256", "256"), ("bailingmoe3-c128-b256", "128", "256")] {
        let p = run_both(key, &fixture("bailingmoe3"), "imatrix.gguf", &args(&[&["-c", c, "-b", b][..], cpu_flags("bailingmoe3")].concat()));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // KDA blocks 0–2 (0 dense), the full-attention block 3; the MTP block 4 never runs
        assert!(m.entries.contains_key("blk.0.ssm_f_a.weight") && m.entries.contains_key("blk.2.ssm_g_a.weight"), "{key}");
        assert!(m.entries.contains_key("blk.3.attn_gate.weight") && m.entries.contains_key("blk.3.ffn_down_shexp.weight"), "{key}");
        assert!(!m.entries.keys().any(|n| n.starts_with("blk.4.")), "{key}");
    }
}

/// nemotron_h_moe (Nemotron-3's layout): Mamba2 mixers (`ssm_in`, the causal convolution, the
/// selective scan, the grouped gated norm, `ssm_out`), attention without rotary embedding, and
/// MoE blocks whose experts have no gate (down·relu²(up·x)) beside a shared expert, routed by a
/// sigmoid with a selection bias; one sequence per batch and two (each its own recurrent state),
/// with the experts in a latent space (`--moe-latent`, Nemotron-3-Super's), and routed within
/// expert groups (8 of 4, 2 used per token).
#[test]
fn nemotron_h_moe_is_byte_identical() {
    let (plain, latent) = (fixture("nemotron_h_moe"), fixture_with("nemotron_h_moe-latent", &["--arch", "nemotron_h_moe", "--moe-latent", "24"]));
    let grouped = fixture_with("nemotron_h_moe-groups", &["--arch", "nemotron_h_moe", "--expert-groups", "8", "--expert-groups-used", "2"]);
    for (key, model, c, b) in [("nh-c256", &plain, "256", "256"), ("nh-c128-b256", &plain, "128", "256"), ("nh-latent", &latent, "256", "256"), ("nh-groups", &grouped, "256", "256")] {
        let p = run_both(key, model, "imatrix.gguf", &args(&["-c", c, "-b", b]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // the mixer's projections and the gateless experts are collected; no gate anywhere
        for t in ["blk.0.ssm_in.weight", "blk.0.ssm_out.weight", "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight", "blk.2.attn_q.weight"] {
            assert!(m.entries.contains_key(t), "{key}: no {t}");
        }
        assert!(!m.entries.keys().any(|k| k.contains("gate_exps")), "{key}");
        // Nemotron-3-Super's latent MoE: the projections into and out of the latent space
        // too, and the experts' entries as wide as the latent
        if model == &latent {
            assert_eq!(m.entries["blk.1.ffn_latent_down.weight"].sums.len(), 64, "{key}");
            assert_eq!(m.entries["blk.1.ffn_latent_up.weight"].sums.len(), 24, "{key}");
            assert_eq!(m.entries["blk.1.ffn_up_exps.weight"].sums.len(), 24 * 32, "{key}");
        }
    }
}

/// qwen35moe (Qwen3.5-MoE's layout): gated delta net blocks (attn_qkv into a causal
/// convolution, the output gate attn_gate, ssm_alpha/ssm_beta, ssm_out) with full attention
/// (q and its sigmoid gate in one matrix) every fourth block, the shared expert behind its
/// sigmoid gate, an MTP block llama.cpp loads and never runs; qwen3next (Qwen3-Next's) the
/// same with beta and alpha in one matrix (ssm_ba) and plain rotary embedding. Two sequences
/// per batch, so the recurrent state of each is kept apart (`-nr`: `cpu_flags`), and one.
#[test]
fn qwen35moe_and_qwen3next_are_byte_identical() {
    for arch in ["qwen35moe", "qwen3next"] {
        let p = run_both(&format!("{arch}-c256-b512"), &fixture(arch), "imatrix.gguf", &args(&[&["-c", "256", "-b", "512"][..], cpu_flags(arch)].concat()));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        p.assert_same_partial_data_warnings();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        let ba: &[(&str, usize)] = if arch == "qwen3next" { &[("blk.0.ssm_ba", 64)] } else { &[("blk.0.ssm_alpha", 64), ("blk.0.ssm_beta", 64)] };
        for &(name, cols) in [
            ("blk.0.attn_qkv", 64),
            ("blk.0.attn_gate", 64),
            ("blk.0.ssm_out", 64),
            ("blk.3.attn_q", 64),
            ("blk.3.attn_output", 64),
            ("blk.0.ffn_gate_inp_shexp", 64),
            ("blk.2.ffn_down_exps", 32 * 32),
        ]
        .iter()
        .chain(ba)
        {
            let e = m.entries.get(&format!("{name}.weight")).unwrap_or_else(|| panic!("{arch}: no entry {name}: {:?}", m.entries.keys().collect::<Vec<_>>()));
            assert_eq!(e.sums.len(), cols, "{arch} {name}");
        }
        assert!(!m.entries.keys().any(|n| n.starts_with("blk.4.")), "{arch}: the MTP block is not run without --nextn");
        let p = run_both(&format!("{arch}-c256"), &fixture(arch), "imatrix.gguf", &args(&["-c", "256", "-b", "256"]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
    }
    // Qwen3-Next GGUFs converted before llama.cpp split ssm_in into attn_qkv and attn_gate
    // (the pin's "legacy" path: one matmul, then views of q, k, v, z per key head)
    let legacy = fixture_with("qwen3next-ssm-in", &["--arch", "qwen3next", "--fused-ssm-in"]);
    let p = run_both("qwen3next-ssm-in", &legacy, "imatrix.gguf", &args(&[&["-c", "256", "-b", "512"][..], cpu_flags("qwen3next")].concat()));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
    let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
    assert_eq!(m.entries["blk.0.ssm_in.weight"].sums.len(), 64);
    assert!(!m.entries.contains_key("blk.0.attn_qkv.weight") && !m.entries.contains_key("blk.0.attn_gate.weight"));
}

/// The pin's AMX matmul multiplies only the first 2-D slice of a 3-D input and leaves the rest
/// of its output wrong; upstream's tools say nothing (llama-perplexity on this fixture with two
/// sequences per batch: PPL 68158 against 20896, seen 2026-12-03). Qwen3.5's gated delta net
/// projects a 3-D input through `ssm_out` once a batch holds two sequences. On a CPU with AMX
/// ours refuses before anything is written, naming the weight and `-nr`; on any other CPU, and
/// with `-nr` on this one, the same run is upstream's byte for byte.
#[test]
fn an_amx_matmul_of_a_3d_input_is_refused_and_elsewhere_the_run_is_upstreams() {
    let model = fixture("qwen35moe");
    let d = temp_dir("amx-3d");
    let flags = ["-c", "128", "-b", "256", "--chunks", "2", "-t", "2", "--no-ppl"];
    let out = run(Command::new(ours()).current_dir(&d).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-o", "i.gguf"]).args(flags));
    let err = String::from_utf8_lossy(&out.stderr);
    let upstream = |dir: &str| {
        std::fs::create_dir_all(d.join(dir)).unwrap();
        run_ok(Command::new(reference_bin("llama-imatrix")).current_dir(d.join(dir)).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-o", "i.gguf", "-nr"]).args(flags));
        d.join(dir).join("i.gguf")
    };
    if cpu_has_amx() {
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("blk.0.ssm_out.weight sits in ggml's AMX buffer") && err.contains("--no-repack (-nr)"), "{err}");
        assert!(!d.join("i.gguf").exists() && !d.join("i.reap.json").exists());
        std::fs::create_dir_all(d.join("nr")).unwrap();
        let out = run(Command::new(ours()).current_dir(d.join("nr")).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-o", "i.gguf", "-nr"]).args(flags));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_same_bytes(&d.join("nr/i.gguf"), &upstream("up"));
    } else {
        assert!(out.status.success(), "{err}");
        assert_same_bytes(&d.join("i.gguf"), &upstream("up"));
    }
}

/// deepseek2 (DeepSeek-V3's layout, and Kimi-K2's): multi-head latent attention, whose per-head
/// matrices attn_k_b and attn_v_b are 3-D (one imatrix matrix per head); glm4moe's routing with
/// the gates scaled by 2.5 after renormalising; and routed within expert groups.
#[test]
fn deepseek2_is_byte_identical() {
    let p = run_both("ds2-c256", &fixture("deepseek2"), "imatrix.gguf", &args(&[&["-c", "256", "-b", "256"][..], cpu_flags("deepseek2")].concat()));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
    let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
    // attn_k_b [16, 32, 4 heads]: its input per head (16 wide), one count per head
    let kb = &m.entries["blk.1.attn_k_b.weight"];
    assert_eq!((kb.sums.len(), kb.counts.len()), (16 * 4, 1));
    assert_eq!(m.entries["blk.1.attn_v_b.weight"].sums.len(), 32 * 4);
    // routed within expert groups as DeepSeek-V3 routes (8 groups of 4, 2 used per token)
    let grouped = fixture_with("deepseek2-groups", &["--arch", "deepseek2", "--expert-groups", "8", "--expert-groups-used", "2"]);
    let p = run_both("ds2-groups", &grouped, "imatrix.gguf", &args(&[&["-c", "256", "-b", "256"][..], cpu_flags("deepseek2")].concat()));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
}

/// glm-dsa (GLM-5's layout) and deepseek32 (DeepSeek-V3.2's): deepseek2's multi-head latent
/// attention and routing, and in every block the lightning indexer of DeepSeek sparse
/// attention, whose three projections upstream collects like any matmul's (its top-k, 2048,
/// keeps every key at this length).
#[test]
fn glm_dsa_and_deepseek32_are_byte_identical() {
    for arch in ["glm-dsa", "deepseek32"] {
        let p = run_both(&format!("{arch}-c256"), &fixture(arch), "imatrix.gguf", &args(&[&["-c", "256", "-b", "256"][..], cpu_flags(arch)].concat()));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // attn_k and proj read the residual stream (64 wide), attn_q_b q's latent (32); every
        // token, as q's own projection
        let every = &m.entries["blk.1.attn_q_a.weight"].counts;
        for (t, cols) in [("indexer.attn_k", 64), ("indexer.proj", 64), ("indexer.attn_q_b", 32)] {
            let e = &m.entries[&format!("blk.1.{t}.weight")];
            assert_eq!((e.sums.len(), &e.counts), (cols, every), "{arch}: {t}");
        }
    }
    // the keys' Hadamard rotation is 64 wide at the least
    let (_, size) = reap_imatrix::fixture::FixtureSpec { arch: reap_imatrix::fixture::FixtureArch::GlmDsa, ..Default::default() }.indexer();
    assert_eq!(size, 64);
}

/// Heads wider than n_embd / n_head (Qwen3-30B-A3B: n_embd 2048, 32 heads of 128; GLM-4.5-Air:
/// 4096, 96 of 128): attn_output's input, and its imatrix entry, is n_head × head_dim wide.
#[test]
fn heads_wider_than_n_embd_are_byte_identical() {
    for arch in ["qwen3moe", "glm4moe"] {
        let key = format!("{arch}-hd32");
        let model = fixture_with(&key, &["--arch", arch, "--head-dim", "32"]);
        let p = run_both(&key, &model, "imatrix.gguf", &args(&["-c", "256", "-b", "256"]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        let m = imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap();
        // 4 heads of 32 against n_embd 64: the entry really is the wider one
        assert_eq!(m.entries["blk.1.attn_output.weight"].sums.len(), 128, "{arch}");
        assert_eq!(m.entries["blk.1.attn_q.weight"].sums.len(), 64, "{arch}");
    }
}

#[test]
fn two_sequences_per_batch() {
    let p = run_both("q3-c256", &fixture("qwen3moe"), "imatrix.gguf", &args(&["-c", "256", "-b", "512"]));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
}

#[test]
fn ubatch_128() {
    let p = run_both("q3-ub128", &fixture("qwen3moe"), "imatrix.gguf", &args(&["-c", "512", "-b", "512", "-ub", "128"]));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
}

#[test]
fn batch_smaller_than_context() {
    // two batches per chunk: logits are gathered across batches before scoring
    let p = run_both("q3-b256", &fixture("qwen3moe"), "imatrix.gguf", &args(&["-c", "512", "-b", "256"]));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
}

#[test]
fn no_ppl_with_two_batches_per_chunk() {
    // the graph of a chunk's last batch stops before the logits; the first must not
    let p = run_both("q3-noppl-b256", &fixture("qwen3moe"), "imatrix.gguf", &args(&["-c", "512", "-b", "256", "--no-ppl"]));
    p.assert_same_file("imatrix.gguf");
    let p = run_both("q2-noppl-2seq", &fixture("qwen2moe"), "imatrix.gguf", &args(&["-c", "256", "-b", "512", "--no-ppl"]));
    p.assert_same_file("imatrix.gguf");
}

#[test]
fn process_output() {
    let p = run_both("q2-out", &fixture("qwen2moe"), "imatrix.gguf", &args(&["-c", "256", "-b", "256", "--process-output"]));
    p.assert_same_file("imatrix.gguf");
}

#[test]
fn skipping_the_first_chunk() {
    let p = run_both("q3-chunk1", &fixture("qwen3moe"), "imatrix.gguf", &args(&["-c", "256", "-b", "256", "--chunk", "1"]));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
}

/// Upstream skips chunks only when `--chunk` > 0: a negative one, given with a space as
/// upstream's parser takes it, runs from the start.
#[test]
fn a_negative_chunk_starts_at_the_first() {
    let p = run_both("q3-chunk-neg", &fixture("qwen3moe"), "imatrix.gguf", &args(&["-c", "256", "-b", "256", "--chunk", "-1"]));
    p.assert_same_file("imatrix.gguf");
    p.assert_same_ppl();
}

#[test]
fn dat_output_format() {
    let p = run_both("q3-dat", &fixture("qwen3moe"), "imatrix.dat", &args(&["-c", "256", "-b", "256", "--output-format", "dat"]));
    p.assert_same_file("imatrix.dat");
    p.assert_same_partial_data_warnings();
}

#[test]
fn save_frequency_writes_the_same_at_n_files() {
    let p = run_both(
        "q3-savefreq",
        &fixture("qwen3moe"),
        "imatrix.gguf",
        &args(&["-c", "256", "-b", "256", "--save-frequency", "2", "--output-frequency", "3", "--no-ppl"]),
    );
    let files = p.assert_same_file_set();
    assert!(files.iter().any(|f| f == "imatrix.gguf.at_2"), "no .at_2 file: {files:?}");
    for f in &files {
        p.assert_same_file(f);
    }
    // a negative frequency is off, as upstream takes it
    let p = run_both("q3-savefreq-off", &fixture("qwen3moe"), "imatrix.gguf", &args(&["-c", "256", "-b", "256", "--save-frequency", "-1", "--no-ppl"]));
    assert_eq!(p.assert_same_file_set(), ["imatrix.gguf"]);
    p.assert_same_file("imatrix.gguf");
}

#[test]
fn one_thread_and_two_threads() {
    for t in ["1", "2"] {
        let p = run_both(&format!("q2-t{t}"), &fixture("qwen2moe"), "imatrix.gguf", &["--chunks", "4", "-c", "256", "-b", "256", "-t", t]);
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
    }
}

#[test]
fn merging_two_in_files_and_combine_only() {
    let model = fixture("qwen3moe");
    let a = run_both("merge-a", &model, "a.gguf", &args(&["-c", "256", "-b", "256", "--no-ppl"]));
    let b = run_both("merge-b", &model, "b.gguf", &args(&["-c", "256", "-b", "256", "--no-ppl", "--chunk", "6"]));
    a.assert_same_file("a.gguf");
    b.assert_same_file("b.gguf");
    let list = format!("{},{}", a.ref_dir.join("a.gguf").display(), b.ref_dir.join("b.gguf").display());
    // combine-only: no -f; -m is still required, as upstream at the pin
    let merged = |bin: PathBuf, dir: &Path| {
        run_ok(Command::new(bin).current_dir(dir).arg("-m").arg(&model).args(["--in-file", &list, "-o", "merged.gguf"]));
    };
    let (od, rd) = (temp_dir("merge-ours"), temp_dir("merge-ref"));
    merged(reference_bin("llama-imatrix"), &rd);
    merged(ours(), &od);
    assert_same_bytes(&od.join("merged.gguf"), &rd.join("merged.gguf"));
    // merging into a fresh run
    let m2 = run_both("merge-run", &model, "m.gguf", &args(&["-c", "256", "-b", "256", "--no-ppl", "--in-file", &list]));
    m2.assert_same_file("m.gguf");
    // the flag repeated: upstream merges every file (its handler appends, whatever its
    // "only last value" warning says)
    let (fa, fb) = (a.ref_dir.join("a.gguf"), b.ref_dir.join("b.gguf"));
    let m3 = run_both("merge-repeated", &model, "m.gguf", &args(&["-c", "256", "-b", "256", "--no-ppl", "--in-file", fa.to_str().unwrap(), "--in-file", fb.to_str().unwrap()]));
    m3.assert_same_file("m.gguf");
    assert_same_bytes(&m3.ours_dir.join("m.gguf"), &m2.ours_dir.join("m.gguf"));
    assert!(String::from_utf8_lossy(&m3.ours.stderr).contains("'--in-file' specified multiple times"));
}

/// Upstream flags that change where or how the graph runs: repeated flags (the last wins), the
/// KV cache types, weight repacking, KV offload, -np (no effect in llama-imatrix either):
/// the same files as upstream's tool given the same flags.
#[test]
fn cache_types_repacking_offload_and_repeated_flags_as_upstream() {
    let model = fixture("qwen3moe");
    for (i, extra) in [
        &["-ctk", "f32", "-ctv", "f32"][..],
        &["-ctk", "bf16", "-fa", "on", "-ctv", "bf16"],
        &["-nr", "-nkvo", "-np", "3", "-fit", "off"],
        &["-c", "64", "-c", "128", "-t", "1", "-t", "2", "--no-ppl", "--no-ppl"],
    ]
    .iter()
    .enumerate()
    {
        let mut a = args(&["-c", "128", "--chunks", "2"]);
        a.extend_from_slice(extra);
        let p = run_both(&format!("upstream-flags-{i}"), &model, "i.gguf", &a);
        p.assert_same_file("i.gguf");
        if !extra.contains(&"--no-ppl") {
            p.assert_same_ppl();
        }
    }
}

#[test]
fn quantize_accepts_our_imatrix() {
    let model = fixture("qwen3moe");
    let d = temp_dir("quantize");
    run_ok(Command::new(ours()).current_dir(&d).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-c", "256", "-b", "256", "--chunks", "4", "--no-ppl", "-o", "i.gguf"]));
    let out = run_ok(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", "i.gguf"]).arg(&model).args(["q.gguf", "Q4_K_M"]));
    assert!(d.join("q.gguf").is_file(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn too_little_text_is_refused_with_the_numbers() {
    let d = temp_dir("short-text");
    std::fs::write(d.join("short.txt"), "just a few words").unwrap();
    let out = run(Command::new(ours()).current_dir(&d).arg("-m").arg(fixture("qwen3moe")).args(["-f", "short.txt", "-c", "256"]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("you need at least 512 tokens"), "{err}");
}

#[test]
fn a_missing_model_file_is_named() {
    let d = temp_dir("missing-model");
    let out = run(Command::new(ours()).current_dir(&d).args(["-m", "nope.gguf", "-f"]).arg(corpus()));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nope.gguf"), "{err}");
}

/// A token of chunk 3 (with -c 256) that chunks 1 and 2 do not contain.
fn token_first_seen_in_third_chunk(model: &Path) -> u32 {
    use reap_imatrix::llama::{Model, ModelParams};
    let m = Model::load(model, &ModelParams::default()).unwrap();
    let mut text = std::fs::read(corpus()).unwrap();
    if text.last() == Some(&b'\n') {
        text.pop();
    }
    let toks = m.vocab().tokenize(&text, true, false).unwrap();
    let early: std::collections::HashSet<i32> = toks[..512].iter().copied().collect();
    toks[512..768].iter().copied().find(|t| !early.contains(t)).expect("a new token in chunk 3") as u32
}

#[test]
fn non_finite_values_stop_the_run_name_the_tensor_and_keep_the_last_checkpoint() {
    let clean = fixture("qwen3moe");
    let poison = token_first_seen_in_third_chunk(&clean);
    let d = temp_dir("poisoned-model");
    let model = d.join("poisoned.gguf");
    run_ok(Command::new(ours()).args(["fixture", "--poison-token", &poison.to_string(), "-o"]).arg(&model));
    let go = |bin: PathBuf, dir: &Path| {
        run(Command::new(bin)
            .current_dir(dir)
            .arg("-m")
            .arg(&model)
            .arg("-f")
            .arg(corpus())
            .args(["-c", "256", "-b", "256", "--chunks", "5", "-ofreq", "1", "--no-ppl", "-t", "2", "-o", "imatrix.gguf"]))
    };
    let (od, rd) = (temp_dir("poisoned-ours"), temp_dir("poisoned-ref"));
    let upstream = go(reference_bin("llama-imatrix"), &rd);
    let ours_out = go(ours(), &od);
    assert!(!upstream.status.success() && !ours_out.status.success());
    let err = String::from_utf8_lossy(&ours_out.stderr);
    assert!(err.contains("non-finite values detected in blk.0."), "{err}");
    assert!(err.contains("(chunk 3)"), "{err}");
    assert!(err.contains("left as it was"), "{err}");
    // the checkpoint both tools left behind is the same, readable file
    assert_same_bytes(&od.join("imatrix.gguf"), &rd.join("imatrix.gguf"));
    let loaded = reap_imatrix::formats::imatrix::load(&od.join("imatrix.gguf")).unwrap();
    assert_eq!(loaded.chunk_count, 2);
}

/// Upstream's logger is a leaked background thread (llama.cpp issue 22142): whatever it has
/// not printed when `main` returns is lost, which at the pin loses the whole statistics table.
/// A preloaded library that lingers 300 ms in its destructor lets it finish printing.
fn linger_shim() -> PathBuf {
    let d = temp_dir("linger-shim");
    let src = d.join("linger.c");
    std::fs::write(&src, "#include <unistd.h>\n__attribute__((destructor)) static void linger(void) { usleep(1000000); }\n").unwrap();
    let so = d.join("linger.so");
    run_ok(Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&so).arg(&src));
    so
}

#[test]
fn show_statistics_prints_upstreams_tables() {
    let model = fixture("qwen3moe");
    let p = run_both("stats", &model, "imatrix.gguf", &args(&["-c", "256", "-b", "256", "--no-ppl"]));
    p.assert_same_file("imatrix.gguf");
    let file = p.ref_dir.join("imatrix.gguf");
    let up = run_ok(
        Command::new(reference_bin("llama-imatrix"))
            .env("LD_PRELOAD", linger_shim())
            .arg("-m")
            .arg(&model)
            .arg("--in-file")
            .arg(&file)
            .arg("--show-statistics"),
    );
    let from_table = |text: &[u8]| -> Vec<String> {
        String::from_utf8_lossy(text).lines().skip_while(|l| !l.starts_with("Computing statistics")).map(String::from).collect()
    };
    // lines its logger started itself carry a `0.00.008.696 I ` timestamp prefix: drop it
    let strip = |l: String| -> String {
        match l.split_once(' ') {
            Some((stamp, rest)) if stamp.len() > 4 && stamp.chars().all(|c| c.is_ascii_digit() || c == '.') => {
                rest.strip_prefix("I ").or(rest.strip_prefix('I')).unwrap_or(rest).to_string()
            }
            _ => l,
        }
    };
    let upstream: Vec<String> = from_table(&up.stderr).into_iter().map(strip).collect();
    let o = run_ok(Command::new(ours()).arg("-m").arg(&model).arg("--in-file").arg(&file).arg("--show-statistics"));
    assert!(upstream.len() > 10, "upstream printed no table: {}", String::from_utf8_lossy(&up.stderr));
    let ours_lines = from_table(&o.stderr);
    let (ours_t, up_t) = (stats_table(&ours_lines), stats_table(&upstream));
    // everything outside the per-tensor rows (headers, the per-layer table) line for line
    assert_eq!(ours_t.other, up_t.other);
    // the rows: the same groups of rows with equal printed sort keys, in the same order, each
    // the same set of rows (upstream's order among exactly equal keys is unspecified)
    assert_eq!(ours_t.groups.len(), up_t.groups.len());
    for (a, b) in ours_t.groups.iter().zip(&up_t.groups) {
        assert_eq!(a.0, b.0, "sort keys differ");
        let (mut x, mut y) = (a.1.clone(), b.1.clone());
        x.sort();
        y.sort();
        assert_eq!(x, y, "rows of tie group {:?} differ", a.0);
    }
    // (our own order among exact ties, by layer number, is unit-tested in formats::imatrix_stats:
    // the printed values cannot tell an exact tie from a near one)
    assert!(ours_t.groups.iter().map(|g| g.1.len()).sum::<usize>() > 10);
}

/// `--show-statistics` output split into the per-tensor rows, grouped by their sort key
/// (tensor kind, printed Σ(Act²)), and every other line.
struct StatsTable {
    other: Vec<String>,
    groups: Vec<((String, String), Vec<String>)>,
}

fn stats_table(lines: &[String]) -> StatsTable {
    let mut t = StatsTable { other: Vec::new(), groups: Vec::new() };
    let mut in_rows = false;
    for l in lines {
        if l.starts_with("====") && t.groups.is_empty() && !in_rows {
            in_rows = true;
            t.other.push(l.clone());
            continue;
        }
        if in_rows && l.trim().is_empty() {
            in_rows = false;
        }
        if !in_rows {
            t.other.push(l.clone());
            continue;
        }
        let f: Vec<&str> = l.split('\t').collect();
        let key = (f[1].trim().to_string(), f[2].trim().to_string());
        match t.groups.last_mut() {
            Some((k, rows)) if *k == key => rows.push(l.clone()),
            _ => t.groups.push((key, vec![l.clone()])),
        }
    }
    t
}

#[test]
fn llama_cpp_logs_are_quiet_by_default_and_shown_with_v() {
    let model = fixture("qwen3moe");
    let d = temp_dir("logs");
    let go = |extra: &[&str]| {
        let o = run_ok(Command::new(ours()).current_dir(&d).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-c", "128", "--chunks", "2", "--no-ppl", "--no-reap"]).args(extra));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let quiet = go(&[]);
    let loud = go(&["-v"]);
    assert!(!quiet.contains("llama_model_loader"), "{quiet}");
    assert!(loud.contains("llama_model_loader"), "{loud}");
}

#[test]
fn help_lists_every_subcommand() {
    let o = run_ok(Command::new(ours()).arg("--help"));
    let text = String::from_utf8_lossy(&o.stdout);
    for sub in ["fixture", "check", "select", "replay", "reproduce"] {
        assert!(text.lines().any(|l| l.trim_start().starts_with(sub) && l.len() > sub.len() + 8), "--help lacks {sub}:\n{text}");
    }
}

/// Output paths are checked before the model is loaded: a typo costs a second, not a run.
#[test]
fn unwritable_outputs_fail_before_computing() {
    let model = fixture("qwen3moe");
    let d = temp_dir("unwritable");
    let go = |extra: &[&str]| {
        let o = run(Command::new(ours()).current_dir(&d).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-c", "128", "--chunks", "2", "--no-ppl"]).args(extra));
        (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    for (extra, says) in [
        (vec!["-o", "missing/dir/imatrix.gguf"], "-o missing/dir/imatrix.gguf: the folder missing/dir does not exist"),
        (vec!["--reap-out", "nope/r.json"], "--reap-out nope/r.json: the folder nope does not exist"),
        (vec!["--trace-out", "nope/t.bin"], "--trace-out nope/t.bin"),
        (vec!["--manifest-out", "nope/m.json"], "--manifest-out nope/m.json"),
        (vec!["-o", "same.gguf", "--trace-out", "./same.gguf"], "name the same file"),
    ] {
        let (code, err) = go(&extra);
        assert_eq!(code, Some(2), "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(!err.contains("compute_imatrix"), "{extra:?} computed before failing: {err}");
    }
    // a read-only folder (root ignores permissions, so only where they apply)
    let ro = d.join("ro");
    std::fs::create_dir_all(&ro).unwrap();
    std::fs::set_permissions(&ro, std::os::unix::fs::PermissionsExt::from_mode(0o555)).unwrap();
    if std::fs::write(ro.join("probe"), b"").is_err() {
        let (code, err) = go(&["-o", "ro/imatrix.gguf"]);
        assert_eq!(code, Some(2));
        assert!(err.contains("cannot write in ro"), "{err}");
    }
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "something was written");
}

/// `-ngl 99 --rpc` to a local `ggml-rpc-server`: every layer off-host, as on a GPU, so every
/// tensor the callback reads is copied from a device buffer; and `-ngl 2` of the fixture's 4
/// layers, a model split between the host and the device (where a layer's experts and their
/// weighting run on different backends, the weighting reads the scheduler's copy,
/// `RPC0[…]#ffn_moe_down-2#0`, which REAP once refused). The imatrix equals upstream's over
/// the same server byte for byte; the REAP sums equal our CPU run's to float rounding (the
/// offloaded graph runs other kernels than the host's, as `eval`'s RPC test measured).
#[test]
fn offloaded_through_rpc_is_byte_identical_and_reap_agrees_with_the_cpu() {
    let server = RpcServer::start();
    let model = fixture("qwen3moe");
    let cpu = temp_dir("rpc-cpu");
    run_ok(Command::new(ours()).current_dir(&cpu).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-o", "imatrix.gguf"]).args(args(&["-c", "128", "-b", "128"])));
    for ngl in ["99", "2"] {
        let p = run_both(&format!("rpc-ngl{ngl}"), &model, "imatrix.gguf", &args(&["-c", "128", "-b", "128", "-ngl", ngl, "--rpc", &server.endpoint]));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        reap_agrees_with_the_cpu(&p.ours_dir, &cpu);
    }
}

/// The same for Qwen3.5-MoE's and Qwen3-Next's hybrid trunks, two sequences per batch: the
/// gated delta net's convolution and recurrent states live on the server with the weights;
/// and for DeepSeek-V4's (its compressor states there too, the hash block's table read on the
/// server) and Gemma 4's (the router's own input, the per-expert output scale).
#[test]
fn hybrid_models_offloaded_through_rpc_are_byte_identical_and_reap_agrees_with_the_cpu() {
    let server = RpcServer::start();
    for arch in ["qwen35moe", "qwen3next", "deepseek4", "gemma4"] {
        let model = fixture(arch);
        let flags = ["-c", "128", "-b", "256"];
        let cpu = temp_dir(&format!("rpc-cpu-{arch}"));
        run_ok(Command::new(ours()).current_dir(&cpu).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-o", "imatrix.gguf"]).args(args(&[&flags[..], cpu_flags(arch)].concat())));
        let p = run_both(&format!("rpc-{arch}"), &model, "imatrix.gguf", &args(&[&flags[..], &["-ngl", "99", "--rpc", &server.endpoint]].concat()));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        reap_agrees_with_the_cpu(&p.ours_dir, &cpu);
    }
}

/// The way a MoE model larger than the GPU is run: `-ngl 99` with the experts' weights kept in
/// host memory (`-ot exps=CPU`, `--cpu-moe`, or `--n-cpu-moe N` for the first N layers), here
/// with a local `ggml-rpc-server` as the device. The imatrix equals upstream's with the same
/// flags byte for byte, the REAP sums our CPU run's to float rounding, and the saliency JSON
/// records the overrides in command-line order (the first matching pattern decides, as in llama.cpp).
/// `--imatrix-on-device` agrees with the exact mode as with every layer offloaded. The
/// placement takes effect: the expert outputs then sit on the host, so fewer bytes per
/// token are copied from the device than with every layer offloaded, and fewer still the more
/// layers keep their experts.
#[test]
fn experts_kept_in_host_memory_are_byte_identical_and_reap_agrees_with_the_cpu() {
    let server = RpcServer::start();
    let model = fixture("qwen3moe");
    let flags = ["-c", "128", "-b", "128"];
    let cpu = temp_dir("ot-cpu");
    run_ok(Command::new(ours()).current_dir(&cpu).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-o", "imatrix.gguf"]).args(args(&flags)));
    let copied_per_token = |o: &Output| -> u64 {
        let err = String::from_utf8_lossy(&o.stderr);
        err.split("MiB copied from device buffers (").nth(1).and_then(|s| s.split(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("no copy line:\n{err}"))
    };
    let rpc_attn = format!("attn=RPC0[{}]", server.endpoint);
    let mut per_token = Vec::new();
    for (name, placement) in [
        ("all", vec![]),
        ("ncmoe", vec!["-ncmoe", "2"]),
        ("ot", vec!["-ot", "exps=CPU"]),
        ("cmoe", vec!["--cpu-moe"]),
        ("ot-two", vec!["-ot", &rpc_attn, "-ot", "ffn_down_exps=CPU,exps=CPU", "--n-cpu-moe", "1"]),
        // -dev: the server by name offloads as without it; none keeps every layer on the host
        ("dev", vec!["-dev", "RPC0"]),
        ("dev-none", vec!["-dev", "none"]),
    ] {
        let extra = [&flags[..], &["-ngl", "99", "--rpc", &server.endpoint], &placement[..]].concat();
        let p = run_both(&format!("ot-{name}"), &model, "imatrix.gguf", &args(&extra));
        p.assert_same_file("imatrix.gguf");
        p.assert_same_ppl();
        reap_agrees_with_the_cpu(&p.ours_dir, &cpu);
        if name == "dev-none" {
            let err = String::from_utf8_lossy(&p.ours.stderr);
            assert!(!err.contains("copied from device buffers"), "-dev none read device buffers:\n{err}");
            assert_same_bytes(&p.ours_dir.join("imatrix.gguf"), &cpu.join("imatrix.gguf"));
            continue;
        }
        per_token.push(copied_per_token(&p.ours));
        if name == "ot" {
            // the fast mode reduces what is off-host on the device and the rest on the host
            run_ok(Command::new(ours()).current_dir(&p.ours_dir).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-o", "fast.gguf", "--imatrix-on-device"]).args(args(&extra)));
            let (a, b) = (imatrix_file::load(&p.ours_dir.join("imatrix.gguf")).unwrap(), imatrix_file::load(&p.ours_dir.join("fast.gguf")).unwrap());
            assert_eq!(a.entries.keys().collect::<Vec<_>>(), b.entries.keys().collect::<Vec<_>>());
            for (entry, ea) in &a.entries {
                let eb = &b.entries[entry];
                assert_eq!(ea.counts, eb.counts, "{entry}");
                for (&x, &y) in ea.sums.iter().zip(&eb.sums) {
                    assert!((x - y).abs() <= 1e-4 * x.abs().max(y.abs()), "{entry}: {x} exact, {y} on the device");
                }
            }
        }
        let saliency: serde_json::Value = serde_json::from_slice(&read(&p.ours_dir.join("imatrix.reap.json"))).unwrap();
        let recorded = &saliency["metadata"]["run"]["tensor_overrides"];
        match name {
            "all" | "dev" => assert!(recorded.is_null(), "{recorded}"),
            "ot-two" => assert_eq!(
                recorded,
                &serde_json::json!([rpc_attn, "ffn_down_exps=CPU", "exps=CPU", r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"]),
            ),
            _ => assert!(recorded.as_array().is_some_and(|a| !a.is_empty()), "{name}: {recorded}"),
        }
    }
    eprintln!("bytes copied per token: {per_token:?} (all offloaded, 2 of 4 layers' experts on the host, all of them: -ot, --cpu-moe, two -ot; -dev RPC0)");
    assert!(per_token[0] > per_token[1] && per_token[1] > per_token[2], "{per_token:?}");
    assert_eq!(per_token[2], per_token[3], "-ot exps=CPU and --cpu-moe place alike");
    assert_eq!(per_token[0], per_token[5], "-dev RPC0 offloads as without -dev");
    // --list-devices names what upstream's names (the free memory may move between the calls)
    let devices = |bin: PathBuf| {
        let o = run_ok(Command::new(bin).args(["--rpc", &server.endpoint, "--list-devices"]));
        String::from_utf8_lossy(&o.stdout).lines().map(|l| l.split(" (").next().unwrap().to_string()).collect::<Vec<_>>()
    };
    let listed = devices(ours());
    assert_eq!(listed, ["Available devices:".to_string(), format!("  RPC0: {}", server.endpoint)]);
    assert_eq!(listed, devices(reference_bin("llama-imatrix")));
}

fn reap_agrees_with_the_cpu(offloaded: &Path, cpu: &Path) {
    let read = |d: &Path| reap_imatrix::formats::saliency::Saliency::read(&d.join("imatrix.reap.json")).unwrap();
    let (off, host) = (read(offloaded), read(cpu));
    assert_eq!(off.tokens, host.tokens);
    let close = |a: &[f64], b: &[f64], what: &str| {
        for (e, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-3 * y.abs().max(1e-6), "{what}[{e}]: {x} off-host, {y} on the CPU");
        }
    };
    let mut routed_same = 0;
    for (a, b) in off.layers.iter().zip(&host.layers) {
        // a near-tie in the router may pick another expert off-host; the fixture has few
        if a.count == b.count {
            routed_same += 1;
            close(&a.reap_l2_sum, &b.reap_l2_sum, &format!("layer {} reap_l2_sum", a.layer));
            close(&a.ean_sum, &b.ean_sum, &format!("layer {} ean_sum", a.layer));
            close(&a.max_l2, &b.max_l2, &format!("layer {} max_l2", a.layer));
        }
    }
    eprintln!("{routed_same} of {} layers routed alike off-host", off.layers.len());
    assert!(routed_same * 2 >= off.layers.len(), "routing differs in most layers off-host");
}

/// `--imatrix-on-device` over a local `ggml-rpc-server` (`-ngl 99`): the matmul inputs are
/// reduced where they live. Counts equal the exact mode's; sums agree to f32 rounding (the
/// largest relative difference is printed); far fewer bytes are copied to the host.
#[test]
fn imatrix_on_device_agrees_with_the_exact_mode() {
    let server = RpcServer::start();
    let model = fixture("qwen3moe");
    let d = temp_dir("imatrix-on-device");
    // chunks of 128 over the server, with -ngl (all layers: 99) and the rest of the flags
    let calibrate = |out: &str, ngl: &str, chunks: &str, extra: &[&str]| {
        let o = run_ok(
            Command::new(ours())
                .current_dir(&d)
                .arg("-m")
                .arg(&model)
                .arg("-f")
                .arg(corpus())
                .args(["-o", out, "-c", "128", "-b", "128", "--chunks", chunks, "-t", "2", "--no-ppl", "-ngl", ngl, "--rpc", &server.endpoint])
                .args(extra),
        );
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let go = |out: &str, extra: &[&str]| calibrate(out, "99", "4", extra);
    let copied_mib = |err: &str| -> f64 { err.split("collection: ").filter_map(|s| s.split(" MiB copied").next()?.parse().ok()).next().unwrap_or_else(|| panic!("no copy line:\n{err}")) };
    let sums_bytes = |err: &str| -> u64 {
        err.split("--imatrix-on-device copied ").nth(1).and_then(|s| s.split(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("no per-chunk sums line:\n{err}"))
    };
    // four ubatches per chunk (the forward itself depends on the ubatch size, so both modes
    // use the same): accumulated on the device, copied once per chunk
    let exact_mib = copied_mib(&go("exact.gguf", &["-ub", "32"]));
    let fast = go("fast.gguf", &["--imatrix-on-device", "-ub", "32"]);
    let fast_mib = copied_mib(&fast);
    let one_ubatch = go("fast-ub128.gguf", &["--imatrix-on-device"]);
    let (a, b) = (imatrix_file::load(&d.join("exact.gguf")).unwrap(), imatrix_file::load(&d.join("fast.gguf")).unwrap());
    assert_eq!(a.entries.keys().collect::<Vec<_>>(), b.entries.keys().collect::<Vec<_>>());
    assert_eq!(a.chunk_count, b.chunk_count);
    let mut worst = 0.0f64;
    for (name, ea) in &a.entries {
        let eb = &b.entries[name];
        assert_eq!(ea.counts, eb.counts, "{name}");
        for (&x, &y) in ea.sums.iter().zip(&eb.sums) {
            let (x, y) = (x as f64, y as f64);
            if x != y {
                worst = worst.max((x - y).abs() / x.abs().max(y.abs()));
            }
        }
    }
    eprintln!("largest relative difference of a sum: {worst:.3e}; copied {exact_mib} MiB exact, {fast_mib} MiB on-device");
    assert!(worst > 0.0 && worst < 1e-4, "{worst}");
    // imatrix-diff says the same (its means Σx²/count, with equal counts: the sums' ratio)
    let o = run_ok(Command::new(ours()).current_dir(&d).args(["imatrix-diff", "exact.gguf", "fast.gguf", "--json", "diff.json"]));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(text.contains("counts: identical"), "{text}");
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(d.join("diff.json")).unwrap()).unwrap();
    let reported = j["max_rel"].as_f64().unwrap();
    assert!((reported - worst).abs() <= 1e-9 * worst, "imatrix-diff {reported} vs {worst}\n{text}");
    // every column of every matrix with rows (the fixture's dead experts have none)
    let routed: u64 = a.entries.values().map(|e| (e.sums.len() / e.counts.len() * e.counts.iter().filter(|&&c| c > 0).count()) as u64).sum();
    assert_eq!(j["values"].as_u64().unwrap(), routed, "{text}");
    // a bound below it fails, one above passes; an unreadable file is named (exit 2)
    let code = |args: &[&str]| run(Command::new(ours()).current_dir(&d).arg("imatrix-diff").args(args)).status.code();
    assert_eq!(code(&["exact.gguf", "fast.gguf", "--max-rel", &format!("{:e}", worst / 2.0)]), Some(1));
    assert_eq!(code(&["exact.gguf", "fast.gguf", "--max-rel", "1e-4"]), Some(0));
    std::fs::write(d.join("bad.gguf"), b"GGUF\x03").unwrap();
    let o = run(Command::new(ours()).current_dir(&d).args(["imatrix-diff", "exact.gguf", "bad.gguf"]));
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("bad.gguf"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(fast_mib * 4.0 < exact_mib, "{fast_mib} MiB vs {exact_mib} MiB");
    // once per drain: each weight's sums (and an expert weight's counts) as f32, whatever the
    // ubatch size; k and v read q's input, the experts' gate reads up's (same size): their
    // sums are not reduced or copied again. A drain where upstream's rule writes a checkpoint
    // and at the end: with the default -ofreq 10, once in 4 chunks
    let shares_input = |name: &str| ["attn_k.weight", "attn_v.weight", "ffn_gate_exps.weight"].iter().any(|s| name.ends_with(s));
    let per_drain: u64 = a.entries.iter().filter(|(n, _)| !shares_input(n)).map(|(_, e)| 4 * (e.sums.len() + if e.counts.len() > 1 { e.counts.len() } else { 0 }) as u64).sum();
    let drains = |err: &str| -> u64 { err.split(" drains (").next().and_then(|s| s.rsplit(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("no drain count:\n{err}")) };
    assert_eq!((sums_bytes(&fast), drains(&fast)), (per_drain, 1), "-ub 32");
    assert_eq!((sums_bytes(&one_ubatch), drains(&one_ubatch)), (per_drain, 1), "-ub 128");
    // with checkpoints every 2 chunks and .at_3: drains at chunks 2, 3 and 4, and each
    // checkpoint holds whole chunks: .at_3 what an exact run over 3 chunks ends with (the
    // same chunks and counts, sums to f32 rounding; upstream's own .at_3 is taken mid-graph,
    // when the first weight's count crosses the chunk, before the rest of that ubatch)
    let ck = go("fast-ck.gguf", &["--imatrix-on-device", "-ub", "32", "-ofreq", "2", "--save-frequency", "3"]);
    assert_eq!((sums_bytes(&ck), drains(&ck)), (3 * per_drain, 3), "-ofreq 2 --save-frequency 3");
    calibrate("exact-3.gguf", "99", "3", &["-ub", "32"]);
    let file = |n: &str| imatrix_file::load(&d.join(n)).unwrap_or_else(|e| panic!("{n}: {e:#}"));
    for (x, y) in [("exact.gguf", "fast-ck.gguf"), ("exact-3.gguf", "fast-ck.gguf.at_3")] {
        let (ex, fa) = (file(x), file(y));
        assert_eq!(ex.chunk_count, fa.chunk_count, "{y}");
        for (name, e) in &ex.entries {
            let f = &fa.entries[name];
            assert_eq!(e.counts, f.counts, "{y}: {name}");
            for (&u, &v) in e.sums.iter().zip(&f.sums) {
                assert!((u - v).abs() <= 1e-4 * u.abs().max(v.abs()), "{y}: {name}: {u} vs {v}");
            }
        }
    }
    assert_eq!(file("fast-ck.gguf.at_3").chunk_count, 3);
    // a model split by -ngl 2 (of 4 layers): the host's layers collected there, the device's
    // reduced; the host's counts run the checkpoint rule mid-graph, so the device sums are
    // added every chunk
    calibrate("exact-split.gguf", "2", "4", &["-ub", "32"]);
    let fast_split = calibrate("fast-split.gguf", "2", "4", &["-ub", "32", "--imatrix-on-device"]);
    assert_eq!(drains(&fast_split), 4, "{fast_split}");
    let o = run_ok(Command::new(ours()).current_dir(&d).args(["imatrix-diff", "exact-split.gguf", "fast-split.gguf", "--max-rel", "1e-4"]));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(text.contains("counts: identical"), "{text}");
    // 3 shared per layer, 4 layers, in each of 16 ubatches (and 4 at -ub 128)
    let shared = |err: &str| -> u64 { err.split(" matmuls collected from the input of the one before").next().and_then(|s| s.rsplit(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("no shared-input count:\n{err}")) };
    assert_eq!((shared(&fast), shared(&one_ubatch)), (3 * 4 * 16, 3 * 4 * 4));

    // what the imatrix is for: models quantized with either score the same perplexity
    let ppl = |imatrix: &str| {
        let q = format!("q-{imatrix}");
        run_ok(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", imatrix]).arg(&model).args([&q, "Q4_K_M"]));
        // -nr: this CPU's repacked quantized kernels crash at the pin (README, Status)
        let out = run_ok(Command::new(reference_bin("llama-perplexity")).current_dir(&d).args(["-m", &q, "-f"]).arg(corpus()).args(["-c", "128", "--chunks", "4", "-t", "2", "-nr"]));
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        let tail = err.split("Final estimate: PPL = ").nth(1).unwrap_or_else(|| panic!("no PPL:\n{err}"));
        tail.split_whitespace().next().unwrap().parse::<f64>().unwrap()
    };
    // on CUDA the outer products run on cuBLAS in TF32 (ggml-cuda's handles, docs/gpu.md):
    // each x² rounded to 10 mantissa bits, a sum off by less than 2^-10 relative. The worst
    // that envelope allows, stood in for here: every sum of the exact imatrix scaled by its
    // own factor in [1 - 2^-10, 1], pseudo-random per value
    let mut m = imatrix_file::Imatrix { datasets: a.datasets.clone(), last_chunk: a.chunk_count, ..Default::default() };
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for (name, e) in &a.entries {
        let values = e
            .sums
            .iter()
            .map(|&v| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                v * (1.0 - ((state >> 40) as f32 / (1u64 << 24) as f32) / 1024.0)
            })
            .collect();
        m.stats.insert(name.clone(), imatrix_file::Stats { values, counts: e.counts.clone() });
    }
    imatrix_file::write_gguf(&d.join("tf32-envelope.gguf"), &m, "", a.chunk_size).unwrap();
    let (pe, pf, pt) = (ppl("exact.gguf"), ppl("fast.gguf"), ppl("tf32-envelope.gguf"));
    eprintln!("Q4_K_M perplexity: {pe} with the exact imatrix, {pf} with the on-device one, {pt} with the exact one off by up to 2^-10");
    assert!((pe - pf).abs() <= 1e-3 * pe, "{pe} vs {pf}");
    assert!((pe - pt).abs() <= 1e-3 * pe, "{pe} vs {pt}");
}

/// `imatrix-diff` of the GGUF and the legacy `.dat` of one run: the `.dat`'s single call count
/// per weight scales every expert's means (as llama-quantize reads it), so the two agree to
/// the f32 rounding of the `.dat`'s pre-scaled values; a model is not an imatrix.
#[test]
fn imatrix_diff_compares_a_dat_with_the_gguf_of_the_same_run() {
    let d = temp_dir("imatrix-diff-dat");
    let model = fixture("qwen3moe");
    for out in ["i.gguf", "i.dat"] {
        let mut c = Command::new(ours());
        c.current_dir(&d).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-c", "128", "--chunks", "2", "-t", "2", "--no-ppl", "--no-reap", "-o", out]);
        if out.ends_with(".dat") {
            c.args(["--output-format", "dat"]);
        }
        run_ok(&mut c);
    }
    let o = run_ok(Command::new(ours()).current_dir(&d).args(["imatrix-diff", "i.gguf", "i.dat", "--max-rel", "1e-6", "--json", "d.json"]));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("counts: not compared") && !text.contains("shapes differ"), "{text}");
    let j: serde_json::Value = serde_json::from_slice(&read(&d.join("d.json"))).unwrap();
    assert_eq!(j["comparable"], true);
    assert!(j["values"].as_u64().unwrap() > 1000, "{j}");
    let o = run(Command::new(ours()).current_dir(&d).arg("imatrix-diff").arg(&model).arg("i.gguf"));
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not an imatrix (a model?)"));
    let o = run(Command::new(ours()).current_dir(&d).args(["imatrix-diff", "i.gguf", "i.gguf", "--max-rel", "nan"]));
    assert_eq!(o.status.code(), Some(2));
}
