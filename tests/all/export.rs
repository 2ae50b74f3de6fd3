//! The REAP reference's terms (CONTRACT §6) on real calibration runs of every fixture arch:
//! `export --format cerebras-reap` against the saliency JSON it came from, `scripts/to-reap-pt`
//! (with a stand-in torch where PyTorch is missing), `select`'s softmax methods, `check` on
//! tampered reference statistics, and bad inputs.

use super::util::*;
use reap_imatrix::formats::saliency::Saliency;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A small calibration run; returns the saliency JSON's path.
fn calibrated(dir: &Path, arch: &str) -> PathBuf {
    run_ok(Command::new(ours()).current_dir(dir).arg("-m").arg(fixture(arch)).arg("-f").arg(corpus()).args([
        "-t", "2", "--no-ppl", "-c", "128", "-b", "128", "--chunks", "3", "-o", "i.gguf",
    ]));
    dir.join("i.reap.json")
}

fn export(dir: &Path, args: &[&str]) -> std::process::Output {
    run(Command::new(ours()).current_dir(dir).arg("export").args(args))
}

fn json(p: &Path) -> Value {
    serde_json::from_slice(&read(p)).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// Every value of an export against the saliency file: which sums it took, and what it derived.
fn assert_export_matches(arch: &str, s: &Saliency, v: &Value, renormalized: bool) {
    assert_eq!(v["format"], "cerebras-reap");
    let layers = v["layers"].as_object().unwrap();
    assert_eq!(layers.keys().cloned().collect::<Vec<_>>(), s.layers.iter().map(|l| l.layer.to_string()).collect::<Vec<_>>());
    for l in &s.layers {
        let x = &layers[&l.layer.to_string()];
        let r = l.reference.as_ref().unwrap();
        let what = format!("{arch} layer {} renormalize {renormalized}", l.layer);
        assert_eq!(x["total_tokens"].as_u64(), Some(l.tokens), "{what}");
        let freq: Vec<u64> = x["expert_frequency"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect();
        assert_eq!(freq, l.count, "{what}");
        assert_eq!(floats(&x["ean_sum"]), l.ean_sum, "{what}");
        let (weighted, freq_sum) = if renormalized { (&l.reap_l2_sum, &l.prob_sum) } else { (&r.reap_softmax_l2_sum, &l.router_prob_sum) };
        assert_eq!(&floats(&x["weighted_ean_sum"]), weighted, "{what}");
        assert_eq!(&floats(&x["weighted_expert_frequency_sum"]), freq_sum, "{what}");
        let reap = floats(&x["reap"]);
        let max_act = floats(&x["max_activations"]);
        for e in 0..l.n_expert {
            // and back: reap × frequency gives the weighted sum again
            if l.count[e] == 0 {
                assert_eq!((reap[e], max_act[e]), (0.0, 0.0), "{what} dead expert {e}");
            } else {
                assert_eq!(reap[e], weighted[e] / l.count[e] as f64, "{what} expert {e}");
                assert!((reap[e] * l.count[e] as f64 - weighted[e]).abs() <= 1e-12 * weighted[e], "{what} expert {e}");
                // the reference's running maximum starts at 0
                assert_eq!(max_act[e], r.max_activation[e].unwrap().max(0.0), "{what} expert {e}");
            }
        }
    }
}

#[test]
fn export_gives_the_saliency_sums_in_the_reference_terms_on_every_fixture_arch() {
    for arch in ["qwen3moe", "qwen2moe", "gpt-oss", "qwen35moe"] {
        let d = temp_dir(&format!("export-{arch}"));
        let sal = calibrated(&d, arch);
        let s = Saliency::read(&sal).unwrap();
        run_ok(Command::new(ours()).current_dir(&d).args(["export", "--reap", "i.reap.json", "--format", "cerebras-reap", "-o", "p.json"]));
        let out = run_ok(Command::new(ours()).current_dir(&d).args([
            "export", "--reap", "i.reap.json", "--format", "cerebras-reap", "--renormalize", "-o", "g.json",
        ]));
        let (p, g) = (json(&d.join("p.json")), json(&d.join("g.json")));
        assert_eq!(p["renormalize_router_weights"], false);
        assert_export_matches(arch, &s, &p, false);
        assert_export_matches(arch, &s, &g, true);
        if arch != "qwen2moe" {
            // top-k-normalised gates (gpt-oss: the softmax over the picks' logits, the same
            // number): the flag takes effect and the weighted sums move
            assert_eq!(g["renormalize_router_weights"], true);
            assert_ne!(p["layers"], g["layers"]);
        } else {
            // no normalisation: as in the reference, the flag changes nothing, and says so
            assert_eq!(g["renormalize_router_weights"], false);
            assert_eq!(p, g);
            assert!(String::from_utf8_lossy(&out.stderr).contains("changes nothing"), "{}", String::from_utf8_lossy(&out.stderr));
        }
    }
}

/// The .pt content as the stand-in torch describes it: {block: {key: (dtype, shape, values)}}.
type PtLayer = std::collections::BTreeMap<String, (String, Vec<u64>, Vec<f64>)>;

fn decode_fake_pt(p: &Path) -> Vec<(u64, PtLayer)> {
    let v = json(p);
    let mut out = Vec::new();
    for entry in v["dict"].as_array().unwrap() {
        assert_eq!(entry[0], "int", "layer keys are ints, as the reference's observer has them");
        let mut layer = PtLayer::new();
        for kv in entry[2]["dict"].as_array().unwrap() {
            let t = &kv[2]["tensor"];
            let shape: Vec<u64> = t["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            let data: Vec<f64> = t["data"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            layer.insert(kv[1].as_str().unwrap().to_string(), (t["dtype"].as_str().unwrap().to_string(), shape, data));
        }
        out.push((entry[1].as_u64().unwrap(), layer));
    }
    out
}

fn torch_installed() -> bool {
    Command::new("python3").args(["-c", "import torch"]).output().map(|o| o.status.success()).unwrap_or(false)
}

#[test]
fn to_reap_pt_writes_the_reference_observer_state() {
    let d = temp_dir("export-pt");
    calibrated(&d, "qwen3moe");
    run_ok(Command::new(ours()).current_dir(&d).args(["export", "--reap", "i.reap.json", "--format", "cerebras-reap", "-o", "p.json"]));
    let ex = json(&d.join("p.json"));
    let script = repo().join("scripts/to-reap-pt");
    let fake = repo().join("tests/fake_torch");
    run_ok(Command::new("python3").current_dir(&d).env("PYTHONPATH", &fake).arg(&script).args(["p.json", "state.pt"]));
    let pt = decode_fake_pt(&d.join("state.pt"));
    let blocks: Vec<u64> = ex["layers"].as_object().unwrap().keys().map(|k| k.parse().unwrap()).collect();
    assert_eq!(pt.iter().map(|(b, _)| *b).collect::<Vec<_>>(), blocks);
    let f32_of = |x: f64| x as f32 as f64;
    for (block, layer) in &pt {
        let x = &ex["layers"][block.to_string()];
        let freq = floats(&x["expert_frequency"]);
        let n = freq.len() as u64;
        let want: [(&str, &str, Vec<u64>); 9] = [
            ("total_tokens", "int64", vec![]),
            ("expert_frequency", "int64", vec![n]),
            ("pairwise_expert_frequency", "int64", vec![n, n]),
            ("ean_sum", "float64", vec![n]),
            ("weighted_ean_sum", "float64", vec![n]),
            ("weighted_expert_frequency_sum", "float64", vec![n]),
            ("ean_mean", "float32", vec![n]),
            ("reap", "float32", vec![n]),
            ("max_activations", "float32", vec![n]),
        ];
        assert_eq!(layer.keys().cloned().collect::<std::collections::BTreeSet<_>>(), want.iter().map(|w| w.0.to_string()).collect());
        for (k, dtype, shape) in &want {
            assert_eq!((&layer[*k].0, &layer[*k].1), (&dtype.to_string(), shape), "layer {block} {k}");
        }
        assert_eq!(layer["total_tokens"].2, vec![x["total_tokens"].as_f64().unwrap()]);
        assert_eq!(layer["expert_frequency"].2, freq);
        for k in ["ean_sum", "weighted_ean_sum", "weighted_expert_frequency_sum"] {
            assert_eq!(layer[k].2, floats(&x[k]), "layer {block} {k}");
        }
        for k in ["reap", "max_activations"] {
            assert_eq!(layer[k].2, floats(&x[k]).into_iter().map(f32_of).collect::<Vec<_>>(), "layer {block} {k}");
        }
        let ean = floats(&x["ean_sum"]);
        let mean: Vec<f64> = ean.iter().zip(&freq).map(|(s, &c)| if c > 0.0 { f32_of(s / c) } else { 0.0 }).collect();
        assert_eq!(layer["ean_mean"].2, mean, "layer {block}");
        let pair = &layer["pairwise_expert_frequency"].2;
        for i in 0..n as usize {
            for j in 0..n as usize {
                assert_eq!(pair[i * n as usize + j], freq[i] + freq[j]);
            }
        }
    }

    if torch_installed() {
        // the real thing: it loads, with the dtypes the reference's prune step expects
        run_ok(Command::new("python3").current_dir(&d).arg(&script).args(["p.json", "real.pt"]));
        let check = "import torch; s = torch.load('real.pt', weights_only=False); l = s[min(s)]; \
                     assert l['reap'].dtype == torch.float32 and l['expert_frequency'].dtype == torch.int64; \
                     torch.topk(l['reap'], 2, largest=False)";
        run_ok(Command::new("python3").current_dir(&d).args(["-c", check]));
    } else {
        // without PyTorch: a clear message, exit 2, nothing written
        let out = run(Command::new("python3").current_dir(&d).arg(&script).args(["p.json", "none.pt"]));
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("needs PyTorch"), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(!d.join("none.pt").exists());
    }
    // a file that is not an export is refused before torch is needed
    let out = run(Command::new("python3").current_dir(&d).env("PYTHONPATH", &fake).arg(&script).args(["i.reap.json", "x.pt"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"format\" is not \"cerebras-reap\""));
}

#[test]
fn export_refuses_bad_input_with_exit_2_and_writes_nothing() {
    let d = temp_dir("export-bad");
    calibrated(&d, "qwen2moe");
    std::fs::write(d.join("junk.json"), "{").unwrap();
    let mut old = json(&d.join("i.reap.json"));
    for l in old["layers"].as_array_mut().unwrap() {
        for k in ["reap_softmax_l2_sum", "reap_softmax_l2_sq_sum", "max_activation"] {
            l.as_object_mut().unwrap().remove(k);
        }
    }
    std::fs::write(d.join("old.json"), serde_json::to_vec(&old).unwrap()).unwrap();
    std::fs::write(d.join("keep.json"), "precious").unwrap();
    // a layer given twice: the reference's per-block object would merge the two silently
    let mut doubled = json(&d.join("i.reap.json"));
    doubled["layers"][1] = doubled["layers"][0].clone();
    std::fs::write(d.join("doubled.json"), serde_json::to_vec(&doubled).unwrap()).unwrap();
    let cases: [(&[&str], &str); 6] = [
        (&["--reap", "doubled.json", "--format", "cerebras-reap", "-o", "keep.json"], "are not in block order, each once"),
        (&["--reap", "missing.json", "--format", "cerebras-reap", "-o", "keep.json"], "missing.json"),
        (&["--reap", "junk.json", "--format", "cerebras-reap", "-o", "keep.json"], "junk.json: not valid JSON"),
        (&["--reap", "i.reap.json", "--format", "cerebras", "-o", "keep.json"], "cerebras-reap"),
        (&["--reap", "old.json", "--format", "cerebras-reap", "-o", "keep.json"], "calibrate again"),
        (&["--reap", "i.reap.json", "--format", "cerebras-reap", "-o", "no/such/dir/x.json"], "does not exist"),
    ];
    for (args, says) in cases {
        let out = export(&d, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: expected «{says}» in: {err}");
        assert_eq!(read(&d.join("keep.json")), b"precious", "{args:?} touched the output");
    }
    // older files still work everywhere else: check passes (with a note), select's applied-gate methods run
    let out = run(Command::new(ours()).current_dir(&d).args(["check", "--reap", "old.json"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stdout).contains("not checked"));
    run_ok(Command::new(ours()).current_dir(&d).args(["select", "--reap", "old.json", "--method", "reap_mean", "--k", "8", "--out-dir", "m"]));
    let out = run(Command::new(ours()).current_dir(&d).args(["select", "--reap", "old.json", "--method", "reap_softmax_mean", "--k", "8", "--out-dir", "m"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no reap_softmax_l2_sum"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Top-k of a score, live experts first, ties by lower id, sorted ascending: the keep set
/// computed here from the JSON alone.
fn keep_by(count: &[u64], score: &[f64], k: usize) -> Vec<u64> {
    let mut idx: Vec<usize> = (0..count.len()).collect();
    idx.sort_by(|&a, &b| (count[b] > 0).cmp(&(count[a] > 0)).then(score[b].total_cmp(&score[a])).then(a.cmp(&b)));
    let mut keep: Vec<u64> = idx[..k].iter().map(|&i| i as u64).collect();
    keep.sort_unstable();
    keep
}

#[test]
fn select_ranks_by_the_softmax_gate_and_reports_the_overlap() {
    let d = temp_dir("export-select");
    let sal = calibrated(&d, "qwen3moe");
    let s = Saliency::read(&sal).unwrap();
    let out = run_ok(Command::new(ours()).current_dir(&d).args([
        "select", "--reap", "i.reap.json", "--method", "reap_mean,reap_softmax_mean,reap_l2_sum,reap_softmax_l2_sum", "--k", "12", "--out-dir", "m",
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("overlap at K = 12"), "{text}");
    let header = text.lines().skip_while(|l| !l.starts_with("overlap at K = 12")).nth(1).unwrap();
    assert!(header.contains("reap_softmax_mean") && header.contains("reap_softmax_l2_sum"), "{text}");
    let report = json(&d.join("m/select_report.json"));
    let pairs: Vec<(String, String)> =
        report["overlap"].as_array().unwrap().iter().map(|o| (o["a"].as_str().unwrap().into(), o["b"].as_str().unwrap().into())).collect();
    assert!(pairs.contains(&("reap_mean".into(), "reap_softmax_mean".into())), "{pairs:?}");
    assert!(pairs.contains(&("reap_l2_sum".into(), "reap_softmax_l2_sum".into())), "{pairs:?}");
    for (m, mean) in [("reap_softmax_mean", true), ("reap_softmax_l2_sum", false)] {
        let map = json(&d.join(format!("m/keep_{m}_k12.json")));
        assert_eq!(map["method"], m);
        for (l, entry) in s.layers.iter().zip(map["layers"].as_array().unwrap()) {
            let r = l.reference.as_ref().unwrap();
            let score: Vec<f64> = (0..l.n_expert)
                .map(|e| if !mean { r.reap_softmax_l2_sum[e] } else if l.count[e] > 0 { r.reap_softmax_l2_sum[e] / l.count[e] as f64 } else { 0.0 })
                .collect();
            let keep: Vec<u64> = entry["keep"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            assert_eq!(keep, keep_by(&l.count, &score, 12), "{m} layer {}", l.layer);
        }
    }
}

#[test]
fn check_fails_on_tampered_reference_statistics() {
    let d = temp_dir("export-check");
    let sal = calibrated(&d, "qwen3moe");
    let v = json(&sal);
    let live = (0..v["layers"][0]["count"].as_array().unwrap().len()).find(|&e| v["layers"][0]["count"][e].as_u64().unwrap() > 0).unwrap();
    let dead = (0..v["layers"][0]["count"].as_array().unwrap().len()).find(|&e| v["layers"][0]["count"][e].as_u64().unwrap() == 0).unwrap();
    let ean = v["layers"][0]["ean_sum"][live].as_f64().unwrap();
    let max_l2 = v["layers"][0]["max_l2"][live].as_f64().unwrap();
    let sq = v["layers"][0]["reap_softmax_l2_sq_sum"][live].as_f64().unwrap();
    let g = v["layers"][0]["prob_sum"][live].as_f64().unwrap();
    let tokens = v["layers"][0]["tokens"].as_f64().unwrap();
    let cases: Vec<(&str, Box<dyn Fn(&mut Value)>, &str)> = vec![
        ("null-max", Box::new(move |v| v["layers"][0]["max_activation"][live] = Value::Null), "count = 0 ⇔ max_activation is null"),
        ("dead-max", Box::new(move |v| v["layers"][0]["max_activation"][dead] = 0.5.into()), "count = 0 ⇔ max_activation is null"),
        ("dead-sum", Box::new(move |v| v["layers"][0]["reap_softmax_l2_sum"][dead] = 0.5.into()), "count = 0 ⇔ reap_softmax_l2_sum = 0"),
        ("cs", Box::new(move |v| v["layers"][0]["reap_softmax_l2_sq_sum"][live] = (sq * 1e-3).into()), "reap_softmax_l2_sq_sum ≥"),
        ("max", Box::new(move |v| v["layers"][0]["max_activation"][live] = (max_l2 * 1.01).into()), "|max_activation| ≤ max_l2"),
        ("p>1", Box::new(move |v| v["layers"][0]["reap_softmax_l2_sum"][live] = (ean * 1.01).into()), "reap_softmax_l2_sum ≤ ean_sum"),
        ("mass", Box::new(move |v| v["layers"][0]["router_prob_sum"][live] = tokens.into()), "Σ over a token's picks of p ≤ 1"),
        ("p>g", Box::new(move |v| v["layers"][0]["router_prob_sum"][live] = (g * 1.01).into()), "softmax sums ≤ applied-gate sums"),
    ];
    for (name, tamper, says) in cases {
        let mut t = v.clone();
        tamper(&mut t);
        let p = d.join(format!("{name}.json"));
        std::fs::write(&p, serde_json::to_vec(&t).unwrap()).unwrap();
        let out = run(Command::new(ours()).current_dir(&d).args(["check", "--reap"]).arg(&p));
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{name}:\n{text}");
        assert!(text.lines().any(|l| l.contains("[FAIL] layer") && l.contains(says)), "{name}: expected «{says}» to fail:\n{text}");
    }
}
