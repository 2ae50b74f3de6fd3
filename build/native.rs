//! The native build: the patched copy of llama.cpp compiled to static libraries by CMake.
//!
//! The build lives in the cache folder under a key of (pin, patches, features, and
//! LLAMA_CPP_DIR's canonical path when set; its sources' sizes and mtimes are in `.done`), not in
//! OUT_DIR, so `cargo build --release` and `cargo test` share one build instead of compiling
//! llama.cpp twice. It is always a Release build with upstream's own flags: the build type
//! changes the numbers (see shared notes), and parity tests compare against a Release build.

use crate::config::Config;
use crate::patch;
use std::fs;
use std::path::{Path, PathBuf};

pub struct NativeLibs {
    pub source_dir: PathBuf,
    pub lib_dirs: Vec<PathBuf>,
    pub patches_digest: String,
    cuda: Option<CudaLink>,
    rpc: bool,
}

/// What the final link needs for ggml-cuda
struct CudaLink {
    lib_dirs: Vec<PathBuf>,
    driver_dir: Option<PathBuf>,
}

pub fn build_llama(cfg: &Config, pristine: &Path) -> Result<NativeLibs, String> {
    let patches = patch::list_patches(&cfg.patches_dir).map_err(|e| format!("{}: {e}", cfg.patches_dir.display()))?;
    let patches_digest = patch::digest(&patches).map_err(|e| format!("reading patches: {e}"))?;
    // LLAMA_CPP_DIR: its own build folder (its path is in the key), rebuilt when its sources change
    let llama_cpp_dir = match &cfg.llama_cpp_dir {
        Some(d) => Some(fs::canonicalize(d).map_err(|e| format!("LLAMA_CPP_DIR={}: {e}", d.display()))?),
        None => None,
    };
    let key = build_key(cfg, &patches_digest, llama_cpp_dir.as_deref());
    let root = cfg.cache_dir.join("build").join(&key);
    let source_dir = root.join("src");
    let done = root.join(".done");
    let stamp = match &llama_cpp_dir {
        Some(d) => format!("{key}\n{}\n", tree_fingerprint(d)?),
        None => format!("{key}\n"),
    };
    let is_done = || match &llama_cpp_dir {
        Some(_) => fs::read_to_string(&done).is_ok_and(|s| s == stamp),
        None => done.is_file(),
    };
    // a finished build is only read: no lock, so a read-only cache with the build in it works
    let _lock = if is_done() {
        None
    } else {
        fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        Some(Lock::take(&root.join(".lock"))?)
    };
    if !is_done() {
        // a stale stamp (LLAMA_CPP_DIR changed) must not outlive a rebuild that fails
        if done.exists() {
            fs::remove_file(&done).map_err(|e| format!("{}: {e}", done.display()))?;
        }
        if source_dir.exists() {
            fs::remove_dir_all(&source_dir).map_err(|e| format!("{}: {e}", source_dir.display()))?;
        }
        patch::copy_tree(pristine, &source_dir)
            .map_err(|e| format!("copying {} to {}: {e}", pristine.display(), source_dir.display()))?;
        patch::apply_patches(&source_dir, &patches)?;
        run_cmake(cfg, &source_dir, &root)?;
        fs::write(&done, &stamp).map_err(|e| format!("{}: {e}", done.display()))?;
    }
    let lib_dirs = find_lib_dirs(&root.join("build"));
    if lib_dirs.is_empty() {
        return Err(format!("no static libraries under {}; remove that folder and rebuild", root.display()));
    }
    let cuda = cfg
        .cuda_toolkit
        .as_ref()
        .map(|t| CudaLink { lib_dirs: t.lib_dirs.clone(), driver_dir: t.driver_dir.clone() });
    Ok(NativeLibs { source_dir, lib_dirs, patches_digest, cuda, rpc: cfg.rpc })
}

/// What of a LLAMA_CPP_DIR tree the `llama` target is built from
const FINGERPRINTED: &[&str] = &["CMakeLists.txt", "cmake", "ggml", "include", "src"];

/// Path, size and mtime of every file under FINGERPRINTED (as make sees a change), hashed.
/// Cargo is told to rerun the build script when any of them changes.
fn tree_fingerprint(tree: &Path) -> Result<String, String> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::MetadataExt;
    let mut files = Vec::new();
    let mut stack: Vec<PathBuf> = FINGERPRINTED.iter().map(|p| tree.join(p)).collect();
    for p in &stack {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    while let Some(p) = stack.pop() {
        let m = match fs::symlink_metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("{}: {e}", p.display())),
        };
        if m.is_dir() {
            let rd = fs::read_dir(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            stack.extend(rd.flatten().map(|e| e.path()));
        } else {
            let rel = p.strip_prefix(tree).unwrap_or(&p).to_string_lossy().into_owned();
            files.push(format!("{rel}\t{}\t{}.{:09}", m.len(), m.mtime(), m.mtime_nsec()));
        }
    }
    files.sort();
    let mut h = Sha256::new();
    for f in &files {
        h.update(f.as_bytes());
        h.update([b'\n']);
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("tree {} files {}", files.len(), &hex[..16]))
}

fn build_key(cfg: &Config, patches_digest: &str, llama_cpp_dir: Option<&Path>) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(format!(
        "{}|{}|cuda={}|rpc={}|v1{}",
        cfg.pin.sha256,
        patches_digest,
        cfg.cuda,
        cfg.rpc,
        // the default key is unchanged, so existing native builds stay valid
        if cfg.native { "" } else { "|native=off" }
    ));
    if let Some(t) = &cfg.cuda_toolkit {
        h.update(format!("|{}|{}|vmm={}", t.root.display(), t.architectures, t.driver_dir.is_some()));
    }
    // only when set, so the key of the fetched pin is unchanged
    if let Some(d) = llama_cpp_dir {
        h.update(format!("|llama_cpp_dir={}", d.display()));
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}", cfg.pin.commit, &hex[..12])
}

fn run_cmake(cfg: &Config, source_dir: &Path, root: &Path) -> Result<(), String> {
    let on_off = |b: bool| if b { "ON" } else { "OFF" };
    let mut c = cmake::Config::new(source_dir);
    c.out_dir(root)
        .profile("Release")
        // exactly upstream's flags: no -O/-g from Cargo's profile leaking into CMAKE_C_FLAGS
        .no_default_flags(true)
        .build_target("llama")
        .define("BUILD_SHARED_LIBS", "OFF")
        .define("LLAMA_BUILD_COMMON", "OFF")
        .define("LLAMA_BUILD_TESTS", "OFF")
        .define("LLAMA_BUILD_TOOLS", "OFF")
        .define("LLAMA_BUILD_EXAMPLES", "OFF")
        .define("LLAMA_BUILD_SERVER", "OFF")
        .define("LLAMA_BUILD_APP", "OFF")
        .define("LLAMA_CURL", "OFF")
        .define("LLAMA_OPENSSL", "OFF")
        .define("GGML_RPC", on_off(cfg.rpc))
        .define("GGML_CUDA", on_off(cfg.cuda));
    if !cfg.native {
        // only when asked: the default is left to ggml, exactly as the reference tools build
        c.define("GGML_NATIVE", "OFF");
    }
    if let Some(t) = &cfg.cuda_toolkit {
        c.define("CMAKE_CUDA_ARCHITECTURES", &t.architectures)
            .define("CMAKE_CUDA_COMPILER", t.root.join("bin/nvcc"))
            .define("CUDAToolkit_ROOT", &t.root);
        if t.driver_dir.is_none() {
            c.define("GGML_CUDA_NO_VMM", "ON");
        }
    }
    // the cmake crate panics on failure; turn that into our one-message error
    crate::quiet_panics(|| {
        c.build();
    })
    .map_err(|why| format!("building llama.cpp with CMake failed ({why}); see the output above; build folder {}", root.display()))
}

fn find_lib_dirs(build: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut stack = vec![build.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                if !p.ends_with("CMakeFiles") {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "a") && !dirs.contains(&d) {
                dirs.push(d.clone());
            }
        }
    }
    dirs.sort();
    dirs
}

impl NativeLibs {
    pub fn emit_link_lines(&self, cfg: &Config) {
        for d in &self.lib_dirs {
            println!("cargo:rustc-link-search=native={}", d.display());
        }
        // static archives need dependents before dependencies
        let mut libs = vec!["llama", "ggml"];
        if self.rpc {
            libs.push("ggml-rpc");
        }
        if self.cuda.is_some() {
            libs.push("ggml-cuda");
        }
        libs.extend(["ggml-cpu", "ggml-base"]);
        for l in libs {
            println!("cargo:rustc-link-lib=static={l}");
        }
        if let Some(cuda) = &self.cuda {
            for d in &cuda.lib_dirs {
                println!("cargo:rustc-link-search=native={}", d.display());
                // found at run time where the toolkit is; elsewhere LD_LIBRARY_PATH names them
                println!("cargo:rustc-link-arg=-Wl,-rpath,{}", d.display());
            }
            for l in ["cudart", "cublas", "cublasLt"] {
                println!("cargo:rustc-link-lib={l}");
            }
            if let Some(d) = &cuda.driver_dir {
                println!("cargo:rustc-link-search=native={}", d.display());
                println!("cargo:rustc-link-lib=cuda");
            }
        }
        if cfg.target_os == "linux" {
            for l in ["stdc++", "gomp", "m", "dl", "pthread"] {
                println!("cargo:rustc-link-lib={l}");
            }
        }
    }
}

/// An exclusive lock on the shared build folder, so two Cargo profiles building at once
/// don't write the same files.
struct Lock(#[allow(dead_code)] fs::File); // closing the file releases the lock

impl Lock {
    fn take(path: &Path) -> Result<Lock, String> {
        use std::os::unix::io::AsRawFd;
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // SAFETY: flock on a file descriptor we own; released when the file is closed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(format!("{}: could not lock: {}", path.display(), std::io::Error::last_os_error()));
        }
        Ok(Lock(f))
    }
}
