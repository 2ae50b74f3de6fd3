//! `reap-imatrix eval` against upstream `llama-perplexity --kl-divergence` (same pin): the
//! same model pair, text and settings must give the same figures to the printed precision,
//! the base log-probs files must be interchangeable, and the cache must be reused or refused
//! as docs/eval.md says.

use super::util::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

/// Four chunks of 128 tokens: 4 × 63 = 252 scored tokens (upstream needs ≥ 100).
const CTX: &str = "128";
const CHUNKS: &str = "4";

/// A fixture with a given arch and seed, generated once per test run.
fn seeded(arch: &str, seed: u32) -> PathBuf {
    static MADE: OnceLock<Mutex<Vec<(String, PathBuf)>>> = OnceLock::new();
    let key = format!("{arch}-s{seed}");
    let mut made = MADE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = made.iter().find(|(k, _)| *k == key) {
        return p.clone();
    }
    let p = temp_dir(&format!("eval-fixture-{key}")).join(format!("{key}.gguf"));
    run_ok(Command::new(ours()).args(["fixture", "--arch", arch, "--seed", &seed.to_string(), "-o"]).arg(&p));
    made.push((key, p.clone()));
    p
}

fn upstream_base(model: &Path, file: &Path, batch: &str) -> Output {
    run_ok(
        Command::new(reference_bin("llama-perplexity"))
            .arg("-m")
            .arg(model)
            .arg("-f")
            .arg(corpus())
            .args(["-c", CTX, "--chunks", CHUNKS, "-b", batch, "-t", "2", "--kl-divergence-base"])
            .arg(file),
    )
}

fn upstream_kld(model: &Path, file: &Path, batch: &str) -> String {
    let out = run_ok(
        Command::new(reference_bin("llama-perplexity"))
            .arg("-m")
            .arg(model)
            .args(["-c", CTX, "-b", batch, "-t", "2", "--kl-divergence", "--kl-divergence-base"])
            .arg(file),
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("Same top p:"), "upstream printed no statistics:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    text
}

/// Our eval; returns (output, parsed JSON).
fn eval(dir: &Path, base: &Path, models: &[&Path], extra: &[&str]) -> (Output, Value) {
    let json = dir.join("eval.json");
    let _ = std::fs::remove_file(&json);
    let list = models.iter().map(|m| m.display().to_string()).collect::<Vec<_>>().join(",");
    let out = run_ok(
        eval_cmd(dir, base, extra).args(["--model", &list, "--json"]).arg(&json),
    );
    let v: Value = serde_json::from_slice(&read(&json)).unwrap();
    (out, v)
}

fn eval_cmd(dir: &Path, base: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(ours());
    c.env("REAP_IMATRIX_HASH_CACHE", dir.join("hashes.tsv"))
        .arg("eval")
        .arg("--base")
        .arg(base)
        .arg("-f")
        .arg(corpus())
        .args(["-t", "2", "--scratch"])
        .arg(dir);
    // the shared settings, unless the test gives its own
    if !extra.contains(&"-c") {
        c.args(["-c", CTX]);
    }
    if !extra.contains(&"--chunks") {
        c.args(["--chunks", CHUNKS]);
    }
    c.args(extra);
    c
}

/// The numbers upstream printed after `label` (e.g. "Mean    KLD:"), as printed text.
fn printed<'a>(text: &'a str, label: &str) -> Vec<&'a str> {
    let line = text.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no `{label}` line in:\n{text}"));
    line[label.len()..].split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-')).filter(|s| s.parse::<f64>().is_ok()).collect()
}

/// `ours` rounds to `printed` at the printed number of decimals (half a unit in the last
/// printed digit, with a hair of slack for a value sitting on the rounding boundary).
fn assert_to_printed(what: &str, ours: f64, printed: &str) {
    let decimals = printed.split_once('.').map_or(0, |(_, d)| d.len()) as i32;
    let p: f64 = printed.parse().unwrap();
    let tol = 0.5 * 10f64.powi(-decimals) * (1.0 + 1e-6);
    assert!((ours - p).abs() <= tol, "{what}: ours {ours} vs upstream's printed {printed}");
}

/// Every figure the contract names, against upstream's printed statistics.
fn assert_matches_upstream(m: &Value, up: &str) {
    let f = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("no {k} in {m}"));
    let ppl = printed(up, "Mean PPL(Q)");
    assert_to_printed("ppl", f("ppl"), ppl[0]);
    assert_to_printed("ppl_err", f("ppl_err"), ppl[1]);
    assert_to_printed("base_ppl", f("base_ppl"), printed(up, "Mean PPL(base)")[0]);
    let kld = printed(up, "Mean    KLD:");
    assert_to_printed("kld_mean", f("kld_mean"), kld[0]);
    assert_to_printed("kld_mean_err", f("kld_mean_err"), kld[1]);
    assert_to_printed("kld_max", f("kld_max"), printed(up, "Maximum KLD:")[0]);
    assert_to_printed("kld_p999", f("kld_p999"), printed(up, "99.9%   KLD:")[0]);
    assert_to_printed("kld_p99", f("kld_p99"), printed(up, "99.0%   KLD:")[0]);
    assert_to_printed("kld_p90", f("kld_p90"), printed(up, "90.0%   KLD:")[0]);
    assert_to_printed("kld_median", f("kld_median"), printed(up, "Median  KLD:")[0]);
    let top = printed(up, "Same top p:");
    assert_to_printed("top1_agree %", 100.0 * f("top1_agree"), top[0]);
    assert_to_printed("top1_agree_err %", 100.0 * f("top1_agree_err"), top[1]);
    assert_to_printed("rms_dp %", 100.0 * f("rms_dp"), printed(up, "RMS Δp    :")[0]);
    // a real difference between the models, not a trivially equal pair
    assert!(f("kld_mean") > 0.01 && f("top1_agree") < 0.99, "{m}");
    assert!(f("tokens") >= 100.0);
}

/// The lines of our stdout that upstream also prints, for the statistics block of one model.
fn assert_same_labels(ours_stdout: &str, up: &str) {
    for label in ["Mean PPL(Q)", "Mean PPL(base)", "Mean    KLD:", "99.9%   KLD:", "Median  KLD:", "RMS Δp    :", "Same top p:"] {
        assert!(ours_stdout.lines().any(|l| l.starts_with(label)), "our output has no `{label}` line");
        let ours_line = ours_stdout.lines().find(|l| l.starts_with(label)).unwrap();
        let up_line = up.lines().find(|l| l.starts_with(label)).unwrap();
        assert_eq!(ours_line.len(), up_line.len(), "`{label}` lines differ in layout:\n{ours_line}\n{up_line}");
    }
}

#[test]
fn eval_matches_llama_perplexity_kl_divergence_and_base_files_are_interchangeable() {
    let d = temp_dir("eval-parity");
    let (base, other) = (seeded("qwen3moe", 1), seeded("qwen3moe", 2));
    // upstream: two passes
    let up_file = d.join("upstream.kld");
    upstream_base(&base, &up_file, "2048");
    let up = upstream_kld(&other, &up_file, "2048");
    // ours: one run, writing its own base file
    let ours_file = d.join("ours.kld");
    let (out, v) = eval(&d, &base, &[&other], &["--base-logits", ours_file.to_str().unwrap()]);
    let m = &v["models"][0];
    assert_eq!(v["base"].as_str(), Some(base.to_str().unwrap()));
    assert_eq!(m["path"].as_str(), Some(other.to_str().unwrap()));
    assert_eq!(v["forward_passes"], 2);
    assert_matches_upstream(m, &up);
    assert_same_labels(&String::from_utf8_lossy(&out.stdout), &up);
    // the running per-chunk lines (stderr) as upstream prints them
    let chunk_lines = |t: &str| t.lines().skip_while(|l| !l.starts_with("chunk ")).take(5).map(str::to_string).collect::<Vec<_>>();
    let ours_chunks = chunk_lines(&String::from_utf8_lossy(&out.stderr));
    assert_eq!(ours_chunks.len(), 5);
    assert_eq!(ours_chunks, chunk_lines(&up));
    // the same forward pass and the same encoding: the files are identical
    assert_same_bytes(&ours_file, &up_file);
    // upstream's second pass reads our file
    let up_on_ours = upstream_kld(&other, &ours_file, "2048");
    assert_matches_upstream(m, &up_on_ours);
    // ours reads upstream's file (no sidecar): reused, one forward pass, same figures
    let (out2, v2) = eval(&d, &base, &[&other], &["--base-logits", up_file.to_str().unwrap()]);
    assert_eq!(v2["forward_passes"], 1, "{v2}");
    assert_eq!(v2["base_logits"]["reused"], true);
    let err = String::from_utf8_lossy(&out2.stderr);
    assert!(err.contains("reusing base log-probs") && err.contains("not checked"), "{err}");
    assert_matches_upstream(&v2["models"][0], &up);
}

/// A model against itself: divergences of the base's quantization error only, whose
/// uncertainties can be 0/0 or √(−0), which C's printf writes `-nan` (Rust: `NaN`). The chunk
/// lines and the statistics are upstream's text, whatever it holds. Whether a `-nan` arises
/// depends on the CPU's rounding: on the AVX512 machines of earlier sessions upstream printed
/// one here; on an AVX2 AMD EPYC (2026-12-02) the variances came out positive and it printed
/// none. The unit test `floats_print_as_c_printf_prints_them_nans_included` checks NaN's text
/// against libc's printf on every machine.
#[test]
fn eval_of_a_model_against_itself_prints_upstreams_text_nans_included() {
    let d = temp_dir("eval-self");
    let base = seeded("qwen3moe", 1);
    let up_file = d.join("upstream.kld");
    upstream_base(&base, &up_file, "2048");
    let up = upstream_kld(&base, &up_file, "2048");
    let (out, _) = eval(&d, &base, &[&base], &[]);
    let chunk_lines = |t: &str| t.lines().skip_while(|l| !l.starts_with("chunk ")).take(5).map(str::to_string).collect::<Vec<_>>();
    let ours = String::from_utf8_lossy(&out.stderr);
    assert_eq!(chunk_lines(&ours), chunk_lines(&up));
    let stats = |t: &str| t.lines().skip_while(|l| !l.starts_with("====== Perplexity")).take_while(|l| !l.starts_with("Same top p")).map(str::to_string).collect::<Vec<_>>();
    let ours_out = String::from_utf8_lossy(&out.stdout);
    assert!(stats(&ours_out).len() > 20);
    assert_eq!(stats(&ours_out), stats(&up));
    if !chunk_lines(&up).iter().any(|l| l.contains("-nan")) {
        eprintln!("note: upstream printed no -nan on this CPU; NaN's text is checked by the unit test against libc's printf");
    }
}

#[test]
fn eval_matches_upstream_with_two_batches_per_chunk_on_qwen2moe() {
    // -b 64 < -c 128: each chunk is two decode calls (logits gathered across them); qwen2moe
    // has a shared expert
    let d = temp_dir("eval-parity-b64");
    let (base, other) = (seeded("qwen2moe", 1), seeded("qwen2moe", 2));
    let up_file = d.join("upstream.kld");
    upstream_base(&base, &up_file, "64");
    let up = upstream_kld(&other, &up_file, "64");
    let ours_file = d.join("ours.kld");
    let (_, v) = eval(&d, &base, &[&other], &["-b", "64", "--base-logits", ours_file.to_str().unwrap()]);
    assert_matches_upstream(&v["models"][0], &up);
    assert_same_bytes(&ours_file, &up_file);
}

#[test]
fn base_logits_cache_is_reused_and_a_mismatch_is_refused() {
    let d = temp_dir("eval-cache");
    let (s1, s2) = (seeded("qwen3moe", 1), seeded("qwen3moe", 2));
    // A file of seed 2's log-probs (written by upstream, so no sidecar) given as the cache of
    // a run whose base is seed 1, evaluating seed 1 itself: reused, the figures are those of
    // seed 1 against seed 2 (a recomputed base would give KLD ≈ 0).
    let foreign = d.join("s2.kld");
    upstream_base(&s2, &foreign, "2048");
    let (_, v) = eval(&d, &s1, &[&s1], &["--base-logits", foreign.to_str().unwrap()]);
    assert_eq!(v["forward_passes"], 1);
    assert!(v["models"][0]["kld_mean"].as_f64().unwrap() > 0.1, "the base pass was re-run: {v}");

    // our own file has a sidecar naming its base: another --base is refused, nothing changes
    let own = d.join("s1.kld");
    let (_, v) = eval(&d, &s1, &[&s2], &["--base-logits", own.to_str().unwrap()]);
    assert_eq!(v["forward_passes"], 2);
    assert!(own.is_file() && d.join("s1.kld.meta.json").is_file());
    let before = read(&own);
    let out = run(&mut eval_cmd(&d, &s2, &["--base-logits", own.to_str().unwrap()]).args(["--model"]).arg(&s1));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another base model") && err.contains("s1.kld"), "{err}");
    // the same base again: reused (the sidecar's sha256 matches)
    let (out, v) = eval(&d, &s1, &[&s2], &["--base-logits", own.to_str().unwrap()]);
    assert_eq!(v["forward_passes"], 1);
    assert!(String::from_utf8_lossy(&out.stderr).contains("sha256 matches"));

    // another text: refused, naming the first differing token; the file is left as it was
    let text = d.join("other.txt");
    let mut t = read(&corpus());
    t.drain(..200);
    std::fs::write(&text, t).unwrap();
    let mut c = Command::new(ours());
    c.env("REAP_IMATRIX_HASH_CACHE", d.join("hashes.tsv"))
        .args(["eval", "--base"])
        .arg(&s1)
        .arg("--model")
        .arg(&s2)
        .arg("-f")
        .arg(&text)
        .args(["-c", CTX, "--chunks", CHUNKS, "-t", "2", "--base-logits"])
        .arg(&own);
    let out = run(&mut c);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("other tokens") && err.contains("nothing was changed"), "{err}");
    assert_eq!(read(&own), before);
    // other -c: refused too
    let out = run(&mut eval_cmd(&d, &s1, &["-c", "64", "--base-logits", own.to_str().unwrap(), "--model", s2.to_str().unwrap()]));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("n_ctx 128 (this run: -c 64)"));
}

#[test]
fn eval_refuses_bad_input_before_running() {
    let d = temp_dir("eval-bad");
    let s1 = seeded("qwen3moe", 1);
    let missing = d.join("missing.gguf");
    let out = run(&mut eval_cmd(&d, &s1, &[]).arg("--model").arg(&missing));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.gguf: no such file"));
    let out = run(&mut eval_cmd(&d, &s1, &["--calibration-text", d.join("nothere.txt").to_str().unwrap()]).arg("--model").arg(&s1));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--calibration-text") && String::from_utf8_lossy(&out.stderr).contains("nothere.txt: no such file"));
    // too few scored tokens for the statistics
    let out = run(&mut eval_cmd(&d, &s1, &["--chunks", "1"]).arg("--model").arg(&s1));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 100"));
    // a base-logits file that is not one
    let junk = d.join("junk.kld");
    std::fs::write(&junk, b"hello").unwrap();
    let out = run(&mut eval_cmd(&d, &s1, &["--base-logits", junk.to_str().unwrap()]).arg("--model").arg(&s1));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("junk.kld"));
    assert_eq!(read(&junk), b"hello");
    // --json onto --base-logits would replace the log-probs with the results
    let same = d.join("same.out");
    let spelled = d.join(".").join("same.out");
    let out = run(&mut eval_cmd(&d, &s1, &["--base-logits", same.to_str().unwrap(), "--json", spelled.to_str().unwrap()]).arg("--model").arg(&s1));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is also --base-logits"));
    // a truncated model: named by its header, before any pass
    let cut = d.join("cut.gguf");
    std::fs::write(&cut, &read(&s1)[..1 << 20]).unwrap();
    let out = run(&mut eval_cmd(&d, &s1, &[]).arg("--model").arg(&cut));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--model") && err.contains("cut.gguf") && !err.contains("base: "), "{err}");
    // a keep map for another model: prune's --dry-run refuses it before the base pass
    let map = d.join("other.json");
    std::fs::write(&map, r#"{"method": "x", "k": 6, "layers": [[0, 1, 2, 3, 4, 5]]}"#).unwrap();
    let out = run(&mut eval_cmd(&d, &s1, &[]).arg("--keep-map").arg(&map));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("1 layers, but the model has 4 MoE layers") && !err.contains("base: "), "{err}");
}

#[test]
fn eval_keep_map_equals_eval_of_the_pruned_file() {
    let d = temp_dir("eval-keep-map");
    let base = seeded("qwen3moe", 1);
    // calibrate → select: a real keep map (K = 16 of 32)
    run_ok(
        Command::new(ours())
            .arg("-m")
            .arg(&base)
            .arg("-f")
            .arg(corpus())
            .args(["-c", "128", "--chunks", "8", "-t", "2", "--no-ppl", "-o"])
            .arg(d.join("imatrix.gguf")),
    );
    run_ok(
        Command::new(ours())
            .args(["select", "--reap"])
            .arg(d.join("imatrix.reap.json"))
            .args(["--method", "reap_l2_sum,frequency", "--k", "16", "--out-dir"])
            .arg(d.join("keep")),
    );
    let maps = [d.join("keep/keep_reap_l2_sum_k16.json"), d.join("keep/keep_frequency_k16.json")];
    let cache = d.join("base.kld");
    let list = format!("{},{}", maps[0].display(), maps[1].display());
    let json = d.join("maps.json");
    let out = run_ok(&mut eval_cmd(&d, &base, &["--base-logits", cache.to_str().unwrap(), "--keep-map", &list, "--json", json.to_str().unwrap()]));
    let via_maps: Value = serde_json::from_slice(&read(&json)).unwrap();
    assert_eq!(via_maps["forward_passes"], 3, "N + 1 passes");
    assert!(String::from_utf8_lossy(&out.stdout).contains("====== Models by mean KLD"));
    // the scratch folder (pruned models) is gone
    assert!(std::fs::read_dir(&d).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().starts_with("reap-eval-")));
    // the same maps pruned by hand and evaluated as models: the same figures, bit for bit
    for (i, map) in maps.iter().enumerate() {
        let pruned = d.join(format!("pruned{i}.gguf"));
        run_ok(Command::new(ours()).args(["prune", "-m"]).arg(&base).arg("--keep-map").arg(map).arg("-o").arg(&pruned));
        let (_, via_model) = eval(&d, &base, &[&pruned], &["--base-logits", cache.to_str().unwrap()]);
        let (a, b) = (&via_maps["models"][i], &via_model["models"][0]);
        assert_eq!(a["path"].as_str(), Some(map.to_str().unwrap()));
        assert_eq!(a["keep_map"].as_str(), Some(map.to_str().unwrap()));
        for k in ["ppl", "base_ppl", "kld_mean", "kld_mean_err", "kld_max", "kld_p99", "kld_median", "top1_agree", "top1_agree_err", "rms_dp"] {
            assert_eq!(a[k], b[k], "{k} differs between --keep-map and --model on the pruned file");
        }
        // pruning half the experts changes the model
        assert!(a["kld_mean"].as_f64().unwrap() > 0.0);
    }
    // in-sample: the calibration evaluated the text's first 8 chunks of 128 tokens (tokenized
    // as eval does: no --parse-special); eval's first 4 are those, so every scored token
    // (4 × 63) is text the maps were fitted on; over 12 chunks the last 4 are not (8 × 63 of 12 × 63)
    for m in via_maps["models"].as_array().unwrap() {
        let s = &m["in_sample"];
        assert_eq!((s["scored_tokens"].as_u64(), s["in_sample_tokens"].as_u64(), s["chunks"].as_str()), (Some(252), Some(252), Some("the run's")), "{s}");
        assert_eq!(s["calibration_text"].as_str(), Some(corpus().to_str().unwrap()));
    }
    let out = run_ok(&mut eval_cmd(&d, &base, &["--chunks", "12", "--keep-map", maps[0].to_str().unwrap(), "--json", json.to_str().unwrap()]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("eval: 504 of 756 scored tokens (66.7%) are text the models were calibrated on (the chunks of "), "{err}");
    let v: Value = serde_json::from_slice(&read(&json)).unwrap();
    assert_eq!((v["models"][0]["in_sample"]["in_sample_tokens"].as_u64(), v["models"][0]["in_sample"]["fraction"].as_f64()), (Some(504), Some(504.0 / 756.0)));
    // a text the calibration did not see, named by --calibration-text: none
    let (out, v) = eval(&d, &base, &[&d.join("pruned0.gguf")], &["--base-logits", cache.to_str().unwrap(), "--calibration-text", repo().join("corpus/prompts.txt").to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("eval: none of the 252 scored tokens is text the models were calibrated on"), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(v["models"][0]["in_sample"]["in_sample_tokens"].as_u64(), Some(0));
    assert!(v["models"][0]["in_sample"]["chunks"] == "all");
    // a map whose saliency JSON is gone: not known, and said so
    let moved = d.join("moved.json");
    let mut mj: Value = serde_json::from_slice(&read(&maps[0])).unwrap();
    mj["source"]["path"] = Value::from(d.join("gone.reap.json").to_str().unwrap());
    std::fs::write(&moved, serde_json::to_vec(&mj).unwrap()).unwrap();
    let out = run_ok(&mut eval_cmd(&d, &base, &["--base-logits", cache.to_str().unwrap(), "--keep-map", moved.to_str().unwrap(), "--json", json.to_str().unwrap()]));
    assert!(String::from_utf8_lossy(&out.stderr).contains("eval: cannot tell whether moved's calibration saw this text: its saliency JSON"), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&read(&json)).unwrap();
    assert!(v["models"][0]["in_sample"]["unknown"].as_str().unwrap().contains("gone.reap.json cannot be read"), "{}", v["models"][0]);

    // a calibration that parsed special tokens (the chat sections' markup) in one chunk of 2048:
    // eval's 8 chunks of 128 (its tokens, markup not parsed) lie inside that chunk's text, so all
    // 8 × 63 scored tokens are in-sample, markup windows included
    let sp = d.join("special");
    std::fs::create_dir_all(&sp).unwrap();
    run_ok(Command::new(ours()).arg("-m").arg(&base).arg("-f").arg(corpus()).args(["--parse-special", "-c", "2048", "--chunks", "1", "-t", "2", "--no-ppl", "-o"]).arg(sp.join("imatrix.gguf")));
    run_ok(Command::new(ours()).args(["select", "--reap"]).arg(sp.join("imatrix.reap.json")).args(["--method", "reap_l2_sum", "--k", "16", "--out-dir"]).arg(&sp));
    let spmap = sp.join("keep_reap_l2_sum_k16.json");
    let out = run_ok(&mut eval_cmd(&d, &base, &["--base-logits", d.join("base8.kld").to_str().unwrap(), "--chunks", "8", "--keep-map", spmap.to_str().unwrap(), "--json", json.to_str().unwrap()]));
    let v: Value = serde_json::from_slice(&read(&json)).unwrap();
    assert_eq!((v["models"][0]["in_sample"]["scored_tokens"].as_u64(), v["models"][0]["in_sample"]["in_sample_tokens"].as_u64()), (Some(504), Some(504)), "{}", String::from_utf8_lossy(&out.stderr));

    // a map prune refuses (K below the 4 experts used per token): exit 2 before any pass
    let bad = d.join("k2.json");
    std::fs::write(&bad, r#"{"method":"x","k":2,"layers":[[0,1],[0,1],[0,1],[0,1]]}"#).unwrap();
    let out = run(&mut eval_cmd(&d, &base, &["--base-logits", cache.to_str().unwrap(), "--keep-map", bad.to_str().unwrap()]));
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("k2.json"));
}

/// `-ngl 99 --rpc` to a local upstream `ggml-rpc-server`: every layer off-host, as on a GPU.
/// The offloaded graph runs other kernels than the host's (measured: PPL 2e-5 relative apart),
/// so the figures agree to float rounding, not bit for bit.
#[test]
fn eval_offloads_through_rpc_with_figures_equal_to_rounding() {
    let d = temp_dir("eval-rpc");
    let (s1, s2) = (seeded("qwen3moe", 1), seeded("qwen3moe", 2));
    let mut server = RpcServer::start();
    let (out, off) = eval(&d, &s1, &[&s2], &["-ngl", "99", "--rpc", &server.endpoint, "--rpc-timeout", "120"]);
    server.kill();
    let (_, cpu) = eval(&d, &s1, &[&s2], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    for (k, rel) in [("ppl", 1e-3), ("base_ppl", 1e-3), ("kld_mean", 1e-2), ("kld_median", 5e-2), ("kld_max", 5e-2)] {
        let (a, b) = (off["models"][0][k].as_f64().unwrap(), cpu["models"][0][k].as_f64().unwrap());
        assert!((a - b).abs() <= rel * b.abs(), "{k}: {a} over RPC, {b} on the CPU\n{err}");
    }
    // top-1 agreement: at most a couple of the 252 scored tokens may flip
    let (a, b) = (off["models"][0]["top1_agree"].as_f64().unwrap(), cpu["models"][0]["top1_agree"].as_f64().unwrap());
    assert!((a - b).abs() <= 2.0 / 252.0 + 1e-12, "top1_agree: {a} over RPC, {b} on the CPU");
}

/// With the experts' weights kept in host memory and the rest offloaded (`-ngl 99 --cpu-moe`
/// over a local `ggml-rpc-server`, or `-ot`), every figure is upstream llama-perplexity's
/// `--kl-divergence` with the same flags. A stored base file records the placement; one made
/// with another is reused, as with another `-ngl`, with a note naming the difference.
#[test]
fn eval_with_the_experts_in_host_memory_matches_upstream() {
    let d = temp_dir("eval-cpu-moe");
    let (s1, s2) = (seeded("qwen3moe", 1), seeded("qwen3moe", 2));
    let server = RpcServer::start();
    let placement = ["-ngl", "99", "--rpc", &server.endpoint, "--cpu-moe"];
    let up_file = d.join("upstream.kld");
    let perplexity = |m: &Path, extra: &[&str]| {
        run_ok(Command::new(reference_bin("llama-perplexity")).arg("-m").arg(m).args(["-c", CTX, "-b", "2048", "-t", "2"]).args(placement).args(extra).arg(&up_file))
    };
    perplexity(&s1, &["-f", corpus().to_str().unwrap(), "--chunks", CHUNKS, "--kl-divergence-base"]);
    let up = String::from_utf8_lossy(&perplexity(&s2, &["--kl-divergence", "--kl-divergence-base"]).stdout).into_owned();
    let base_file = d.join("base.kld");
    let stored = ["--base-logits", base_file.to_str().unwrap()];
    let (_, v) = eval(&d, &s1, &[&s2], &[&stored[..], &placement[..]].concat());
    assert_eq!(v["forward_passes"], 2);
    assert_matches_upstream(&v["models"][0], &up);
    let (out, again) = eval(&d, &s1, &[&s2], &[&stored[..], &["-ngl", "99", "--rpc", &server.endpoint, "-cmoe"][..]].concat());
    assert_eq!(again["forward_passes"], 1, "the same placement spelled -cmoe reuses the stored base");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("note: computed with"), "{}", String::from_utf8_lossy(&out.stderr));
    assert_matches_upstream(&again["models"][0], &up);
    let (out, _) = eval(&d, &s1, &[&s2], &[&stored[..], &placement[..4]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(r#"note: computed with tensor_overrides = ["\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"], this run has null"#), "{err}");
}

/// `eval --keep-map --drop-nextn` prunes as `prune --drop-nextn` does: select's map of the
/// glm4moe fixture (blocks 1–3, no entry for the nextn block 4) is refused without the flag,
/// before any pass, and evaluated with it; keeping every live expert, the trunk's logits are
/// the base's (top-1 agreement 100%, KLD only the rounding of the base's stored log-probs, as in
/// llama-perplexity's base file).
#[test]
fn eval_keep_map_with_drop_nextn() {
    let d = temp_dir("eval-drop-nextn");
    let base = d.join("glm.gguf");
    std::fs::copy(fixture("glm4moe"), &base).unwrap();
    run_ok(Command::new(ours()).arg("-m").arg(&base).arg("-f").arg(corpus()).args(["-c", "128", "--chunks", "4", "-t", "2", "--no-ppl", "-o"]).arg(d.join("imatrix.gguf")));
    run_ok(Command::new(ours()).args(["select", "--reap"]).arg(d.join("imatrix.reap.json")).args(["--method", "reap_mean", "--k", "28", "--out-dir"]).arg(d.join("keep")));
    let map = d.join("keep/keep_reap_mean_k28.json");
    let out = run(&mut eval_cmd(&d, &base, &["--keep-map", map.to_str().unwrap()]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--drop-nextn") && !err.contains("base: "), "{err}");
    let json = d.join("e.json");
    run_ok(&mut eval_cmd(&d, &base, &["--keep-map", map.to_str().unwrap(), "--drop-nextn", "--json", json.to_str().unwrap()]));
    let v: Value = serde_json::from_slice(&read(&json)).unwrap();
    let m = &v["models"][0];
    assert_eq!(m["top1_agree"].as_f64(), Some(1.0), "{m}");
    assert!(m["kld_mean"].as_f64().unwrap() < 1e-5 && m["kld_max"].as_f64().unwrap() < 1e-4, "{m}");
}

/// Qwen3.5-MoE's hybrid layout, several chunks per batch (so its gated delta net multiplies
/// 3-D inputs): with `-nr` (`--no-repack`, which eval takes as llama.cpp's tools do) every
/// figure is upstream llama-perplexity's `--kl-divergence` with `-nr`. Without it, on a CPU
/// with AMX, eval refuses before any figure, naming `-nr` (`amx_guard`); elsewhere it gives
/// the same figures.
#[test]
fn eval_of_a_hybrid_model_takes_no_repack_and_matches_upstream() {
    let d = temp_dir("eval-hybrid");
    let (base, other) = (seeded("qwen35moe", 1), seeded("qwen35moe", 2));
    let up_file = d.join("upstream.kld");
    let perplexity = |m: &Path, extra: &[&str]| {
        run_ok(Command::new(reference_bin("llama-perplexity")).arg("-m").arg(m).args(["-c", CTX, "-b", "2048", "-t", "2", "-nr"]).args(extra).arg(&up_file))
    };
    perplexity(&base, &["-f", corpus().to_str().unwrap(), "--chunks", CHUNKS, "--kl-divergence-base"]);
    let up = String::from_utf8_lossy(&perplexity(&other, &["--kl-divergence", "--kl-divergence-base"]).stdout).into_owned();
    let (_, v) = eval(&d, &base, &[&other], &["-nr"]);
    assert_matches_upstream(&v["models"][0], &up);
    let out = run(&mut eval_cmd(&d, &base, &["--model", other.to_str().unwrap()]));
    let err = String::from_utf8_lossy(&out.stderr);
    if cpu_has_amx() {
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("sits in ggml's AMX buffer") && err.contains("--no-repack (-nr)"), "{err}");
    } else {
        assert!(out.status.success(), "{err}");
        let (_, w) = eval(&d, &base, &[&other], &[]);
        assert_matches_upstream(&w["models"][0], &up);
    }
}
