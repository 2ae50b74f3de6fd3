//! `reap-imatrix corpus`: token shares against upstream's `llama-tokenize`, prefix mixing,
//! planted duplicates and eval leaks, chat rendering against a hand-written ChatML rendering,
//! bad input.

use super::util::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Deterministic pseudo-random words (an LCG), so documents are distinct unless planted.
struct Words(u64);
impl Words {
    fn doc(&mut self, n: usize) -> String {
        let mut w = Vec::with_capacity(n);
        for _ in 0..n {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            w.push(format!("w{}", (self.0 >> 33) % 5000));
        }
        w.join(" ") + "."
    }
}

fn write_jsonl(path: &Path, docs: &[Value]) {
    let s: String = docs.iter().map(|d| serde_json::to_string(d).unwrap() + "\n").collect();
    std::fs::write(path, s).unwrap();
}

fn corpus_cmd(dir: &Path, model: &Path, args: &[&str]) -> std::process::Output {
    run(Command::new(ours()).current_dir(dir).arg("corpus").arg("-m").arg(model).args(args))
}

fn report(dir: &Path, stem: &str) -> Value {
    serde_json::from_slice(&read(&dir.join(format!("{stem}.report.json")))).unwrap()
}

/// (start, end, domain, tokens) rows of a domains file.
fn domains(path: &Path) -> Vec<(usize, usize, String, u64)> {
    let text = String::from_utf8(read(path)).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("start\tend\tdomain\ttokens"));
    lines
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].to_string(), f[3].parse().unwrap())
        })
        .collect()
}

/// Upstream's token count of `bytes` (verbatim, special tokens parsed: llama-tokenize's default; no BOS: the qwen2 vocab
/// adds none).
fn upstream_count(dir: &Path, model: &Path, bytes: &[u8], name: &str) -> u64 {
    let f = dir.join(name);
    std::fs::write(&f, bytes).unwrap();
    let out = run_ok(
        Command::new(reference_bin("llama-tokenize"))
            .arg("-m")
            .arg(model)
            .arg("-f")
            .arg(&f)
            .args(["--no-escape", "--show-count", "--ids", "--log-disable"]),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("Total number of tokens: ")).unwrap_or_else(|| panic!("{text}"));
    line.trim().parse().unwrap()
}

/// Three sources: prose-like text, chat (messages), and a second text source; shares 0.5/0.3/0.2.
fn sources(dir: &Path) -> Vec<String> {
    let mut w = Words(1);
    let a: Vec<Value> = (0..120).map(|i| json!({"text": w.doc(40 + (i * 37) % 200)})).collect();
    let b: Vec<Value> = (0..120)
        .map(|_| json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": w.doc(20)}, {"role": "assistant", "content": w.doc(60)}]}))
        .collect();
    let c: Vec<Value> = (0..120).map(|_| json!({"text": format!("東京の{}です。\n\n  {}", w.doc(10), w.doc(80))})).collect();
    write_jsonl(&dir.join("a.jsonl"), &a);
    write_jsonl(&dir.join("b.jsonl"), &b);
    write_jsonl(&dir.join("c.jsonl"), &c);
    vec!["--source".into(), "prose=a.jsonl:0.5".into(), "--source".into(), "chat=b.jsonl:0.3".into(), "--source".into(), "ja=c.jsonl".into()]
}

#[test]
fn shares_are_true_token_counts_and_every_prefix_is_mixed() {
    let d = temp_dir("corpus-shares");
    let model = fixture("qwen3moe");
    let mut args = sources(&d);
    args.extend(["--tokens", "12000", "-o", "mix.txt", "--max-doc-tokens", "150"].map(String::from));
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = corpus_cmd(&d, &model, &a);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("prose") && table.contains("total"), "{table}");
    let r = report(&d, "mix");
    // a mix short of its target says so
    let short = r["tokens"].as_u64().unwrap() < 12000;
    assert_eq!(short, String::from_utf8_lossy(&out.stderr).contains("below --tokens 12000"), "{r}");
    let text = read(&d.join("mix.txt"));
    let rows = domains(&d.join("mix.domains.tsv"));
    // the ranges tile the file
    assert_eq!(rows[0].0, 0);
    assert_eq!(rows.last().unwrap().1, text.len());
    assert!(rows.windows(2).all(|w| w[0].1 == w[1].0));

    // whole text, as calibration reads it (one trailing newline removed), counted by upstream
    let calib = text.strip_suffix(b"\n").unwrap();
    let total = upstream_count(&d, &model, calib, "whole.txt");
    assert_eq!(r["tokens"].as_u64().unwrap(), total);
    assert_eq!(rows.iter().map(|r| r.3).sum::<u64>(), total);
    // each source's documents, concatenated, counted by upstream: the per-source figures
    for (s, want_share) in [("prose", 0.5), ("chat", 0.3), ("ja", 0.2)] {
        let mut bytes = Vec::new();
        for r in rows.iter().filter(|r| r.2 == s) {
            bytes.extend_from_slice(&text[r.0..r.1.min(calib.len())]);
        }
        let n = upstream_count(&d, &model, &bytes, &format!("{s}.txt"));
        let src = r["sources"].as_array().unwrap().iter().find(|x| x["name"] == s).unwrap();
        assert_eq!(src["tokens"].as_u64().unwrap(), n, "{s}");
        assert_eq!(src["tokens_target"].as_u64().unwrap(), (want_share * 12000.0f64).round() as u64, "{s}");
        // achieved within a few tokens of the target (the last document is cut to fit)
        let got = n as f64 / 12000.0;
        assert!((got - want_share).abs() < 0.005, "{s}: share {got}");
        assert!((src["share"].as_f64().unwrap() - n as f64 / total as f64).abs() < 1e-12);
    }
    // every document is at most --max-doc-tokens long, cut ones are counted
    assert!(rows.iter().all(|r| r.3 <= 150), "{rows:?}");
    let truncated: u64 = r["sources"].as_array().unwrap().iter().map(|s| s["truncated"].as_u64().unwrap()).sum();
    assert!(truncated > 3, "{r}");
    // counting stops at the target: at least the documents used were counted, at most those kept
    for src in r["sources"].as_array().unwrap() {
        let n = |k: &str| src[k].as_u64().unwrap_or_else(|| panic!("{k}: {src}"));
        let kept = n("documents_read") - n("duplicates_dropped") - n("eval_overlaps_dropped");
        assert!(n("documents") <= n("documents_counted") && n("documents_counted") <= kept, "{src}");
        assert_eq!(src["tokens_available"].is_null(), n("documents_counted") < kept, "{src}");
    }
    // every prefix (at document boundaries) holds each source within one document of its share
    let mut cum = std::collections::HashMap::new();
    let mut all = 0u64;
    for row in &rows {
        *cum.entry(row.2.clone()).or_insert(0u64) += row.3;
        all += row.3;
        for (s, share) in [("prose", 0.5), ("chat", 0.3), ("ja", 0.2)] {
            let got = *cum.get(s).unwrap_or(&0) as f64;
            assert!((got - share * all as f64).abs() <= 150.0, "{s} at {all} tokens: {got}");
        }
    }
    // all three domains within the first 1000 tokens
    let first: std::collections::HashSet<&str> = rows.iter().scan(0, |t, r| { *t += r.3; Some((*t, r)) }).take_while(|(t, _)| *t < 1000).map(|(_, r)| r.2.as_str()).collect();
    assert_eq!(first.len(), 3, "{first:?}");

    // same inputs, same bytes; another seed, another order
    let out2 = corpus_cmd(&d, &model, &[&a[..a.len() - 4], &["-o", "mix2.txt", "--max-doc-tokens", "150"]].concat());
    assert!(out2.status.success());
    assert_same_bytes(&d.join("mix.txt"), &d.join("mix2.txt"));
    assert_same_bytes(&d.join("mix.domains.tsv"), &d.join("mix2.domains.tsv"));
    let out3 = corpus_cmd(&d, &model, &[&a[..a.len() - 4], &["-o", "mix3.txt", "--seed", "9"]].concat());
    assert!(out3.status.success());
    assert_ne!(read(&d.join("mix.txt")), read(&d.join("mix3.txt")));
}

#[test]
fn chat_documents_are_rendered_with_the_models_template() {
    let d = temp_dir("corpus-chat");
    let model = fixture("qwen3moe");
    let msgs = json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]);
    write_jsonl(&d.join("chat.jsonl"), &[json!({"messages": msgs})]);
    // ChatML, written out by hand: what the fixture's tokenizer.chat_template (Qwen's) produces
    // for a conversation that starts with a system message
    let hand = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>";
    let out = corpus_cmd(&d, &model, &["--source", "chat=chat.jsonl", "--tokens", "1000", "-o", "m.txt"]);
    assert!(!out.status.success(), "the source holds fewer than 1000 tokens");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("chat: target 1000 tokens, available"), "{e}");
    let avail: u64 = e.split("available ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    let n = upstream_count(&d, &model, format!("{hand}\n\n").as_bytes(), "hand.txt");
    assert_eq!(avail, n, "the document's token count is that of the hand rendering");
    let tokens = n.to_string();
    let out = corpus_cmd(&d, &model, &["--source", "chat=chat.jsonl", "--tokens", &tokens, "-o", "m.txt"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(read(&d.join("m.txt"))).unwrap(), format!("{hand}\n"));

    // a model without a chat template: the error names the source, nothing is written
    let plain = d.join("spm.gguf");
    let vocab = spm_vocab();
    run_ok(Command::new(ours()).args(["fixture", "--vocab"]).arg(&vocab).arg("-o").arg(&plain));
    let out = corpus_cmd(&d, &plain, &["--source", "talk=chat.jsonl", "--tokens", "10", "-o", "n.txt"]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("source talk (chat.jsonl), line 1") && e.contains("no chat template"), "{e}");
    assert!(!d.join("n.txt").exists() && !d.join("n.domains.tsv").exists() && !d.join("n.report.json").exists());
}

/// A SentencePiece vocab puts a space before the text after each special token (`</s> words`
/// → `</s>`, `▁▁words`): the tokens of each fragment still start on the text's own bytes, so
/// `corpus` and `--domains` map them (both failed on such text before).
#[test]
fn special_tokens_inside_sentencepiece_text_map_to_their_own_bytes() {
    let d = temp_dir("corpus-spm-special");
    let vocab_file = spm_vocab();
    let model = reap_imatrix::llama::Model::load_vocab(&vocab_file).unwrap();
    let v = model.vocab();
    let text = b"Some words. </s> trailing words</s>\nafter a newline</s>  two spaces <s>[INST] a question [/INST]";
    let tokens = v.tokenize(text, true, true).unwrap();
    let offsets = v.token_offsets(text, &tokens).unwrap();
    assert_eq!(offsets.len(), tokens.len());
    // every special token sits on its own spelling in the text, and the next token starts
    // right after it, whatever space the tokenizer added
    let mut specials = 0;
    for (i, &t) in tokens.iter().enumerate() {
        if i > 0 && v.is_special_fragment(t) {
            let piece = v.piece(t);
            let at = offsets[i] as usize;
            assert_eq!(&text[at..at + piece.len()], &piece[..], "token {i}");
            if let Some(&next) = offsets.get(i + 1) {
                assert_eq!(next as usize, at + piece.len(), "the token after special token {i}");
            }
            specials += 1;
        }
    }
    assert_eq!(specials, 4, "</s> three times and <s>");
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));

    // and the whole path: a mix of such documents, its token count upstream's
    let spm = d.join("spm.gguf");
    run_ok(Command::new(ours()).args(["fixture", "--vocab"]).arg(&vocab_file).arg("-o").arg(&spm));
    let docs: Vec<Value> = (0..3).map(|i| json!({"text": format!("Document {i}. </s> trailing words</s>\nand a newline {i}")})).collect();
    write_jsonl(&d.join("s.jsonl"), &docs);
    let out = corpus_cmd(&d, &spm, &["--source", "s=s.jsonl", "--tokens", "30", "-o", "m.txt"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mix = read(&d.join("m.txt"));
    // calibration reads the mix without its final newline, and this vocab adds a BOS
    let up = upstream_count(&d, &spm, mix.strip_suffix(b"\n").unwrap(), "up.txt");
    assert_eq!(report(&d, "m")["tokens"].as_u64(), Some(up));
    assert_eq!(domains(&d.join("m.domains.tsv")).iter().map(|r| r.3).sum::<u64>(), up);
}

fn pin_commit() -> String {
    let pin = std::fs::read_to_string(repo().join("vendor/llama.cpp.pin")).unwrap();
    pin.lines().find_map(|l| l.strip_prefix("commit=")).unwrap().trim().to_string()
}

#[test]
fn planted_duplicates_and_eval_leaks_are_dropped_and_counted() {
    let d = temp_dir("corpus-dedupe");
    let model = fixture("qwen3moe");
    let mut w = Words(7);
    let base: Vec<String> = (0..40).map(|_| w.doc(120)).collect();
    // near duplicate of base[3]: 2 words of 121 changed (Jaccard of the 5-word shingles 107/127)
    let mut near: Vec<String> = base[3].split(' ').map(String::from).collect();
    for i in [10, 90] {
        near[i] = "planted".into();
    }
    let near = near.join(" ");
    let leak_exact = w.doc(100);
    let leak_inside = w.doc(60);
    let mut a: Vec<Value> = base.iter().map(|t| json!({"text": t})).collect();
    a.push(json!({"text": base[5].replace(' ', "  \n ")})); // exact duplicate within the source
    a.push(json!({"text": format!("  {leak_exact}\n")})); // an eval text, whitespace aside
    // empty documents are skipped: not duplicates of each other, nor overlaps of an empty eval one
    a.extend([json!({"text": ""}), json!({"text": " \n "})]);
    let b: Vec<Value> = vec![
        json!({"text": base[7].clone()}),               // exact duplicate across sources
        json!({"text": near}),                          // near duplicate across sources
        json!({"text": format!("{} {leak_inside} {}", w.doc(50), w.doc(50))}), // contains an eval text
        json!({"text": w.doc(120)}),
        json!({"text": w.doc(120)}),
    ];
    write_jsonl(&d.join("a.jsonl"), &a);
    write_jsonl(&d.join("b.jsonl"), &b);
    write_jsonl(&d.join("eval.jsonl"), &[json!({"text": leak_exact}), json!({"text": leak_inside}), json!({"text": w.doc(30)}), json!({"text": "  "})]);
    let args = ["--source", "a=a.jsonl:0.9", "--source", "b=b.jsonl:0.1", "--tokens", "400", "--eval", "eval.jsonl", "-o", "m.txt"];
    let out = corpus_cmd(&d, &model, &args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = report(&d, "m");
    let s = r["sources"].as_array().unwrap();
    assert_eq!((s[0]["duplicates_dropped"].as_u64(), s[0]["eval_overlaps_dropped"].as_u64()), (Some(1), Some(1)), "{r}");
    assert_eq!((s[1]["duplicates_dropped"].as_u64(), s[1]["eval_overlaps_dropped"].as_u64()), (Some(2), Some(1)), "{r}");
    // the report lists availability after the drops: b keeps 2 documents
    let text = String::from_utf8(read(&d.join("m.txt"))).unwrap();
    assert!(!text.contains(&leak_exact[..200]) && !text.contains(&leak_inside[..100]));
    assert!(!text.contains("planted"));

    // --strict: fail, naming the overlapping lines, and write nothing
    let mut strict = args.to_vec();
    strict.extend(["--strict"]);
    strict[9] = "s.txt";
    let out = corpus_cmd(&d, &model, &strict);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("2 document(s) overlap the --eval set") && e.contains("a.jsonl:42 overlaps eval.jsonl:1") && e.contains("b.jsonl:3 overlaps eval.jsonl:2"), "{e}");
    assert!(!d.join("s.txt").exists() && !d.join("s.report.json").exists());
}

#[test]
fn bad_input_is_named_and_nothing_is_written() {
    let d = temp_dir("corpus-bad");
    let model = fixture("qwen3moe");
    std::fs::write(d.join("ok.jsonl"), "{\"text\": \"one two three four five six\"}\n").unwrap();
    std::fs::write(d.join("bad.jsonl"), "{\"text\": \"fine\"}\n{\"text\": \"x\"\n").unwrap();
    std::fs::write(d.join("nofield.jsonl"), "{\"body\": \"x\"}\n").unwrap();
    std::fs::write(d.join("ok2.jsonl"), "{\"text\": \"seven eight nine ten eleven twelve\"}\n").unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--source", "b=bad.jsonl", "--tokens", "5"], "bad.jsonl:2: not valid JSON"),
        (&["--source", "n=nofield.jsonl", "--tokens", "5"], "nofield.jsonl:1: a document needs \"text\" or \"messages\""),
        (&["--source", "a=ok.jsonl:0.7", "--source", "b=ok.jsonl:0.6", "--tokens", "5"], "shares add up to 1.3"),
        (&["--source", "a=ok.jsonl", "--tokens", "500"], "a: target 500 tokens, available"),
        (&["--source", "a=missing.jsonl", "--tokens", "5"], "missing.jsonl"),
        // a target that rounds to 0 tokens would leave the source out without a word
        (&["--source", "a=ok.jsonl:0.05", "--source", "b=ok2.jsonl", "--tokens", "5"], "--source a: share 0.05 of --tokens 5 is a target of 0 tokens"),
    ];
    for (args, want) in cases {
        let out = corpus_cmd(&d, &model, &[*args, &["-o", "x.txt"]].concat());
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(want), "{args:?}: {e}");
        assert!(!d.join("x.txt").exists() && !d.join("x.domains.tsv").exists() && !d.join("x.report.json").exists());
    }
    // an output that is an input (here the source itself) is refused and the input kept
    let before = read(&d.join("ok.jsonl"));
    let out = corpus_cmd(&d, &model, &["--source", "a=ok.jsonl", "--tokens", "5", "-o", "./ok.jsonl"]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("which is the --source a input: it would be overwritten"), "{e}");
    assert_eq!(read(&d.join("ok.jsonl")), before);
    let out = corpus_cmd(&d, &model, &["--source", "(none)=ok.jsonl", "--tokens", "5", "-o", "x.txt"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is kept for tokens outside every document"));
    // a model that is missing, not GGUF or a folder: the shared -m check, before llama.cpp
    std::fs::write(d.join("junk.gguf"), "not a model at all").unwrap();
    std::fs::create_dir_all(d.join("dir.gguf")).unwrap();
    for (m, want) in [("missing.gguf", "-m missing.gguf: cannot read the model file"), ("junk.gguf", "-m junk.gguf: not a GGUF file"), ("dir.gguf", "-m dir.gguf: is a folder")] {
        let out = corpus_cmd(&d, Path::new(m), &["--source", "a=ok.jsonl", "--tokens", "5", "-o", "x.txt"]);
        assert_eq!(out.status.code(), Some(2), "{m}");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(want), "{m}: {e}");
        assert!(!d.join("x.txt").exists() && !d.join("x.domains.tsv").exists() && !d.join("x.report.json").exists());
    }
}

/// With every share given and a sum below 1 the mix holds that part of --tokens: the note
/// says so and gives the budget to ask for accordingly.
#[test]
fn shares_below_one_say_what_budget_to_ask_for() {
    let d = temp_dir("corpus-shares-below-one");
    let mut w = Words(3);
    write_jsonl(&d.join("a.jsonl"), &(0..40).map(|_| json!({"text": w.doc(30)})).collect::<Vec<_>>());
    let out = corpus_cmd(&d, &fixture("qwen3moe"), &["--source", "a=a.jsonl:0.5", "--tokens", "400", "-o", "m.txt"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("the --source shares add up to 0.5") && e.contains("a little more than K × C / 0.5"), "{e}");
    let tokens = report(&d, "m")["tokens"].as_u64().unwrap();
    assert!((190..=200).contains(&tokens), "{tokens}");
}

/// A SentencePiece vocab adds a space before a text, a token of its own before what cannot
/// merge with it (CJK, digits): each document is counted as it stands in the mix, after the
/// separator, where it has no such space, so a mix of many short documents reaches --tokens
/// (counting each alone planned about one token per document that the mix lacks).
#[test]
fn sentencepiece_documents_are_counted_as_they_stand_in_the_mix() {
    let d = temp_dir("corpus-spm-count");
    let vocab = spm_vocab();
    let spm = d.join("spm.gguf");
    run_ok(Command::new(ours()).args(["fixture", "--vocab"]).arg(&vocab).arg("-o").arg(&spm));
    let chars: Vec<char> = "日本語文章東京大阪京都雨晴今明山川海空花鳥風月".chars().collect();
    let mut x = 3u64;
    let docs: Vec<Value> = (0..2000)
        .map(|i| {
            let t: String = (0..8)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    chars[((x >> 33) % chars.len() as u64) as usize]
                })
                .collect();
            json!({"text": format!("{t}{i}")})
        })
        .collect();
    write_jsonl(&d.join("ja.jsonl"), &docs);
    let out = corpus_cmd(&d, &spm, &["--source", "ja=ja.jsonl", "--tokens", "8000", "-o", "m.txt"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = report(&d, "m");
    let tokens = r["tokens"].as_u64().unwrap();
    // BOS and the first document's leading space added, the final newline stripped
    assert!(tokens.abs_diff(8000) <= 3, "{tokens}");
    let mix = read(&d.join("m.txt"));
    assert_eq!(upstream_count(&d, &spm, mix.strip_suffix(b"\n").unwrap(), "up.txt"), tokens);
}

/// The bundled mix is what `corpus` makes of the bundled sources for the fixture's vocab.
#[test]
fn the_bundled_mix_is_up_to_date() {
    let d = temp_dir("corpus-bundled");
    let src = |n: &str| format!("{n}={}", repo().join(format!("corpus/sources/{n}.jsonl")).display());
    let out = corpus_cmd(
        &d,
        &fixture("qwen3moe"),
        &["--source", &src("prose"), "--source", &src("code"), "--source", &src("ja"), "--source", &src("chat"), "--tokens", "36000", "-o", "mix.txt"],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_same_bytes(&d.join("mix.txt"), &repo().join("corpus/mix.txt"));
    assert_same_bytes(&d.join("mix.domains.tsv"), &repo().join("corpus/mix.domains.tsv"));
    let (mut a, mut b) = (report(&d, "mix"), report(&repo().join("corpus"), "mix"));
    for r in [&mut a, &mut b] {
        r["model"] = Value::Null;
        for s in r["sources"].as_array_mut().unwrap() {
            s["file"] = Value::Null;
        }
    }
    assert_eq!(a, b);
}

/// The pinned tree's SentencePiece vocab-only GGUF (in the cache `REAP_IMATRIX_CACHE` names).
fn spm_vocab() -> PathBuf {
    PathBuf::from(std::env::var_os("REAP_IMATRIX_CACHE").map(PathBuf::from).unwrap_or(repo().join("vendor/cache")))
        .join(format!("llama.cpp-{}", pin_commit()))
        .join("models/ggml-vocab-llama-spm.gguf")
}
