//! Bad input, one case at a time (docs/failures.md): each is refused with exit 2 and a message
//! naming the file or flag and what is wrong, and, where it can be, before llama.cpp loads the
//! model (runs use `-v`, which shows llama.cpp's `llama_model_loader` lines when it loads).

use super::util::*;
use reap_imatrix::formats::trace::TraceReader;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn calibrate_in(d: &Path, model: &Path, args: &[&str]) -> Output {
    run(Command::new(ours()).current_dir(d).arg("-m").arg(model).args(["-v", "-t", "2", "--no-ppl"]).args(args))
}

/// Exit 2, stderr mentions every `needles`, and llama.cpp never started loading the model.
fn refused_early(out: &Output, needles: &[&str]) -> String {
    let err = refused(out, needles);
    assert!(!err.contains("llama_model_loader") && !err.contains("compute_imatrix"), "refused only after loading:\n{err}");
    err
}

fn refused(out: &Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "expected exit 2:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}:\n{err}");
    }
    err
}

// ---- the model

#[test]
fn model_missing_folder_not_gguf_truncated_unknown_arch() {
    let d = temp_dir("bad-model");
    let c = corpus().to_string_lossy().into_owned();
    let f = ["-f", c.as_str()];
    refused_early(&calibrate_in(&d, Path::new("nope.gguf"), &f), &["-m nope.gguf", "cannot read the model file"]);
    std::fs::create_dir_all(d.join("adir")).unwrap();
    refused_early(&calibrate_in(&d, &d.join("adir"), &f), &["adir", "is a folder"]);
    std::fs::write(d.join("text.gguf"), "hello, not a model").unwrap();
    refused_early(&calibrate_in(&d, &d.join("text.gguf"), &f), &["text.gguf", "not a GGUF file"]);
    let model = read(&fixture("qwen3moe"));
    std::fs::write(d.join("half.gguf"), &model[..model.len() / 2]).unwrap();
    refused_early(&calibrate_in(&d, &d.join("half.gguf"), &f), &["half.gguf", "truncated", &format!("the file has {}", model.len() / 2)]);
    std::fs::write(d.join("head.gguf"), &model[..200]).unwrap();
    refused_early(&calibrate_in(&d, &d.join("head.gguf"), &f), &["head.gguf", "header cannot be read"]);
    // the architecture renamed everywhere (same length, so the file stays consistent)
    let renamed = replace_all(&model, b"qwen3moe", b"qwen9moe");
    std::fs::write(d.join("alien.gguf"), renamed).unwrap();
    refused_early(&calibrate_in(&d, &d.join("alien.gguf"), &f), &["alien.gguf", "architecture 'qwen9moe' is not known"]);
}

/// Tensor placement (`-ot PATTERN=TYPE`, `--n-cpu-moe N`): a value without a type, a type no
/// device has (the message lists those there are), a negative count, before the model loads;
/// a pattern that is not a regex, when llama.cpp's loader compiles it (its message names none,
/// ours adds the patterns given).
#[test]
fn tensor_overrides_that_cannot_apply() {
    let d = temp_dir("bad-ot");
    let model = fixture("qwen3moe");
    let c = corpus().to_string_lossy().into_owned();
    let go = |extra: &[&str]| calibrate_in(&d, &model, &[&["-f", c.as_str(), "-c", "128", "--chunks", "1"][..], extra].concat());
    refused_early(&go(&["-ot", "exps=CPU,attn"]), &["-ot exps=CPU,attn: 'attn' is not <tensor name pattern>=<buffer type>"]);
    refused_early(&go(&["-ot", "exps=CUDA0"]), &["-ot exps=CUDA0: unknown buffer type (available: CPU"]);
    refused_early(&go(&["--n-cpu-moe", "-1"]), &["--n-cpu-moe -1: expected a number of layers, 0 or more"]);
    refused(&go(&["-ot", "attn=CPU", "-ot", "(exps=CPU"]), &["regular expression", "a pattern of -ot is not a valid ECMAScript regex: attn  (exps"]);
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "something was written");
}

fn replace_all(b: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = b.to_vec();
    let mut i = 0;
    let mut n = 0;
    while i + from.len() <= out.len() {
        if &out[i..i + from.len()] == from {
            out[i..i + from.len()].copy_from_slice(to);
            n += 1;
        }
        i += 1;
    }
    assert!(n > 1, "{n} replacements");
    out
}

fn dense_fixture() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let d = temp_dir("dense-fixture");
        let p = d.join("dense.gguf");
        run_ok(Command::new(ours()).args(["fixture", "--dense", "-o"]).arg(&p));
        p
    })
    .clone()
}

#[test]
fn a_dense_model_gets_the_imatrix_only_with_one_notice_and_upstreams_bytes() {
    let model = dense_fixture();
    let (od, rd) = (temp_dir("dense-ours"), temp_dir("dense-ref"));
    let args = ["-f", &corpus().to_string_lossy(), "-c", "128", "-b", "128", "--chunks", "3", "--no-ppl", "-t", "2", "-o", "i.gguf"].map(String::from);
    let out = run_ok(Command::new(ours()).current_dir(&od).arg("-m").arg(&model).args(&args).args(["--trace-out", "t.bin"]));
    run_ok(Command::new(reference_bin("llama-imatrix")).current_dir(&rd).arg("-m").arg(&model).args(&args));
    let err = String::from_utf8_lossy(&out.stderr);
    let notices: Vec<&str> = err.lines().filter(|l| l.contains("dense model")).collect();
    assert_eq!(notices.len(), 1, "{err}");
    assert!(notices[0].starts_with("notice: ") && notices[0].contains("imatrix only"), "{err}");
    assert!(!od.join("i.reap.json").exists() && !od.join("t.bin").exists());
    assert_same_bytes(&od.join("i.gguf"), &rd.join("i.gguf"));
    // the manifest lists no REAP outputs
    let m: serde_json::Value = serde_json::from_slice(&read(&od.join("i.manifest.json"))).unwrap();
    let roles: Vec<&str> = m["outputs"].as_array().unwrap().iter().map(|o| o["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["imatrix"]);
}

// ---- the corpus

#[test]
fn corpus_missing_empty_not_utf8_too_short() {
    let d = temp_dir("bad-corpus");
    let m = fixture("qwen3moe");
    refused_early(&calibrate_in(&d, &m, &["-f", "none.txt"]), &["-f none.txt", "cannot read the calibration text"]);
    std::fs::write(d.join("empty.txt"), "\n").unwrap();
    refused_early(&calibrate_in(&d, &m, &["-f", "empty.txt"]), &["-f empty.txt", "empty"]);
    let mut text = read(&corpus());
    text[1000] = 0xff;
    let line = 1 + text[..1000].iter().filter(|&&b| b == b'\n').count();
    std::fs::write(d.join("latin1.txt"), &text).unwrap();
    refused_early(&calibrate_in(&d, &m, &["-f", "latin1.txt"]), &["-f latin1.txt", "not valid UTF-8", &format!("byte offset 1000 (line {line})")]);
    // too short by bytes: refused before loading
    std::fs::write(d.join("short.txt"), "a few words").unwrap();
    refused_early(&calibrate_in(&d, &m, &["-f", "short.txt", "-c", "64"]), &["short.txt", "you need at least 128 tokens", "only 11 bytes"]);
    // enough bytes, too few tokens: only the tokenizer can tell (after loading), still exit 2
    std::fs::write(d.join("words.txt"), "word ".repeat(60)).unwrap();
    refused(&calibrate_in(&d, &m, &["-f", "words.txt", "-c", "128"]), &["you need at least 256 tokens"]);
}

// ---- flags

#[test]
fn flags_refused_before_loading() {
    let d = temp_dir("bad-flags");
    let m = fixture("qwen3moe");
    let c = corpus().to_string_lossy().into_owned();
    for ctx in ["0", "-5"] {
        refused_early(&calibrate_in(&d, &m, &["-f", &c, "-c", ctx]), &["--ctx-size"]);
    }
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "--chunks", "0"]), &["--chunks 0"]);
    // negative values given with a space are values, as upstream's parser takes them
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "-b", "-1"]), &["-b -1: the batch size must be at least 1"]);
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "-ub", "-3"]), &["-ub -3: the micro-batch size"]);
    // llama.cpp takes at most 256 sequences per batch; said before the load, not after it
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "-c", "4"]), &["-b 2048 holds 512 chunks of -c 4", "at most 256"]);
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "--trace-out", "t.bin", "--trace-tokens", "0"]), &["--trace-tokens 0 traces nothing"]);
    // --domains describes the text of -f: combining --in-file alone reads none
    let domains = repo().join("corpus/mix.domains.tsv");
    let dc = temp_dir("bad-flags-combine");
    assert!(calibrate_in(&dc, &m, &["-f", &c, "-c", "128", "--chunks", "1", "-o", "i.gguf"]).status.success());
    refused_early(&calibrate_in(&dc, &m, &["--in-file", "i.gguf", "-o", "j.gguf", "--domains", domains.to_str().unwrap()]), &["--domains", "needs the calibration text it describes (-f)"]);
    assert!(!dc.join("j.gguf").exists());
    // a trace holds one k: a model whose layers use different counts is not traced
    let per_layer = d.join("per-layer-k.gguf");
    with_per_layer_k(&m, &per_layer, &[4, 2, 6, 4]);
    refused_early(&calibrate_in(&d, &per_layer, &["-f", &c, "--trace-out", "t.bin"]), &["different number of experts per token in different layers (2, 4, 6)", "leave out --trace-out"]);
    // llama4 weights the experts' inputs: REAP is off by default (a notice), refused when asked for
    let l4 = d.join("llama4-header.gguf");
    with_kv(&m, &l4, |_| "general.architecture".into(), &gguf_string("llama4"));
    refused_early(&calibrate_in(&d, &l4, &["-f", &c, "--reap-out", "r.json"]), &["is a llama4 model", "REAP saliency (gate × ‖expert output‖) is not defined"]);
    let out = calibrate_in(&d, &l4, &["-f", &c]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("notice: ") && String::from_utf8_lossy(&out.stderr).contains("imatrix only"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run(Command::new(ours()).args(["trace-decode", "-m"]).arg(&l4).args(["-f"]).arg(repo().join("corpus/prompts.txt")).args(["--trace-out"]).arg(d.join("d.bin")));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("its routing cannot be traced here"), "{}", String::from_utf8_lossy(&out.stderr));
    // grovemoe's two MoE passes per block carry the same node names: likewise
    let grove = d.join("grovemoe-header.gguf");
    with_kv(&m, &grove, |_| "general.architecture".into(), &gguf_string("grovemoe"));
    refused_early(&calibrate_in(&d, &grove, &["-f", &c, "--trace-out", "t.bin"]), &["is a grovemoe model", "cannot be told apart"]);
    let out = run(Command::new(ours()).args(["trace-decode", "-m"]).arg(&per_layer).args(["-f"]).arg(repo().join("corpus/prompts.txt")).args(["--trace-out"]).arg(d.join("d.bin")));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("different number of experts per token"), "{}", String::from_utf8_lossy(&out.stderr));
    // the fixture has 32 experts
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "--trace-out", "t.bin", "--trace-top-n", "33"]), &["--trace-top-n 33", "32 experts"]);
    // fewer candidates than the 4 experts a token uses: a trace no reader would accept
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "--trace-out", "t.bin", "--trace-top-n", "2"]), &["--trace-top-n 2: fewer than the 4 experts"]);
    // upstream's placement and cache flags are read, not dropped: bad values are named
    for (flag, value, says) in [
        ("-sm", "bogus", "expected none, layer, row or tensor"),
        ("-ts", "1,x", "expected non-negative numbers"),
        ("-ctk", "q9", "unsupported cache type"),
        ("-ctv", "q9", "unsupported cache type"),
        ("-fit", "on", "does not fit arguments to device memory"),
        ("-dev", "CPU", "not a device to offload to (available: none; -dev none keeps every layer on the host)"),
        ("-dev", ",", "no devices specified"),
    ] {
        refused_early(&calibrate_in(&d, &m, &["-f", &c, flag, value]), &[flag, says]);
    }
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "-o", "a.gguf", "--reap-out", "./a.gguf"]), &["name the same file"]);
    // the same new file through `..` or a linked folder
    std::fs::create_dir_all(d.join("sub")).unwrap();
    let _ = std::os::unix::fs::symlink(".", d.join("here"));
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "-o", "a.gguf", "--reap-out", "sub/../a.gguf"]), &["name the same file"]);
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "-o", "a.gguf", "--trace-out", "here/a.gguf"]), &["name the same file"]);
    std::fs::write(d.join("dom.tsv"), "start	end	domain	tokens
").unwrap();
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "--domains", "dom.tsv", "--manifest-out", "dom.tsv"]), &["--manifest-out dom.tsv is the --domains input"]);
    assert_eq!(std::fs::read_to_string(d.join("dom.tsv")).unwrap(), "start	end	domain	tokens
");
    let copy = d.join("model-copy.gguf");
    std::fs::copy(&m, &copy).unwrap();
    refused_early(&calibrate_in(&d, &copy, &["-f", &c, "-o", "model-copy.gguf"]), &["-o model-copy.gguf is the -m input"]);
    assert_eq!(read(&copy), read(&m), "the model was not touched");
    // nothing listens on a port that was free a moment ago
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let rpc = format!("127.0.0.1:{port}");
    refused_early(&calibrate_in(&d, &m, &["-f", &c, "--rpc", &rpc]), &[&format!("--rpc {rpc}"), "unreachable"]);
    assert!(std::fs::read_dir(&d).unwrap().all(|e| e.unwrap().path().extension().is_none_or(|x| x != "json")), "nothing written");
}

/// Upstream at the pin runs `-b` below `-c` and not dividing it (batches of b, then the
/// rest), so we do too, with the same bytes.
#[test]
fn a_batch_that_does_not_divide_the_context_matches_upstream() {
    let model = fixture("qwen3moe");
    let (od, rd) = (temp_dir("b-nodiv-ours"), temp_dir("b-nodiv-ref"));
    let args = ["-f", &corpus().to_string_lossy(), "-c", "128", "-b", "48", "--chunks", "3", "-t", "2", "-o", "i.gguf"].map(String::from);
    let a = run_ok(Command::new(ours()).current_dir(&od).arg("-m").arg(&model).args(&args));
    let b = run_ok(Command::new(reference_bin("llama-imatrix")).current_dir(&rd).arg("-m").arg(&model).args(&args));
    assert_same_bytes(&od.join("i.gguf"), &rd.join("i.gguf"));
    assert_eq!(ppl_lines(&a), ppl_lines(&b));
    let out = run(Command::new(ours()).current_dir(&od).arg("check").args(["--reap", "i.reap.json", "--imatrix", "i.gguf"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn an_in_file_of_another_model_is_refused_before_loading() {
    let d = temp_dir("in-file-other");
    let other = d.join("wide.gguf");
    run_ok(Command::new(ours()).args(["fixture", "--n-embd", "128", "--layers", "2", "-o"]).arg(&other));
    run_ok(Command::new(ours()).current_dir(&d).arg("-m").arg(&other).arg("-f").arg(corpus()).args(["-c", "64", "--chunks", "2", "--no-ppl", "--no-reap", "-o", "wide.imatrix.gguf"]));
    let out = calibrate_in(&d, &fixture("qwen3moe"), &["-f", &corpus().to_string_lossy(), "--in-file", "wide.imatrix.gguf"]);
    refused_early(&out, &["--in-file wide.imatrix.gguf", "blk.0.", "another model"]);
}

/// A NaN in an `--in-file` is named with the file before the model loads (upstream stops on it
/// after the load, naming only a tensor).
#[test]
fn an_in_file_with_a_nan_is_refused_before_loading() {
    let d = temp_dir("in-file-nan");
    let m = fixture("qwen3moe");
    let c = corpus().to_string_lossy().into_owned();
    let good = calibrate_in(&d, &m, &["-f", &c, "-c", "64", "--chunks", "2", "--no-reap", "--output-format", "dat", "-o", "good.dat"]);
    assert!(good.status.success(), "{}", String::from_utf8_lossy(&good.stderr));
    // legacy layout: n_entries, then per entry: name length, name, ncall, nval, nval floats
    let mut b = read(&d.join("good.dat"));
    let name_len = i32::from_le_bytes(b[4..8].try_into().unwrap()) as usize;
    let first_value = 8 + name_len + 8;
    b[first_value..first_value + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(d.join("nan.dat"), &b).unwrap();
    let out = calibrate_in(&d, &m, &["-f", &c, "--in-file", "nan.dat"]);
    refused_early(&out, &["--in-file nan.dat", "non-finite sum (NaN at index 0)", "damaged imatrix"]);
}

// ---- files read by check, select, replay, reproduce

struct Run {
    dir: PathBuf,
}

/// One real run with every output, and a keep map, shared by the reader tests.
fn real_run() -> &'static Run {
    static R: OnceLock<Run> = OnceLock::new();
    R.get_or_init(|| {
        let dir = temp_dir("bad-files-run");
        run_ok(Command::new(ours()).current_dir(&dir).arg("-m").arg(fixture("qwen3moe")).arg("-f").arg(corpus()).args([
            "-c", "128", "-b", "128", "--chunks", "3", "--no-ppl", "-t", "2", "-o", "i.gguf", "--trace-out", "t.bin",
        ]));
        run_ok(Command::new(ours()).current_dir(&dir).args(["select", "--reap", "i.reap.json", "--method", "frequency", "--k", "8", "--out-dir", "maps"]));
        Run { dir }
    })
}

impl Run {
    fn bytes(&self, name: &str) -> Vec<u8> {
        read(&self.dir.join(name))
    }
    fn keep_map(&self) -> serde_json::Value {
        let p = std::fs::read_dir(self.dir.join("maps")).unwrap().map(|e| e.unwrap().path()).find(|p| p.file_name().unwrap().to_string_lossy().starts_with("keep_")).unwrap();
        serde_json::from_slice(&read(&p)).unwrap()
    }
    fn tool(&self, args: &[&str]) -> Output {
        run(Command::new(ours()).current_dir(&self.dir).args(args))
    }
}

#[test]
fn damaged_traces_are_refused_by_every_reader() {
    let r = real_run();
    let good = r.bytes("t.bin");
    let h = TraceReader::open(&r.dir.join("t.bin")).unwrap().header;
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    let row = h.row_size();
    cases.push(("trunc.bin", good[..good.len() - row - 5].to_vec(), "only 382 are present (truncated file)"));
    let mut magic = good.clone();
    magic[..8].copy_from_slice(b"NOTATRCE");
    cases.push(("magic.bin", magic, "no REAPTRC1 magic"));
    let mut version = good.clone();
    version[8..12].copy_from_slice(&7u32.to_le_bytes());
    cases.push(("version.bin", version, "unsupported trace version 7"));
    let mut layers = good.clone();
    layers[16..20].copy_from_slice(&1_000_000u32.to_le_bytes());
    cases.push(("layers.bin", layers, "header says 1000000 layers"));
    let mut rows = good.clone();
    rows[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
    cases.push(("rows.bin", rows, "truncated file"));
    let mut shape = good.clone();
    shape[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
    cases.push(("shape.bin", shape, "implausible shape"));
    for (name, bytes, why) in &cases {
        std::fs::write(r.dir.join(name), bytes).unwrap();
        for args in [
            vec!["check", "--reap", "i.reap.json", "--trace", name],
            vec!["replay", "--trace", name, "--policy", "lru", "--capacity", "8"],
            vec!["select", "--reap", "i.reap.json", "--method", "frequency", "--k", "8", "--out-dir", "m2", "--trace", name],
        ] {
            refused(&r.tool(&args), &[name, why]);
        }
    }
    assert_eq!(h.n_tokens, 384);
}

#[test]
fn damaged_saliency_json_is_refused_or_fails_check() {
    let r = real_run();
    let good: serde_json::Value = serde_json::from_slice(&r.bytes("i.reap.json")).unwrap();
    let text = String::from_utf8(r.bytes("i.reap.json")).unwrap();
    let write = |name: &str, s: &str| std::fs::write(r.dir.join(name), s).unwrap();
    write("cut.json", &text[..text.len() / 2]);
    write("nan.json", &text.replacen("\"reap_l2_sum\": [\n", "\"reap_l2_sum\": [\n NaN,", 1));
    let mut v = good.clone();
    v["version"] = 9.into();
    write("v9.json", &v.to_string());
    let mut v = good.clone();
    v["layers"][0]["count"][0] = (-1).into();
    write("negcount.json", &v.to_string());
    let mut v = good.clone();
    v["layers"][0]["n_expert"] = u64::MAX.into();
    write("huge.json", &v.to_string());
    for (name, why) in [
        ("cut.json", "not valid JSON"),
        ("nan.json", "not valid JSON"),
        ("v9.json", "unsupported version 9"),
        ("negcount.json", "\"count\" holds -1, not a non-negative integer"),
        ("huge.json", "\"count\" has 32 values, n_expert is 18446744073709551615"),
    ] {
        refused(&r.tool(&["check", "--reap", name]), &[name, why]);
        refused(&r.tool(&["select", "--reap", name, "--method", "frequency", "--k", "8", "--out-dir", "m3"]), &[name, why]);
    }
    // a negative sum parses: check reports the broken invariant (exit 1), select refuses it
    let mut v = good.clone();
    v["layers"][1]["reap_l2_sum"][3] = (-0.5).into();
    write("negsum.json", &v.to_string());
    let out = r.tool(&["check", "--reap", "negsum.json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("FAIL"));
    refused(&r.tool(&["select", "--reap", "negsum.json", "--method", "frequency", "--k", "8", "--out-dir", "m3"]), &["negsum.json", "\"reap_l2_sum\"[3] is -0.5"]);
    // sums for an expert no token chose, and a k above the expert count: the file is named, not --k
    let mut v = good.clone();
    let dead = v["layers"][1]["count"].as_array().unwrap().iter().position(|c| c == 0).expect("the fixture has dead experts");
    v["layers"][1]["reap_l2_sum"][dead] = 0.25.into();
    write("deadsum.json", &v.to_string());
    let mut v = good.clone();
    v["layers"][0]["n_expert_used"] = 40.into();
    write("bigk.json", &v.to_string());
    for (name, why) in [("deadsum.json", &format!("expert {dead} has count 0 but \"reap_l2_sum\" 0.25") as &str), ("bigk.json", "n_expert_used 40 is more than its n_expert 32")] {
        refused(&r.tool(&["select", "--reap", name, "--method", "frequency", "--k", "8", "--out-dir", "m3"]), &[name, why]);
    }
    assert!(!r.dir.join("m3").exists());
}

#[test]
fn a_keep_map_for_another_model_is_refused() {
    let r = real_run();
    let good = r.keep_map();
    let write = |name: &str, v: &serde_json::Value| std::fs::write(r.dir.join(name), v.to_string()).unwrap();
    let mut fewer = good.clone();
    fewer["layers"].as_array_mut().unwrap().pop();
    write("fewer.json", &fewer);
    let mut id = good.clone();
    id["layers"][0]["keep"][0] = 40.into();
    write("id.json", &id);
    let mut block = good.clone();
    block["layers"][0]["layer"] = 7.into();
    write("block.json", &block);
    std::fs::write(r.dir.join("cut-map.json"), &good.to_string()[..20]).unwrap();
    for (name, why) in [
        ("fewer.json", "3 layers, the trace has 4 MoE layers"),
        ("id.json", "keeps expert 40, the trace has 32 experts"),
        ("block.json", "entry 0 is block 7"),
        ("cut-map.json", "not valid JSON"),
    ] {
        refused(&r.tool(&["replay", "--trace", "t.bin", "--policy", "lru", "--capacity", "8", "--keep-map", name]), &[name, why]);
    }
}

#[test]
fn damaged_manifests_are_refused_by_reproduce() {
    let r = real_run();
    let text = String::from_utf8(r.bytes("i.manifest.json")).unwrap();
    let good: serde_json::Value = serde_json::from_str(&text).unwrap();
    std::fs::write(r.dir.join("cut.manifest.json"), &text[..text.len() / 3]).unwrap();
    let mut v = good.clone();
    v["version"] = 2.into();
    std::fs::write(r.dir.join("v2.manifest.json"), v.to_string()).unwrap();
    let mut v = good.clone();
    v["inputs"][0]["size"] = (-1).into();
    std::fs::write(r.dir.join("neg.manifest.json"), v.to_string()).unwrap();
    for (name, why) in [("cut.manifest.json", "not valid JSON"), ("v2.manifest.json", "unsupported \"version\""), ("neg.manifest.json", "file record without \"size\"")] {
        refused(&r.tool(&["reproduce", name]), &[name, why]);
    }
}

#[test]
fn a_damaged_imatrix_is_refused_by_check() {
    let r = real_run();
    let good = r.bytes("i.gguf");
    std::fs::write(r.dir.join("cut.imatrix.gguf"), &good[..good.len() / 2]).unwrap();
    refused(&r.tool(&["check", "--reap", "i.reap.json", "--imatrix", "cut.imatrix.gguf"]), &["cut.imatrix.gguf", "not a readable GGUF"]);
    std::fs::write(r.dir.join("junk.imatrix"), b"\x05\x00\x00\x00junk").unwrap();
    refused(&r.tool(&["check", "--reap", "i.reap.json", "--imatrix", "junk.imatrix"]), &["junk.imatrix", "neither GGUF nor a legacy imatrix"]);
    // a well-formed GGUF whose chunk count has another type: ggml's typed getter would abort
    // (found by the fuzz target on CI); the int32 keeps every size and offset as it was
    let key = b"imatrix.chunk_count";
    let at = good.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(&good[at..at + 4], &4u32.to_le_bytes(), "uint32 type tag after the key");
    let mut retyped = good.clone();
    retyped[at..at + 4].copy_from_slice(&5u32.to_le_bytes());
    std::fs::write(r.dir.join("retyped.imatrix.gguf"), &retyped).unwrap();
    refused(&r.tool(&["check", "--reap", "i.reap.json", "--imatrix", "retyped.imatrix.gguf"]), &["retyped.imatrix.gguf", "imatrix.chunk_count must be a uint32"]);
}

/// `REAP_BACKEND_DIR` (backend modules loaded at start, docs/gpu.md): a file that is not a
/// loadable module is named in a warning and the run goes on with the backends linked in; CPU
/// modules and ggml's base library are never loaded (the CPU backend is linked in).
#[test]
fn a_bad_backend_module_is_named_and_the_run_goes_on() {
    let d = temp_dir("backend-dir");
    let mods = d.join("mods");
    std::fs::create_dir_all(&mods).unwrap();
    for f in ["libggml-junk.so", "libggml-cpu-haswell.so", "libggml-base.so", "README"] {
        std::fs::write(mods.join(f), b"not a shared library").unwrap();
    }
    let out = run(Command::new(ours()).current_dir(&d).env("REAP_BACKEND_DIR", &mods).arg("-m").arg(fixture("qwen3moe")).arg("-f").arg(corpus()).args(["-c", "64", "--chunks", "1", "--no-ppl", "-o", "i.gguf"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("could not load the backend module") && err.contains("libggml-junk.so"), "{err}");
    assert!(!err.contains("libggml-cpu-haswell.so") && !err.contains("libggml-base.so"), "{err}");
}

/// Every flag spelling of upstream's `llama-imatrix --help` at the pin is either parsed or
/// refused by name: none reaches clap as an unknown argument or, being a multi-letter short
/// flag, as a bundle of one-letter ones (`-hff` as `-h`: help and exit 0; `-bs` as `-b s`).
/// The list our binary embeds is the reference binary's, as its --help spells it today.
#[test]
fn every_upstream_flag_is_parsed_or_refused_by_name() {
    let help = run(Command::new(reference_bin("llama-imatrix")).arg("--help"));
    let text = String::from_utf8_lossy(&help.stdout).into_owned() + &String::from_utf8_lossy(&help.stderr);
    // a flag line: its spelling fills the first 40 columns, unless it runs past them
    let mut upstream = std::collections::BTreeSet::new();
    for line in text.lines().filter(|l| l.starts_with('-') && !l.starts_with("-----")) {
        let spec = if line.len() > 40 && line.as_bytes()[39] == b' ' { &line[..40] } else { line };
        for (i, _) in spec.match_indices('-') {
            let before = spec[..i].chars().last();
            if !(before.is_none() || before == Some(' ') || before == Some(',')) {
                continue;
            }
            let flag: String = spec[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
            if flag.trim_start_matches('-').starts_with(|c: char| c.is_ascii_alphabetic()) {
                upstream.insert(flag);
            }
        }
    }
    let embedded: std::collections::BTreeSet<String> = std::fs::read_to_string(repo().join("src/cli/llama-imatrix-flags.txt"))
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    assert!(upstream.len() > 150, "parsed only {} flags from upstream's --help", upstream.len());
    assert_eq!(embedded, upstream, "src/cli/llama-imatrix-flags.txt is not upstream's flag list");
    // --list-devices prints the devices and exits 0, as upstream's does
    let out = run(Command::new(ours()).args(["-m", "/nonexistent.gguf", "--list-devices"]));
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with("Available devices:\n"), "{out:?}");
    for flag in upstream.iter().filter(|f| !matches!(f.as_str(), "-h" | "--help" | "--version" | "--list-devices")) {
        let out = run(Command::new(ours()).args(["-m", "/nonexistent.gguf", flag]));
        let said = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{flag}: exit 0: {said}");
        assert!(
            !said.contains("unexpected argument") && !said.contains("invalid value") && !said.contains("A drop-in llama-imatrix"),
            "{flag} was not parsed as upstream's flag: {said}"
        );
    }
}
