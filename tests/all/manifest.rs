//! The run manifest and `reproduce`.

use super::util::*;
use std::process::Command;

#[test]
fn a_run_reproduces_byte_for_byte_and_changes_are_reported() {
    let d = temp_dir("reproduce");
    std::fs::copy(fixture("qwen2moe"), d.join("m.gguf")).unwrap();
    std::fs::copy(corpus(), d.join("c.txt")).unwrap();
    run_ok(Command::new(ours()).current_dir(&d).args([
        "-m", "m.gguf", "-f", "c.txt", "-c", "256", "-b", "256", "--chunks", "4", "-t", "2", "--no-ppl", "-o", "i.gguf",
        "--trace-out", "t.bin", "--save-frequency", "2",
    ]));
    let m: serde_json::Value = serde_json::from_slice(&read(&d.join("i.manifest.json"))).unwrap();
    let roles: Vec<&str> = m["outputs"].as_array().unwrap().iter().map(|o| o["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["imatrix", "reap", "trace", "imatrix_at", "imatrix_at"]);
    // what makes the numbers CPU-dependent is recorded
    let platform = &m["platform"];
    assert!(platform["system_info"].as_str().unwrap().contains("CPU"), "{platform}");
    assert!(!platform["cpu_features"].as_array().unwrap().is_empty(), "{platform}");
    assert!(platform["devices"].as_array().unwrap().iter().any(|d| d.as_str().unwrap().starts_with("CPU")), "{platform}");
    let out = run(Command::new(ours()).args(["reproduce"]).arg(d.join("i.manifest.json")));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(text.matches(": identical").count(), 5, "{text}");
    assert!(!text.contains("outputs may differ"), "{text}");

    // recorded on a CPU with other features: said up front, before any byte is compared
    let mut other = m.clone();
    let mut feats: Vec<serde_json::Value> = other["platform"]["cpu_features"].as_array().unwrap().clone();
    feats.retain(|f| f != "AVX512");
    feats.push("AVX512".into());
    if m["platform"]["cpu_features"].as_array().unwrap().iter().any(|f| f == "AVX512") {
        feats.retain(|f| f != "AVX512");
    }
    other["platform"]["cpu_features"] = feats.into();
    std::fs::write(d.join("other-cpu.manifest.json"), serde_json::to_vec(&other).unwrap()).unwrap();
    let out = run(Command::new(ours()).args(["reproduce"]).arg(d.join("other-cpu.manifest.json")));
    let text = String::from_utf8_lossy(&out.stdout);
    let warn = text.lines().position(|l| l.contains("warning: outputs may differ: built for")).unwrap_or_else(|| panic!("{text}"));
    assert!(text.contains("AVX512"), "{text}");
    assert!(warn < text.lines().position(|l| l.contains("output ")).unwrap(), "{text}");

    // a recorded output that does not match what the run gives
    let mut bad = m.clone();
    bad["outputs"][1]["sha256"] = "0".repeat(64).into();
    std::fs::write(d.join("bad.manifest.json"), serde_json::to_vec(&bad).unwrap()).unwrap();
    let out = run(Command::new(ours()).args(["reproduce"]).arg(d.join("bad.manifest.json")));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("output reap i.reap.json: DIFFERENT"));

    // -o with its value attached, reproduced from another folder into a relative --work-dir
    std::fs::create_dir_all(d.join("at")).unwrap();
    std::fs::create_dir_all(d.join("elsewhere")).unwrap();
    run_ok(Command::new(ours()).current_dir(&d).args(["-m", "m.gguf", "-f", "c.txt", "-c", "256", "--chunks", "2", "-t", "2", "--no-ppl", "-oat/y.gguf"]));
    let out = run(Command::new(ours()).current_dir(d.join("elsewhere")).args(["reproduce", "../at/y.manifest.json", "--work-dir", "wd", "--keep"]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("output imatrix at/y.gguf: identical"), "{text}");
    assert!(d.join("elsewhere/wd/at/y.gguf").is_file());
    // without --keep, a --work-dir that existed loses only the re-run's files (and the folder
    // made for them)
    std::fs::create_dir_all(d.join("elsewhere/wd2")).unwrap();
    std::fs::write(d.join("elsewhere/wd2/mine.txt"), "keep me").unwrap();
    let out = run(Command::new(ours()).current_dir(d.join("elsewhere")).args(["reproduce", "../at/y.manifest.json", "--work-dir", "wd2"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    let left: Vec<String> = std::fs::read_dir(d.join("elsewhere/wd2")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(left, ["mine.txt"]);
    // the kept re-run's files are there still: the same folder again is refused, not written over
    let out = run(Command::new(ours()).current_dir(d.join("elsewhere")).args(["reproduce", "../at/y.manifest.json", "--work-dir", "wd"]));
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));

    // a manifest recording no outputs has nothing to reproduce
    let mut none = m.clone();
    none["outputs"] = serde_json::json!([]);
    std::fs::write(d.join("none.manifest.json"), serde_json::to_vec(&none).unwrap()).unwrap();
    let out = run(Command::new(ours()).args(["reproduce"]).arg(d.join("none.manifest.json")));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("records no outputs"));

    // an input that changed since: refused before running
    let mut text = read(&d.join("c.txt"));
    text.extend_from_slice(b"\nmore text\n");
    std::fs::write(d.join("c.txt"), text).unwrap();
    let out = run(Command::new(ours()).args(["reproduce"]).arg(d.join("i.manifest.json")));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("input corpus c.txt: CHANGED"));
}

/// A signal that ends `reproduce` ends its re-run too and takes the re-run's files and the
/// folder it made with it: no orphan keeps writing, no scratch folder is left. And a manifest
/// whose outputs were written over since says so.
#[test]
fn a_signal_to_reproduce_stops_the_rerun_and_leaves_no_scratch() {
    let d = temp_dir("reproduce-signal");
    let run_args = ["-c", "64", "-b", "64", "--chunks", "150", "--trace-out", "t.bin"];
    run_ok(&mut calibrate_cmd(&d, &run_args));
    let work = d.join("again");
    let mut cmd = Command::new(ours());
    cmd.args(["reproduce"]).arg(d.join("i.manifest.json")).arg("--work-dir").arg(&work);
    let mut child = default_signals(&mut cmd).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    wait_for_file(&mut child, &work.join("i.reap.json"));
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert!(!status.success());
    // an orphaned re-run would go on writing into the folder
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(!work.exists(), "the scratch folder was left: {:?}", std::fs::read_dir(&work).map(|r| r.map(|e| e.unwrap().file_name()).collect::<Vec<_>>()));
    // outputs written over by a later run (which removes the manifest at its own path; a copy
    // kept aside still names them) are named, and the re-run still reproduces
    let short = ["-c", "64", "-b", "64", "--trace-out", "s.bin", "-o", "s.gguf"];
    run_ok(calibrate_cmd(&d, &short).args(["--chunks", "2"]));
    std::fs::copy(d.join("s.manifest.json"), d.join("saved.json")).unwrap();
    run_ok(calibrate_cmd(&d, &short).args(["--chunks", "3"]));
    let out = run(Command::new(ours()).arg("reproduce").arg(d.join("saved.json")));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for f in ["s.gguf", "s.reap.json", "s.bin"] {
        assert!(text.contains(&format!("note: {f} on disk is not the")), "{f}: {text}");
    }
}

/// `reproduce --work-dir` never writes over (and then removes) a file that is there: each
/// output goes to its recorded path under the folder (so the recorded run's own folder leaves
/// the recorded outputs alone), one that would land on an existing file is refused, and so is
/// a file given as the folder. The re-run keeps two outputs of one name in two folders apart, writes a device
/// output in place (no stray file in the work dir), and a re-run that fails leaves no empty
/// folder. A recorded output deleted since is noted.
#[test]
fn reproduce_writes_over_nothing_and_leaves_nothing() {
    let d = temp_dir("reproduce-work-dir");
    std::fs::copy(fixture("qwen3moe"), d.join("m.gguf")).unwrap();
    std::fs::copy(corpus(), d.join("c.txt")).unwrap();
    let calibrate = |extra: &[&str]| {
        run_ok(Command::new(ours()).current_dir(&d).args(["-m", "m.gguf", "-f", "c.txt", "-c", "128", "-b", "128", "--chunks", "2", "-t", "2", "--no-ppl"]).args(extra))
    };
    let reproduce = |args: &[&str]| run(Command::new(ours()).current_dir(&d).arg("reproduce").args(args));
    for f in ["out", "x", "y", "dn"] {
        std::fs::create_dir_all(d.join(f)).unwrap();
    }
    let listing = |p: &str| {
        let mut v: Vec<String> = std::fs::read_dir(d.join(p)).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    };

    calibrate(&["-o", "out/i.gguf", "--trace-out", "out/t.bin", "--manifest-out", "out/run.manifest.json"]);
    let before: Vec<(String, Vec<u8>)> = listing("out").into_iter().map(|f| (f.clone(), read(&d.join("out").join(&f)))).collect();
    // the run's own folder: the re-run's files go to out/out/…, and only they are removed
    let out = reproduce(&["out/run.manifest.json", "--work-dir", "out"]);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let after: Vec<(String, Vec<u8>)> = listing("out").into_iter().map(|f| (f.clone(), read(&d.join("out").join(&f)))).collect();
    assert!(before == after, "the recorded outputs changed");
    // an absolute path lands on itself under --work-dir /: refused, nothing touched
    let abs = d.join("out/i.gguf");
    calibrate(&["-o", abs.to_str().unwrap(), "--manifest-out", "abs.manifest.json"]);
    let before = read(&abs);
    let out = reproduce(&["abs.manifest.json", "--work-dir", "/"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("already holds") && err.contains("i.gguf"), "{err}");
    assert_eq!(read(&abs), before);
    let out = reproduce(&["out/run.manifest.json", "--work-dir", "c.txt"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));

    // one file name in two folders, and a device output, into an empty --work-dir
    calibrate(&["-o", "x/out", "--reap-out", "y/out", "--manifest-out", "two.manifest.json"]);
    calibrate(&["-o", "/dev/null", "--reap-out", "dn/r.json", "--manifest-out", "dn.manifest.json"]);
    std::fs::create_dir_all(d.join("wd")).unwrap();
    for m in ["two.manifest.json", "dn.manifest.json"] {
        let out = reproduce(&[m, "--work-dir", "wd"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && text.contains("reproduced: every output is byte-identical"), "{m}: {text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(listing("wd").is_empty(), "{m}: left {:?}", listing("wd"));
    }

    // a re-run that fails at once: no folder left behind
    let mut m: serde_json::Value = serde_json::from_slice(&read(&d.join("two.manifest.json"))).unwrap();
    m["argv"].as_array_mut().unwrap().push("--no-such-flag".into());
    std::fs::write(d.join("bad.manifest.json"), serde_json::to_vec(&m).unwrap()).unwrap();
    let out = reproduce(&["bad.manifest.json", "--work-dir", "fresh"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("it wrote nothing") && !d.join("fresh").exists(), "{err}");

    // a recorded output deleted since
    std::fs::remove_file(d.join("out/t.bin")).unwrap();
    let out = reproduce(&["out/run.manifest.json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("out/t.bin (the trace this manifest records) no longer exists"), "{text}");
}

/// The manifest and the saliency JSON record the corpus bytes the run read: a file changed
/// while the run goes on (here once its routing trace has started) is recorded as it was read,
/// and `reproduce` then reports the input as changed.
#[test]
fn the_corpus_is_recorded_as_read() {
    let d = temp_dir("manifest-corpus-read");
    std::fs::copy(fixture("qwen3moe"), d.join("m.gguf")).unwrap();
    std::fs::copy(corpus(), d.join("c.txt")).unwrap();
    let read_sha = reap_imatrix::formats::sha256::sha256_file(&d.join("c.txt")).unwrap();
    let mut child = Command::new(ours())
        .current_dir(&d)
        .args(["-m", "m.gguf", "-f", "c.txt", "-c", "128", "-b", "128", "--chunks", "40", "-t", "1", "--no-ppl", "-o", "i.gguf", "--trace-out", "t.bin"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while !std::fs::read_dir(&d).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().starts_with("t.bin")) {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before its trace started");
        assert!(started.elapsed().as_secs() < 120, "no trace after 2 minutes");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut text = read(&d.join("c.txt"));
    text.extend_from_slice(b"\nappended while the run went on\n");
    std::fs::write(d.join("c.txt"), text).unwrap();
    assert!(child.wait().unwrap().success());
    let m: serde_json::Value = serde_json::from_slice(&read(&d.join("i.manifest.json"))).unwrap();
    let rec = m["inputs"].as_array().unwrap().iter().find(|r| r["role"] == "corpus").unwrap();
    assert_eq!((rec["sha256"].as_str(), rec["size"].as_u64()), (Some(read_sha.as_str()), Some(std::fs::metadata(corpus()).unwrap().len())));
    let s: serde_json::Value = serde_json::from_slice(&read(&d.join("i.reap.json"))).unwrap();
    assert_eq!(s["metadata"]["corpus"]["sha256"].as_str(), Some(read_sha.as_str()));
    let out = run(Command::new(ours()).args(["reproduce"]).arg(d.join("i.manifest.json")));
    assert!(String::from_utf8_lossy(&out.stdout).contains("input corpus c.txt: CHANGED"), "{}", String::from_utf8_lossy(&out.stdout));
}
