//! `reap-imatrix select`: keep maps and the report, from synthetic saliency files and traces.

use super::util::*;
use reap_imatrix::formats::saliency::{LayerSums, Saliency};
use reap_imatrix::formats::trace::{RowData, TraceFile, TraceHeader, FLAG_NORMALISED};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const METHODS: &str = "frequency,reap_mean,reap_l2_sum,ean_sum,reap_shrink,reap_hybrid";

/// The audit's shape: heavy hitters with big outputs pull the count-weighted mean above most
/// experts' means; a few experts never fire; a few fire rarely.
fn skewed_layer(layer: u32, n: usize, dead: &[usize]) -> LayerSums {
    let mut l = LayerSums::new(layer, n, 2);
    for i in 0..n {
        let (count, mean) = if dead.contains(&i) {
            (0u64, 0.0)
        } else if i < 2 {
            (5000, 10.0)
        } else if i < 4 {
            (3, 1.2)
        } else {
            (200 + 13 * i as u64, 1.0 + 0.03 * i as f64)
        };
        l.count[i] = count;
        l.reap_l2_sum[i] = mean * count as f64;
        l.reap_l2_sq_sum[i] = count as f64 * mean * mean * 1.1;
        l.ean_sum[i] = 3.0 * mean * count as f64;
        l.prob_sum[i] = 0.3 * count as f64;
    }
    l.tokens = l.count.iter().sum::<u64>() / 2;
    l
}

fn write_saliency(dir: &Path, layers: Vec<LayerSums>, trace_rows: u64) -> PathBuf {
    let s =
        Saliency { tokens: layers[0].tokens, nonfinite_drops: 0, trace_tokens_written: trace_rows, metadata: Default::default(), layers, ..Default::default() };
    let p = dir.join("run.reap.json");
    s.write(&p).unwrap();
    p
}

fn json(p: &Path) -> Value {
    serde_json::from_slice(&read(p)).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn select(args: &[&str]) -> std::process::Output {
    run(Command::new(ours()).arg("select").args(args))
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn select_writes_nested_keep_maps_and_a_report() {
    let d = temp_dir("select-maps");
    let sal = write_saliency(&d, vec![skewed_layer(3, 24, &[7, 9]), skewed_layer(5, 24, &[11])], 0);
    let out_dir = d.join("maps");
    let out = run_ok(
        Command::new(ours()).args(["select", "--reap"]).arg(&sal).args(["--method", METHODS, "--k", "16,8,12", "--out-dir"]).arg(&out_dir),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("K = 8") && text.contains("K = 16") && text.contains("overlap at K = 12"), "{text}");
    assert!(text.contains("nested across K (8 ⊂ 12 ⊂ 16): reap_shrink yes"), "{text}");
    let sha = sha256_hex(&read(&sal));
    for m in METHODS.split(',') {
        for k in [8usize, 12, 16] {
            let v = json(&out_dir.join(format!("keep_{m}_k{k}.json")));
            assert_eq!(v["method"], m);
            assert_eq!(v["k"], k);
            assert!(v["parameters"].is_object());
            assert_eq!(v["source"]["sha256"], sha.as_str());
            let layers = v["layers"].as_array().unwrap();
            assert_eq!(layers.iter().map(|l| l["layer"].as_u64().unwrap()).collect::<Vec<_>>(), vec![3, 5]);
            for (l, dead) in layers.iter().zip([&[7u64, 9][..], &[11][..]]) {
                let keep: Vec<u64> = l["keep"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
                assert_eq!(keep.len(), k);
                assert!(keep.windows(2).all(|w| w[0] < w[1]), "{m} K={k}: not sorted ascending: {keep:?}");
                assert!(dead.iter().all(|d| !keep.contains(d)), "{m} K={k} keeps a dead expert: {keep:?}");
            }
        }
    }
    let r = json(&out_dir.join("select_report.json"));
    for m in METHODS.split(',') {
        assert_eq!(r["nested"][m]["nested"], true, "{m}");
    }
    let maps = r["maps"].as_array().unwrap();
    assert_eq!(maps.len(), 18);
    for m in maps {
        assert_eq!(m["dead_kept"], 0);
        let layers = m["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 2);
        let repl: Vec<f64> = layers.iter().map(|l| l["slot_replacement"].as_f64().unwrap()).collect();
        let mean = (repl[0] + repl[1]) / 2.0;
        assert!((m["slot_replacement_mean"].as_f64().unwrap() - mean).abs() < 1e-12);
        let worst = repl[0].max(repl[1]);
        assert_eq!(m["slot_replacement_worst"]["value"].as_f64().unwrap(), worst);
    }
    // frequency keeps the most-hit experts, so it has the smallest replacement at every K
    let repl = |m: &str, k: u64| maps.iter().find(|x| x["method"] == m && x["k"] == k).unwrap()["slot_replacement_mean"].as_f64().unwrap();
    for k in [8, 12, 16] {
        for m in METHODS.split(',') {
            assert!(repl("frequency", k) <= repl(m, k) + 1e-15, "{m} K={k}");
        }
    }
    assert!(r["overlap"].as_array().unwrap().iter().any(|o| o["a"] == "frequency" && o["b"] == "reap_l2_sum" && o["k"] == 8));
}

#[test]
fn shrink_with_median_or_lcb_prior_keeps_no_dead_expert_the_audit_scenario() {
    let d = temp_dir("select-shrink");
    // 32 experts, 4 dead, 2 heavy hitters, 2 rare: K = 20 and 26 leave live experts out
    let sal = write_saliency(&d, vec![skewed_layer(0, 32, &[20, 21, 22, 23]), skewed_layer(47, 32, &[31])], 0);
    for (prior, extra) in [("median", vec![]), ("lcb", vec!["--z", "1.5"]), ("median", vec!["--min-count", "10"])] {
        let out_dir = d.join(format!("{prior}{}", extra.len()));
        let mut args = vec!["--method", "reap_shrink,reap_hybrid", "--k", "20,26,30", "--prior", prior];
        args.extend(extra.iter().copied());
        run_ok(Command::new(ours()).args(["select", "--reap"]).arg(&sal).args(&args).arg("--out-dir").arg(&out_dir));
        let r = json(&out_dir.join("select_report.json"));
        for m in r["maps"].as_array().unwrap() {
            let k = m["k"].as_u64().unwrap();
            // layer 0 has 28 live experts: only K = 30 must take 2 dead ones
            let want = if k == 30 { 2 } else { 0 };
            assert_eq!(m["layers"][0]["dead_kept"], want, "{prior} {} K={k}", m["method"]);
            assert_eq!(m["layers"][1]["dead_kept"], 0, "{prior} {} K={k}", m["method"]);
        }
        let v = json(&out_dir.join("keep_reap_shrink_k20.json"));
        assert_eq!(v["parameters"]["prior"], prior);
    }
}

#[test]
fn select_refuses_bad_input_with_exit_2() {
    let d = temp_dir("select-bad");
    let sal = write_saliency(&d, vec![skewed_layer(0, 16, &[])], 0);
    let s = sal.to_str().unwrap();
    let out_dir = d.join("o");
    let o = out_dir.to_str().unwrap();
    let out = select(&["--reap", s, "--method", "frequency", "--k", "8,17", "--out-dir", o]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--k 17") && err.contains("16 experts") && err.contains("run.reap.json"), "{err}");
    let out = select(&["--reap", s, "--method", "frequency", "--k", "1", "--out-dir", o]);
    assert_eq!(out.status.code(), Some(2), "K below n_expert_used");
    let out = select(&["--reap", s, "--method", "nope", "--k", "8", "--out-dir", o]);
    assert_eq!(out.status.code(), Some(2));
    let missing = d.join("missing.json");
    let out = select(&["--reap", missing.to_str().unwrap(), "--method", "frequency", "--k", "8", "--out-dir", o]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.json"));
    std::fs::write(d.join("bad.json"), b"{\"format\": \"reap-saliency\"").unwrap();
    let out = select(&["--reap", d.join("bad.json").to_str().unwrap(), "--method", "frequency", "--k", "8", "--out-dir", o]);
    assert_eq!(out.status.code(), Some(2));
    // --domain-weights on a file without domains, or without reap_l2_sum among the methods
    for (method, want) in [("reap_l2_sum", "no per-domain sums"), ("frequency", "applies to --method reap_l2_sum")] {
        let out = select(&["--reap", s, "--method", method, "--k", "8", "--out-dir", o, "--domain-weights", "a=1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{method}: {err}");
        assert!(err.contains(want), "{method}: {err}");
    }
    // no refusal leaves an --out-dir behind
    assert!(!out_dir.exists());
}

#[test]
fn substitution_screen_counts_pruned_slots_and_lost_probability() {
    let d = temp_dir("select-screen");
    // 1 MoE layer (block 2), 8 experts, k = 2, top-N 3; counts make frequency keep {0,1,2,3} at K = 4
    let mut l = LayerSums::new(2, 8, 2);
    l.count = vec![80, 70, 60, 50, 5, 4, 3, 0];
    l.reap_l2_sum = l.count.iter().map(|&c| c as f64).collect();
    l.reap_l2_sq_sum = l.count.iter().map(|&c| c as f64 * 1.5).collect();
    l.tokens = 136;
    let sal = write_saliency(&d, vec![l], 4);
    let h = TraceHeader { layers: vec![2], n_expert: 8, k: 2, top_n: 3, n_tokens: 0, flags: FLAG_NORMALISED };
    let trace = d.join("run.trace");
    let layout = h.layout();
    let mut f = TraceFile::create(&trace, h).unwrap();
    let mut buf = Vec::new();
    // (sel, sel weights, cand, cand probs)
    type Row = ([u16; 2], [f32; 2], [u16; 3], [f32; 3]);
    let rows: [Row; 4] = [
        ([0, 1], [0.6, 0.4], [0, 1, 5], [0.5, 0.3, 0.1]),   // nothing pruned
        ([4, 0], [0.75, 0.25], [4, 0, 6], [0.6, 0.2, 0.1]), // 4 pruned: gate .75, prob .6; 1 survivor
        ([5, 6], [0.5, 0.5], [5, 6, 7], [0.4, 0.4, 0.1]),   // both pruned, and no survivor among the candidates
        ([2, 3], [0.5, 0.5], [2, 3, 0], [0.3, 0.3, 0.2]),   // nothing pruned
    ];
    for (t, (sel, w, cand, p)) in rows.iter().enumerate() {
        layout.encode(&RowData { chunk: 0, pos: t as u32, token: 0, phase: 0, sel_weight: w, cand_prob: p, sel_id: sel, cand_id: cand }, &mut buf);
    }
    f.append(&buf, 4).unwrap();
    let out_dir = d.join("o");
    let out = run_ok(
        Command::new(ours())
            .args(["select", "--reap"])
            .arg(&sal)
            .args(["--method", "frequency", "--k", "4", "--trace"])
            .arg(&trace)
            .arg("--out-dir")
            .arg(&out_dir),
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("slots pruned"));
    let keep = json(&out_dir.join("keep_frequency_k4.json"));
    assert_eq!(keep["layers"][0]["keep"], serde_json::json!([0, 1, 2, 3]));
    let r = json(&out_dir.join("select_report.json"));
    let s = &r["maps"][0]["screen"]["layers"][0];
    assert_eq!(s["slots"], 8);
    assert_eq!(s["pruned_slots"], 3);
    assert_eq!(s["tokens_with_pruned_pick"], 2);
    assert_eq!(s["tokens_short"], 2);
    assert!((s["slot_share_pruned"].as_f64().unwrap() - 3.0 / 8.0).abs() < 1e-12);
    assert!((s["gate_share_lost"].as_f64().unwrap() - 1.75 / 4.0).abs() < 1e-6);
    assert!((s["router_prob_lost"].as_f64().unwrap() - 1.4).abs() < 1e-6);
    assert!((s["router_prob_lost_per_token"].as_f64().unwrap() - 0.35).abs() < 1e-6);
    // a trace of another shape is refused
    let h2 = TraceHeader { layers: vec![3], n_expert: 8, k: 2, top_n: 3, n_tokens: 0, flags: FLAG_NORMALISED };
    let other = d.join("other.trace");
    TraceFile::create(&other, h2).unwrap();
    let out = run(Command::new(ours())
        .args(["select", "--reap"])
        .arg(&sal)
        .args(["--method", "frequency", "--k", "4", "--trace"])
        .arg(&other)
        .arg("--out-dir")
        .arg(&out_dir));
    assert_eq!(out.status.code(), Some(2));
    // the same layers and experts, but k = 3: another model's trace
    let h3 = TraceHeader { layers: vec![2], n_expert: 8, k: 3, top_n: 3, n_tokens: 0, flags: FLAG_NORMALISED };
    let other_k = d.join("other-k.trace");
    TraceFile::create(&other_k, h3).unwrap();
    let out = select_k4_with_trace(&sal, &other_k, &out_dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("8 experts per layer, k = 3; the saliency file has 8 experts, k = 2"), "{err}");
    // a damaged trace (an expert id past n_expert) is refused as replay refuses it, before any
    // file is written; a pick and a candidate past the end are each caught
    let h = TraceHeader { layers: vec![2], n_expert: 8, k: 2, top_n: 3, n_tokens: 0, flags: FLAG_NORMALISED };
    for (name, sel, cand) in [("bad-pick", [0u16, 9], [0u16, 9, 1]), ("bad-cand", [0, 1], [0, 1, 40])] {
        let bad = d.join(format!("{name}.trace"));
        let mut f = TraceFile::create(&bad, h.clone()).unwrap();
        let mut buf = Vec::new();
        for (t, (sel, cand)) in [([0u16, 1], [0u16, 1, 2]), (sel, cand)].iter().enumerate() {
            let rd = RowData { chunk: 0, pos: t as u32, token: 0, phase: 0, sel_weight: &[0.5, 0.5], cand_prob: &[0.5, 0.3, 0.1], sel_id: sel, cand_id: cand };
            layout.encode(&rd, &mut buf);
        }
        f.append(&buf, 2).unwrap();
        drop(f);
        let fresh = d.join(format!("o-{name}"));
        let out = select_k4_with_trace(&sal, &bad, &fresh);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        let id = if name == "bad-pick" { 9 } else { 40 };
        let want = format!("--trace {}: row 1, MoE layer slot 0: expert id {id} is not below n_expert 8 (damaged trace)", bad.display());
        assert!(err.contains(&want), "{name}: {err}");
        assert!(!fresh.exists(), "{name}");
    }
}

/// A saliency file with two domains: "en" routes to experts 0–3, "ja" to experts 4–7 (8 experts,
/// top-2). The report's per-domain slot shares are recomputed here; `--domain-weights` moves the
/// `reap_l2_sum` selection towards the upweighted domain.
#[test]
fn domains_in_the_report_and_domain_weights() {
    use reap_imatrix::formats::saliency::{DomainLayer, DomainSums};
    let d = temp_dir("select-domains");
    let n = 8;
    let en_count: Vec<u64> = vec![400, 300, 200, 100, 0, 0, 0, 0];
    let ja_count: Vec<u64> = vec![0, 0, 0, 0, 40, 30, 20, 10];
    let part = |count: &Vec<u64>| DomainLayer { layer: 0, count: count.clone(), prob_sum: count.iter().map(|&c| 0.5 * c as f64).collect(), reap_l2_sum: count.iter().map(|&c| 2.0 * c as f64).collect() };
    let mut l = LayerSums::new(0, n, 2);
    for e in 0..n {
        l.count[e] = en_count[e] + ja_count[e];
        l.prob_sum[e] = 0.5 * l.count[e] as f64;
        l.reap_l2_sum[e] = 2.0 * l.count[e] as f64;
        l.reap_l2_sq_sum[e] = 4.0 * l.count[e] as f64;
        l.ean_sum[e] = 3.0 * l.count[e] as f64;
    }
    l.tokens = 550;
    let s = Saliency {
        tokens: 550,
        layers: vec![l],
        domains: vec![
            DomainSums { name: "en".into(), tokens: 500, layers: vec![part(&en_count)] },
            DomainSums { name: "ja".into(), tokens: 50, layers: vec![part(&ja_count)] },
        ],
        ..Default::default()
    };
    let p = d.join("run.reap.json");
    s.write(&p).unwrap();
    let out_dir = d.join("maps");
    let out = select(&["--reap", p.to_str().unwrap(), "--method", "reap_l2_sum,frequency", "--k", "4", "--out-dir", out_dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    // keep = the 4 busiest = experts 0..3: en keeps all its slots, ja none
    assert!(text.contains("slots kept per domain: en 100.0%") && text.contains("ja 0.0%"), "{text}");
    let rep = json(&out_dir.join("select_report.json"));
    let m = &rep["maps"][0];
    assert_eq!(m["domains"][0]["name"], "en");
    assert_eq!(m["domains"][0]["slots_kept"].as_f64(), Some(1.0));
    assert_eq!(m["domains"][1]["slots_kept"].as_f64(), Some(0.0));
    assert_eq!(m["domains"][1]["slot_replacement"].as_f64(), Some(1.0));

    // ja weighted 20×: scores are en 2c for experts 0–3 (800, 600, 400, 200) and 20·2c for
    // experts 4–7 (1600, 1200, 800, 400) → the top 4 are experts 4, 5, 0 and 6
    let out = select(&["--reap", p.to_str().unwrap(), "--method", "reap_l2_sum", "--k", "4", "--out-dir", out_dir.to_str().unwrap(), "--domain-weights", "ja=20"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let map = json(&out_dir.join("keep_reap_l2_sum_k4.json"));
    let keep: Vec<u64> = map["layers"][0].as_object().map_or_else(|| map["layers"][0].clone(), |o| o["keep"].clone()).as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(keep, [0, 4, 5, 6]);
    assert_eq!(map["parameters"]["domain_weights"]["ja"].as_f64(), Some(20.0));
    assert_eq!(map["parameters"]["domain_weights"]["en"].as_f64(), Some(1.0));
    // a name not in the file
    let out = select(&["--reap", p.to_str().unwrap(), "--method", "reap_l2_sum", "--k", "4", "--out-dir", out_dir.to_str().unwrap(), "--domain-weights", "fr=2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no domain fr"));
}

/// reap_shrink's median prior μ and pseudo-count m, per layer, in the keep map's parameters and
/// the report (μ is null in the report under --prior lcb, which has no prior).
#[test]
fn shrink_prior_and_m_are_recorded_per_layer() {
    let d = temp_dir("select-prior");
    let layers = vec![skewed_layer(0, 16, &[3]), skewed_layer(4, 16, &[])];
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
    };
    let want_mu: Vec<f64> =
        layers.iter().map(|l| median((0..16).filter(|&i| l.count[i] > 0).map(|i| l.reap_l2_sum[i] / l.count[i] as f64).collect())).collect();
    let want_m: Vec<f64> = layers.iter().map(|l| median(l.count.iter().filter(|&&c| c > 0).map(|&c| c as f64).collect())).collect();
    let sal = write_saliency(&d, layers, 0);
    let out_dir = d.join("median");
    run_ok(Command::new(ours()).args(["select", "--reap"]).arg(&sal).args(["--method", "reap_shrink,reap_hybrid", "--k", "8", "--out-dir"]).arg(&out_dir));
    let nums = |v: &Value| -> Vec<f64> { v.as_array().unwrap_or_else(|| panic!("{v}")).iter().map(|x| x.as_f64().unwrap()).collect() };
    for m in ["reap_shrink", "reap_hybrid"] {
        let p = &json(&out_dir.join(format!("keep_{m}_k8.json")))["parameters"];
        assert_eq!(nums(&p["shrink_prior_per_layer"]), want_mu, "{m}");
        assert_eq!(nums(&p["shrink_m_per_layer"]), want_m, "{m}");
    }
    let r = json(&out_dir.join("select_report.json"));
    let per_layer = |key: &str| -> Vec<Value> { r["layers"].as_array().unwrap().iter().map(|l| l[key].clone()).collect() };
    assert_eq!(nums(&Value::Array(per_layer("shrink_prior"))), want_mu);
    assert_eq!(nums(&Value::Array(per_layer("shrink_m"))), want_m);
    let out_dir = d.join("lcb");
    run_ok(Command::new(ours()).args(["select", "--reap"]).arg(&sal).args(["--method", "reap_shrink", "--k", "8", "--prior", "lcb", "--out-dir"]).arg(&out_dir));
    let r = json(&out_dir.join("select_report.json"));
    assert!(r["layers"].as_array().unwrap().iter().all(|l| l["shrink_prior"].is_null()), "{}", r["layers"]);
}

/// `select | head`: the reader goes away before the report is printed; the files are written
/// and select exits 0, without a panic.
#[test]
fn report_into_a_closed_pipe_exits_quietly() {
    let d = temp_dir("select-pipe");
    let sal = write_saliency(&d, vec![skewed_layer(0, 24, &[5]), skewed_layer(1, 24, &[])], 0);
    let out_dir = d.join("o");
    run_ok_into_closed_pipe(Command::new(ours()).args(["select", "--reap"]).arg(&sal).args(["--method", METHODS, "--k", "8,12,16", "--per-layer", "--out-dir"]).arg(&out_dir));
    assert!(out_dir.join("select_report.json").is_file());
}

/// A prior flag that changes nothing is said: `--z` without `--prior lcb`, `--shrink-m` with it,
/// and any of them when no method uses a prior. The maps are those without the flag.
#[test]
fn prior_flags_that_change_nothing_are_warned_about() {
    let d = temp_dir("select-unused-flags");
    let sal = write_saliency(&d, vec![skewed_layer(0, 24, &[5]), skewed_layer(1, 24, &[])], 0);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let run_with = |out: &str, extra: &[&str]| {
        let o = d.join(out);
        let mut args = vec!["--reap".to_string(), s(&sal), "--k".into(), "8".into(), "--out-dir".into(), s(&o)];
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = select(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8_lossy(&out.stderr).into_owned(), o)
    };
    let (quiet, plain) = run_with("plain", &["--method", "reap_shrink"]);
    assert!(!quiet.contains("no effect"), "{quiet}");
    for (name, extra, needle) in [
        ("z", &["--method", "reap_shrink", "--z", "2"][..], "--z is the lower confidence bound's"),
        ("m", &["--method", "reap_shrink", "--prior", "lcb", "--shrink-m", "3"][..], "--shrink-m is the median prior's"),
        ("none", &["--method", "frequency", "--prior", "lcb"][..], "neither is among the methods"),
    ] {
        let (err, dir) = run_with(name, extra);
        assert!(err.contains(needle) && err.contains("it has no effect here"), "{name}: {err}");
        if name == "z" {
            assert_eq!(read(&dir.join("keep_reap_shrink_k8.json")), read(&plain.join("keep_reap_shrink_k8.json")));
        }
    }
}

/// `select --method frequency --k 4` with a `--trace`.
fn select_k4_with_trace(sal: &Path, trace: &Path, out_dir: &Path) -> std::process::Output {
    run(Command::new(ours()).args(["select", "--reap"]).arg(sal).args(["--method", "frequency", "--k", "4", "--trace"]).arg(trace).arg("--out-dir").arg(out_dir))
}
