//! Faults during a run (docs/failures.md): SIGKILL at several moments leaves every output
//! either the previous complete checkpoint or the next one (and `check` passes on them); a
//! full disk stops the run with an error naming the file, earlier checkpoints intact.

use super::util::*;
use reap_imatrix::fixture::rng::SplitMix64;
use reap_imatrix::formats::imatrix as imatrix_file;
use reap_imatrix::formats::saliency::Saliency;
use reap_imatrix::formats::trace::TraceReader;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ARGS: [&str; 16] = ["-t", "1", "-c", "64", "-b", "64", "--no-ppl", "--output-frequency", "1", "--chunks", "48", "-o", "i.gguf", "--trace-out", "t.bin", "-v"];

/// Every output present is complete and they agree; `check` passes on them.
fn assert_consistent(d: &Path, what: &str) {
    let im = imatrix_file::load(&d.join("i.gguf")).unwrap_or_else(|e| panic!("{what}: imatrix: {e:#}"));
    assert!(im.chunk_count >= 1, "{what}");
    let s = Saliency::read(&d.join("i.reap.json")).unwrap_or_else(|e| panic!("{what}: saliency: {e:#}"));
    let t = TraceReader::open(&d.join("t.bin")).unwrap_or_else(|e| panic!("{what}: trace: {e:#}"));
    assert!(!t.header_count_missing, "{what}");
    assert_eq!(s.tokens % 64, 0, "{what}: the JSON holds whole chunks");
    // Upstream writes an imatrix checkpoint at the first tensor that completes chunk N, so its
    // label N is one chunk ahead of the REAP sums taken at that moment (N − 1 chunks); a kill
    // between the imatrix and the JSON of the next checkpoint adds one more
    let im_tokens = im.chunk_count as u64 * 64;
    assert!((s.tokens..=s.tokens + 128).contains(&im_tokens), "{what}: imatrix {im_tokens} tokens, JSON {}", s.tokens);
    let out = run(Command::new(ours()).current_dir(d).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf", "--trace", "t.bin"]));
    assert!(out.status.success(), "{what}: check failed:\n{}", String::from_utf8_lossy(&out.stdout));
}

/// A calibration with `ARGS` (and `extra`) in `d`, stderr to `stderr`.
fn start_run(d: &Path, model: &Path, extra: &[&str], stderr: Stdio) -> std::process::Child {
    Command::new(ours()).current_dir(d).arg("-m").arg(model).arg("-f").arg(corpus()).args(ARGS).args(extra).stdout(Stdio::null()).stderr(stderr).spawn().unwrap()
}

fn wait_for(p: &Path, child: &mut std::process::Child, what: &str) {
    let t0 = Instant::now();
    while !p.exists() {
        assert!(child.try_wait().unwrap().is_none(), "{what}: the run ended before {} appeared", p.display());
        assert!(t0.elapsed() < Duration::from_secs(120), "{what}: no {} after 2 minutes", p.display());
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn sigkill_at_several_moments_leaves_complete_checkpoints() {
    let model = fixture("qwen3moe");
    // pseudo-random delays after the first JSON checkpoint, printed so a failure can be rerun
    let seed = std::env::var("REAP_KILL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(std::process::id() as u64);
    let mut rng = SplitMix64::new(seed);
    let mut delays: Vec<u64> = vec![0, 1];
    delays.extend((0..4).map(|_| rng.next_u64() % 400));
    eprintln!("kill delays (ms) after the first checkpoint, REAP_KILL_SEED={seed}: {delays:?}");
    let mut killed_mid_run = 0;
    for (i, &ms) in delays.iter().enumerate() {
        let d = temp_dir(&format!("sigkill-{i}"));
        let what = format!("kill {ms} ms after the first checkpoint");
        let mut child = start_run(&d, &model, &[], Stdio::null());
        wait_for(&d.join("i.reap.json"), &mut child, &what);
        std::thread::sleep(Duration::from_millis(ms));
        let still_running = child.try_wait().unwrap().is_none();
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        child.wait().unwrap();
        killed_mid_run += still_running as usize;
        assert_consistent(&d, &what);
        // the only leftovers beside complete files are temporary files of the atomic writes
        for e in std::fs::read_dir(&d).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            assert!(["i.gguf", "i.reap.json", "t.bin", "i.manifest.json"].contains(&name.as_str()) || name.contains(".tmp"), "{what}: {name}");
        }
    }
    assert!(killed_mid_run >= 3, "only {killed_mid_run} kills hit a running run: make the run longer");
}

/// A tmpfs of a few hundred KiB mounted for the test (needs root; skipped with a note
/// otherwise), unmounted when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(name: &str, kib: u32) -> Option<SmallDisk> {
        let p = temp_dir(name);
        let ok = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"]).arg(&p).status().is_ok_and(|s| s.success());
        if !ok {
            eprintln!("note: cannot mount a tmpfs here (not root?): the disk-full test did not run");
            return None;
        }
        Some(SmallDisk(p))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_stops_the_run_with_the_file_named_and_earlier_checkpoints_intact() {
    let Some(disk) = SmallDisk::mount("disk-full", 640) else { return };
    let d = &disk.0;
    let t0 = Instant::now();
    let out = run(Command::new(ours()).current_dir(d).arg("-m").arg(fixture("qwen3moe")).arg("-f").arg(corpus()).args(ARGS));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("No space left on device") || err.contains("disk full?"), "{err}");
    assert!(["t.bin", "i.gguf", "i.reap.json"].iter().any(|f| err.contains(&format!("{}/{f}", d.display())) || err.contains(&format!("writing trace {f}")) || err.contains(f)), "{err}");
    assert!(err.contains("earlier checkpoints are left as they were"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(120));
    // it stopped early, and what is there is whole
    let im = imatrix_file::load(&d.join("i.gguf")).unwrap();
    assert!(im.chunk_count >= 1 && im.chunk_count < 48, "{}", im.chunk_count);
    assert!(!d.join("i.manifest.json").exists(), "no manifest for a failed run");
    let t = TraceReader::open(&d.join("t.bin")).unwrap();
    assert!(t.n_rows > 0 && !t.header_count_missing);
    assert_consistent(d, "disk full");
    // no temporary file is left behind by a failed atomic write
    let names: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
}

/// `-ngl 99 --rpc` to a local `ggml-rpc-server` killed mid-run: the error names the server,
/// the exit code is 1, and the last checkpoint stays complete (`check` passes on it).
#[test]
fn a_lost_rpc_server_is_named_and_the_last_checkpoint_stays_intact() {
    let model = fixture("qwen3moe");
    let d = temp_dir("rpc-lost");
    let mut server = RpcServer::start();
    let mut child = start_run(&d, &model, &["-ngl", "99", "--rpc", &server.endpoint], Stdio::piped());
    wait_for(&d.join("i.reap.json"), &mut child, "run over RPC");
    server.kill();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for want in ["llama.cpp stopped the run", "RPC", &format!("lost the RPC server {}", server.endpoint), "last checkpoint) are intact"] {
        assert!(err.contains(want), "stderr lacks {want:?}:\n{err}");
    }
    assert!(!err.contains("Thread debugging") && !err.contains("backtrace"), "no gdb backtrace:\n{err}");
    assert_consistent(&d, "server killed mid-run");
}

/// A server that stops answering without closing its connection (SIGSTOP: how a hung server or
/// a cut network looks from here; ggml-rpc alone waits in recv() for ever) ends the run after
/// `--rpc-timeout`, named, with the last checkpoint intact; a pause shorter than the timeout
/// costs nothing.
#[test]
fn a_silent_rpc_server_is_named_after_the_timeout_and_a_short_pause_is_harmless() {
    let model = fixture("qwen3moe");
    let finish = |child: std::process::Child| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(child.wait_with_output().unwrap()).unwrap());
        rx.recv_timeout(Duration::from_secs(120)).expect("the run still waits on the stopped server after 2 minutes")
    };
    let d = temp_dir("rpc-silent");
    let server = RpcServer::start();
    let mut child = start_run(&d, &model, &["-ngl", "99", "--rpc", &server.endpoint, "--rpc-timeout", "3"], Stdio::piped());
    wait_for(&d.join("i.reap.json"), &mut child, "run over RPC");
    server.signal(libc::SIGSTOP);
    let t0 = Instant::now();
    let out = finish(child);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(t0.elapsed() >= Duration::from_secs(3), "ended {:?} after the stop, before the timeout:\n{err}", t0.elapsed());
    for want in [&format!("the RPC server {} has not answered for", server.endpoint), "--rpc-timeout is 3 s", "last checkpoint) are intact"] {
        assert!(err.contains(want), "stderr lacks {want:?}:\n{err}");
    }
    assert_consistent(&d, "server stopped mid-run");
    drop(server);

    let d = temp_dir("rpc-paused");
    let server = RpcServer::start();
    let mut child = start_run(&d, &model, &["-ngl", "99", "--rpc", &server.endpoint, "--rpc-timeout", "30"], Stdio::piped());
    wait_for(&d.join("i.reap.json"), &mut child, "run over RPC");
    server.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(4));
    server.signal(libc::SIGCONT);
    let out = finish(child);
    assert!(out.status.success(), "a 4 s pause ended the run:\n{}", String::from_utf8_lossy(&out.stderr));
    assert_consistent(&d, "server paused for 4 s");
}

/// A symlink output is written through (the file it names is replaced, the link stays), and a
/// device is written in place: never replaced by a regular file (as root, `-o /dev/null`
/// would otherwise replace the system's /dev/null), with nothing written beside it.
#[test]
fn outputs_through_a_symlink_and_onto_a_device_keep_what_they_point_at() {
    let d = temp_dir("link-and-device");
    std::fs::create_dir(d.join("real")).unwrap();
    std::os::unix::fs::symlink("real/i.gguf", d.join("link.gguf")).unwrap();
    let quick = ["-c", "64", "-b", "64", "--chunks", "2"];
    run_ok(calibrate_cmd(&d, &quick).args(["-o", "link.gguf"]));
    assert!(std::fs::symlink_metadata(d.join("link.gguf")).unwrap().file_type().is_symlink(), "the link was replaced");
    assert_eq!(imatrix_file::load(&d.join("real/i.gguf")).unwrap().chunk_count, 2);
    Saliency::read(&d.join("link.reap.json")).unwrap();
    // a private null device (mknod needs root; the test says so and stops otherwise)
    use std::os::unix::fs::FileTypeExt;
    let null = d.join("null");
    let c = std::ffi::CString::new(null.to_str().unwrap()).unwrap();
    // SAFETY: mknod(2) of a new node in the test's own folder.
    if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } != 0 {
        eprintln!("note: cannot make a device node here (not root?): the device half of this test did not run");
        return;
    }
    let is_device = |p: &Path| std::fs::symlink_metadata(p).unwrap().file_type().is_char_device();
    let out = run_ok(calibrate_cmd(&d, &quick).args(["-o", "null", "--reap-out", "r.json", "--trace-out", "t.bin"]));
    assert!(is_device(&null), "-o replaced the device with a file");
    Saliency::read(&d.join("r.json")).unwrap();
    assert_eq!(TraceReader::open(&d.join("t.bin")).unwrap().n_rows, 128);
    assert!(String::from_utf8_lossy(&out.stderr).contains("name --manifest-out to keep the manifest"));
    let before: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
    let out = run_ok(calibrate_cmd(&d, &quick).args(["-o", "null"]));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing is written beside it; name --reap-out and --manifest-out"));
    assert!(is_device(&null));
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), before.len(), "something was written beside the device");
    let out = run(calibrate_cmd(&d, &quick).args(["-o", "null", "--trace-out", "t2.bin"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("give --reap-out"));
}

/// A run over an earlier run's outputs, killed before its first checkpoint, leaves every earlier
/// file as it was (its trace grows under a temporary name); killed after it, the earlier
/// manifest is gone (it described the replaced files) and what is left is consistent.
#[test]
fn a_rerun_killed_leaves_the_earlier_run_whole_or_its_own_consistent() {
    let model = fixture("qwen3moe");
    let d = temp_dir("rerun-killed");
    let first = run_ok(Command::new(ours()).current_dir(&d).arg("-m").arg(&model).arg("-f").arg(corpus()).args(ARGS).args(["--chunks", "4"]));
    assert!(first.status.success());
    let names = ["i.gguf", "i.reap.json", "t.bin", "i.manifest.json"];
    let earlier: Vec<Vec<u8>> = names.iter().map(|n| read(&d.join(n))).collect();
    // no checkpoint before the end: killed once its trace holds rows
    let mut child = start_run(&d, &model, &["--output-frequency", "1000"], Stdio::null());
    let staged = d.join(format!("t.bin.tmp{}", child.id()));
    let t0 = Instant::now();
    while std::fs::metadata(&staged).map_or(true, |m| m.len() < 64 * 1024) {
        assert!(child.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(120), "the re-run's trace never grew");
        std::thread::sleep(Duration::from_millis(2));
    }
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    for (n, bytes) in names.iter().zip(&earlier) {
        assert!(read(&d.join(n)) == *bytes, "{n} changed before the re-run's first checkpoint");
    }
    // killed after its first checkpoint: the earlier manifest went first
    let mut child = start_run(&d, &model, &[], Stdio::null());
    let t0 = Instant::now();
    while std::fs::read(d.join("i.reap.json")).is_ok_and(|b| b == earlier[1]) {
        assert!(child.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(120), "no checkpoint of the re-run");
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: as above
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    assert!(!d.join("i.manifest.json").exists(), "the earlier manifest still vouches for replaced files");
    assert_consistent(&d, "a re-run killed after its first checkpoint");
}
