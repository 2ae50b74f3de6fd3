//! Bounded fuzzing of every reader of a file a user hands us: the routing trace, the saliency
//! JSON, keep maps, the run manifest and imatrix files (GGUF and legacy .dat). Seeds are real
//! outputs of a fixture run made here; each target runs a fixed number of seeded mutations
//! (seconds in all, deterministic), and every input must end in `Ok` or an error: no panic, no
//! out-of-bounds read (the readers index with checked slices; a panic is a finding), and no
//! allocation sized by an unchecked header field (the allocator below refuses any single
//! allocation over 64 MiB while a target runs: such a request aborts the run with its size).
//!
//! A self-written mutator rather than proptest or cargo-fuzz: no nightly toolchain, no new
//! dependency, and mutations that know the formats (header fields, JSON nodes) reach far more
//! of each reader than random strategies would. `REAP_FUZZ_SCALE=N` multiplies the budget.
//! A panicking input is written to target/fuzz-findings/ for replay.
//!
//! The domains TSV reader (`--domains`) is seeded from the bundled mix's own domains file, and
//! the GGUF header parser `prune` reads models with from the seed run's fixture model.

use reap_imatrix::analyze::select::keep_map::KeepMap;
use reap_imatrix::fixture::rng::SplitMix64;
use reap_imatrix::formats::domains::Domains;
use reap_imatrix::formats::gguf::Header as GgufHeader;
use reap_imatrix::formats::imatrix as imatrix_file;
use reap_imatrix::formats::manifest::Manifest;
use reap_imatrix::formats::saliency::Saliency;
use reap_imatrix::formats::trace::TraceReader;
use serde_json::Value;
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::cell::Cell;
use std::sync::OnceLock;

/// Refuses single allocations over `CAP` while `ARMED` on this thread (during the fuzz loops).
struct Capped;
const CAP: usize = 64 << 20;
thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
}

fn armed() -> bool {
    ARMED.try_with(Cell::get).unwrap_or(false)
}

unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if armed() && l.size() > CAP {
            // the default alloc-error handler aborts, printing the size: a finding
            return std::ptr::null_mut();
        }
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if armed() && new > CAP {
            return std::ptr::null_mut();
        }
        System.realloc(p, l, new)
    }
}

#[global_allocator]
static GLOBAL: Capped = Capped;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scale() -> usize {
    std::env::var("REAP_FUZZ_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1)
}

/// Real outputs of a small fixture run: imatrix (GGUF and .dat), saliency JSON, trace,
/// manifest, keep map.
struct Seeds {
    dir: PathBuf,
}

impl Seeds {
    fn get() -> &'static Seeds {
        static S: OnceLock<Seeds> = OnceLock::new();
        S.get_or_init(|| {
            let dir = repo().join("target/test-tmp").join(format!("fuzz-seeds-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let bin = env!("CARGO_BIN_EXE_reap-imatrix");
            let ok = |c: &mut Command| {
                let o = c.current_dir(&dir).output().unwrap();
                assert!(o.status.success(), "{c:?}: {}", String::from_utf8_lossy(&o.stderr));
            };
            ok(Command::new(bin).args(["fixture", "-o", "m.gguf", "--layers", "2", "--experts", "8", "--experts-used", "2"])
                .args(["--dead", "1", "--heavy", "1", "--n-embd", "32", "--expert-ffn", "32"]));
            // a relative corpus path: the imatrix records it, and the mutations must not depend on
            // where the checkout lives (CI's clone found an input that this one did not)
            std::fs::copy(repo().join("corpus/calibration.txt"), dir.join("calibration.txt")).unwrap();
            ok(Command::new(bin).args(["-m", "m.gguf", "-f", "calibration.txt"])
                .args(["-c", "32", "-b", "32", "--chunks", "3", "--no-ppl", "-t", "2", "-o", "i.gguf", "--trace-out", "t.bin", "--trace-top-n", "4"]));
            ok(Command::new(bin).args(["-m", "m.gguf", "--in-file", "i.gguf", "--output-format", "dat", "-o", "i.dat", "--manifest-out", "dat.manifest.json"]));
            ok(Command::new(bin).args(["select", "--reap", "i.reap.json", "--method", "frequency", "--k", "4", "--out-dir", "maps"]));
            Seeds { dir }
        })
    }
    fn bytes(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    }
    fn keep_map(&self) -> Vec<u8> {
        let p = std::fs::read_dir(self.dir.join("maps")).unwrap().map(|e| e.unwrap().path()).find(|p| p.file_name().unwrap().to_string_lossy().starts_with("keep_")).unwrap();
        std::fs::read(p).unwrap()
    }
}

/// Values that break size arithmetic.
const INTERESTING: [u64; 12] = [0, 1, 2, 3, 7, 64, 0x7f, 0xff, 0x7fff_ffff, 0xffff_ffff, 0x7fff_ffff_ffff_ffff, u64::MAX];

struct Mutator {
    rng: SplitMix64,
}

impl Mutator {
    fn below(&mut self, n: usize) -> usize {
        (self.rng.next_u64() % n.max(1) as u64) as usize
    }

    /// One to four byte-level mutations; `hot` bytes at the start (a header) are hit more often.
    fn bytes(&mut self, seed: &[u8], hot: usize) -> Vec<u8> {
        let mut b = seed.to_vec();
        for _ in 0..1 + self.below(4) {
            let len = b.len().max(1);
            let at = if self.below(2) == 0 { self.below(hot.min(len)) } else { self.below(len) };
            match self.below(8) {
                0 if !b.is_empty() => {
                    let (i, bit) = (at.min(b.len() - 1), self.below(8));
                    b[i] ^= 1 << bit;
                }
                1 if !b.is_empty() => {
                    let (i, v) = (at.min(b.len() - 1), INTERESTING[self.below(INTERESTING.len())] as u8);
                    b[i] = v;
                }
                2 | 3 => {
                    // a 4- or 8-byte little-endian field
                    let v = INTERESTING[self.below(INTERESTING.len())].wrapping_add(self.below(3) as u64).wrapping_sub(1);
                    let w = if self.below(2) == 0 { 4 } else { 8 };
                    let at = at & !3;
                    if at + w <= b.len() {
                        b[at..at + w].copy_from_slice(&v.to_le_bytes()[..w]);
                    }
                }
                4 => b.truncate(self.below(b.len() + 1)),
                5 => {
                    let n = 1 + self.below(64);
                    let extra: Vec<u8> = (0..n).map(|_| self.rng.next_u64() as u8).collect();
                    let at = at.min(b.len());
                    b.splice(at..at, extra);
                }
                6 if !b.is_empty() => {
                    let start = self.below(b.len());
                    let end = (start + 1 + self.below(256)).min(b.len());
                    b.drain(start..end);
                }
                _ if !b.is_empty() => {
                    let start = self.below(b.len());
                    let end = (start + 1 + self.below(256)).min(b.len());
                    let chunk = b[start..end].to_vec();
                    let at = self.below(b.len());
                    b.splice(at..at, chunk);
                }
                _ => {}
            }
        }
        b
    }

    /// A JSON value with one to three nodes replaced, removed or duplicated.
    fn json(&mut self, seed: &Value) -> Value {
        let mut v = seed.clone();
        for _ in 0..1 + self.below(3) {
            let n = count_nodes(&v);
            let target = self.below(n);
            let replacement = match self.below(12) {
                0 => Value::from(-1),
                1 => Value::from(u64::MAX),
                2 => serde_json::from_str("1e308").unwrap(),
                3 => Value::from(-0.5),
                4 => Value::from(1.5),
                5 => Value::from("x"),
                6 => Value::Null,
                7 => Value::Array(vec![]),
                8 => Value::Object(Default::default()),
                9 => Value::from(0x7fff_ffff_u64),
                10 => {
                    let other = self.below(n);
                    nth_node(&mut v.clone(), other).map(|x| x.clone()).unwrap_or(Value::Null)
                }
                _ => Value::Bool(true),
            };
            let remove = self.below(4) == 0;
            edit_node(&mut v, target, replacement, remove);
        }
        v
    }
}

fn count_nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count_nodes).sum(),
        Value::Object(o) => o.values().map(count_nodes).sum(),
        _ => 0,
    }
}

fn nth_node(v: &mut Value, mut n: usize) -> Option<&mut Value> {
    fn go<'a>(v: &'a mut Value, n: &mut usize) -> Option<&'a mut Value> {
        if *n == 0 {
            return Some(v);
        }
        *n -= 1;
        match v {
            Value::Array(a) => a.iter_mut().find_map(|x| go(x, n)),
            Value::Object(o) => o.values_mut().find_map(|x| go(x, n)),
            _ => None,
        }
    }
    go(v, &mut n)
}

/// Replaces node `n` (pre-order), or removes it from its parent when `remove`.
fn edit_node(v: &mut Value, n: usize, with: Value, remove: bool) {
    if remove && n > 0 {
        // find the parent of node n and drop that child
        fn go(v: &mut Value, n: &mut usize) -> bool {
            let kids: Vec<usize> = match v {
                Value::Array(a) => a.iter().map(count_nodes).collect(),
                Value::Object(o) => o.values().map(count_nodes).collect(),
                _ => return false,
            };
            let mut i = 0;
            for (idx, size) in kids.into_iter().enumerate() {
                if *n == i + 1 {
                    match v {
                        Value::Array(a) => {
                            a.remove(idx);
                        }
                        Value::Object(o) => {
                            let k = o.keys().nth(idx).unwrap().clone();
                            o.remove(&k);
                        }
                        _ => {}
                    }
                    return true;
                }
                if *n < i + 1 + size {
                    let child = match v {
                        Value::Array(a) => &mut a[idx],
                        Value::Object(o) => o.values_mut().nth(idx).unwrap(),
                        _ => unreachable!(),
                    };
                    *n -= i + 1;
                    return go(child, n);
                }
                i += size;
            }
            false
        }
        let mut k = n;
        go(v, &mut k);
        return;
    }
    if let Some(x) = nth_node(v, n) {
        *x = with;
    }
}

/// ggml's reader logs every refused input to stderr (thousands of lines per target); in a
/// failing CI run they bury the verdict, so the fuzz targets silence it.
fn quiet_ggml() {
    unsafe extern "C" fn drop_line(_: reap_imatrix::llama::sys::ggml_log_level, _: *const std::ffi::c_char, _: *mut std::ffi::c_void) {}
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: installs a callback that ignores its arguments and lives for the whole program.
    ONCE.call_once(|| unsafe { reap_imatrix::llama::sys::ggml_log_set(Some(drop_line), std::ptr::null_mut()) });
}

/// Runs `exec` on `iters` inputs from `make`, armed; panics are collected and reported.
/// `exec` returns whether the reader accepted the input (the rest it refused with an error).
fn fuzz(name: &str, iters: usize, mut make: impl FnMut(&mut Mutator) -> Vec<u8>, exec: impl Fn(&[u8]) -> bool + std::panic::RefUnwindSafe) {
    // REAP_FUZZ_SEED varies the mutations for longer hunts; the default is fixed
    let extra: u64 = std::env::var("REAP_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    quiet_ggml();
    let mut m = Mutator { rng: SplitMix64::new(0x5eed ^ name.len() as u64 * 0x9e37_79b9 ^ extra.wrapping_mul(0xff51_afd7_ed55_8ccd)) };
    let findings = repo().join("target/fuzz-findings");
    let (mut accepted, mut refused, mut panics) = (0usize, 0usize, Vec::new());
    let t0 = std::time::Instant::now();
    for i in 0..iters {
        let input = make(&mut m);
        ARMED.with(|a| a.set(true));
        let r = std::panic::catch_unwind(|| exec(&input));
        ARMED.with(|a| a.set(false));
        match r {
            Ok(true) => accepted += 1,
            Ok(false) => refused += 1,
            Err(_) => {
                std::fs::create_dir_all(&findings).unwrap();
                let p = findings.join(format!("{name}-{i}.bin"));
                std::fs::write(&p, &input).unwrap();
                panics.push(p);
            }
        }
    }
    eprintln!(
        "fuzz {name}: {iters} executions in {:.2} s: {accepted} accepted, {refused} refused with an error, {} panics",
        t0.elapsed().as_secs_f64(),
        panics.len()
    );
    assert!(panics.is_empty(), "fuzz {name}: {} inputs panicked, saved as {:?}", panics.len(), panics);
}

/// Reads every field of every row a reader accepts.
fn read_trace(b: &[u8]) -> bool {
    let Ok(t) = TraceReader::from_bytes(b) else { return false };
    {
        let mut acc = 0u64;
        for r in t.rows() {
            acc = acc.wrapping_add(r.chunk() as u64 + r.pos() as u64 + r.token() as u64);
            for li in 0..t.header.n_layers() {
                acc = acc.wrapping_add(r.sel_ids(li).iter().map(|&x| x as u64).sum::<u64>());
                acc = acc.wrapping_add(r.cand_ids(li).len() as u64);
                acc = acc.wrapping_add(r.sel_weights(li).iter().chain(r.cand_probs(li)).map(|x| x.to_bits() as u64).sum::<u64>());
            }
        }
        std::hint::black_box(acc);
    }
    true
}

#[test]
fn trace_reader() {
    let seed = Seeds::get().bytes("t.bin");
    let header = TraceReader::from_bytes(&seed).unwrap().header.header_size();
    fuzz("trace", 20_000 * scale(), |m| m.bytes(&seed, header), read_trace);
}

/// Mutated text or mutated JSON structure, half and half.
fn json_input(m: &mut Mutator, text: &[u8], value: &Value) -> Vec<u8> {
    if m.below(2) == 0 {
        m.bytes(text, text.len())
    } else {
        serde_json::to_vec(&m.json(value)).unwrap()
    }
}

#[test]
fn saliency_reader() {
    let text = Seeds::get().bytes("i.reap.json");
    let value: Value = serde_json::from_slice(&text).unwrap();
    fuzz("saliency", 20_000 * scale(), |m| json_input(m, &text, &value), |b| {
        let Ok(s) = serde_json::from_slice::<Value>(b).map_err(anyhow::Error::from).and_then(|v| Saliency::from_json(&v)) else { return false };
        std::hint::black_box(s.value_problem());
        let mut rep = reap_imatrix::analyze::check::Report::default();
        reap_imatrix::analyze::check::check_saliency(&s, reap_imatrix::analyze::check::Gating::from_metadata(&s), 3, &mut rep);
        std::hint::black_box(s.to_json());
        true
    });
}

#[test]
fn keep_map_reader() {
    let text = Seeds::get().keep_map();
    let value: Value = serde_json::from_slice(&text).unwrap();
    fuzz("keep_map", 20_000 * scale(), |m| json_input(m, &text, &value), |b| {
        let Ok(k) = serde_json::from_slice::<Value>(b).map_err(anyhow::Error::from).and_then(|v| KeepMap::from_json(&v)) else { return false };
        std::hint::black_box(k.fits(&[0, 1], 8, "the trace").is_ok());
        std::hint::black_box(k.to_json());
        true
    });
}

#[test]
fn manifest_reader() {
    let text = Seeds::get().bytes("i.manifest.json");
    let value: Value = serde_json::from_slice(&text).unwrap();
    fuzz("manifest", 20_000 * scale(), |m| json_input(m, &text, &value), |b| {
        let Ok(x) = serde_json::from_slice::<Value>(b).map_err(anyhow::Error::from).and_then(|v| Manifest::from_json(&v)) else { return false };
        std::hint::black_box(x.to_json());
        true
    });
}

/// The imatrix readers take a path: each input goes through one scratch file.
fn imatrix_target(name: &str, seed_file: &str, iters: usize) {
    let seed = Seeds::get().bytes(seed_file);
    let scratch = Seeds::get().dir.join(format!("scratch-{name}"));
    let s2 = scratch.clone();
    fuzz(name, iters * scale(), |m| m.bytes(&seed, 512), move |b| {
        std::fs::write(&s2, b).unwrap();
        let Ok(l) = imatrix_file::load(Path::new(&s2)) else { return false };
        std::hint::black_box(l.entries.values().map(|e| e.sums.len() + e.counts.len()).sum::<usize>());
        true
    });
    let _ = std::fs::remove_file(scratch);
}

#[test]
fn imatrix_legacy_reader() {
    imatrix_target("imatrix_dat", "i.dat", 3_000);
}

#[test]
fn imatrix_gguf_reader() {
    imatrix_target("imatrix_gguf", "i.gguf", 2_000);
}

#[test]
fn domains_reader() {
    let seed = std::fs::read(repo().join("corpus/mix.domains.tsv")).unwrap();
    let text_len = std::fs::metadata(repo().join("corpus/mix.txt")).unwrap().len();
    let hot = seed.iter().position(|&c| c == b'\n').unwrap_or(0) + 200;
    fuzz("domains", 20_000 * scale(), |m| m.bytes(&seed, hot), |b| {
        let Ok(text) = std::str::from_utf8(b) else { return false };
        // a text length near the real one, and a short one that the ranges overrun
        let ok = Domains::parse(text, "fuzz.tsv", text_len).is_ok();
        std::hint::black_box(Domains::parse(text, "fuzz.tsv", text_len / 3).is_ok());
        ok
    });
}

#[test]
fn gguf_header_parser() {
    let model = Seeds::get().bytes("m.gguf");
    let h = GgufHeader::parse(&model).unwrap();
    let hot = h.data_start as usize;
    fuzz("gguf_header", 500 * scale(), |m| m.bytes(&model, hot), |b| {
        let Ok(h) = GgufHeader::parse(b) else { return false };
        std::hint::black_box((h.uint(b, "qwen3moe.expert_count"), h.string(b, "general.architecture"), h.tensors.iter().map(|t| t.nbytes()).sum::<u64>()));
        true
    });
}
