//! Shared test helpers: paths, temp dirs, generated fixtures, the upstream reference tools.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn ours() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_reap-imatrix"))
}

pub fn corpus() -> PathBuf {
    repo().join("corpus/calibration.txt")
}

/// The folder with upstream's tools built from the same pin (scripts/build-reference).
/// Missing tools fail the test: parity is never skipped silently.
pub fn reference_bin(tool: &str) -> PathBuf {
    let dir = std::env::var_os("REAP_REFERENCE_BIN").map(PathBuf::from).unwrap_or_else(|| {
        let pin = std::fs::read_to_string(repo().join("vendor/llama.cpp.pin")).unwrap();
        let commit = pin.lines().find_map(|l| l.strip_prefix("commit=")).unwrap().trim().to_string();
        repo().join(format!("vendor/cache/reference-{commit}/bin"))
    });
    let p = dir.join(tool);
    assert!(p.is_file(), "upstream reference tool {} is missing: run scripts/build-reference (or scripts/test)", p.display());
    p
}

/// A fresh empty folder for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = repo().join("target/test-tmp").join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
    out
}

pub fn run_ok(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A generated fixture model, built once per test run and shared.
pub fn fixture(arch: &str) -> PathBuf {
    fixture_with(arch, &["--arch", arch])
}

/// Flags for CPU runs of the `arch` fixture (f16), upstream's tools' and ours alike. On a CPU
/// with AMX the pin's CPU backend keeps f16 matrices in its AMX buffer type, and deepseek2's
/// graph then has an op that no backend takes: `ggml_backend_sched_split_graph` aborts
/// (`GGML_ASSERT(*cur_backend_id != -1)`) in upstream's llama-imatrix and llama-perplexity as in
/// ours. And the AMX matmul multiplies only the first 2-D slice of a 3-D input: qwen35moe's
/// gated delta net feeds `ssm_out` one once a batch holds two sequences, which upstream's tools
/// (and qwen3next's) get wrong silently and ours refuse (`drop_in::an_amx_matmul_of_a_3d_input_is_refused_…`).
/// `-nr` turns the extra buffer types off; on a CPU without AMX it changes nothing for an
/// f16 model (ggml repacks quantized types only), so a test means the same on every machine.
pub fn cpu_flags(arch: &str) -> &'static [&'static str] {
    if ["deepseek2", "glm-dsa", "deepseek32", "qwen35moe", "qwen3next", "bailingmoe3"].contains(&arch) {
        &["-nr"]
    } else {
        &[]
    }
}

/// A fixture made with `reap-imatrix fixture ARGS`, once per test process under `key`.
pub fn fixture_with(key: &str, args: &[&str]) -> PathBuf {
    static MADE: OnceLock<Mutex<Vec<(String, PathBuf)>>> = OnceLock::new();
    let made = MADE.get_or_init(|| Mutex::new(Vec::new()));
    let mut made = made.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = made.iter().find(|(a, _)| a == key) {
        return p.clone();
    }
    let dir = temp_dir(&format!("fixture-{key}"));
    let path = dir.join(format!("{key}.gguf"));
    run_ok(Command::new(ours()).arg("fixture").args(args).arg("-o").arg(&path));
    made.push((key.to_string(), path.clone()));
    path
}

pub fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Asserts two files are byte-identical, saying where they first differ.
pub fn assert_same_bytes(a: &Path, b: &Path) {
    let (x, y) = (read(a), read(b));
    if x != y {
        let at = x.iter().zip(&y).position(|(p, q)| p != q).unwrap_or(x.len().min(y.len()));
        panic!("{} ({} bytes) and {} ({} bytes) differ, first at byte {at}", a.display(), x.len(), b.display(), y.len());
    }
}

/// The perplexity lines a run printed on stdout (`[1]…,` and `Final estimate: …`).
pub fn ppl_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('[') || l.starts_with("Final estimate"))
        .map(String::from)
        .collect()
}

/// A calibration of the qwen3moe fixture on the bundled corpus in `dir` (`-o i.gguf`, one
/// thread, no perplexity), with `extra` flags.
pub fn calibrate_cmd(dir: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(ours());
    c.current_dir(dir).arg("-m").arg(fixture("qwen3moe")).arg("-f").arg(corpus()).args(["-t", "1", "--no-ppl", "-o", "i.gguf"]).args(extra);
    default_signals(&mut c);
    c
}

/// The child starts with SIGINT and SIGTERM at their default action. A test run launched in
/// the background by a non-interactive shell inherits SIGINT ignored, and reap-imatrix keeps an
/// ignored SIGINT ignored (as `nohup` users expect), so the signal tests would see nothing.
pub fn default_signals(c: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls (signal(2)) between fork and exec.
    unsafe {
        c.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
            Ok(())
        });
    }
    c
}

/// Sends `sig` to a child process.
pub fn signal(child: &std::process::Child, sig: i32) {
    // SAFETY: plain kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0, "kill({}, {sig})", child.id());
}

/// Waits until `path` exists while `child` runs (panics if it ends first or after 2 minutes).
pub fn wait_for_file(child: &mut std::process::Child, path: &Path) {
    let t0 = std::time::Instant::now();
    while !path.exists() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before {} was written", path.display());
        assert!(t0.elapsed().as_secs() < 120, "{} not written after 2 minutes", path.display());
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Upstream's `ggml-rpc-server` on a free loopback port, killed on drop: tensors offloaded to
/// it (`-ngl 99 --rpc ENDPOINT`) live off-host, as on a GPU.
pub struct RpcServer {
    pub endpoint: String,
    child: Option<std::process::Child>,
}

impl RpcServer {
    pub fn start() -> RpcServer {
        let port = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port();
        let child = Command::new(reference_bin("ggml-rpc-server"))
            .args(["-H", "127.0.0.1", "-p", &port.to_string(), "-t", "2"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let t0 = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t0.elapsed().as_secs() < 30, "ggml-rpc-server did not listen on {port}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        RpcServer { endpoint: format!("127.0.0.1:{port}"), child: Some(child) }
    }

    /// Sends the server a signal (SIGSTOP: it stops answering but its connections stay open).
    pub fn signal(&self, sig: i32) {
        let c = self.child.as_ref().expect("the server was killed");
        // SAFETY: kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(c.id() as i32, sig) }, 0);
    }

    /// Kills the server now (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A copy of `src` whose `<arch>.expert_used_count` is the u32 array `ks` (one per layer, as
/// Nemotron-H's Puzzle variants write it), every other pair and tensor as they were.
pub fn with_per_layer_k(src: &Path, dst: &Path, ks: &[u32]) {
    let mut value = Vec::new();
    value.extend_from_slice(&9u32.to_le_bytes()); // array
    value.extend_from_slice(&4u32.to_le_bytes()); // of u32
    value.extend_from_slice(&(ks.len() as u64).to_le_bytes());
    for k in ks {
        value.extend_from_slice(&k.to_le_bytes());
    }
    with_kv(src, dst, |arch| format!("{arch}.expert_used_count"), &value);
}

/// A copy of `src` whose key `key(arch)` has the (type, value) bytes `value`, every other
/// pair and tensor as they were.
pub fn with_kv(src: &Path, dst: &Path, key: impl Fn(&str) -> String, value: &[u8]) {
    rewrite_kv(src, dst, key, value, true)
}

/// A copy of `src` with the pair `key(arch)` = (type, value) bytes `value` added (it must not
/// be there yet), every other pair and tensor as they were.
pub fn with_added_kv(src: &Path, dst: &Path, key: impl Fn(&str) -> String, value: &[u8]) {
    rewrite_kv(src, dst, key, value, false)
}

fn rewrite_kv(src: &Path, dst: &Path, key: impl Fn(&str) -> String, value: &[u8], existing: bool) {
    use reap_imatrix::formats::gguf::{encode_header, Header};
    let b = read(src);
    let h = Header::parse(&b).unwrap();
    let key = key(&h.string(&b, "general.architecture").unwrap());
    let mut raw = Vec::new();
    raw.extend_from_slice(&(key.len() as u64).to_le_bytes());
    raw.extend_from_slice(key.as_bytes());
    raw.extend_from_slice(value);
    assert_eq!(h.kvs.iter().any(|kv| kv.key == key), existing, "{}: {key} present", src.display());
    let mut kvs: Vec<&[u8]> = h.kvs.iter().map(|kv| if kv.key == key { &raw[..] } else { &b[kv.raw.clone()] }).collect();
    if !existing {
        kvs.push(&raw);
    }
    let (mut out, offsets) = encode_header(h.version, &kvs, &h.tensors, h.alignment);
    let data_start = out.len();
    for (t, off) in h.tensors.iter().zip(offsets) {
        out.resize(data_start + off as usize, 0);
        let from = (h.data_start + t.offset) as usize;
        out.extend_from_slice(&b[from..from + t.nbytes() as usize]);
    }
    std::fs::write(dst, out).unwrap();
}

/// A copy of `src` with one more tensor, `t` (its offset is laid out here) holding `data`,
/// after the others; every pair and tensor as they were.
pub fn with_added_tensor(src: &Path, dst: &Path, t: reap_imatrix::formats::gguf::TensorInfo, data: &[u8]) {
    use reap_imatrix::formats::gguf::{encode_header, Header};
    let b = read(src);
    let h = Header::parse(&b).unwrap();
    assert_eq!(t.nbytes(), data.len() as u64, "{}", t.name);
    let kvs: Vec<&[u8]> = h.kvs.iter().map(|kv| &b[kv.raw.clone()]).collect();
    let mut tensors = h.tensors.clone();
    tensors.push(t);
    let (mut out, offsets) = encode_header(h.version, &kvs, &tensors, h.alignment);
    let data_start = out.len();
    for (i, (t, off)) in tensors.iter().zip(offsets).enumerate() {
        out.resize(data_start + off as usize, 0);
        let from = (h.data_start + t.offset) as usize;
        out.extend_from_slice(if i < h.tensors.len() { &b[from..from + t.nbytes() as usize] } else { data });
    }
    std::fs::write(dst, out).unwrap();
}

/// A string value's (type, value) bytes for [with_kv].
pub fn gguf_string(s: &str) -> Vec<u8> {
    let mut v = 8u32.to_le_bytes().to_vec();
    v.extend_from_slice(&(s.len() as u64).to_le_bytes());
    v.extend_from_slice(s.as_bytes());
    v
}

/// Runs `cmd` with its stdout a pipe whose reader is gone (as in `cmd | head` after head
/// exits): the command must still finish its work, exit 0 and not panic.
pub fn run_ok_into_closed_pipe(cmd: &mut Command) -> Output {
    let mut child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !err.contains("panicked"), "{}: {err}", o.status);
    o
}

/// Whether this CPU has AMX (the pin's CPU backend then puts f16 and some quantized weights in
/// its AMX buffer type unless `-nr`).
pub fn cpu_has_amx() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.lines().any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "amx_tile")))
}
