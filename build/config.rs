//! Everything the build reads from its environment, read once.

use std::env;
use std::path::PathBuf;

/// One `key=value` line of `vendor/llama.cpp.pin`.
pub struct Pin {
    pub commit: String,
    pub sha256: String,
}

pub struct Config {
    pub manifest_dir: PathBuf,
    pub out_dir: PathBuf,
    pub pin: Pin,
    pub patches_dir: PathBuf,
    /// `LLAMA_CPP_DIR`: a user's own checkout at the pin, used instead of the fetched sdist.
    pub llama_cpp_dir: Option<PathBuf>,
    /// `REAP_IMATRIX_CACHE`: where the sdist, the unpacked tree and the shared native build live.
    pub cache_dir: PathBuf,
    pub cuda: bool,
    /// Where the CUDA toolkit is, for `--features cuda` only
    pub cuda_toolkit: Option<CudaToolkit>,
    pub rpc: bool,
    /// `REAP_GGML_NATIVE=OFF`: ggml without `-march=native`, for a binary carried to another
    /// machine (`scripts/gpu-bundle`); the default builds for this CPU, as upstream does
    pub native: bool,
    pub target_os: String,
}

/// A CUDA toolkit: `CUDA_PATH` (default /usr/local/cuda), as a full install or as
/// `scripts/cuda-toolkit` assembles it from PyPI's wheels.
pub struct CudaToolkit {
    pub root: PathBuf,
    /// The folders with libcudart/libcublas (lib64, lib) that exist
    pub lib_dirs: Vec<PathBuf>,
    /// The folder holding libcuda.so (the driver or the toolkit's stub), if any: without it
    /// ggml-cuda is built with GGML_CUDA_NO_VMM, which does not link the driver library
    pub driver_dir: Option<PathBuf>,
    pub architectures: String,
}

impl CudaToolkit {
    fn find() -> Result<CudaToolkit, String> {
        let root = PathBuf::from(var("CUDA_PATH").unwrap_or_else(|| "/usr/local/cuda".into()));
        let nvcc = root.join("bin/nvcc");
        if !nvcc.is_file() {
            return Err(format!(
                "--features cuda: no nvcc at {} (set CUDA_PATH to a CUDA toolkit; without one, \
                 scripts/cuda-toolkit puts one together from PyPI and prints the CUDA_PATH to use)",
                nvcc.display()
            ));
        }
        let lib_dirs: Vec<PathBuf> = ["lib64", "lib"].iter().map(|d| root.join(d)).filter(|d| d.is_dir()).collect();
        let driver_dir = lib_dirs
            .iter()
            .map(|d| d.join("stubs"))
            .chain(["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"].map(PathBuf::from))
            .find(|d| d.join("libcuda.so").exists());
        // "native" needs a visible GPU; otherwise the server parts people calibrate on
        let architectures = var("CMAKE_CUDA_ARCHITECTURES").unwrap_or_else(|| "80;86;89;90".into());
        Ok(CudaToolkit { root, lib_dirs, driver_dir, architectures })
    }
}

/// Reads an environment variable and tells Cargo to rerun when it changes.
pub fn var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

impl Config {
    pub fn from_env() -> Result<Config, String> {
        let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
        let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
        let pin_file = manifest_dir.join("vendor/llama.cpp.pin");
        let patches_dir = manifest_dir.join("patches");
        // Printing any rerun-if-* switches off Cargo's rerun-on-any-change, so name every input.
        println!("cargo:rerun-if-changed={}", pin_file.display());
        println!("cargo:rerun-if-changed={}", patches_dir.display());
        println!("cargo:rerun-if-changed={}", manifest_dir.join("src/llama/wrapper.h").display());
        println!("cargo:rerun-if-changed={}", manifest_dir.join("build").display());
        let pin = read_pin(&pin_file)?;
        let cache_dir = var("REAP_IMATRIX_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| manifest_dir.join("vendor/cache"));
        let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();
        Ok(Config {
            llama_cpp_dir: var("LLAMA_CPP_DIR").map(PathBuf::from),
            cache_dir,
            cuda,
            cuda_toolkit: if cuda { Some(CudaToolkit::find()?) } else { None },
            rpc: env::var_os("CARGO_FEATURE_RPC").is_some(),
            native: var("REAP_GGML_NATIVE").is_none_or(|v| !v.eq_ignore_ascii_case("off")),
            target_os: env::var("CARGO_CFG_TARGET_OS").unwrap_or_default(),
            manifest_dir,
            out_dir,
            pin,
            patches_dir,
        })
    }
}

fn read_pin(path: &std::path::Path) -> Result<Pin, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let get = |key: &str| {
        text.lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .find_map(|l| l.split_once('=').filter(|(k, _)| k.trim() == key).map(|(_, v)| v.trim().to_string()))
            .ok_or_else(|| format!("{}: missing key '{key}'", path.display()))
    };
    Ok(Pin { commit: get("commit")?, sha256: get("sha256")? })
}
