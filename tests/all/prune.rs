//! `reap-imatrix prune`: pruned fixtures load and run in upstream llama.cpp, keep-all maps
//! reproduce the file, sliced imatrices pass upstream llama-quantize, kept experts route and
//! compute as before, and every bad input is refused with nothing written.

use super::util::*;
use reap_imatrix::formats::gguf::Header;
use reap_imatrix::formats::imatrix;
use reap_imatrix::formats::saliency::Saliency;
use reap_imatrix::formats::trace::TraceReader;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// MoE blocks, experts and experts used of the default fixtures (`util::fixture`).
const BLOCKS: [u32; 4] = [0, 1, 2, 3];
const N_EXPERT: u16 = 32;
/// The fixture architectures; gpt-oss adds per-expert biases and a router bias to slice.
const ARCHS: [&str; 3] = ["qwen3moe", "qwen2moe", "gpt-oss"];

fn prune(args: &[&std::ffi::OsStr]) -> Output {
    run(Command::new(ours()).arg("prune").args(args))
}

/// Runs prune in the output's folder (relative paths in `extra` are relative to it).
fn prune_ok(model: &Path, map: &Path, out: &Path, extra: &[&str]) -> Output {
    run_ok(
        Command::new(ours())
            .current_dir(out.parent().unwrap())
            .arg("prune")
            .arg("-m")
            .arg(model)
            .arg("--keep-map")
            .arg(map)
            .arg("-o")
            .arg(out)
            .args(extra),
    )
}

fn write_map(path: &Path, v: Value) -> PathBuf {
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    path.to_path_buf()
}

/// A map keeping `keep[i]` in block `BLOCKS[i]`.
fn map_json(keep: &[Vec<u16>]) -> Value {
    map_json_for(keep, &BLOCKS)
}

/// A map keeping `keep[i]` in block `blocks[i]`.
fn map_json_for(keep: &[Vec<u16>], blocks: &[u32]) -> Value {
    let layers: Vec<Value> = keep.iter().zip(blocks).map(|(k, b)| json!({"layer": b, "keep": k})).collect();
    json!({"format": "reap-keep-map", "version": 1, "method": "test", "k": keep[0].len(), "layers": layers})
}

/// Calibrates `model` on the bundled corpus into `dir` (imatrix, saliency JSON, full trace).
fn calibrate(dir: &Path, model: &Path) {
    calibrate_with(dir, model, &[]);
}

/// [calibrate] with `extra` flags (an arch's [cpu_flags]).
fn calibrate_with(dir: &Path, model: &Path, extra: &[&str]) {
    run_ok(
        Command::new(ours())
            .current_dir(dir)
            .arg("-m")
            .arg(model)
            .arg("-f")
            .arg(corpus())
            .args(["-c", "128", "-b", "128", "--chunks", "4", "-t", "2", "--no-ppl", "-o", "imatrix.gguf", "--trace-out", "t.bin"])
            .args(extra),
    );
}

fn final_ppl(out: &Output) -> f64 {
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let line = text.lines().find(|l| l.contains("Final estimate: PPL =")).unwrap_or_else(|| panic!("no final estimate in:\n{text}"));
    line.split("PPL =").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap()
}

/// Upstream llama-perplexity's final estimate. `-nr` (no weight repacking): on CPUs with AMX
/// in some VMs the repacked Q8_0/Q4_0 kernels die with SIGILL, for unpruned models too.
pub fn upstream_ppl(model: &Path) -> f64 {
    let out = run_ok(
        Command::new(reference_bin("llama-perplexity"))
            .arg("-m")
            .arg(model)
            .arg("-f")
            .arg(corpus())
            .args(["-c", "128", "--chunks", "3", "-t", "2", "-nr"]),
    );
    final_ppl(&out)
}

fn keep_all() -> Vec<Vec<u16>> {
    vec![(0..N_EXPERT).collect(); BLOCKS.len()]
}

#[test]
fn a_keep_all_map_reproduces_the_model_and_imatrix_byte_for_byte() {
    for arch in ARCHS {
        let d = temp_dir(&format!("prune-keepall-{arch}"));
        calibrate(&d, &fixture(arch));
        let map = write_map(&d.join("all.json"), map_json(&keep_all()));
        prune_ok(&fixture(arch), &map, &d.join("out.gguf"), &["--imatrix", "imatrix.gguf", "--imatrix-out", "out.imatrix.gguf"]);
        assert_same_bytes(&fixture(arch), &d.join("out.gguf"));
        assert_same_bytes(&d.join("imatrix.gguf"), &d.join("out.imatrix.gguf"));

        // a map from select records the model it was fitted on, and prune accepts that model
        run_ok(Command::new(ours()).current_dir(&d).args([
            "select",
            "--reap",
            "imatrix.reap.json",
            "--method",
            "frequency",
            "--k",
            "6",
            "--out-dir",
            "maps",
        ]));
        let map = d.join("maps/keep_frequency_k6.json");
        let v: Value = serde_json::from_slice(&read(&map)).unwrap();
        let sha = reap_imatrix::formats::sha256::sha256_file(&fixture(arch)).unwrap();
        assert_eq!((v["model"]["sha256"].as_str(), v["model"]["expert_count"].as_u64()), (Some(sha.as_str()), Some(32)), "{arch}");
        prune_ok(&fixture(arch), &map, &d.join("k6.gguf"), &[]);
        let b = read(&d.join("k6.gguf"));
        assert_eq!(Header::parse(&b).unwrap().uint(&b, &format!("{arch}.expert_count")), Some(6));
    }
}

/// The mapped copy (the fallback where `copy_file_range` is refused, forced here) writes the
/// same bytes as the kernel copy, for a map that slices every per-expert tensor.
#[test]
fn the_mapped_copy_writes_what_the_kernel_copy_writes() {
    let d = temp_dir("prune-copy-paths");
    let keep: Vec<Vec<u16>> = vec![(0..N_EXPERT).step_by(3).collect(); BLOCKS.len()];
    let map = write_map(&d.join("third.json"), map_json(&keep));
    prune_ok(&fixture("qwen3moe"), &map, &d.join("kernel.gguf"), &[]);
    let out = run(Command::new(ours()).env("REAP_PRUNE_COPY", "map").arg("prune").arg("-m").arg(fixture("qwen3moe")).arg("--keep-map").arg(&map).arg("-o").arg(d.join("mapped.gguf")));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_same_bytes(&d.join("kernel.gguf"), &d.join("mapped.gguf"));
}

#[test]
fn a_keep_all_map_reproduces_a_quantized_model_byte_for_byte() {
    let d = temp_dir("prune-keepall-q8");
    let model = d.join("q8.gguf");
    run_ok(Command::new(ours()).args(["fixture", "--wtype", "q8_0", "-o"]).arg(&model));
    let map = write_map(&d.join("all.json"), map_json(&keep_all()));
    prune_ok(&model, &map, &d.join("out.gguf"), &[]);
    assert_same_bytes(&model, &d.join("out.gguf"));
}

/// Upstream llama-perplexity loads each pruned fixture (f16 and Q8_0, both archs) and prints
/// a finite perplexity; the file says K experts and every per-expert tensor has K along its
/// outermost dimension.
#[test]
fn upstream_llama_perplexity_runs_every_pruned_fixture() {
    let d = temp_dir("prune-ppl");
    let q8 = d.join("q8.gguf");
    run_ok(Command::new(ours()).args(["fixture", "--wtype", "q8_0", "--arch", "qwen2moe", "-o"]).arg(&q8));
    // K = 6 of 32 (above the 4 each token uses), different ids per layer, listed unsorted
    let keep: Vec<Vec<u16>> = BLOCKS.iter().map(|&b| (0..6).map(|i| (i * 11 + b as u16) % N_EXPERT).collect()).collect();
    let mut keep_sorted = keep.clone();
    keep_sorted.iter_mut().for_each(|k| k.sort_unstable());
    // the map lists ids unsorted: the output is in ascending id order anyway
    let map = write_map(&d.join("k6.json"), map_json(&keep));
    for (name, model) in [("q3", fixture("qwen3moe")), ("q2", fixture("qwen2moe")), ("q2-q8", q8)] {
        let out = d.join(format!("{name}.k6.gguf"));
        prune_ok(&model, &map, &out, &[]);
        let ppl = upstream_ppl(&out);
        assert!(ppl.is_finite() && ppl > 1.0, "{name}: PPL {ppl}");
        let b = read(&out);
        let h = Header::parse(&b).unwrap();
        let arch = h.string(&b, "general.architecture").unwrap();
        assert_eq!(h.uint(&b, &format!("{arch}.expert_count")), Some(6));
        let src = read(&model);
        let hs = Header::parse(&src).unwrap();
        assert_eq!(h.tensors.len(), hs.tensors.len());
        for (t, s) in h.tensors.iter().zip(&hs.tensors) {
            let per_expert = ["_exps.", "ffn_gate_inp.weight"].iter().any(|p| t.name.contains(p));
            let mut want = s.ne.clone();
            if per_expert {
                *want.last_mut().unwrap() = 6;
            }
            assert_eq!((&t.name, &t.ne, t.ggml_type), (&s.name, &want, s.ggml_type), "{name}");
            if per_expert && name == "q2-q8" && s.ne.len() == 3 {
                // Q8_0: rows of ne[0]/32 blocks of 34 bytes, ne[1] rows per expert
                let per = (s.ne[0] / 32 * 34 * s.ne[1]) as usize;
                let (a, o) = ((hs.data_start + s.offset) as usize, (h.data_start + t.offset) as usize);
                let l = BLOCKS.iter().position(|&blk| t.name.starts_with(&format!("blk.{blk}."))).unwrap();
                for (j, &e) in keep_sorted[l].iter().enumerate() {
                    assert!(b[o + j * per..o + (j + 1) * per] == src[a + e as usize * per..a + (e as usize + 1) * per], "{}: expert {e}", t.name);
                }
            }
        }
    }
}

/// Element by element, independent of prune's byte runs: out[.., j] = src[.., keep[j]] along
/// the outermost dimension, on a fixture whose expert FFN width equals its expert count (so
/// the axis cannot be told by size), f32 so every element is 4 bytes.
#[test]
fn experts_are_sliced_along_the_outermost_axis_even_when_sizes_coincide() {
    let d = temp_dir("prune-axis");
    let model = d.join("m.gguf");
    run_ok(
        Command::new(ours())
            .args(["fixture", "--wtype", "f32", "--experts", "16", "--expert-ffn", "16", "--dead", "2", "--layers", "2", "-o"])
            .arg(&model),
    );
    let keep: Vec<u16> = vec![1, 2, 5, 8, 11, 15];
    let map = write_map(&d.join("k.json"), json!({"layers": [keep, keep]}));
    let out = d.join("out.gguf");
    prune_ok(&model, &map, &out, &[]);
    let (src, dst) = (read(&model), read(&out));
    let (hs, hd) = (Header::parse(&src).unwrap(), Header::parse(&dst).unwrap());
    let mut checked = 0;
    for (s, t) in hs.tensors.iter().zip(&hd.tensors) {
        let elems = |b: &[u8], h: &Header, t: &reap_imatrix::formats::gguf::TensorInfo| -> Vec<u32> {
            let at = (h.data_start + t.offset) as usize;
            b[at..at + t.nbytes() as usize].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
        };
        let (a, b) = (elems(&src, &hs, s), elems(&dst, &hd, t));
        if s.ne == t.ne {
            assert_eq!(a, b, "{} changed", s.name);
            continue;
        }
        assert_eq!(s.ggml_type, 0, "{}", s.name);
        let inner: u64 = s.ne[..s.ne.len() - 1].iter().product();
        assert_eq!(*s.ne.last().unwrap(), 16);
        for (j, &e) in keep.iter().enumerate() {
            for i in 0..inner {
                assert_eq!(b[(j as u64 * inner + i) as usize], a[(e as u64 * inner + i) as usize], "{} expert {e} element {i}", s.name);
            }
        }
        checked += 1;
    }
    // per layer: gate, up, down and the router
    assert_eq!(checked, 8);
    let ppl = upstream_ppl(&out);
    assert!(ppl.is_finite(), "PPL {ppl}");
}

/// The sliced imatrix is what upstream llama-quantize --imatrix needs for the pruned model:
/// the unsliced one is refused (the control), the sliced one quantizes; its per-expert values
/// are the kept experts' columns of the original. Also on minimax-m2 (a selection bias to
/// slice), nemotron_h_moe (MoE in blocks 1 and 3 only, experts without a gate), cohere2moe
/// (block 0 dense, a shared expert beside the routed ones), step35 (three MTP blocks left out,
/// its per-block arrays cut to the trunk), mimo2 (block 0 and three MTP blocks dense, the
/// MTP blocks left out with theirs), hy_v3 (its selection bias `exp_probs_b` without a suffix),
/// bailingmoe3 (Kimi Delta Attention blocks, `attention.head_count_kv` cut to the trunk) and
/// gemma4 (the per-expert `ffn_down_exps.scale` sliced, the router's per-column
/// `ffn_gate_inp.scale` copied: refused as a per-expert tensor before).
#[test]
fn upstream_llama_quantize_accepts_the_sliced_imatrix() {
    for &arch in ARCHS.iter().chain(&["minimax-m2", "nemotron_h_moe", "cohere2moe", "step35", "mimo2", "hy_v3", "bailingmoe3", "gemma4"]) {
        let d = temp_dir(&format!("prune-quantize-{arch}"));
        calibrate_with(&d, &fixture(arch), cpu_flags(arch));
        let blocks: Vec<u32> = Saliency::read(&d.join("imatrix.reap.json")).unwrap().layers.iter().map(|l| l.layer).collect();
        let want: &[u32] = match arch {
            "nemotron_h_moe" => &[1, 3],
            "cohere2moe" | "step35" | "mimo2" | "hy_v3" | "bailingmoe3" => &BLOCKS[1..],
            _ => &BLOCKS,
        };
        assert_eq!(blocks, want, "{arch}");
        let keep: Vec<Vec<u16>> = blocks.iter().map(|&b| vec![0, 3, 4, 9, 17, 30 - b as u16]).collect();
        let map = write_map(&d.join("k6.json"), map_json_for(&keep, &blocks));
        // nemotron_h_moe's, cohere2moe's and step35's MTP blocks (never calibrated here) go
        let drop: &[&str] = if ["nemotron_h_moe", "cohere2moe", "step35", "mimo2", "hy_v3", "bailingmoe3"].contains(&arch) { &["--drop-nextn"] } else { &[] };
        prune_ok(&fixture(arch), &map, &d.join("p.gguf"), &[&["--imatrix", "imatrix.gguf", "--imatrix-out", "p.imatrix.gguf"][..], drop].concat());
        let quantize = |im: &str, out: &str| {
            run(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", im, "p.gguf", out, "Q4_0"]))
        };
        let control = quantize("imatrix.gguf", "bad.gguf");
        let why = String::from_utf8_lossy(&control.stderr);
        assert!(!control.status.success() && why.contains("is different from tensor size"), "{arch}: the unsliced imatrix: {why}");
        let ok = quantize("p.imatrix.gguf", "p.q4_0.gguf");
        assert!(ok.status.success(), "{arch}: {}", String::from_utf8_lossy(&ok.stderr));
        let ppl = upstream_ppl(&d.join("p.q4_0.gguf"));
        assert!(ppl.is_finite(), "{arch}: PPL {ppl}");

        let full = reap_imatrix::formats::imatrix::load(&d.join("imatrix.gguf")).unwrap();
        let sliced = reap_imatrix::formats::imatrix::load(&d.join("p.imatrix.gguf")).unwrap();
        assert_eq!(full.entries.len(), sliced.entries.len());
        assert_eq!((full.datasets.clone(), full.chunk_count), (sliced.datasets.clone(), sliced.chunk_count));
        let mut n_sliced = 0;
        for (name, f) in &full.entries {
            let s = &sliced.entries[name];
            if f.counts.len() == 1 {
                assert_eq!((&f.sums, &f.counts), (&s.sums, &s.counts), "{name}");
                continue;
            }
            let slot = blocks.iter().position(|&b| name.starts_with(&format!("blk.{b}."))).unwrap();
            let n_in = f.sums.len() / f.counts.len();
            for (j, &e) in keep[slot].iter().enumerate() {
                assert_eq!(s.counts[j], f.counts[e as usize], "{name}");
                assert_eq!(&s.sums[j * n_in..(j + 1) * n_in], &f.sums[e as usize * n_in..(e as usize + 1) * n_in], "{name}");
            }
            n_sliced += 1;
        }
        let per_layer = if arch == "nemotron_h_moe" { 2 } else { 3 };
        assert_eq!(n_sliced, per_layer * blocks.len(), "{arch}: gate (but nemotron_h_moe's), up and down per layer");
    }
}

/// One trace row: chunk, pos, token, and per layer the selected ids and their gate weights.
type TraceRow = (u32, u32, i32, Vec<Vec<u16>>, Vec<Vec<f32>>);

fn trace_rows(p: &Path) -> Vec<TraceRow> {
    let t = TraceReader::open(p).unwrap();
    let nl = t.header.n_layers();
    t.rows()
        .map(|r| {
            (
                r.chunk(),
                r.pos(),
                r.token(),
                (0..nl).map(|l| r.sel_ids(l).to_vec()).collect(),
                (0..nl).map(|l| r.sel_weights(l).to_vec()).collect(),
            )
        })
        .collect()
}

/// Per layer the `n` most selected experts, ascending.
fn most_used(sal: &Saliency, n: usize) -> Vec<Vec<u16>> {
    sal.layers
        .iter()
        .map(|l| {
            let mut ids: Vec<u16> = (0..l.n_expert as u16).collect();
            ids.sort_by_key(|&e| std::cmp::Reverse(l.count[e as usize]));
            ids.truncate(n);
            ids.sort_unstable();
            ids
        })
        .collect()
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-12)
}

/// Kept experts route and compute as before. Keeping every live expert (the fixture's dead
/// experts are never chosen) leaves every token's experts in place in every layer: the pruned
/// model's trace, ids mapped through the map, equals the original's, gate weights agree, and
/// each kept expert's REAP sums (count, Σg·‖f‖, Σ‖f‖) equal the original's. A map that also
/// drops live experts keeps, in the first MoE layer (whose input no pruning can change), the
/// same experts for every token whose top-k were all kept.
#[test]
fn kept_experts_route_and_compute_as_in_the_original() {
    for arch in ARCHS {
        let d = temp_dir(&format!("prune-routing-{arch}"));
        let model = fixture(arch);
        let orig = d.join("orig");
        std::fs::create_dir_all(&orig).unwrap();
        calibrate(&orig, &model);
        let sal = Saliency::read(&orig.join("imatrix.reap.json")).unwrap();
        let rows = trace_rows(&orig.join("t.bin"));

        // (1) every live expert kept: K = 28 of 32
        let live: Vec<Vec<u16>> =
            sal.layers.iter().map(|l| (0..l.n_expert as u16).filter(|&e| l.count[e as usize] > 0).collect()).collect();
        let k = live.iter().map(Vec::len).max().unwrap();
        let keep: Vec<Vec<u16>> = live
            .iter()
            .map(|l| {
                let mut v = l.clone();
                v.extend((0..N_EXPERT).filter(|e| !l.contains(e)).take(k - l.len()));
                v.sort_unstable();
                v
            })
            .collect();
        assert!(k < N_EXPERT as usize, "{arch}: the fixture has dead experts");
        let map = write_map(&d.join("live.json"), map_json(&keep));
        let pdir = d.join("live");
        std::fs::create_dir_all(&pdir).unwrap();
        prune_ok(&model, &map, &pdir.join("p.gguf"), &[]);
        calibrate(&pdir, &pdir.join("p.gguf"));
        let prow = trace_rows(&pdir.join("t.bin"));
        assert_eq!(rows.len(), prow.len());
        for (a, b) in rows.iter().zip(&prow) {
            assert_eq!((a.0, a.1, a.2), (b.0, b.1, b.2));
            for (l, kept) in keep.iter().enumerate() {
                let mapped: Vec<u16> = b.3[l].iter().map(|&j| kept[j as usize]).collect();
                assert_eq!(a.3[l], mapped, "{arch}: chunk {} pos {} layer {l}", a.0, a.1);
                for (x, y) in a.4[l].iter().zip(&b.4[l]) {
                    assert!((x - y).abs() < 1e-4, "{arch}: gate weight {x} vs {y}");
                }
            }
        }
        let psal = Saliency::read(&pdir.join("imatrix.reap.json")).unwrap();
        for (l, (o, p)) in sal.layers.iter().zip(&psal.layers).enumerate() {
            assert_eq!(p.n_expert, k);
            for (j, &e) in keep[l].iter().enumerate() {
                let e = e as usize;
                assert_eq!(o.count[e], p.count[j], "{arch}: layer {l} expert {e}");
                assert!(
                    close(o.reap_l2_sum[e], p.reap_l2_sum[j], 1e-4),
                    "{arch}: layer {l} expert {e}: {} vs {}",
                    o.reap_l2_sum[e],
                    p.reap_l2_sum[j]
                );
                assert!(close(o.ean_sum[e], p.ean_sum[j], 1e-4), "{arch}: layer {l} expert {e}");
            }
        }

        // (2) 8 of 32: first MoE layer, tokens whose top-k were all kept
        // the 8 most used experts of each layer (the heavy hitters and the busiest middle ones)
        let keep8 = most_used(&sal, 8);
        let map8 = write_map(&d.join("k8.json"), map_json(&keep8));
        let p8 = d.join("k8");
        std::fs::create_dir_all(&p8).unwrap();
        prune_ok(&model, &map8, &p8.join("p.gguf"), &[]);
        calibrate(&p8, &p8.join("p.gguf"));
        let prow8 = trace_rows(&p8.join("t.bin"));
        let mut compared = 0;
        for (a, b) in rows.iter().zip(&prow8) {
            if a.3[0].iter().all(|e| keep8[0].contains(e)) {
                let mapped: Vec<u16> = b.3[0].iter().map(|&j| keep8[0][j as usize]).collect();
                assert_eq!(a.3[0], mapped, "{arch}: chunk {} pos {}", a.0, a.1);
                compared += 1;
            }
        }
        assert!(compared >= 10, "{arch}: only {compared} tokens had all their experts kept");
    }
}

// ---- refusals: exit 2, a message naming the problem, nothing written

struct Refusal {
    dir: PathBuf,
    out: PathBuf,
}

impl Refusal {
    fn new(name: &str) -> Refusal {
        let dir = temp_dir(&format!("prune-refuse-{name}"));
        let out = dir.join("out.gguf");
        Refusal { dir, out }
    }

    fn map(&self, v: Value) -> PathBuf {
        write_map(&self.dir.join("map.json"), v)
    }

    /// Runs prune on the qwen3moe fixture with `map` and `extra`, expects exit 2 with
    /// `needle` in stderr and no output file.
    fn expect(&self, map: &Path, extra: &[&str], needle: &str) {
        self.expect_on(&fixture("qwen3moe"), map, extra, needle)
    }

    /// [Refusal::expect] on another model.
    fn expect_on(&self, model: &Path, map: &Path, extra: &[&str], needle: &str) {
        let out = run(Command::new(ours())
            .current_dir(&self.dir)
            .arg("prune")
            .arg("-m")
            .arg(model)
            .arg("--keep-map")
            .arg(map)
            .arg("-o")
            .arg(&self.out)
            .args(extra));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "stderr: {err}");
        assert!(err.contains(needle), "expected {needle:?} in: {err}");
        assert!(!self.out.exists(), "{} was written", self.out.display());
        let left: Vec<_> = std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().contains(".tmp"))
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
    }
}

fn k6() -> Vec<Vec<u16>> {
    vec![vec![0, 1, 2, 3, 4, 5]; BLOCKS.len()]
}

/// The qwen3moe fixture with a DeepSeek-V4-style hash-routing table in block 0
/// (`blk.0.ffn_gate_tid2eid.weight`, [k, n_vocab] I32: each token's experts), its ids
/// `id(token, slot)`. llama.cpp would not load the file (qwen3moe has no such tensor); prune
/// reads tensors by name, so this checks what prune writes of the table.
fn with_hash_table(dir: &Path, id: impl Fn(u64, u64) -> i32) -> (PathBuf, Vec<i32>, u64) {
    let src = fixture("qwen3moe");
    let b = read(&src);
    let h = Header::parse(&b).unwrap();
    let k = h.uint(&b, "qwen3moe.expert_used_count").unwrap();
    let n_vocab = h.tensors.iter().find(|t| t.name == "token_embd.weight").unwrap().ne[1];
    let ids: Vec<i32> = (0..n_vocab).flat_map(|t| (0..k).map(move |s| (t, s))).map(|(t, s)| id(t, s)).collect();
    let data: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let t = reap_imatrix::formats::gguf::TensorInfo { name: "blk.0.ffn_gate_tid2eid.weight".into(), ne: vec![k, n_vocab], ggml_type: 26, offset: 0 };
    let model = dir.join("hash.gguf");
    with_added_tensor(&src, &model, t, &data);
    (model, ids, k)
}

/// A hash-routed block's table of expert ids is renumbered as the experts are: each id becomes
/// the kept expert's position in the keep list (recomputed here from the source's ids), the
/// table's shape and every other tensor as a table-less prune writes them. A map that drops an
/// expert the table names is refused (its entries and tokens counted here), and so is every
/// map of a model whose table names all experts; nothing is written.
#[test]
fn a_hash_routing_table_is_renumbered_and_a_map_dropping_its_experts_is_refused() {
    let d = temp_dir("prune-hash");
    // the table names 12 scattered experts of the 32
    let named: Vec<i32> = vec![2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 30, 31];
    let (model, ids, k) = with_hash_table(&d, |t, s| named[((t * 5 + s * 7) % 12) as usize]);
    let mut keep: Vec<u16> = named.iter().map(|&e| e as u16).chain([0, 9, 20, 25]).collect();
    keep.sort_unstable();
    let map = write_map(&d.join("k.json"), map_json(&vec![keep.clone(); BLOCKS.len()]));
    let out = d.join("out.gguf");
    prune_ok(&model, &map, &out, &[]);
    let plain = d.join("plain.gguf");
    prune_ok(&fixture("qwen3moe"), &map, &plain, &[]);
    let (o, p) = (read(&out), read(&plain));
    let (ho, hp) = (Header::parse(&o).unwrap(), Header::parse(&p).unwrap());
    let bytes = |b: &[u8], h: &Header, name: &str| {
        let t = h.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no {name}"));
        let at = (h.data_start + t.offset) as usize;
        (t.ne.clone(), b[at..at + t.nbytes() as usize].to_vec())
    };
    for t in &hp.tensors {
        assert_eq!(bytes(&o, &ho, &t.name), bytes(&p, &hp, &t.name), "{}", t.name);
    }
    let (ne, table) = bytes(&o, &ho, "blk.0.ffn_gate_tid2eid.weight");
    assert_eq!(ne, vec![k, ids.len() as u64 / k]);
    let got: Vec<i32> = table.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
    let want: Vec<i32> = ids.iter().map(|&e| keep.iter().position(|&x| x as i32 == e).unwrap() as i32).collect();
    assert_eq!(got, want);
    assert_eq!(ho.tensors.len(), hp.tensors.len() + 1);

    // a map that keeps 20 but not expert 29, which slot 0 of tokens 9, 21, 33, … names
    let r = Refusal::new("hash");
    let mut keep2 = keep.clone();
    keep2.retain(|&e| e != 29);
    keep2.push(1);
    keep2.sort_unstable();
    let (entries, tokens) = {
        let hit: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] == 29).collect();
        let mut t: Vec<u64> = hit.iter().map(|&i| i as u64 / k).collect();
        t.dedup();
        (hit.len(), t.len())
    };
    let first = (0..ids.len()).find(|&i| ids[i] == 29).unwrap() as u64;
    r.expect_on(
        &model,
        &r.map(map_json(&vec![keep2; BLOCKS.len()])),
        &[],
        &format!("block 0 routes by token id (blk.0.ffn_gate_tid2eid.weight names each token's experts; DeepSeek-V4's hash routing), and the map drops experts it names: 29, in {entries} entries of {tokens} tokens (first: token {}, slot {}, expert 29)", first / k, first % k),
    );
    r.expect_on(&model, &r.map(map_json(&vec![(0..12).collect::<Vec<u16>>(); BLOCKS.len()])), &["--dry-run"], "A map that keeps all 12 experts it names in block 0 (K ≥ 12) prunes it");
    // a table that names every expert: nothing can go
    let dall = temp_dir("prune-hash-all");
    let (all, _, _) = with_hash_table(&dall, |t, s| ((t * 3 + s * 11) % 32) as i32);
    r.expect_on(&all, &r.map(map_json(&vec![keep; BLOCKS.len()])), &[], "It names all 32: llama.cpp reads one expert_count for every block");
}

#[test]
fn prune_refuses_a_map_with_another_layer_count() {
    let r = Refusal::new("layers");
    let mut v = map_json(&k6());
    v["layers"].as_array_mut().unwrap().pop();
    r.expect(&r.map(v), &[], "3 layers, but the model has 4 MoE layers");
}

#[test]
fn prune_refuses_a_map_for_another_expert_count() {
    let r = Refusal::new("experts");
    let mut v = map_json(&k6());
    v["model"] = json!({"path": "other.gguf", "sha256": null, "expert_count": 64});
    r.expect(&r.map(v), &[], "made for a model with 64 experts per layer; the model has 32");
}

#[test]
fn prune_refuses_a_map_for_a_model_with_another_sha256() {
    let r = Refusal::new("sha");
    let mut v = map_json(&k6());
    v["model"] = json!({"path": "other.gguf", "sha256": "0".repeat(64), "expert_count": 32});
    r.expect(&r.map(v), &[], "made for the model with sha256 0000");
}

#[test]
fn prune_refuses_an_expert_id_out_of_range() {
    let r = Refusal::new("range");
    let mut keep = k6();
    keep[2][5] = 32;
    r.expect(&r.map(map_json(&keep)), &[], "layer 2: expert id 32 is out of range");
}

#[test]
fn prune_refuses_a_repeated_expert_id() {
    let r = Refusal::new("repeat");
    let mut keep = k6();
    keep[1][5] = 4;
    r.expect(&r.map(map_json(&keep)), &[], "lists an expert twice");
}

#[test]
fn prune_refuses_a_map_with_different_k_per_layer() {
    let r = Refusal::new("uneven");
    let mut keep = k6();
    keep[3].push(9);
    let mut v = map_json(&keep);
    v["k"] = json!(6);
    r.expect(&r.map(v), &[], "layer 3 keeps 7 experts, layer 0 keeps 6");
}

#[test]
fn prune_refuses_k_below_expert_used_count() {
    let r = Refusal::new("small-k");
    r.expect(&r.map(map_json(&vec![vec![0, 1, 2]; 4])), &[], "fewer than the 4 each token uses");
}

/// Where `expert_used_count` is one value per layer, the largest is what a kept set must hold
/// (llama.cpp asserts n_expert_used_max <= n_expert at load).
#[test]
fn prune_refuses_k_below_the_largest_per_layer_expert_used_count() {
    let r = Refusal::new("small-k-per-layer");
    let model = r.dir.join("per-layer-k.gguf");
    with_per_layer_k(&fixture("qwen3moe"), &model, &[4, 2, 6, 4]);
    r.expect_on(&model, &r.map(map_json(&vec![vec![0, 1, 2, 3, 4]; 4])), &[], "fewer than the 6 each token uses");
}

#[test]
fn prune_refuses_to_overwrite_an_input() {
    let r = Refusal::new("same");
    let map = r.map(map_json(&k6()));
    let model = fixture("qwen3moe");
    let before = read(&model);
    let out = prune(&[
        "-m".as_ref(),
        model.as_os_str(),
        "--keep-map".as_ref(),
        map.as_os_str(),
        "-o".as_ref(),
        model.as_os_str(),
        "--force".as_ref(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("the same file as -m"), "{err}");
    assert_eq!(read(&model), before);
    // the imatrix output onto the keep map, spelled differently
    r.expect(&map, &["--imatrix", "nope.gguf", "--imatrix-out", "./map.json"], "--imatrix-out ./map.json: the same file as --keep-map");
}

#[test]
fn prune_refuses_an_existing_output_without_force() {
    let r = Refusal::new("exists");
    let map = r.map(map_json(&k6()));
    std::fs::write(&r.out, b"keep me").unwrap();
    let out =
        prune(&["-m".as_ref(), fixture("qwen3moe").as_os_str(), "--keep-map".as_ref(), map.as_os_str(), "-o".as_ref(), r.out.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("already exists (pass --force to replace it)"), "{err}");
    assert_eq!(read(&r.out), b"keep me");
    prune_ok(&fixture("qwen3moe"), &map, &r.out, &["--force"]);
    assert!(Header::parse(&read(&r.out)).is_ok());
}

#[test]
fn prune_refuses_an_imatrix_of_another_model() {
    let r = Refusal::new("imatrix");
    let other = r.dir.join("other.gguf");
    run_ok(Command::new(ours()).args(["fixture", "--experts", "16", "--dead", "2", "-o"]).arg(&other));
    calibrate(&r.dir, &other);
    r.expect(
        &r.map(map_json(&k6())),
        &["--imatrix", "imatrix.gguf", "--imatrix-out", "out.imatrix.gguf"],
        "has 16 along its expert axis (ne[1], the outermost), not the model's expert_count 32",
    );
    assert!(!r.dir.join("out.imatrix.gguf").exists());
}

#[test]
fn prune_refuses_an_imatrix_of_a_model_with_other_widths() {
    // same layers and expert count, another n_embd: the per-expert slicing fits, the widths
    // do not (llama-quantize would refuse the pair later)
    let r = Refusal::new("imatrix-width");
    let other = r.dir.join("wide.gguf");
    run_ok(Command::new(ours()).args(["fixture", "--n-embd", "128", "-o"]).arg(&other));
    calibrate(&r.dir, &other);
    r.expect(
        &r.map(map_json(&k6())),
        &["--imatrix", "imatrix.gguf", "--imatrix-out", "out.imatrix.gguf"],
        "sums for 128 columns × 1 matrices, but the model's",
    );
    assert!(!r.dir.join("out.imatrix.gguf").exists());
}

/// A first shard whose siblings are not beside it: the missing shard is named (split models
/// that add up: tests/all/split.rs).
#[test]
fn prune_refuses_a_split_model_naming_a_missing_shard() {
    let r = Refusal::new("split");
    // a GGUF v3 with no tensors and the two keys llama-gguf-split writes into every shard
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(2u64.to_le_bytes());
    for (key, v) in [("split.no", 0u16), ("split.count", 3u16)] {
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key.as_bytes());
        b.extend(2u32.to_le_bytes()); // GGUF_TYPE_UINT16
        b.extend(v.to_le_bytes());
    }
    let shard = r.dir.join("big-00001-of-00003.gguf");
    std::fs::write(&shard, &b).unwrap();
    let out = run(Command::new(ours()).current_dir(&r.dir).arg("prune").arg("-m").arg(&shard).arg("--keep-map").arg(r.map(map_json(&k6()))).arg("-o").arg(&r.out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("-m (a shard) {}", r.dir.join("big-00002-of-00003.gguf").display())), "{err}");
    assert!(!r.out.exists());
}

#[test]
fn dry_run_checks_everything_and_writes_nothing() {
    let r = Refusal::new("dry-run");
    calibrate(&r.dir, &fixture("qwen3moe"));
    let map = r.map(map_json(&k6()));
    let im_out = r.dir.join("out.imatrix.gguf");
    let args = ["--imatrix", "imatrix.gguf", "--imatrix-out", "out.imatrix.gguf", "--dry-run"];
    let out = prune_ok(&fixture("qwen3moe"), &map, &r.out, &args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("--dry-run") && text.contains("32 → 6 experts") && text.contains("nothing written"), "{text}");
    assert!(!r.out.exists() && !im_out.exists());
    // and refuses what a run refuses
    let mut keep = k6();
    keep[2][5] = 32;
    r.expect(&r.map(map_json(&keep)), &["--dry-run"], "layer 2: expert id 32 is out of range");
}

/// glm4moe's nextn/MTP block (4): calibration never runs it, so select's map covers blocks 1–3.
/// Without --drop-nextn prune refuses the map, naming the block and both ways on, and writes
/// nothing. With it the output is the model as convert_hf_to_gguf.py --no-mtp writes it: no
/// blk.4 tensor, block_count 4, no nextn_predict_layers, a per-layer array (expert_used_count
/// here) cut to 4 values, every other key as before but expert_count; it loads in upstream
/// llama-perplexity with the original's PPL (all live experts kept), and its sliced imatrix
/// goes through llama-quantize. A hand-made entry for block 4 prunes that block too (or, with
/// --drop-nextn, goes with it, named or as a trailing plain list); a model without a nextn
/// block refuses the flag.
#[test]
fn a_nextn_block_is_dropped_on_request_or_pruned_by_a_hand_made_entry() {
    let d = temp_dir("prune-nextn");
    // one expert_used_count per block, as some converters write it: the loader wants exactly
    // block_count values
    let model = d.join("glm-k.gguf");
    with_per_layer_k(&fixture("glm4moe"), &model, &[4; 5]);
    calibrate(&d, &model);
    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "imatrix.reap.json", "--method", "reap_mean", "--k", "28", "--out-dir", "maps"]));
    let map = d.join("maps/keep_reap_mean_k28.json");
    let out = d.join("p.gguf");

    let refused = prune(&["-m".as_ref(), model.as_os_str(), "--keep-map".as_ref(), map.as_os_str(), "-o".as_ref(), out.as_os_str()]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{err}");
    assert!(err.contains("nextn/MTP block [4]") && err.contains("--drop-nextn") && err.contains("{\"layer\": 4"), "{err}");
    assert!(!out.exists());

    prune_ok(&model, &map, &out, &["--drop-nextn", "--imatrix", "imatrix.gguf", "--imatrix-out", "p.imatrix.gguf"]);
    let (a, b) = (read(&model), read(&out));
    let (ha, hb) = (Header::parse(&a).unwrap(), Header::parse(&b).unwrap());
    let in_block4 = |h: &Header| h.tensors.iter().filter(|t| t.name.starts_with("blk.4.")).count();
    assert!(in_block4(&ha) > 0 && ha.tensors.iter().any(|t| t.name == "blk.4.nextn.eh_proj.weight"));
    assert_eq!((in_block4(&hb), hb.tensors.len()), (0, ha.tensors.len() - in_block4(&ha)));
    let changed = ["glm4moe.expert_count", "glm4moe.block_count", "glm4moe.nextn_predict_layers", "glm4moe.expert_used_count"];
    let keys = |h: &Header| h.kvs.iter().map(|k| k.key.clone()).filter(|k| k != "glm4moe.nextn_predict_layers").collect::<Vec<_>>();
    assert_eq!(keys(&ha), keys(&hb));
    for kv in ha.kvs.iter().filter(|kv| !changed.contains(&kv.key.as_str())) {
        assert_eq!(&a[kv.raw.clone()], &b[hb.kv(&kv.key).unwrap().raw.clone()], "{}", kv.key);
    }
    assert_eq!((hb.uint(&b, "glm4moe.expert_count"), hb.uint(&b, "glm4moe.block_count")), (Some(28), Some(4)));
    assert!(hb.kv("glm4moe.nextn_predict_layers").is_none());
    assert_eq!(hb.uints(&b, "glm4moe.expert_used_count"), Some(vec![4; 4]));
    // every live expert kept: the trunk computes as before
    assert_eq!(upstream_ppl(&out), upstream_ppl(&model));
    let q = run(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", "p.imatrix.gguf", "p.gguf", "p.q4_0.gguf", "Q4_0"]));
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert!(upstream_ppl(&d.join("p.q4_0.gguf")).is_finite());

    // a hand-made entry for block 4
    let mut v: Value = serde_json::from_slice(&read(&map)).unwrap();
    v["layers"].as_array_mut().unwrap().push(json!({"layer": 4, "keep": (0..28).collect::<Vec<u16>>()}));
    let hand = write_map(&d.join("hand.json"), v);
    prune_ok(&model, &hand, &d.join("h.gguf"), &[]);
    let h = read(&d.join("h.gguf"));
    let hh = Header::parse(&h).unwrap();
    assert_eq!(hh.tensors.iter().find(|t| t.name == "blk.4.ffn_down_exps.weight").map(|t| t.ne[2]), Some(28));
    assert!(hh.tensors.iter().any(|t| t.name == "blk.4.nextn.eh_proj.weight"));
    assert!(upstream_ppl(&d.join("h.gguf")).is_finite());
    prune_ok(&model, &hand, &d.join("h2.gguf"), &["--drop-nextn"]);
    assert_same_bytes(&out, &d.join("h2.gguf"));
    // the same map as plain lists, one per MoE block in order: the trailing one goes too
    let v: Value = serde_json::from_slice(&read(&hand)).unwrap();
    let lists: Vec<Value> = v["layers"].as_array().unwrap().iter().map(|l| l["keep"].clone()).collect();
    let plain4 = write_map(&d.join("plain4.json"), json!({"method": "test", "k": 28, "layers": lists}));
    prune_ok(&model, &plain4, &d.join("h3.gguf"), &["--drop-nextn"]);
    assert_same_bytes(&out, &d.join("h3.gguf"));

    let plain = d.join("plain.json");
    write_map(&plain, map_json(&keep_all()));
    let r = prune(&["-m".as_ref(), fixture("qwen3moe").as_os_str(), "--keep-map".as_ref(), plain.as_os_str(), "-o".as_ref(), d.join("q.gguf").as_os_str(), "--drop-nextn".as_ref()]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(err.contains("has no nextn/MTP block") && !d.join("q.gguf").exists(), "{err}");
}

/// Qwen3.5-MoE's layout: `--drop-nextn` cuts the per-block bool array of block kinds
/// (`attention.recurrent_layers`, which the converter writes from the config's `layer_types`)
/// to the trunk's, leaves `rope.dimension_sections` (4 values, not one per block) alone, and the
/// result loads in upstream llama-perplexity with the original's PPL to 1e-5 (every live
/// expert kept).
#[test]
fn drop_nextn_cuts_the_block_kinds_of_a_hybrid_model() {
    let d = temp_dir("prune-nextn-qwen35moe");
    let model = fixture("qwen35moe");
    calibrate(&d, &model);
    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "imatrix.reap.json", "--method", "reap_mean", "--k", "28", "--out-dir", "maps"]));
    let out = d.join("p.gguf");
    prune_ok(&model, &d.join("maps/keep_reap_mean_k28.json"), &out, &["--drop-nextn"]);
    let (a, b) = (read(&model), read(&out));
    let (ha, hb) = (Header::parse(&a).unwrap(), Header::parse(&b).unwrap());
    let key = "qwen35moe.attention.recurrent_layers";
    assert_eq!((ha.array_len(&a, key), hb.array_len(&b, key)), (Some(5), Some(4)));
    let (va, vb) = (&a[ha.kv(key).unwrap().value.clone()], &b[hb.kv(key).unwrap().value.clone()]);
    assert_eq!((&va[12..], &vb[12..]), (&[1u8, 1, 1, 0, 0][..], &[1u8, 1, 1, 0][..]));
    let sections = "qwen35moe.rope.dimension_sections";
    assert_eq!(&a[ha.kv(sections).unwrap().raw.clone()], &b[hb.kv(sections).unwrap().raw.clone()]);
    assert_eq!((hb.uint(&b, "qwen35moe.block_count"), hb.kv("qwen35moe.nextn_predict_layers").is_none()), (Some(4), true));
    assert!(!hb.tensors.iter().any(|t| t.name.starts_with("blk.4.")));
    // the softmax's sum loses the dead experts' e^-20-sized terms: the renormalised gates move
    // in float rounding only
    let (p, q) = (upstream_ppl(&out), upstream_ppl(&model));
    assert!((p - q).abs() < 1e-5 * q, "PPL {p} pruned, {q} before");
}

/// The glm4moe fixture routing within 4 expert groups of 8, 2 used per token (written in `d`).
fn grouped_glm4moe(d: &Path) -> PathBuf {
    let u32_kv = |v: u32| [4u32.to_le_bytes(), v.to_le_bytes()].concat();
    let half = d.join("half.gguf");
    with_added_kv(&fixture("glm4moe"), &half, |a| format!("{a}.expert_group_count"), &u32_kv(4));
    let model = d.join("grouped.gguf");
    with_added_kv(&half, &model, |a| format!("{a}.expert_group_used_count"), &u32_kv(2));
    model
}

/// A model that routes within expert groups (DeepSeek-V3's n_group; here the glm4moe fixture
/// with 4 groups of 8, 2 used per token): select keeps K/4 in every group, by the method's
/// order within the group, and refuses a K that cannot be split so; prune refuses a map whose
/// groups keep different numbers and writes one whose groups keep the same, which upstream
/// llama.cpp loads and runs (with the original's PPL when every expert is kept).
#[test]
fn group_routed_models_keep_the_same_number_in_every_group() {
    let d = temp_dir("prune-groups");
    let model = grouped_glm4moe(&d);
    calibrate(&d, &model);
    let sal = Saliency::read(&d.join("imatrix.reap.json")).unwrap();
    assert_eq!(sal.metadata["model"]["expert_group_count"], "4");
    let select = |k: &str| run(Command::new(ours()).current_dir(&d).args(["select", "--reap", "imatrix.reap.json", "--method", "reap_mean,frequency", "--k", k, "--out-dir", "maps"]));
    for bad in ["18", "4"] {
        let out = select(bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--k {bad}: {err}");
        assert!(err.contains("routes within 4 expert groups"), "{err}");
    }
    let out = select("16,28,32");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (method, k) in [("reap_mean", 16usize), ("frequency", 16), ("reap_mean", 28)] {
        let map: Value = serde_json::from_slice(&read(&d.join(format!("maps/keep_{method}_k{k}.json")))).unwrap();
        assert_eq!(map["parameters"]["expert_groups"], 4);
        for (l, entry) in sal.layers.iter().zip(map["layers"].as_array().unwrap()) {
            let keep: Vec<usize> = entry["keep"].as_array().unwrap().iter().map(|e| e.as_u64().unwrap() as usize).collect();
            for g in 0..4 {
                let kept: Vec<usize> = keep.iter().copied().filter(|e| e / 8 == g).collect();
                assert_eq!(kept.len(), k / 4, "{method} k {k} layer {} group {g}", l.layer);
                // within the group, the best by the method's order: nothing dropped outranks a kept one
                let score = |e: usize| if method == "frequency" { l.count[e] as f64 } else if l.count[e] > 0 { l.reap_l2_sum[e] / l.count[e] as f64 } else { -1.0 };
                let worst_kept = kept.iter().map(|&e| score(e)).fold(f64::INFINITY, f64::min);
                let best_dropped = (g * 8..g * 8 + 8).filter(|e| !kept.contains(e)).map(score).fold(f64::NEG_INFINITY, f64::max);
                assert!(worst_kept >= best_dropped, "{method} k {k} layer {} group {g}", l.layer);
            }
        }
    }

    // prune: the grouped maps load and run; K = 32 keeps every expert (the nextn block is
    // dropped: select's map has no entry for it), so the PPL is the original's
    prune_ok(&model, &d.join("maps/keep_reap_mean_k32.json"), &d.join("p32.gguf"), &["--drop-nextn"]);
    assert_eq!(upstream_ppl(&d.join("p32.gguf")), upstream_ppl(&model));
    prune_ok(&model, &d.join("maps/keep_reap_mean_k16.json"), &d.join("p16.gguf"), &["--drop-nextn"]);
    assert!(upstream_ppl(&d.join("p16.gguf")).is_finite());
    // the same K, unevenly over the groups: refused, naming the layer's counts
    let mut v: Value = serde_json::from_slice(&read(&d.join("maps/keep_reap_mean_k16.json"))).unwrap();
    v["layers"][0]["keep"] = json!((0..16).collect::<Vec<u16>>());
    v["model"] = Value::Null;
    let uneven = write_map(&d.join("uneven.json"), v);
    let out = prune(&["-m".as_ref(), model.as_os_str(), "--keep-map".as_ref(), uneven.as_os_str(), "-o".as_ref(), d.join("u.gguf").as_os_str(), "--drop-nextn".as_ref()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("keeps [8, 8, 0, 0] experts of its 4 expert groups") && !d.join("u.gguf").exists(), "{err}");
}

/// Calibrates `m` on the bundled corpus in `dir` with a trace of the top `top_n` candidates.
fn trace_of(dir: &Path, m: &Path, top_n: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    run_ok(Command::new(ours()).current_dir(dir).arg("-m").arg(m).arg("-f").arg(corpus()).args([
        "-c", "128", "-b", "128", "--chunks", "4", "-t", "2", "--no-ppl", "-o", "imatrix.gguf", "--trace-out", "t.bin",
        "--trace-top-n", top_n,
    ]));
    dir.join("t.bin")
}

/// A pruned model's picks in its first MoE layer, per row, as original ids (`kept`: that
/// layer's keep list), sorted.
fn first_layer_picks(trace: &Path, kept: &[u16]) -> Vec<Vec<u16>> {
    trace_rows(trace)
        .iter()
        .map(|r| {
            let mut v: Vec<u16> = r.3[0].iter().map(|&j| kept[j as usize]).collect();
            v.sort_unstable();
            v
        })
        .collect()
}

/// Writes a keep map of `keep` (one list per block of `blocks`, `k` each) as `d/kK.json`,
/// prunes `model` by it (without its nextn block, where it has one) and traces the pruned model: the map's path
/// and the pruned model's first-MoE-layer picks as original ids ([first_layer_picks]).
fn prune_and_trace(d: &Path, model: &Path, keep: &[Vec<u16>], blocks: &[u32], k: &str) -> (PathBuf, Vec<Vec<u16>>) {
    let layers: Vec<Value> = keep.iter().zip(blocks).map(|(l, b)| json!({"layer": b, "keep": l})).collect();
    let v = json!({"format": "reap-keep-map", "version": 1, "method": "test", "k": k.parse::<u64>().unwrap(), "layers": layers});
    let map = write_map(&d.join(format!("k{k}.json")), v);
    let pruned = d.join("p.gguf");
    let has_nextn = Header::parse(&read(model)).unwrap().kvs.iter().any(|kv| kv.key.ends_with(".nextn_predict_layers"));
    prune_ok(model, &map, &pruned, if has_nextn { &["--drop-nextn"] } else { &[] });
    (map, first_layer_picks(&trace_of(&d.join("pruned"), &pruned, k), &keep[0]))
}

/// Keep lists as `layers × ne` flags.
fn keep_flags(keep: &[Vec<u16>], ne: usize) -> Vec<bool> {
    let mut flags = vec![false; keep.len() * ne];
    for (li, k) in keep.iter().enumerate() {
        for &e in k {
            flags[li * ne + e as usize] = true;
        }
    }
    flags
}

/// replay's --keep-map re-routing against the pruned model itself, on glm4moe (a router whose
/// choice adds the selection bias exp_probs_b): sigmoid, and with `--softmax-router` a softmax
/// (which pruning renormalises over the kept experts). In the first MoE layer (block 1: block
/// 0 is dense and unpruned, so its input is the original's) the pruned model's picks, mapped to
/// the original ids, are the truth. Re-routed as `replay --model` does, every pick agrees; from
/// a top-10 trace only picks sure to be made are named, each agreeing too (a softmax router
/// needs every expert listed: replay refuses). By probability order alone, as replay did
/// before, many tokens re-route wrongly, and `replay` says so without --model.
#[test]
fn keep_map_rerouting_follows_the_pruned_model_under_a_selection_bias() {
    reroute_against_the_pruned_model("glm4moe", &["--arch", "glm4moe"], false, &[1, 2, 3]);
    reroute_against_the_pruned_model("glm4moe-softmax", &["--arch", "glm4moe", "--softmax-router"], true, &[1, 2, 3]);
    // MiniMax-M2's routing: glm4moe's, in every block
    reroute_against_the_pruned_model("minimax-m2", &["--arch", "minimax-m2"], false, &[0, 1, 2, 3]);
    // Nemotron-3's: in its MoE blocks, after a Mamba2 mixer; its file names no gating function
    // (the graph's own sigmoid), so replay takes the router's kind from the run's --reap
    reroute_against_the_pruned_model("nemotron_h_moe", &["--arch", "nemotron_h_moe"], false, &[1, 3]);
    // Hy3's: glm4moe's, its bias named exp_probs_b (no suffix), which prune slices and replay
    // reads by that name
    reroute_against_the_pruned_model("hy_v3", &["--arch", "hy_v3"], false, &[1, 2, 3]);
}

fn reroute_against_the_pruned_model(key: &str, fixture_args: &[&str], softmax: bool, moe_blocks: &[u32]) {
    use reap_imatrix::analyze::replay::engine::{Keep, Router, Shape};
    use reap_imatrix::analyze::replay::gguf::selection_bias;
    let d = temp_dir(&format!("prune-reroute-{key}"));
    let model = fixture_with(key, fixture_args);
    let full = trace_of(&d.join("orig"), &model, "32");
    let top10 = trace_of(&d.join("orig10"), &model, "10");
    let sal = Saliency::read(&d.join("orig/imatrix.reap.json")).unwrap();
    assert_eq!(sal.routing().probs_op.as_deref() == Some("SOFT_MAX"), softmax, "{key}");
    let blocks: Vec<u32> = sal.layers.iter().map(|l| l.layer).collect();
    assert_eq!(blocks, moe_blocks, "{key}");
    // 12 of 32 per layer: the most used, so that most tokens lose some of their picks
    let keep = most_used(&sal, 12);
    let (map, truth) = prune_and_trace(&d, &model, &keep, &blocks, "12");
    let ne = 32usize;
    let flags = keep_flags(&keep, ne);
    let bias = selection_bias(&model, &blocks, ne, &[]).unwrap().expect("the model has exp_probs_b");
    for (trace, name) in [(&full, "top-32"), (&top10, "top-10")] {
        if softmax && name == "top-10" {
            continue; // refused below
        }
        let tr = TraceReader::open(trace).unwrap();
        assert_eq!(tr.n_rows as usize, truth.len());
        let shape = Shape { n_layers: blocks.len(), n_expert: ne, k: tr.header.k as usize };
        let mut biased = Router::new(shape, Some(Keep { flags: &flags, bias: Some(&bias), renormalise: softmax, groups: None, fixed: None, remap: None }), false);
        let mut plain = Router::new(shape, Some(Keep { flags: &flags, bias: None, renormalise: false, groups: None, fixed: None, remap: None }), false);
        // a softmax's p + b without the renormalisation
        let mut unnormalised = Router::new(shape, Some(Keep { flags: &flags, bias: Some(&bias), renormalise: false, groups: None, fixed: None, remap: None }), false);
        let (mut wrong_plain, mut wrong_unnormalised, mut undecided) = (0, 0, 0);
        for (t, want) in truth.iter().enumerate() {
            let row = tr.row(t as u64);
            let r = biased.route(&row, 0);
            let mut got = r.picks.to_vec();
            got.sort_unstable();
            if name == "top-32" {
                assert_eq!(&got, want, "{key} {name} row {t}: re-routed");
            } else {
                assert!(got.iter().all(|e| want.contains(e)), "{key} {name} row {t}: {got:?} not within the pruned model's {want:?}");
                undecided += r.forced;
            }
            let r = plain.route(&row, 0);
            let mut got = r.picks.to_vec();
            got.sort_unstable();
            wrong_plain += (r.forced == 0 && &got != want) as u32;
            let r = unnormalised.route(&row, 0);
            let mut got = r.picks.to_vec();
            got.sort_unstable();
            wrong_unnormalised += (r.forced == 0 && &got != want) as u32;
        }
        assert_eq!(softmax, wrong_unnormalised > 0, "{key} {name}: {wrong_unnormalised} rows wrong by p + b unnormalised");
        if name == "top-32" {
            assert!(wrong_plain > 20, "{key} {name}: by probability alone only {wrong_plain} of {} rows re-route wrongly", truth.len());
        }
        eprintln!(
            "{key} {name}: {} rows, {wrong_plain} wrong by probability alone, {wrong_unnormalised} by p + b unnormalised, {undecided} undecided slots",
            truth.len()
        );
    }

    // the binary: --model re-routes by the bias; without it, a warning says what is missing
    let out_json = d.join("r.json");
    let replay = |trace: &Path, extra: &[&std::ffi::OsStr]| {
        run(Command::new(ours()).args(["replay", "--policy", "lru", "--capacity", "8", "--trace"]).arg(trace).arg("--keep-map").arg(&map).arg("--json").arg(&out_json).args(extra))
    };
    let has_gating_kv = Header::parse(&read(&model)).unwrap().kvs.iter().any(|kv| kv.key.ends_with(".expert_gating_func"));
    let reap_json = d.join("orig/imatrix.reap.json");
    let o = replay(&full, &["--model".as_ref(), model.as_os_str()]);
    let o = if has_gating_kv {
        o
    } else {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{key}: {err}");
        assert!(err.contains("no expert_gating_func key") && err.contains("give --reap"), "{key}: {err}");
        replay(&full, &["--model".as_ref(), model.as_os_str(), "--reap".as_ref(), reap_json.as_os_str()])
    };
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&read(&out_json)).unwrap();
    let want = if softmax { "renormalised probability + selection bias" } else { "probability + selection bias" };
    assert_eq!(v["keep_map"]["rerouting"], want, "{key}");
    assert_eq!(v["keep_map"]["forced_misses"], 0, "{key}");
    let o = replay(&full, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("selection bias") && err.contains("--model GGUF"), "{key}: {err}");
    let v: Value = serde_json::from_slice(&read(&out_json)).unwrap();
    assert_eq!(v["keep_map"]["rerouting"], "probability");
    // a few rows of the trace: its first rows show the bias all the same
    let o = replay(&full, &["--tokens".as_ref(), "500..502".as_ref()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("selection bias"), "{}", String::from_utf8_lossy(&o.stderr));
    if !softmax && key == "glm4moe" {
        // selection by the raw logits + bias (gating 3): the trace holds no logits; refused
        let g3 = d.join("gating3.gguf");
        let mut v = 4u32.to_le_bytes().to_vec();
        v.extend_from_slice(&3u32.to_le_bytes());
        with_kv(&model, &g3, |a| format!("{a}.expert_gating_func"), &v);
        let o = replay(&full, &["--model".as_ref(), g3.as_os_str()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("raw logits"), "{err}");
        // a NaN bias is refused, naming the tensor and expert
        let nan = d.join("nan-bias.gguf");
        let mut b = read(&model);
        let h = Header::parse(&b).unwrap();
        let t = h.tensors.iter().find(|t| t.name == "blk.2.exp_probs_b.bias").unwrap();
        let at = (h.data_start + t.offset) as usize + 4 * 5;
        b[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        std::fs::write(&nan, &b).unwrap();
        let o = replay(&full, &["--model".as_ref(), nan.as_os_str()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("blk.2.exp_probs_b.bias holds NaN for expert 5"), "{err}");
        // a model of another expert count is not the trace's
        let other = fixture_with("qwen3moe-e16", &["--experts", "16"]);
        let o = replay(&full, &["--model".as_ref(), other.as_os_str()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("holds 16 experts, the trace has 32"), "{err}");
    }
    if softmax {
        std::fs::remove_file(&out_json).unwrap();
        let o = replay(&top10, &["--model".as_ref(), model.as_os_str()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("softmax") && err.contains("--trace-top-n 32"), "{err}");
        assert!(!out_json.exists(), "nothing written on a refusal");
    }
}

/// replay's --keep-map re-routing of a group-routed model (DeepSeek-V3's expert groups: the
/// glm4moe fixture with 4 groups of 8, 2 used) against the pruned model's own picks in the
/// first MoE layer: from a trace of every expert, with --model, every token agrees; ignoring
/// the groups (as replay did) many do not. A trace of fewer candidates gets a warning instead.
#[test]
fn keep_map_rerouting_follows_a_group_routed_pruned_model() {
    use reap_imatrix::analyze::replay::engine::{Keep, Router, Shape};
    use reap_imatrix::analyze::replay::gguf::selection_bias;
    let d = temp_dir("prune-reroute-groups");
    let model = grouped_glm4moe(&d);
    let full = trace_of(&d.join("orig"), &model, "32");
    let sal = Saliency::read(&d.join("orig/imatrix.reap.json")).unwrap();
    let blocks: Vec<u32> = sal.layers.iter().map(|l| l.layer).collect();
    // per layer and group the 4 most used of its 8
    let keep: Vec<Vec<u16>> = sal
        .layers
        .iter()
        .map(|l| {
            let mut kept = Vec::new();
            for g in 0..4u16 {
                let mut ids: Vec<u16> = (g * 8..g * 8 + 8).collect();
                ids.sort_by_key(|&e| std::cmp::Reverse(l.count[e as usize]));
                kept.extend_from_slice(&ids[..4]);
            }
            kept.sort_unstable();
            kept
        })
        .collect();
    let (map, truth) = prune_and_trace(&d, &model, &keep, &blocks, "16");
    let ne = 32usize;
    let flags = keep_flags(&keep, ne);
    let bias = selection_bias(&model, &blocks, ne, &[]).unwrap().unwrap();
    let tr = TraceReader::open(&full).unwrap();
    let shape = Shape { n_layers: blocks.len(), n_expert: ne, k: tr.header.k as usize };
    let grouped = Keep { flags: &flags, bias: Some(&bias), renormalise: false, groups: Some((4, 2)), fixed: None, remap: None };
    let (mut r, mut flat) = (Router::new(shape, Some(grouped), false), Router::new(shape, Some(Keep { groups: None, ..grouped }), false));
    let mut wrong_flat = 0;
    for (t, want) in truth.iter().enumerate() {
        let row = tr.row(t as u64);
        let mut got = r.route(&row, 0).picks.to_vec();
        got.sort_unstable();
        assert_eq!(&got, want, "row {t}: re-routed within the groups");
        let mut got = flat.route(&row, 0).picks.to_vec();
        got.sort_unstable();
        wrong_flat += (&got != want) as u32;
    }
    eprintln!("groups: {} rows, {wrong_flat} wrong ignoring the groups", truth.len());
    assert!(wrong_flat > 20, "ignoring the groups only {wrong_flat} rows re-route wrongly");

    let out_json = d.join("r.json");
    let replay = |trace: &Path| {
        run(Command::new(ours()).args(["replay", "--policy", "lru", "--capacity", "8", "--trace"]).arg(trace).arg("--keep-map").arg(&map).arg("--model").arg(&model).arg("--json").arg(&out_json))
    };
    let o = replay(&full);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&read(&out_json)).unwrap();
    assert_eq!(v["keep_map"]["rerouting"], "probability + selection bias, within the chosen expert groups");
    assert_eq!(v["keep_map"]["forced_misses"], 0);
    let o = replay(&trace_of(&d.join("orig10"), &model, "10"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("choice of groups is not modelled") && err.contains("--trace-top-n 32"), "{err}");
    // a map prune would refuse (groups keeping different numbers) is refused here too
    let mut v: Value = serde_json::from_slice(&read(&map)).unwrap();
    v["layers"][0]["keep"] = json!((0..16).collect::<Vec<u16>>());
    std::fs::write(&map, serde_json::to_string(&v).unwrap()).unwrap();
    std::fs::remove_file(&out_json).unwrap();
    let o = replay(&full);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("keeps [8, 8, 0, 0] experts of its 4 expert groups") && !out_json.exists(), "{err}");
}

/// A model converted with `--fuse-gate-up-exps` (`ffn_gate_up_exps`: each expert's gate rows,
/// then its up rows), on the archs whose loader takes it: the same values as the unfused
/// fixture compute the same thing, so calibration gives the unfused run's trace byte for byte
/// and its REAP sums bit for bit, the fused entry's Σx² is the unfused gate's (and upstream's
/// file byte for byte); select keeps the same experts; prune slices the fused tensor and its
/// imatrix entry, and the pruned model has the pruned unfused model's PPL and quantizes with
/// that imatrix.
#[test]
fn fused_gate_up_experts_calibrate_and_prune_as_the_unfused() {
    for arch in ["qwen35moe", "deepseek2", "hy_v3"] {
        let d = temp_dir(&format!("fused-{arch}"));
        let plain = fixture(arch);
        let fused = fixture_with(&format!("{arch}-fused"), &["--arch", arch, "--fuse-gate-up"]);
        let flags = [&["-c", "256", "-b", "512", "--chunks", "4", "-t", "2", "--no-ppl"][..], cpu_flags(arch)].concat();
        let calibrate = |name: &str, model: &Path| {
            run_ok(Command::new(ours()).current_dir(&d).arg("-m").arg(model).arg("-f").arg(corpus()).args(&flags).args(["-o", &format!("{name}.gguf"), "--trace-out", &format!("{name}.trace")]));
            Saliency::read(&d.join(format!("{name}.reap.json"))).unwrap()
        };
        let (a, b) = (calibrate("plain", &plain), calibrate("fused", &fused));
        assert_same_bytes(&d.join("plain.trace"), &d.join("fused.trace"));
        assert_eq!(a.layers, b.layers, "{arch}: the REAP sums");
        std::fs::create_dir_all(d.join("up")).unwrap();
        run_ok(Command::new(reference_bin("llama-imatrix")).current_dir(d.join("up")).arg("-m").arg(&fused).arg("-f").arg(corpus()).args(&flags).args(["-o", "fused.gguf"]));
        assert_same_bytes(&d.join("fused.gguf"), &d.join("up/fused.gguf"));
        let (ia, ib) = (imatrix::load(&d.join("plain.gguf")).unwrap(), imatrix::load(&d.join("fused.gguf")).unwrap());
        let layer = a.layers[0].layer;
        let (g, f) = (&ia.entries[&format!("blk.{layer}.ffn_gate_exps.weight")], &ib.entries[&format!("blk.{layer}.ffn_gate_up_exps.weight")]);
        assert!(g.counts == f.counts && g.sums == f.sums, "{arch}: the fused entry is the gate's");
        assert!(!ib.entries.keys().any(|n| n.contains("ffn_gate_exps") || n.contains("ffn_up_exps")));

        let pruned = |name: &str, model: &Path| {
            let maps = format!("maps-{name}");
            run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", &format!("{name}.reap.json"), "--method", "reap_mean", "--k", "16", "--out-dir", &maps]));
            let out = d.join(format!("p-{name}.gguf"));
            prune_ok(model, &d.join(&maps).join("keep_reap_mean_k16.json"), &out, &["--drop-nextn", "--imatrix", &format!("{name}.gguf"), "--imatrix-out", &format!("p-{name}.imatrix.gguf")]);
            let m: Value = serde_json::from_slice(&read(&d.join(&maps).join("keep_reap_mean_k16.json"))).unwrap();
            (out, m["layers"].clone())
        };
        let ((pa, ka), (pb, kb)) = (pruned("plain", &plain), pruned("fused", &fused));
        assert_eq!(ka, kb, "{arch}: the kept experts");
        let h = read(&pb);
        let hb = Header::parse(&h).unwrap();
        assert_eq!(hb.tensors.iter().find(|t| t.name == format!("blk.{layer}.ffn_gate_up_exps.weight")).map(|t| t.ne[..3].to_vec()), Some(vec![64, 64, 16]));
        assert_eq!(upstream_ppl(&pa), upstream_ppl(&pb), "{arch}: the pruned models");
        let q = run(Command::new(reference_bin("llama-quantize")).current_dir(&d).args(["--imatrix", "p-fused.imatrix.gguf", "p-fused.gguf", "p-fused.q4_0.gguf", "Q4_0"]));
        assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    }
}

/// In `d`, after a prune to `p.gguf` with `p.imatrix.gguf`: upstream llama-quantize makes a
/// Q4_0 of it with that imatrix, upstream llama-perplexity runs it, and `p.gguf` calibrated
/// again (in `d/pruned`) gives a trace of as many rows as `d/t.bin`: (original rows, pruned rows).
fn quantize_run_and_recalibrate(d: &Path) -> (Vec<TraceRow>, Vec<TraceRow>) {
    let q = run(Command::new(reference_bin("llama-quantize")).current_dir(d).args(["--imatrix", "p.imatrix.gguf", "p.gguf", "p.q4_0.gguf", "Q4_0"]));
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    let ppl = upstream_ppl(&d.join("p.q4_0.gguf"));
    assert!(ppl.is_finite(), "PPL {ppl}");
    let pd = d.join("pruned");
    std::fs::create_dir_all(&pd).unwrap();
    calibrate(&pd, &d.join("p.gguf"));
    let (orig, pruned) = (trace_rows(&d.join("t.bin")), trace_rows(&pd.join("t.bin")));
    assert_eq!(orig.len(), pruned.len());
    (orig, pruned)
}

/// What replay's router needs for the deepseek4 fixture (hash block 0) and `d/t.bin`: the hash
/// flags, the keep flags, the selection bias, the trace and its shape.
fn deepseek4_replay_inputs(
    model: &Path,
    d: &Path,
    blocks: &[u32],
    keep: &[Vec<u16>],
) -> (Vec<bool>, Vec<bool>, Vec<f32>, TraceReader, reap_imatrix::analyze::replay::engine::Shape) {
    use reap_imatrix::analyze::replay::gguf::{hash_blocks, selection_bias};
    let ne = N_EXPERT as usize;
    let hash = hash_blocks(model, blocks).unwrap();
    assert_eq!(hash, vec![true, false, false, false]);
    let flags = keep_flags(keep, ne);
    let bias = selection_bias(model, blocks, ne, &hash).unwrap().unwrap();
    let tr = TraceReader::open(&d.join("t.bin")).unwrap();
    let shape = reap_imatrix::analyze::replay::engine::Shape { n_layers: blocks.len(), n_expert: ne, k: tr.header.k as usize };
    (hash, flags, bias, tr, shape)
}

/// DeepSeek-V4 pruned end to end: calibrate, keep each block's live experts (28 of 32: the
/// fixture's 4 dead ones go, and block 0's hash table names only live ones), prune with the
/// imatrix, quantize with upstream llama-quantize and run upstream llama-perplexity; then the
/// pruned f16 model, calibrated again, routes every token of every block (the hash block by
/// its renumbered table) to the same experts as the original, by their original ids, with the
/// same gates. A map that drops a live expert of block 0 is refused.
#[test]
fn a_deepseek4_model_with_a_hash_routed_block_prunes_quantizes_and_routes_as_before() {
    let d = temp_dir("prune-deepseek4");
    let model = fixture("deepseek4");
    calibrate(&d, &model);
    let sal = Saliency::read(&d.join("imatrix.reap.json")).unwrap();
    let blocks: Vec<u32> = sal.layers.iter().map(|l| l.layer).collect();
    assert_eq!(blocks, BLOCKS);
    let keep: Vec<Vec<u16>> = sal.layers.iter().map(|l| (0..N_EXPERT).filter(|&e| l.count[e as usize] > 0).collect()).collect();
    assert!(keep.iter().all(|k| k.len() == 28), "{:?}", keep.iter().map(Vec::len).collect::<Vec<_>>());
    let map = write_map(&d.join("live.json"), map_json(&keep));
    prune_ok(&model, &map, &d.join("p.gguf"), &["--imatrix", "imatrix.gguf", "--imatrix-out", "p.imatrix.gguf"]);
    let (orig, pruned) = quantize_run_and_recalibrate(&d);
    for (i, (o, p)) in orig.iter().zip(&pruned).enumerate() {
        assert_eq!((o.0, o.1, o.2), (p.0, p.1, p.2), "row {i}");
        for (l, kept) in keep.iter().enumerate() {
            let mut a: Vec<(u16, f32)> = o.3[l].iter().copied().zip(o.4[l].iter().copied()).collect();
            let mut b: Vec<(u16, f32)> = p.3[l].iter().map(|&j| kept[j as usize]).zip(p.4[l].iter().copied()).collect();
            a.sort_by_key(|x| x.0);
            b.sort_by_key(|x| x.0);
            assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), b.iter().map(|x| x.0).collect::<Vec<_>>(), "row {i} block {l}");
            for (x, y) in a.iter().zip(&b) {
                assert!(close(x.1 as f64, y.1 as f64, 1e-4), "row {i} block {l} expert {}: gate {} vs {}", x.0, x.1, y.1);
            }
        }
    }

    // replay's re-routing: the hash block keeps the trace's picks (what the pruned model does
    // there), the others follow score + bias; routing the hash block by its scores instead
    // (the control) gets most rows wrong
    {
        use reap_imatrix::analyze::replay::engine::{Keep, Router};
        let (hash, flags, bias, tr, shape) = deepseek4_replay_inputs(&model, &d, &blocks, &keep);
        let mut fixed = Router::new(shape, Some(Keep { flags: &flags, bias: Some(&bias), renormalise: false, groups: None, fixed: Some(&hash), remap: None }), false);
        let mut scored = Router::new(shape, Some(Keep { flags: &flags, bias: Some(&bias), renormalise: false, groups: None, fixed: None, remap: None }), false);
        let mut wrong_scored = 0;
        for (t, p) in pruned.iter().enumerate() {
            let row = tr.row(t as u64);
            for (l, kept) in keep.iter().enumerate() {
                let mut want: Vec<u16> = p.3[l].iter().map(|&j| kept[j as usize]).collect();
                want.sort_unstable();
                let mut got = fixed.route(&row, l).picks.to_vec();
                got.sort_unstable();
                assert_eq!(got, want, "row {t} block {l}: re-routed");
                if l == 0 {
                    let mut s = scored.route(&row, 0).picks.to_vec();
                    s.sort_unstable();
                    wrong_scored += usize::from(s != want);
                }
            }
        }
        assert!(wrong_scored * 2 > pruned.len(), "scoring the hash block re-routes only {wrong_scored} of {} rows wrongly", pruned.len());
    }
    let replay = |map: &Path| {
        run(Command::new(ours()).args(["replay", "--policy", "lru", "--capacity", "8", "--trace"]).arg(d.join("t.bin")).arg("--keep-map").arg(map).arg("--model").arg(&model))
    };
    let o = replay(&map);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("block 0 routes by token id (ffn_gate_tid2eid): its picks are the trace's, not re-routed"), "{err}");

    // dropping a live expert of the hash block: refused, nothing written
    let r = Refusal::new("deepseek4-hash");
    let mut k2 = keep.clone();
    let live = k2[0].remove(5);
    let dead = (0..N_EXPERT).find(|e| !keep[0].contains(e)).unwrap();
    k2[0].push(dead);
    k2[0].sort_unstable();
    r.expect_on(&model, &r.map(map_json(&k2)), &[], &format!("block 0 routes by token id (blk.0.ffn_gate_tid2eid.weight names each token's experts; DeepSeek-V4's hash routing), and the map drops experts it names: {live}"));
    // and replay refuses it too
    let o = replay(&write_map(&d.join("k2.json"), map_json(&k2)));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("block 0 routes by token id (DeepSeek-V4's hash routing: ffn_gate_tid2eid), and the map drops expert {live}")), "{err}");
}

/// `--hash-remap`'s rule, written from docs/prune.md: in each token's row of a hash table, an
/// entry naming an expert `keep` lacks, slot by slot, becomes the first of `stand_in` the row
/// does not name yet.
fn remap_row(row: &[i32], keep: &[u16], stand_in: &[u16]) -> Vec<i32> {
    let mut out = row.to_vec();
    for s in 0..out.len() {
        if !keep.contains(&(out[s] as u16)) {
            out[s] = stand_in.iter().map(|&e| e as i32).find(|e| !out.contains(e)).expect("a free kept expert");
        }
    }
    out
}

/// DeepSeek-V4 pruned below the experts its hash block's table names (K = 12 of 32): select's
/// map lists each block's kept experts in stand-in order (smallest mean REAP contribution
/// first; checked against the saliency JSON); prune refuses the map without `--hash-remap` and with it writes the table the rule
/// gives (recomputed here from the source table), which upstream llama-quantize and
/// llama-perplexity take; the pruned model, calibrated again, routes every token of the hash
/// block to that row's experts; replay --hash-remap on the original trace routes the block as
/// the pruned model did; eval --hash-remap prunes the same file. A map without a stand-in
/// order, or with one that does not list its kept experts, is refused with --hash-remap.
#[test]
fn a_deepseek4_hash_block_pruned_below_its_table_sends_dropped_entries_to_stand_ins() {
    let d = temp_dir("prune-deepseek4-remap");
    let model = fixture("deepseek4");
    calibrate(&d, &model);
    const K: usize = 12;
    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "imatrix.reap.json", "--method", "reap_l2_sum", "--k", "12", "--out-dir", "maps"]));
    let map = d.join("maps").join("keep_reap_l2_sum_k12.json");
    let mj: Value = serde_json::from_slice(&read(&map)).unwrap_or_else(|e| panic!("{}: {e}", map.display()));
    let sal = Saliency::read(&d.join("imatrix.reap.json")).unwrap();
    let mut keep: Vec<Vec<u16>> = Vec::new();
    let mut stand_ins: Vec<Vec<u16>> = Vec::new();
    // the map says which blocks route by token id (the fixture's first), and only they get a
    // stand-in order
    assert_eq!(mj["model"]["hash_layer_count"], json!(1), "{}", mj["model"]);
    for (l, s) in mj["layers"].as_array().unwrap().iter().zip(&sal.layers) {
        let ids = |k: &str| -> Vec<u16> { l[k].as_array().unwrap_or_else(|| panic!("no {k} in {l}")).iter().map(|x| x.as_u64().unwrap() as u16).collect() };
        if s.layer != 0 {
            assert!(l.get("stand_in").is_none(), "block {}: not hash-routed, yet {l}", s.layer);
            keep.push(ids("keep"));
            stand_ins.push(Vec::new());
            continue;
        }
        let (kp, si) = (ids("keep"), ids("stand_in"));
        let mut sorted = si.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, kp, "block {}: stand_in lists the kept experts", s.layer);
        // the smallest reap_l2_sum / count first, ties by id (every kept expert is live here)
        for w in si.windows(2) {
            let mean = |e: u16| s.reap_l2_sum[e as usize] / s.count[e as usize] as f64;
            let (a, b) = (mean(w[0]), mean(w[1]));
            assert!(a < b || (a == b && w[0] < w[1]), "block {}: stand_in {si:?} puts {} ({a}) before {} ({b})", s.layer, w[0], w[1]);
        }
        keep.push(kp);
        stand_ins.push(si);
    }
    assert_eq!(keep[0].len(), K);
    // a model without hash routing gets maps without stand_in, and --hash-remap says it does
    // nothing there
    let q = d.join("qwen3moe");
    std::fs::create_dir_all(&q).unwrap();
    calibrate(&q, &fixture("qwen3moe"));
    run_ok(Command::new(ours()).current_dir(&q).args(["select", "--reap", "imatrix.reap.json", "--method", "reap_l2_sum", "--k", "12", "--out-dir", "."]));
    let qm: Value = serde_json::from_slice(&read(&q.join("keep_reap_l2_sum_k12.json"))).unwrap();
    assert!(qm["layers"].as_array().unwrap().iter().all(|l| l.get("stand_in").is_none() && l.get("keep").is_some()), "{qm}");
    let o = prune_ok(&fixture("qwen3moe"), &q.join("keep_reap_l2_sum_k12.json"), &q.join("p.gguf"), &["--hash-remap", "--dry-run"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--hash-remap: ") && String::from_utf8_lossy(&o.stderr).contains("has no hash-routed block"), "{}", String::from_utf8_lossy(&o.stderr));

    // the source table names more than K experts: refused without the flag
    let src = read(&model);
    let hs = Header::parse(&src).unwrap();
    let tensor = |b: &[u8], h: &Header, name: &str| -> (Vec<u64>, Vec<i32>) {
        let t = h.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no {name}"));
        let at = (h.data_start + t.offset) as usize;
        (t.ne.clone(), b[at..at + t.nbytes() as usize].chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect())
    };
    let (ne, table) = tensor(&src, &hs, "blk.0.ffn_gate_tid2eid.weight");
    let k = ne[0] as usize;
    let named: std::collections::BTreeSet<i32> = table.iter().copied().collect();
    assert!(named.len() > K, "the table names {} experts", named.len());
    let r = Refusal::new("deepseek4-remap");
    r.expect_on(&model, &map, &[], "Or pass --hash-remap: each such entry then names the first kept expert of the map's stand_in list that the token's row lacks");

    // with it: the table the rule gives, renumbered
    let out = prune_ok(&model, &map, &d.join("p.gguf"), &["--hash-remap", "--imatrix", "imatrix.gguf", "--imatrix-out", "p.imatrix.gguf"]);
    let rows: Vec<Vec<i32>> = table.chunks(k).map(|row| remap_row(row, &keep[0], &stand_ins[0])).collect();
    let moved = table.iter().filter(|&&e| !keep[0].contains(&(e as u16))).count();
    let moved_tokens = table.chunks(k).filter(|row| row.iter().any(|&e| !keep[0].contains(&(e as u16)))).count();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(&format!("block 0 routes by token id: {moved} table entries of {moved_tokens} tokens sent to kept experts (--hash-remap)")), "{said}");
    let pruned = read(&d.join("p.gguf"));
    let (pne, ptable) = tensor(&pruned, &Header::parse(&pruned).unwrap(), "blk.0.ffn_gate_tid2eid.weight");
    assert_eq!(pne, ne);
    let want: Vec<i32> = rows.iter().flatten().map(|&e| keep[0].iter().position(|&x| x as i32 == e).unwrap() as i32).collect();
    assert_eq!(ptable.len(), want.len());
    if let Some(i) = (0..want.len()).find(|&i| ptable[i] != want[i]) {
        panic!("token {}: the table row is {:?}, the rule gives {:?} (source row {:?})", i / k, &ptable[i / k * k..][..k], &want[i / k * k..][..k], &table[i / k * k..][..k]);
    }
    for row in ptable.chunks(k) {
        assert!(row.iter().all(|&e| (0..K as i32).contains(&e)) && (1..k).all(|i| !row[..i].contains(&row[i])), "row {row:?}");
    }
    // the pruned model, calibrated again, routes each token of block 0 to its row's experts
    let (orig, after) = quantize_run_and_recalibrate(&d);
    let sorted = |mut v: Vec<u16>| {
        v.sort_unstable();
        v
    };
    let mut changed = 0;
    for (i, (o, p)) in orig.iter().zip(&after).enumerate() {
        assert_eq!((o.0, o.1, o.2), (p.0, p.1, p.2), "row {i}");
        let tok = o.2 as usize;
        let before: Vec<u16> = table[tok * k..(tok + 1) * k].iter().map(|&e| e as u16).collect();
        assert_eq!(sorted(o.3[0].clone()), sorted(before.clone()), "row {i}: the original routes block 0 by its table");
        let now: Vec<u16> = p.3[0].iter().map(|&j| keep[0][j as usize]).collect();
        assert_eq!(sorted(now.clone()), sorted(rows[tok].iter().map(|&e| e as u16).collect()), "row {i} (token {tok}): block 0");
        changed += usize::from(sorted(now) != sorted(before));
    }
    assert!(changed > 0, "no calibration token met a remapped entry");

    // replay --hash-remap routes block 0 of the original trace as the pruned model did
    {
        use reap_imatrix::analyze::replay::engine::{Keep, Router};
        let blocks: Vec<u32> = sal.layers.iter().map(|l| l.layer).collect();
        let (hash, flags, bias, tr, shape) = deepseek4_replay_inputs(&model, &d, &blocks, &keep);
        let keep_arg = Keep { flags: &flags, bias: Some(&bias), renormalise: false, groups: None, fixed: Some(&hash), remap: Some(&stand_ins) };
        let mut router = Router::new(shape, Some(keep_arg), false);
        for (t, p) in after.iter().enumerate() {
            let got = router.route(&tr.row(t as u64), 0).picks.to_vec();
            assert_eq!(sorted(got), sorted(p.3[0].iter().map(|&j| keep[0][j as usize]).collect()), "row {t}: replayed block 0");
        }
    }
    let replay = |m: &Path, extra: &[&str]| {
        run(Command::new(ours()).args(["replay", "--policy", "lru", "--capacity", "8", "--trace"]).arg(d.join("t.bin")).arg("--keep-map").arg(m).arg("--model").arg(&model).args(extra))
    };
    let o = replay(&map, &["--hash-remap", "--json", d.join("r-model.json").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("block 0 routes by token id (ffn_gate_tid2eid): its picks are the trace's, a dropped one sent"), "{err}");
    let o = replay(&map, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    // without --model the map's hash_layer_count tells the block: block 0 replays the same (the
    // other blocks lack the model's selection bias, so they may not); a map without it routes
    // block 0 by scores (the control: another outcome)
    let no_model = |m: &Path, extra: &[&str]| {
        run(Command::new(ours()).args(["replay", "--policy", "lru", "--capacity", "8", "--trace"]).arg(d.join("t.bin")).arg("--keep-map").arg(m).args(extra))
    };
    let block0 = |json: &str| -> Value {
        let v: Value = serde_json::from_slice(&read(&d.join(json))).unwrap();
        v["results"][0]["layers"][0].clone()
    };
    let o = no_model(&map, &["--hash-remap", "--json", d.join("r-map.json").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("block 0 routes by token id (ffn_gate_tid2eid): its picks are the trace's, a dropped one sent"), "{err}");
    assert_eq!(block0("r-map.json"), block0("r-model.json"));
    assert!(block0("r-map.json")["accesses"].as_u64().unwrap() > 0);
    let o = no_model(&map, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("block 0 routes by token id (DeepSeek-V4's hash routing: ffn_gate_tid2eid), and the map drops expert"), "{err}");
    let mut unstated = mj.clone();
    unstated["model"].as_object_mut().unwrap().remove("hash_layer_count");
    let unstated = write_map(&d.join("unstated.json"), unstated);
    let o = no_model(&unstated, &["--json", d.join("r-scored.json").to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_ne!(block0("r-scored.json"), block0("r-map.json"));

    // eval --keep-map --hash-remap prunes the same file (the same figures as eval of p.gguf)
    let eval = |extra: &[&std::ffi::OsStr], json: &Path| {
        run_ok(
            Command::new(ours())
                .env("REAP_IMATRIX_HASH_CACHE", d.join("hashes.tsv"))
                .args(["eval", "--base"])
                .arg(&model)
                .arg("-f")
                .arg(corpus())
                .args(["-t", "2", "-c", "128", "--chunks", "2", "--scratch"])
                .arg(&d)
                .args(extra)
                .arg("--json")
                .arg(json),
        );
        let v: Value = serde_json::from_slice(&read(json)).unwrap();
        (v["models"][0]["kld_mean"].as_f64().unwrap(), v["prune_flags"].clone())
    };
    let (via_map, flags) = eval(&["--keep-map".as_ref(), map.as_os_str(), "--hash-remap".as_ref()], &d.join("e1.json"));
    assert_eq!(flags, json!(["--hash-remap"]));
    let (via_map, via_file) = (via_map, eval(&["-m".as_ref(), d.join("p.gguf").as_os_str()], &d.join("e2.json")).0);
    assert_eq!(via_map, via_file);
    assert!(via_map > 0.0);

    // a map without a stand-in order: refused with --hash-remap, naming what is missing
    let mut bare = mj.clone();
    for l in bare["layers"].as_array_mut().unwrap() {
        l.as_object_mut().unwrap().remove("stand_in");
    }
    let bare = r.map(bare);
    r.expect_on(&model, &bare, &["--hash-remap"], "but there is no stand-in order for block 0: the map has no \"stand_in\"");
    // a keep list edited by hand, its stand_in not: refused with --hash-remap (elsewhere such a map
    // serves as before: group_routed_models_keep_the_same_number_in_every_group edits one)
    let mut edited = mj.clone();
    let swap = (0..N_EXPERT).find(|e| !keep[0].contains(e) && named.contains(&(*e as i32))).unwrap();
    let mut k0 = keep[0].clone();
    k0[0] = swap;
    k0.sort_unstable();
    edited["layers"][0]["keep"] = json!(k0);
    let edited = write_map(&d.join("edited.json"), edited);
    r.expect_on(&model, &edited, &["--hash-remap"], "its \"stand_in\" does not list the kept experts, each once");
    // and replay: without a stand-in order, and without --model or the map's hash_layer_count
    // (which say where the tables are)
    let o = replay(&bare, &["--hash-remap"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--hash-remap: block 0 routes by token id, and the map has no \"stand_in\""), "{}", String::from_utf8_lossy(&o.stderr));
    let o = no_model(&unstated, &["--hash-remap"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--hash-remap needs --model, or a keep map that states the model's hash_layer_count"), "{}", String::from_utf8_lossy(&o.stderr));
}
