//! `reap-imatrix replay` through the command line: synthetic traces with known answers.

use super::util::*;
use reap_imatrix::formats::saliency::{LayerSums, Saliency};
use reap_imatrix::formats::trace::{RowData, TraceFile, TraceHeader, FLAG_NORMALISED};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Writes a trace: `rows[t][li]` = (picks, candidates); probabilities fall with the rank.
fn write_trace(path: &Path, blocks: &[u32], n_expert: u32, k: u32, top_n: u32, rows: &[Vec<(Vec<u16>, Vec<u16>)>]) {
    let h = TraceHeader { layers: blocks.to_vec(), n_expert, k, top_n, n_tokens: 0, flags: FLAG_NORMALISED };
    let layout = h.layout();
    let mut f = TraceFile::create(path, h).unwrap();
    let mut buf = Vec::new();
    for (t, row) in rows.iter().enumerate() {
        let sel: Vec<u16> = row.iter().flat_map(|(s, _)| s.iter().copied()).collect();
        let cand: Vec<u16> = row.iter().flat_map(|(_, c)| c.iter().copied()).collect();
        let w = vec![1.0 / k as f32; sel.len()];
        let p: Vec<f32> = (0..cand.len()).map(|i| 1.0 / (2 + i % top_n as usize) as f32).collect();
        layout.encode(
            &RowData { chunk: 0, pos: t as u32, token: t as i32, phase: 0, sel_weight: &w, cand_prob: &p, sel_id: &sel, cand_id: &cand },
            &mut buf,
        );
    }
    f.append(&buf, rows.len() as u64).unwrap();
}

/// k = 1, top-N 1, the same cyclic sequence in every layer.
fn cyclic(path: &Path, blocks: &[u32], c: usize, len: usize) {
    let rows: Vec<Vec<(Vec<u16>, Vec<u16>)>> = (0..len)
        .map(|t| {
            let e = (t % (c + 1)) as u16;
            blocks.iter().map(|_| (vec![e], vec![e])).collect()
        })
        .collect();
    write_trace(path, blocks, c as u32 + 1, 1, 1, &rows);
}

fn replay(args: &[&str]) -> Output {
    run(Command::new(ours()).arg("replay").args(args))
}

fn json(p: &Path) -> Value {
    serde_json::from_slice(&read(p)).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn result<'a>(v: &'a Value, policy: &str, capacity: &str) -> &'a Value {
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["policy"] == policy && r["capacity"] == capacity)
        .unwrap_or_else(|| panic!("no {policy}@{capacity}"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn cyclic_trace_lru_misses_everything_belady_closed_form_in_one_pass() {
    let d = temp_dir("replay-cyclic");
    let (trace, out) = (d.join("cyc.trace"), d.join("r.json"));
    let (c, len) = (4usize, 203usize);
    cyclic(&trace, &[1, 4], c, len);
    let o =
        replay(&["--trace", s(&trace), "--policy", "lru,lfu,ema,near-pick-ema,inverse-router-ema", "--capacity", "4,5", "--json", s(&out)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("belady") && text.contains("per-layer miss rate"), "{text}");
    let v = json(&out);
    let lru = result(&v, "lru", "4");
    assert_eq!(lru["total"]["accesses"], 2 * len as u64);
    assert_eq!(lru["total"]["misses"], 2 * len as u64);
    assert_eq!(lru["total"]["miss_rate"], 1.0);
    let belady = (c + (len - c).div_ceil(c)) as u64;
    let b = result(&v, "belady", "4");
    assert_eq!(b["total"]["misses"], 2 * belady);
    for l in b["layers"].as_array().unwrap() {
        assert_eq!(l["misses"], belady);
        assert_eq!(l["forced_misses"], 0);
    }
    assert_eq!(b["layers"][1]["layer"], 4);
    assert!((lru["belady_miss_rate"].as_f64().unwrap() - belady as f64 / len as f64).abs() < 1e-12);
    // capacity C + 1 holds the whole cycle: cold misses only, for every policy
    for p in ["lru", "lfu", "ema", "near-pick-ema", "inverse-router-ema", "belady"] {
        assert_eq!(result(&v, p, "5")["total"]["misses"], 2 * (c as u64 + 1), "{p}");
        assert!(result(&v, p, "4")["total"]["misses"].as_u64().unwrap() >= 2 * belady, "{p} beats Belady");
    }
    // --no-belady drops the bound
    let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "4", "--no-belady", "--json", s(&out)]);
    assert!(o.status.success());
    assert_eq!(json(&out)["results"].as_array().unwrap().len(), 1);
}

#[test]
fn header_with_zero_tokens_replays_the_rows_present_with_a_warning() {
    let d = temp_dir("replay-header0");
    let (trace, out) = (d.join("t.trace"), d.join("r.json"));
    cyclic(&trace, &[0], 2, 10);
    let mut b = read(&trace);
    b[32..40].copy_from_slice(&0u64.to_le_bytes());
    std::fs::write(&trace, &b).unwrap();
    let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "2", "--json", s(&out)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("header says 0 tokens") && err.contains("10 complete rows"), "{err}");
    let v = json(&out);
    assert_eq!(v["trace"]["header_count_missing"], true);
    assert_eq!(result(&v, "lru", "2")["total"]["accesses"], 10);
    assert!(v["warnings"].as_array().unwrap().iter().any(|w| w.as_str().unwrap().contains("0 tokens")));
}

#[test]
fn token_ranges_replay_a_slice_and_bad_ranges_are_usage_errors() {
    let d = temp_dir("replay-range");
    let (trace, out) = (d.join("t.trace"), d.join("r.json"));
    // 0 1 2 3 0 1 2 3 0 1
    cyclic(&trace, &[0], 3, 10);
    let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "4", "--tokens", "4..10", "--json", s(&out)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&out);
    assert_eq!(v["tokens"], serde_json::json!([4, 10]));
    let r = result(&v, "lru", "4");
    assert_eq!((r["total"]["accesses"].as_u64(), r["total"]["misses"].as_u64()), (Some(6), Some(4)));
    for bad in ["4..11", "5..5", "x"] {
        let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "4", "--tokens", bad]);
        assert_eq!(o.status.code(), Some(2), "--tokens {bad}");
    }
}

#[test]
fn keep_map_forced_misses_and_the_in_sample_note() {
    let d = temp_dir("replay-keep");
    // 1 layer (block 0), 6 experts, k = 2, top-N 3. Saliency of the run's first 4 tokens.
    let rows: Vec<Vec<(Vec<u16>, Vec<u16>)>> =
        [[0u16, 1, 2], [4, 5, 0], [1, 0, 3], [5, 4, 3], [0, 1, 5], [2, 4, 5]].iter().map(|c| vec![(c[..2].to_vec(), c.to_vec())]).collect();
    let trace = d.join("t.trace");
    write_trace(&trace, &[0], 6, 2, 3, &rows);
    let mut l = LayerSums::new(0, 6, 2);
    l.count = vec![9, 8, 7, 6, 1, 0];
    l.reap_l2_sum = l.count.iter().map(|&c| c as f64).collect();
    l.reap_l2_sq_sum = l.count.iter().map(|&c| c as f64).collect();
    l.tokens = 4;
    let sal_path = d.join("run.reap.json");
    Saliency { tokens: 4, nonfinite_drops: 0, trace_tokens_written: 4, metadata: Default::default(), layers: vec![l], ..Default::default() }
        .write(&sal_path)
        .unwrap();
    let maps = d.join("maps");
    run_ok(
        Command::new(ours()).args(["select", "--reap"]).arg(&sal_path).args(["--method", "frequency", "--k", "4", "--out-dir"]).arg(&maps),
    );
    let map = maps.join("keep_frequency_k4.json");
    // keeps {0,1,2,3}: re-routed picks per token: [0,1] [0]+1 forced [1,0] [3]+1 forced [0,1] [2]+1 forced
    let out = d.join("r.json");
    let o = replay(&[
        "--trace",
        s(&trace),
        "--policy",
        "lru",
        "--capacity",
        "2",
        "--keep-map",
        s(&map),
        "--reap",
        s(&sal_path),
        "--json",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("IN-SAMPLE") && err.contains("confirmed"), "{err}");
    let v = json(&out);
    assert_eq!(v["keep_map"]["tokens_short"], 3);
    assert_eq!(v["keep_map"]["forced_misses"], 3);
    assert_eq!(v["validity"]["same_run"], "confirmed");
    assert_eq!(v["validity"]["in_sample_rows"], 4);
    assert_eq!(v["validity"]["in_sample"], true);
    for p in ["lru", "belady"] {
        let r = result(&v, p, "2");
        // 12 slots: 9 fetched + 3 forced. C = 2 over 0 1 | 0 | 1 0 | 3 | 0 1 | 2: misses at
        // 0 1 (cold), 3, then t4 needs both 0 and 1 of which one was evicted, then 2 → 5 (+3)
        assert_eq!(r["total"]["accesses"], 12, "{p}");
        assert_eq!(r["total"]["forced_misses"], 3, "{p}");
        assert_eq!(r["total"]["misses"], 8, "{p}");
    }
    // rows past the fitted tokens are out-of-sample
    let o = replay(&[
        "--trace",
        s(&trace),
        "--policy",
        "lru",
        "--capacity",
        "2",
        "--keep-map",
        s(&map),
        "--reap",
        s(&sal_path),
        "--tokens",
        "4..",
        "--json",
        s(&out),
    ]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("out-of-sample"));
    assert_eq!(json(&out)["validity"]["in_sample"], false);
    // without --reap: the trace has 6 rows, the source run traced 4, so the run is not assumed
    let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "2", "--keep-map", s(&map), "--json", s(&out)]);
    assert!(o.status.success());
    assert_eq!(json(&out)["validity"]["same_run"], "unknown");
    // with --reap of the source but a trace shorter than the 4 rows that run had traced: not
    // that run's trace, so not confirmed, and the note does not call the replay in-sample
    let short = d.join("short.trace");
    write_trace(&short, &[0], 6, 2, 3, &rows[..3]);
    let o = replay(&[
        "--trace", s(&short), "--policy", "lru", "--capacity", "2", "--keep-map", s(&map), "--reap", s(&sal_path), "--json", s(&out),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("IN-SAMPLE if this trace is of that run") && err.contains("traced 4 rows and this trace holds 3"), "{err}");
    assert_eq!(json(&out)["validity"]["same_run"], "unknown");
    // a map recording another model's expert count is refused, naming the map
    let mut other: serde_json::Value = json(&map);
    other["model"] = serde_json::json!({"path": "other.gguf", "sha256": null, "expert_count": 16});
    let other_path = d.join("other-model.json");
    std::fs::write(&other_path, other.to_string()).unwrap();
    let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "2", "--keep-map", s(&other_path)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("other-model.json") && err.contains("16 experts per layer; the trace has 6"), "{err}");
    // a --json that cannot be written is refused before the replay
    let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "2", "--json", s(&d.join("no-such-dir/r.json"))]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--json") && err.contains("does not exist"), "{err}");
    // a keep map for another layer layout is refused
    let bad = d.join("bad.json");
    std::fs::write(&bad, r#"{"method": "x", "k": 2, "layers": [{"layer": 3, "keep": [0, 1]}]}"#).unwrap();
    let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "2", "--keep-map", s(&bad)]);
    assert_eq!(o.status.code(), Some(2));
}

/// A saliency JSON of `tokens` tokens (all of them traced), one entry per block; with
/// `trace_top_n` it records the run's `--trace-top-n` as a calibration does.
fn write_saliency(path: &Path, blocks: &[u32], n_expert: usize, k: usize, tokens: u64, trace_top_n: Option<u64>) {
    let layers = blocks
        .iter()
        .map(|&b| {
            let mut l = LayerSums::new(b, n_expert, k);
            l.count = (0..n_expert as u64).map(|e| n_expert as u64 - e).collect();
            l.reap_l2_sum = l.count.iter().map(|&c| c as f64).collect();
            l.reap_l2_sq_sum = l.reap_l2_sum.clone();
            l.tokens = tokens;
            l
        })
        .collect();
    let mut metadata = serde_json::Map::new();
    if let Some(n) = trace_top_n {
        metadata.insert("run".into(), serde_json::json!({"trace_top_n": n}));
    }
    Saliency { tokens, nonfinite_drops: 0, trace_tokens_written: tokens, metadata, layers, ..Default::default() }.write(path).unwrap();
}

/// `--reap` is read as a saliency JSON of the trace's model: another file, or one of another
/// layout, is refused; and a run that traced another top-N did not write this trace.
#[test]
fn reap_is_checked_against_the_trace() {
    let d = temp_dir("replay-reap-check");
    // block 0, 6 experts, k = 2, top-N 3, 4 rows
    let rows: Vec<Vec<(Vec<u16>, Vec<u16>)>> =
        [[0u16, 1, 2], [4, 5, 0], [1, 0, 3], [5, 4, 3]].iter().map(|c| vec![(c[..2].to_vec(), c.to_vec())]).collect();
    let trace = d.join("t.trace");
    write_trace(&trace, &[0], 6, 2, 3, &rows);
    // a keep map fitted on `sal` (its source sha256), replayed with --reap `reap`
    let replay_with = |name: &str, sal: &Path, reap: &Path| {
        let maps = d.join(format!("maps-{name}"));
        run_ok(Command::new(ours()).args(["select", "--reap"]).arg(sal).args(["--method", "frequency", "--k", "4", "--out-dir"]).arg(&maps));
        let out = d.join(format!("{name}.json"));
        let _ = std::fs::remove_file(&out);
        let map = maps.join("keep_frequency_k4.json");
        let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "2", "--keep-map", s(&map), "--reap", s(reap), "--json", s(&out)]);
        (o, out)
    };
    let good = d.join("good.reap.json");
    write_saliency(&good, &[0], 6, 2, 4, Some(3));
    let (o, out) = replay_with("good", &good, &good);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(json(&out)["validity"]["same_run"], "confirmed");

    // refused, naming the file, and nothing written
    for (name, layers, ne, k, want) in [
        ("two-layers", &[0u32, 1][..], 6, 2, "its MoE layers [0, 1] are not the trace's [0]"),
        ("other-experts", &[0], 8, 2, "8 experts, k = 2 in layer 0; the trace has 6 experts per layer, k = 2"),
        ("other-k", &[0], 6, 3, "6 experts, k = 3 in layer 0; the trace has 6 experts per layer, k = 2"),
    ] {
        let bad = d.join(format!("{name}.reap.json"));
        write_saliency(&bad, layers, ne, k, 4, Some(3));
        let (o, out) = replay_with(name, &good, &bad);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains(&format!("--reap {}: {want}", bad.display())), "{name}: {err}");
        assert!(!out.exists(), "{name}");
    }
    let (o, out) = replay_with("trace", &good, &trace);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("--reap {}: not a saliency JSON", trace.display())), "{err}");
    assert!(!out.exists());

    // the map's source, but its run traced the top-2: not this trace's run
    let top2 = d.join("top2.reap.json");
    write_saliency(&top2, &[0], 6, 2, 4, Some(2));
    let (o, out) = replay_with("top2", &top2, &top2);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("traced the top-2 candidates and this trace holds the top-3"), "{err}");
    assert_eq!(json(&out)["validity"]["same_run"], "unknown");

    // a run asked for more candidates than there are experts traces them all: still its trace
    let all = d.join("all.trace");
    let wide: Vec<Vec<(Vec<u16>, Vec<u16>)>> = rows
        .iter()
        .map(|r| r.iter().map(|(s, _)| (s.clone(), s.iter().copied().chain((0..6).filter(|e| !s.contains(e))).collect())).collect())
        .collect();
    write_trace(&all, &[0], 6, 2, 6, &wide);
    let top64 = d.join("top64.reap.json");
    write_saliency(&top64, &[0], 6, 2, 4, Some(64));
    let maps = d.join("maps-top64");
    run_ok(Command::new(ours()).args(["select", "--reap"]).arg(&top64).args(["--method", "frequency", "--k", "4", "--out-dir"]).arg(&maps));
    let out = d.join("top64.json");
    let map = maps.join("keep_frequency_k4.json");
    let o = replay(&["--trace", s(&all), "--policy", "lru", "--capacity", "2", "--keep-map", s(&map), "--reap", s(&top64), "--json", s(&out)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(json(&out)["validity"]["same_run"], "confirmed");
}

#[test]
fn capacity_in_mib_uses_the_models_expert_bytes() {
    let d = temp_dir("replay-mib");
    let model = fixture("qwen3moe"); // 4 blocks, 32 experts of 3 × 64 × 32 f16 = 12288 bytes
    let trace = d.join("t.trace");
    let rows: Vec<Vec<(Vec<u16>, Vec<u16>)>> = (0..40u16)
        .map(|t| {
            (0..4)
                .map(|l| (vec![(t + l) % 32, (t * 7 + l + 1) % 32], vec![(t + l) % 32, (t * 7 + l + 1) % 32]))
                .filter(|(s, _)| s[0] != s[1])
                .collect()
        })
        .collect();
    let rows: Vec<_> = rows.into_iter().filter(|r| r.len() == 4).collect();
    write_trace(&trace, &[0, 1, 2, 3], 32, 2, 2, &rows);
    let out = d.join("r.json");
    // 0.1875 MiB = 196608 bytes = 16 experts
    let o = replay(&[
        "--trace",
        s(&trace),
        "--policy",
        "lru",
        "--capacity-mib",
        "0.1875",
        "--capacity",
        "8",
        "--model",
        s(&model),
        "--json",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&out);
    assert_eq!(v["expert_bytes"], serde_json::json!([12288, 12288, 12288, 12288]));
    assert_eq!(result(&v, "lru", "0.1875MiB")["capacity_per_layer"], serde_json::json!([16, 16, 16, 16]));
    assert_eq!(result(&v, "lru", "8")["capacity_per_layer"], serde_json::json!([8, 8, 8, 8]));
    // without --model, or too small for k experts: usage errors
    let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity-mib", "1"]);
    assert_eq!(o.status.code(), Some(2));
    let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity-mib", "0.01", "--model", s(&model)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("below k = 2"));
}

#[test]
fn replay_usage_errors_exit_2() {
    let d = temp_dir("replay-usage");
    let trace = d.join("t.trace");
    cyclic(&trace, &[0], 2, 5);
    let missing: PathBuf = d.join("missing.trace");
    for args in [
        vec!["--trace", s(&missing), "--policy", "lru", "--capacity", "2"],
        vec!["--trace", s(&trace), "--policy", "lru"],
        vec!["--trace", s(&trace), "--policy", "fifo", "--capacity", "2"],
        vec!["--trace", s(&trace), "--policy", "lru", "--capacity", "0"],
        vec!["--trace", s(&trace), "--policy", "ema", "--capacity", "2", "--ema-decay", "1.5"],
    ] {
        let o = replay(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    // --reap without --keep-map, --model without --capacity-mib: each would be ignored
    for (flag, needs) in [("--reap", "--keep-map"), ("--model", "--capacity-mib")] {
        let o = replay(&["--trace", s(&trace), "--policy", "lru", "--capacity", "2", flag, s(&missing)]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flag}: {err}");
        assert!(err.contains(&format!("{flag} {}: needs {needs}", missing.display())), "{flag}: {err}");
    }
    // a damaged trace naming an expert past n_expert is refused, not indexed
    let bad = d.join("bad.trace");
    write_trace(&bad, &[0], 4, 1, 1, &[vec![(vec![1], vec![1])], vec![(vec![7], vec![7])]]);
    for p in ["lru", "belady"] {
        let o = replay(&["--trace", s(&bad), "--policy", p, "--capacity", "2"]);
        assert_eq!(o.status.code(), Some(2), "{p}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("row 1"), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

/// `replay | head`: the reader goes away before the report is printed; replay still writes its
/// JSON and exits 0, without a panic.
#[test]
fn report_into_a_closed_pipe_exits_quietly() {
    let d = temp_dir("replay-pipe");
    let (trace, out) = (d.join("t.trace"), d.join("r.json"));
    cyclic(&trace, &[0, 1], 4, 200);
    run_ok_into_closed_pipe(Command::new(ours()).args(["replay", "--trace", s(&trace), "--policy", "lru,lfu", "--capacity", "2,3,4", "--json", s(&out)]));
    assert_eq!(json(&out)["format"], "reap-replay");
}
