//! SIGINT / SIGTERM during a calibration: the run stops between ubatches with consistent
//! outputs and a manifest saying where; a second signal exits at once, leaving the previous
//! checkpoint.

use super::util::*;
use reap_imatrix::formats::manifest::Manifest;
use reap_imatrix::formats::saliency::Saliency;
use reap_imatrix::formats::trace::TraceReader;
use std::process::{Command, Stdio};

fn check(dir: &std::path::Path, args: &[&str]) {
    run_ok(Command::new(ours()).current_dir(dir).arg("check").args(args));
}

#[test]
fn a_signal_stops_the_run_between_ubatches_with_consistent_outputs() {
    for (sig, name, code) in [(libc::SIGINT, "SIGINT", 130), (libc::SIGTERM, "SIGTERM", 143)] {
        let d = temp_dir(&format!("interrupt-{name}"));
        // two ubatches per chunk, so the signal can land inside a chunk
        let mut child = calibrate_cmd(&d, &["-c", "128", "-b", "128", "-ub", "64", "-ofreq", "2", "--trace-out", "t.bin"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for_file(&mut child, &d.join("i.reap.json"));
        signal(&child, sig);
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{name}: {err}");

        let m = Manifest::read(&d.join("i.manifest.json")).unwrap();
        let i = m.interrupted.unwrap_or_else(|| panic!("{name}: the manifest does not record the interruption"));
        assert_eq!(i.signal, name);
        assert!(i.tokens > 0 && i.tokens % 64 == 0, "{name}: {} tokens is not whole ubatches", i.tokens);
        assert_eq!((i.chunks_done, i.chunk), (i.tokens / 128, i.tokens / 128 + 1), "{name}: {i:?}");
        assert!(err.contains(&format!("interrupted by {name} during chunk {}: the outputs hold the {} tokens", i.chunk, i.tokens)), "{err}");

        // every output holds exactly those tokens, and every invariant holds across them
        check(&d, &["--reap", "i.reap.json", "--imatrix", "i.gguf", "--trace", "t.bin"]);
        let s = Saliency::read(&d.join("i.reap.json")).unwrap();
        assert_eq!((s.tokens, s.trace_tokens_written), (i.tokens, i.tokens));
        let t = TraceReader::open(&d.join("t.bin")).unwrap();
        assert!(!t.header_count_missing);
        assert_eq!(t.n_rows, i.tokens);
        let im = reap_imatrix::formats::imatrix::load(&d.join("i.gguf")).unwrap();
        assert_eq!(im.chunk_count as u64, i.chunks_done);
        // and the manifest's hashes are those of the files left
        for f in &m.outputs {
            let now = reap_imatrix::formats::manifest::FileRecord::of(&f.role, &f.path, &d).unwrap();
            assert_eq!(now.sha256, f.sha256, "{}", f.path.display());
        }
        // a partial run is not something to reproduce
        let r = run(Command::new(ours()).current_dir(&d).args(["reproduce", "i.manifest.json"]));
        assert_eq!(r.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&r.stderr).contains(&format!("stopped by {name} at chunk {}", i.chunk)));
    }
}

/// Whether `sig` is pending for the whole process (sent, not yet handled).
fn pending(pid: u32, sig: i32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mask = status.lines().find_map(|l| l.strip_prefix("ShdPnd:")).map(|m| u64::from_str_radix(m.trim(), 16).unwrap()).unwrap_or(0);
    mask & (1 << (sig - 1)) != 0
}

#[test]
fn a_second_signal_exits_at_once_leaving_the_previous_checkpoint() {
    let d = temp_dir("interrupt-twice");
    // one 512-token ubatch per chunk: the first signal waits for the ubatch in flight
    let mut child = calibrate_cmd(&d, &["-c", "512", "-b", "512", "-ofreq", "1"]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    wait_for_file(&mut child, &d.join("i.reap.json"));
    signal(&child, libc::SIGINT);
    // a second SIGINT sent while the first is still pending would merge with it
    let t0 = std::time::Instant::now();
    while pending(child.id(), libc::SIGINT) {
        assert!(t0.elapsed().as_secs() < 10, "the first SIGINT was not handled");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    signal(&child, libc::SIGINT);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("second signal: exiting at once"), "{err}");
    assert!(!err.contains("interrupted by SIGINT during"), "the run stopped gracefully instead: {err}");
    assert!(!d.join("i.manifest.json").exists(), "nothing is written after the second signal");
    // the checkpoint before it: whole files that agree with each other
    let im = reap_imatrix::formats::imatrix::load(&d.join("i.gguf")).unwrap();
    assert!(im.chunk_count >= 1);
    let s = Saliency::read(&d.join("i.reap.json")).unwrap();
    assert!(s.tokens > 0 && s.tokens % 512 == 0, "{} tokens: not a checkpoint", s.tokens);
    check(&d, &["--reap", "i.reap.json", "--imatrix", "i.gguf"]);
}

/// Offloaded (`-ngl 99 --rpc`), a graph has several splits, and ggml's scheduler ends only the
/// current one when the callback says stop: the outputs must still hold exactly the ubatches
/// begun before the signal. `--imatrix-on-device` also holds a chunk's sums on the device until
/// the chunk ends, so a signal inside a chunk must still leave them in the imatrix.
#[test]
fn an_interrupted_offloaded_run_holds_exactly_the_ubatches_before_the_signal() {
    let server = RpcServer::start();
    for mode in [&[][..], &["--imatrix-on-device"][..]] {
        let d = temp_dir(&format!("interrupt-offloaded-{}", mode.len()));
        // eight ubatches per chunk: the signal almost always lands inside a chunk
        let mut child = calibrate_cmd(&d, &["-c", "128", "-b", "128", "-ub", "16", "-ofreq", "2", "-ngl", "99", "--rpc", &server.endpoint])
            .args(mode)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for_file(&mut child, &d.join("i.reap.json"));
        signal(&child, libc::SIGINT);
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(130), "{mode:?}: {err}");
        let i = Manifest::read(&d.join("i.manifest.json")).unwrap().interrupted.expect("the manifest records the interruption");
        eprintln!("{mode:?}: interrupted after {} tokens ({} whole chunks)", i.tokens, i.chunks_done);
        let im = reap_imatrix::formats::imatrix::load(&d.join("i.gguf")).unwrap();
        let s = Saliency::read(&d.join("i.reap.json")).unwrap();
        assert_eq!(s.tokens, i.tokens, "{mode:?}");
        // a dense weight counts every token; an expert weight each expert's rows, as REAP does
        assert_eq!(im.entries["blk.0.attn_q.weight"].counts, vec![i.tokens as i64], "{mode:?}");
        for l in &s.layers {
            let e = &im.entries[&format!("blk.{}.ffn_down_exps.weight", l.layer)];
            assert_eq!(e.counts.iter().map(|&c| c as u64).collect::<Vec<_>>(), l.count, "{mode:?} layer {}", l.layer);
        }
    }
}

/// A signal that ends `eval` removes its scratch folder (the base log-probs being written
/// there, gigabytes on a real model) before the process dies of it.
#[test]
fn a_signal_to_eval_removes_its_scratch_folder() {
    let d = temp_dir("interrupt-eval");
    let model = fixture("qwen3moe");
    let mut child = default_signals(
        Command::new(ours())
            .arg("eval")
            .arg("--base")
            .arg(&model)
            .arg("--model")
            .arg(&model)
            .arg("-f")
            .arg(corpus())
            .args(["-c", "128", "-t", "2", "--scratch"])
            .arg(&d),
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let scratch = d.join(format!("reap-eval-{}", child.id()));
    let tmp = scratch.join(format!("base.logits.tmp{}", child.id()));
    wait_for_file(&mut child, &tmp);
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert!(!scratch.exists(), "{} left behind", scratch.display());
}
