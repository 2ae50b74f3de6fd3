//! `--chunk-sampling` and `--domains`: which chunks are evaluated (checked against upstream's
//! tokenizer), per-domain sums recomputed from the trace by another route, `check`'s domain
//! invariants on both archs, `reproduce` of sampled runs, prefix sampling byte-identical to
//! upstream.

use super::util::*;
use reap_imatrix::formats::saliency::Saliency;
use reap_imatrix::formats::trace::TraceReader;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn mix() -> PathBuf {
    repo().join("corpus/mix.txt")
}
fn mix_domains() -> PathBuf {
    repo().join("corpus/mix.domains.tsv")
}

/// Upstream's token ids of the mix as calibration reads it (one trailing newline removed).
fn upstream_ids(dir: &Path, model: &Path) -> Vec<i32> {
    let text = read(&mix());
    let f = dir.join("calib.txt");
    std::fs::write(&f, text.strip_suffix(b"\n").unwrap()).unwrap();
    let out = run_ok(Command::new(reference_bin("llama-tokenize")).arg("-m").arg(model).arg("-f").arg(&f).args(["--no-escape", "--ids", "--log-disable"]));
    let s = String::from_utf8_lossy(&out.stdout);
    let list = s.trim().trim_start_matches('[').trim_end_matches(']');
    list.split(',').map(|x| x.trim().parse().unwrap()).collect()
}

/// The domain of each token index, from the token counts of the domains file (the ranges tile
/// the text and start on token boundaries, so the counts laid end to end give the domain of
/// every token without any byte offsets).
fn domain_by_token_index() -> (Vec<String>, Vec<usize>) {
    let text = String::from_utf8(read(&mix_domains())).unwrap();
    let mut names: Vec<String> = Vec::new();
    let mut of = Vec::new();
    for l in text.lines().skip(1) {
        let f: Vec<&str> = l.split('\t').collect();
        if !names.iter().any(|n| n == f[2]) {
            names.push(f[2].to_string());
        }
        let d = names.iter().position(|n| n == f[2]).unwrap();
        of.extend(std::iter::repeat(d).take(f[3].parse().unwrap()));
    }
    (names, of)
}

fn calibrate(dir: &Path, model: &Path, extra: &[&str]) -> std::process::Output {
    run_ok(Command::new(ours()).current_dir(dir).arg("-m").arg(model).arg("-f").arg(mix()).args(["-t", "2", "--no-ppl", "--parse-special", "-o", "i.gguf"]).args(extra))
}

#[test]
fn even_sampling_covers_the_tail_and_domain_sums_match_the_trace() {
    let d = temp_dir("coverage-even");
    let model = fixture("qwen3moe");
    let dom = mix_domains();
    let out = calibrate(&d, &model, &["-c", "128", "-b", "256", "--chunks", "5", "--chunk-sampling", "even", "--trace-out", "t.bin", "--domains", dom.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    let ids = upstream_ids(&d, &model);
    let total = ids.len();
    let n = total / 128;
    // even: first and last chunk, evenly spaced between (computed here in floating point)
    let want: Vec<u64> = (0..5).map(|i| (i as f64 * (n - 1) as f64 / 4.0).round() as u64).collect();
    assert_eq!(*want.last().unwrap(), n as u64 - 1);
    let s = Saliency::read(&d.join("i.reap.json")).unwrap();
    let cov = s.coverage.clone().expect("coverage object");
    assert_eq!(cov["corpus_tokens"].as_u64().unwrap(), total as u64);
    assert_eq!(cov["chunks_total"].as_u64().unwrap(), n as u64);
    assert_eq!(cov["evaluated_tokens"].as_u64().unwrap(), 5 * 128);
    let got: Vec<u64> = cov["chunk_indices"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(got, want);
    assert!(err.contains(&format!("coverage: corpus {total} tokens, {n} chunks of 128; evaluating 5 chunks (640 tokens")), "{err}");
    assert!(err.contains("coverage:   domain ja:"), "{err}");
    // the manifest records the same
    let m: Value = serde_json::from_slice(&read(&d.join("i.manifest.json"))).unwrap();
    assert_eq!(m["coverage"], cov);

    // trace rows: the chunk is the corpus chunk, the token the one upstream's tokenizer puts there
    let t = TraceReader::open(&d.join("t.bin")).unwrap();
    let mut chunks: Vec<u64> = t.rows().map(|r| r.chunk() as u64).collect();
    chunks.dedup();
    assert_eq!(chunks, want);
    for r in t.rows() {
        assert_eq!(r.token(), ids[r.chunk() as usize * 128 + r.pos() as usize], "chunk {} pos {}", r.chunk(), r.pos());
    }

    // per-domain sums recomputed from the trace rows, each row's domain from the token counts
    let (names, dom_of) = domain_by_token_index();
    assert_eq!(dom_of.len(), total, "the domains file's token counts add up to upstream's count");
    let names_json: Vec<&str> = s.domains.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(names_json, names);
    let k = s.layers[0].n_expert_used;
    let mut tokens = vec![0u64; names.len()];
    for (li, l) in s.layers.iter().enumerate() {
        let mut count = vec![vec![0u64; l.n_expert]; names.len()];
        let mut prob = vec![vec![0f64; l.n_expert]; names.len()];
        for r in t.rows() {
            let dd = dom_of[r.chunk() as usize * 128 + r.pos() as usize];
            if li == 0 {
                tokens[dd] += 1;
            }
            for j in 0..k {
                let e = r.sel_ids(li)[j] as usize;
                count[dd][e] += 1;
                prob[dd][e] += r.sel_weights(li)[j] as f64;
            }
        }
        for (dd, ds) in s.domains.iter().enumerate() {
            assert_eq!(ds.layers[li].count, count[dd], "layer {} domain {}", l.layer, ds.name);
            for e in 0..l.n_expert {
                assert!((ds.layers[li].prob_sum[e] - prob[dd][e]).abs() <= 1e-9 * prob[dd][e].max(1.0), "layer {} domain {} expert {e}", l.layer, ds.name);
            }
        }
    }
    let dom_tokens: Vec<u64> = s.domains.iter().map(|x| x.tokens).collect();
    assert_eq!(dom_tokens, tokens);
    assert!(tokens.iter().filter(|&&x| x > 0).count() >= 3, "even sampling reaches most domains: {tokens:?}");
    // coverage per domain: corpus tokens from the domains file, evaluated = the rows
    for (dd, c) in cov["domains"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["corpus_tokens"].as_u64().unwrap(), dom_of.iter().filter(|&&x| x == dd).count() as u64);
        assert_eq!(c["evaluated_tokens"].as_u64().unwrap(), tokens[dd]);
    }
    let chk = run(Command::new(ours()).current_dir(&d).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf", "--trace", "t.bin"]));
    let text = String::from_utf8_lossy(&chk.stdout);
    assert!(chk.status.success(), "{text}");
    assert!(text.contains("Σ_domains count = count") && text.contains("Σ_domains reap_l2_sum"), "{text}");

    // a sampled run reproduces byte for byte
    let rep = run(Command::new(ours()).arg("reproduce").arg(d.join("i.manifest.json")));
    assert!(rep.status.success(), "{}\n{}", String::from_utf8_lossy(&rep.stdout), String::from_utf8_lossy(&rep.stderr));
}

#[test]
fn seeded_sampling_with_domains_on_qwen2moe_checks_and_reproduces() {
    let d = temp_dir("coverage-seeded");
    let model = fixture("qwen2moe");
    let dom = mix_domains();
    calibrate(&d, &model, &["-c", "128", "-b", "128", "--chunks", "4", "--chunk-sampling", "seeded", "--seed", "3", "--domains", dom.to_str().unwrap()]);
    let s = Saliency::read(&d.join("i.reap.json")).unwrap();
    let idx: Vec<u64> = s.coverage.as_ref().unwrap()["chunk_indices"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(idx.len(), 4);
    assert!(idx.windows(2).all(|w| w[0] < w[1]) && idx != [0, 1, 2, 3], "{idx:?}");
    // per-domain arrays add up to the whole-run arrays (computed here, then by check)
    for (li, l) in s.layers.iter().enumerate() {
        for e in 0..l.n_expert {
            assert_eq!(s.domains.iter().map(|x| x.layers[li].count[e]).sum::<u64>(), l.count[e]);
            let r: f64 = s.domains.iter().map(|x| x.layers[li].reap_l2_sum[e]).sum();
            assert!((r - l.reap_l2_sum[e]).abs() <= 1e-9 * l.reap_l2_sum[e].max(1.0));
        }
    }
    assert_eq!(s.domains.iter().map(|x| x.tokens).sum::<u64>(), s.tokens);
    let chk = run(Command::new(ours()).current_dir(&d).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf"]));
    assert!(chk.status.success(), "{}", String::from_utf8_lossy(&chk.stdout));
    let rep = run(Command::new(ours()).arg("reproduce").arg(d.join("i.manifest.json")));
    assert!(rep.status.success(), "{}", String::from_utf8_lossy(&rep.stdout));
    // another seed, other chunks
    let d2 = temp_dir("coverage-seeded-2");
    calibrate(&d2, &model, &["-c", "128", "-b", "128", "--chunks", "4", "--chunk-sampling", "seeded", "--seed", "4", "--no-reap"]);
    let m: Value = serde_json::from_slice(&read(&d2.join("i.manifest.json"))).unwrap();
    let idx2: Vec<u64> = m["coverage"]["chunk_indices"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_ne!(idx, idx2);
    // upstream's spellings: `-s N` is --seed N, and its default `--seed -1` is the default here
    let of = |extra: &[&str]| -> Vec<u64> {
        let d3 = temp_dir("coverage-seeded-3");
        calibrate(&d3, &model, &[&["-c", "128", "-b", "128", "--chunks", "4", "--chunk-sampling", "seeded", "--no-reap"], extra].concat());
        let m: Value = serde_json::from_slice(&read(&d3.join("i.manifest.json"))).unwrap();
        m["coverage"]["chunk_indices"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
    };
    assert_eq!(of(&["-s", "4"]), idx2);
    assert_eq!(of(&["--seed", "-1"]), of(&[]));
    let bad = run(Command::new(ours()).arg("-m").arg(&model).arg("-f").arg(mix()).args(["--chunk-sampling", "seeded", "--seed", "-2"]));
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("\"-2\" is not a seed"));
}

#[test]
fn prefix_sampling_is_upstream_byte_for_byte_and_says_what_it_misses() {
    let ours_dir = temp_dir("coverage-prefix-ours");
    let ref_dir = temp_dir("coverage-prefix-ref");
    let model = fixture("qwen3moe");
    let common = ["-c", "128", "-b", "256", "--chunks", "3", "-t", "2", "-o", "i.gguf"];
    let up = run_ok(Command::new(reference_bin("llama-imatrix")).current_dir(&ref_dir).arg("-m").arg(&model).arg("-f").arg(mix()).args(common));
    let dom = mix_domains();
    let ours_out = run_ok(
        Command::new(ours()).current_dir(&ours_dir).arg("-m").arg(&model).arg("-f").arg(mix()).args(common).args(["--chunk-sampling", "prefix", "--seed", "9", "--domains", dom.to_str().unwrap()]),
    );
    assert_same_bytes(&ref_dir.join("i.gguf"), &ours_dir.join("i.gguf"));
    assert_eq!(ppl_lines(&up), ppl_lines(&ours_out));
    let err = String::from_utf8_lossy(&ours_out.stderr);
    assert!(err.contains("prefix sampling sees only the first") && err.contains("--chunk-sampling even"), "{err}");
}

#[test]
fn a_bad_domains_file_is_refused_before_anything_is_written() {
    let d = temp_dir("coverage-bad-domains");
    let len = read(&mix()).len();
    std::fs::write(d.join("over.tsv"), format!("start\tend\tdomain\ttokens\n0\t100\ta\t1\n50\t200\tb\t1\n")).unwrap();
    std::fs::write(d.join("long.tsv"), format!("start\tend\tdomain\ttokens\n0\t{}\ta\t1\n", len + 1)).unwrap();
    for (f, want) in [("over.tsv", "over.tsv:3: range [50, 200) overlaps"), ("long.tsv", &format!("does not fit the text ({len} bytes)") as &str)] {
        let out = run(Command::new(ours()).current_dir(&d).arg("-m").arg(fixture("qwen3moe")).arg("-f").arg(mix()).args(["-c", "128", "--chunks", "1", "-o", "i.gguf", "--domains", f]));
        assert_eq!(out.status.code(), Some(2), "{f}");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(want), "{f}: {e}");
        assert!(!d.join("i.gguf").exists() && !d.join("i.reap.json").exists());
    }
    // a file whose token counts are not this text's (another mix that happens to fit): run,
    // with a warning naming the line; the bundled one for its own mix: no warning
    let tsv = String::from_utf8(read(&mix_domains())).unwrap();
    let mut lines: Vec<String> = tsv.lines().map(String::from).collect();
    let mut f: Vec<String> = lines[2].split('\t').map(String::from).collect();
    f[3] = (f[3].parse::<u64>().unwrap() + 1).to_string();
    lines[2] = f.join("\t");
    std::fs::write(d.join("stale.tsv"), lines.join("\n") + "\n").unwrap();
    for (tsv, warns) in [(d.join("stale.tsv"), true), (mix_domains(), false)] {
        let out = calibrate(&d, &fixture("qwen3moe"), &["-c", "128", "--chunks", "1", "--domains", tsv.to_str().unwrap()]);
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(e.contains("warning: --domains"), warns, "{}: {e}", tsv.display());
        if warns {
            assert!(e.contains("stale.tsv:3:") && e.contains("a domains file of another mix"), "{e}");
        }
    }
}

/// The token-count check of a domains file counts only the tokens inside each range (a file
/// with gaps: the gaps' tokens are no range's), and its warning names the range's line in the
/// file, blank lines counted.
#[test]
fn domains_counts_are_checked_inside_the_ranges_and_warnings_name_the_files_line() {
    let d = temp_dir("coverage-domains-lines");
    let tsv = String::from_utf8(read(&mix_domains())).unwrap();
    let lines: Vec<&str> = tsv.lines().collect();
    // every second document left out: right counts, with gaps between the ranges
    let gaps: Vec<&str> = std::iter::once(lines[0]).chain(lines[1..].iter().step_by(2).copied()).collect();
    std::fs::write(d.join("gaps.tsv"), gaps.join("\n") + "\n").unwrap();
    let out = calibrate(&d, &fixture("qwen3moe"), &["-c", "128", "--chunks", "1", "--domains", "gaps.tsv"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!e.contains("warning: --domains"), "{e}");
    assert!(e.contains("(none)"), "the gaps' tokens are no domain's: {e}");
    // blank lines after the header and a stale count on the second range: line 5 of the file
    let mut stale: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    let mut f: Vec<String> = stale[2].split('\t').map(String::from).collect();
    f[3] = (f[3].parse::<u64>().unwrap() + 1).to_string();
    stale[2] = f.join("\t");
    stale.splice(1..1, ["".to_string(), "".to_string()]);
    std::fs::write(d.join("blank.tsv"), stale.join("\n") + "\n").unwrap();
    let out = calibrate(&d, &fixture("qwen3moe"), &["-c", "128", "--chunks", "1", "--domains", "blank.tsv"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("warning: --domains blank.tsv:5:"), "{e}");
}
