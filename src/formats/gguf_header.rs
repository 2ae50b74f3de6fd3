//! A model GGUF's header, read before llama.cpp loads anything: the checks that turn a wrong
//! `-m` into a one-second error (missing, a folder, not GGUF, truncated, an architecture the
//! pin does not know) and the facts the flags are checked against (expert count, tensor
//! shapes). Shared by every tool that takes a model (calibration, prune, eval, corpus).
//!
//! The header is parsed by ggml's own `gguf_init_from_file` (metadata only, `no_alloc`), so
//! it reads exactly what llama.cpp will read; the data section's length is checked here.

use crate::error::UsageError;
use crate::llama::sys;
use anyhow::{anyhow, Result};
use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io::Read;
use std::path::Path;

/// `general.architecture` values the pinned llama.cpp knows (`LLM_ARCH_NAMES` in
/// src/llama-arch.cpp at the pin; a unit test compares this list with the pinned tree).
pub const KNOWN_ARCHS: &[&str] = &[
    "clip", "llama", "llama4", "deci", "falcon", "grok", "gpt2", "gptj", "gptneox", "mpt", "baichuan", 
    "starcoder", "refact", "bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", 
    "jina-bert-v2", "jina-bert-v3", "eurobert", "bloom", "stablelm", "qwen", "qwen2", "qwen2moe", 
    "qwen2vl", "qwen3", "qwen3moe", "qwen3next", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", 
    "qwen4exp", "phi2", "phi3", "phimoe", "plamo", "plamo2", "plamo3", "codeshell", "orion", 
    "internlm2", "minicpm", "minicpm3", "gemma", "gemma2", "gemma3", "gemma3n", "gemma4", 
    "gemma4-assistant", "gemma-embedding", "starcoder2", "mamba", "mamba2", "maple", "jamba", 
    "falcon-h1", "xverse", "command-r", "cohere2", "cohere2moe", "dbrx", "olmo", "olmo2", "olmoe", 
    "muse-glimmer", "openelm", "arctic", "deepseek", "deepseek2", "deepseek2-ocr", "deepseek32", 
    "deepseek4", "chatglm", "glm4", "glm4moe", "glm-dsa", "bitnet", "t5", "t5encoder", "jais", "jais2", 
    "nemotron", "nemotron_h", "nemotron_h_moe", "exaone", "exaone4", "exaone-moe", "rwkv6", 
    "rwkv6qwen2", "rwkv7", "arwkv7", "granite", "granitemoe", "granitehybrid", "graniteswitch", 
    "granite_swa", "chameleon", "wavtokenizer-dec", "plm", "bailingmoe", "bailingmoe2", "bailingmoe3", 
    "dots1", "dots3note", "arcee", "afmoe", "laguna", "ernie4_5", "ernie4_5-moe", "hunyuan-moe", 
    "hunyuan-dense", "hunyuan_vl", "hy_v3", "hy_v4", "smollm3", "gpt-oss", "lfm2", "lfm2moe", "dream", 
    "smallthinker", "llada", "llada-moe", "seed_oss", "grovemoe", "apertus", "minimax-01", "hrm_text", 
    "minimax-m2", "minimax-m3", "cogvlm", "rnd1", "pangu-embedded", "mistral3", "eagle3", "dflash", 
    "mistral4", "paddleocr", "mimo2", "step35", "spark2_5", "llama-embed", "maincoder", "kimi-linear", 
    "kimi-k3", "glm5-next", "talkie", "mellum", "nanbeige", "qwen3tts", "pockettts", 
];

/// What the checks need from a model's header.
#[derive(Clone, Debug, Default)]
pub struct ModelHeader {
    pub arch: String,
    /// `<arch>.expert_count`; 0 or absent: a dense model
    pub n_expert: u32,
    /// `<arch>.expert_used_count` (the largest, where it is an array of one per layer)
    pub n_expert_used: u32,
    /// the per-layer values where `expert_used_count` is an array (Nemotron-H Puzzle), else empty
    pub n_expert_used_per_layer: Vec<u32>,
    /// tensor name → ne (ggml order, unused dimensions 1), of every shard of a split model
    pub tensors: BTreeMap<String, [i64; 4]>,
    /// a split model (`split.count` > 1, as `llama-gguf-split` writes it): every shard's path,
    /// the first (the one given) first; empty for a single file
    pub shards: Vec<std::path::PathBuf>,
}

impl ModelHeader {
    pub fn is_moe(&self) -> bool {
        self.n_expert > 0
    }

    /// The distinct experts-per-token counts of the MoE layers, where they differ (a routing
    /// trace holds one k per file).
    pub fn varying_k(&self) -> Option<Vec<u32>> {
        let mut ks: Vec<u32> = self.n_expert_used_per_layer.iter().copied().filter(|&k| k > 0).collect();
        ks.sort_unstable();
        ks.dedup();
        (ks.len() > 1).then_some(ks)
    }
}

fn bad(flag: &str, path: &Path, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow!(UsageError(format!("{flag} {}: {what}", path.display())))
}

/// The paths of every shard of a split model, as llama.cpp finds them (`llama_split_prefix`,
/// `llama_split_path`): the given shard `no` (0-based) of `count` must be named
/// `PREFIX-NNNNN-of-CCCCC.gguf`, and shard i is `PREFIX-{i+1:05}-of-{count:05}.gguf`.
pub fn split_paths(path: &Path, no: u64, count: u64) -> std::result::Result<Vec<std::path::PathBuf>, String> {
    let suffix = format!("-{:05}-of-{count:05}.gguf", no + 1);
    let s = path.as_os_str().to_string_lossy();
    let prefix = s.strip_suffix(&suffix).ok_or_else(|| format!("shard {} of {count} of a split model, but not named *{suffix} (llama.cpp finds the other shards by that name)", no + 1))?;
    Ok((1..=count).map(|i| std::path::PathBuf::from(format!("{prefix}-{i:05}-of-{count:05}.gguf"))).collect())
}

/// Reads and checks the header of the model `path` given by `flag` (`-m`, `--base`, …): of a
/// split model, the first shard's keys and every shard's tensors (each shard checked as the
/// file is). Every error is a [UsageError] naming the flag, the file and what is wrong.
pub fn read_model(flag: &str, path: &Path) -> Result<ModelHeader> {
    let mut h = read_one(flag, path, true)?;
    let Some((no, count)) = h.split else { return Ok(h.header) };
    if no != 0 {
        let first = split_paths(path, no, count).ok().map_or_else(|| "the first shard".into(), |p| p[0].display().to_string());
        return Err(bad(flag, path, format!("shard {} of {count} of a split model: give the first shard ({first}); llama.cpp loads a split model from it", no + 1)));
    }
    let paths = split_paths(path, no, count).map_err(|e| bad(flag, path, e))?;
    for p in &paths[1..] {
        let shard = read_one(flag, p, false)?;
        if shard.split.map(|s| s.1) != Some(count) {
            return Err(bad(flag, p, format!("not a shard of the {count}-file split model {} (its split.count differs)", path.display())));
        }
        for (name, ne) in shard.header.tensors {
            if h.header.tensors.insert(name.clone(), ne).is_some() {
                return Err(bad(flag, p, format!("tensor {name} is in an earlier shard too")));
            }
        }
    }
    if let Some(n) = h.tensor_count.filter(|&n| n != h.header.tensors.len() as u64) {
        return Err(bad(flag, path, format!("split.tensors.count says {n} tensors, the {count} shards hold {}", h.header.tensors.len())));
    }
    h.header.shards = paths;
    Ok(h.header)
}

/// One file's header, and its `split.no`/`split.count` where `split.count` > 1.
struct OneFile {
    header: ModelHeader,
    split: Option<(u64, u64)>,
    /// `split.tensors.count`
    tensor_count: Option<u64>,
}

/// Reads one GGUF file's header: its tensors, and with `keys` the architecture and expert
/// counts (a shard after the first holds the split keys only).
fn read_one(flag: &str, path: &Path, keys: bool) -> Result<OneFile> {
    let meta = std::fs::metadata(path).map_err(|e| bad(flag, path, format!("cannot read the model file: {e}")))?;
    if meta.is_dir() {
        return Err(bad(flag, path, "is a folder, not a model file"));
    }
    let mut magic = [0u8; 4];
    let n = std::fs::File::open(path)
        .and_then(|mut f| f.read(&mut magic))
        .map_err(|e| bad(flag, path, format!("cannot read the model file: {e}")))?;
    if n < 4 || &magic != b"GGUF" {
        return Err(bad(flag, path, "not a GGUF file (it does not start with the GGUF magic)"));
    }
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| bad(flag, path, "the path holds a NUL byte"))?;
    // SAFETY: valid C string; no_alloc reads the header and tensor infos only.
    let g = unsafe { sys::gguf_init_from_file(c.as_ptr(), sys::gguf_init_params { no_alloc: true, ctx: std::ptr::null_mut() }) };
    if g.is_null() {
        return Err(bad(flag, path, "the GGUF header cannot be read (truncated or corrupt file)"));
    }
    struct Owned(*mut sys::gguf_context);
    impl Drop for Owned {
        fn drop(&mut self) {
            // SAFETY: created above, freed once.
            unsafe { sys::gguf_free(self.0) }
        }
    }
    let g = Owned(g);
    let mut h = ModelHeader::default();
    // SAFETY: g is live; every string is copied out before it is freed; ids come from gguf.
    unsafe {
        let str_kv = |k: &str| -> Option<String> {
            let id = sys::gguf_find_key(g.0, CString::new(k).ok()?.as_ptr());
            (id >= 0 && sys::gguf_get_kv_type(g.0, id) == sys::GGUF_TYPE_STRING)
                .then(|| CStr::from_ptr(sys::gguf_get_val_str(g.0, id)).to_string_lossy().into_owned())
        };
        let int_kv = |k: &str| -> Option<u64> {
            let id = sys::gguf_find_key(g.0, CString::new(k).ok()?.as_ptr());
            if id < 0 {
                return None;
            }
            match sys::gguf_get_kv_type(g.0, id) {
                sys::GGUF_TYPE_UINT32 => Some(sys::gguf_get_val_u32(g.0, id) as u64),
                sys::GGUF_TYPE_INT32 => u64::try_from(sys::gguf_get_val_i32(g.0, id)).ok(),
                sys::GGUF_TYPE_UINT64 => Some(sys::gguf_get_val_u64(g.0, id)),
                sys::GGUF_TYPE_UINT16 => Some(sys::gguf_get_val_u16(g.0, id) as u64),
                _ => None,
            }
        };
        let split = int_kv("split.count").filter(|&n| n > 1).map(|n| (int_kv("split.no").unwrap_or(0), n));
        let tensor_count = int_kv("split.tensors.count");
        // a later shard holds the split keys only (read_model refuses it as -m, by its number)
        if !keys || split.is_some_and(|(no, _)| no != 0) {
            for i in 0..sys::gguf_get_n_tensors(g.0) {
                let name = CStr::from_ptr(sys::gguf_get_tensor_name(g.0, i)).to_string_lossy().into_owned();
                let ne = std::slice::from_raw_parts(sys::gguf_get_tensor_ne(g.0, i), 4);
                h.tensors.insert(name, [ne[0], ne[1], ne[2], ne[3]]);
            }
            check_length(flag, path, g.0, meta.len())?;
            return Ok(OneFile { header: h, split, tensor_count });
        }
        h.arch = str_kv("general.architecture").ok_or_else(|| bad(flag, path, "no general.architecture in its header"))?;
        h.n_expert = int_kv(&format!("{}.expert_count", h.arch)).unwrap_or(0).min(u32::MAX as u64) as u32;
        let used_key = format!("{}.expert_used_count", h.arch);
        h.n_expert_used = int_kv(&used_key).unwrap_or(0).min(u32::MAX as u64) as u32;
        let id = CString::new(used_key).map_or(-1, |k| sys::gguf_find_key(g.0, k.as_ptr()));
        if id >= 0 && sys::gguf_get_kv_type(g.0, id) == sys::GGUF_TYPE_ARRAY {
            let n = sys::gguf_get_arr_n(g.0, id);
            let data = sys::gguf_get_arr_data(g.0, id);
            let values: Option<Vec<u32>> = match sys::gguf_get_arr_type(g.0, id) {
                sys::GGUF_TYPE_UINT32 => Some(std::slice::from_raw_parts(data.cast::<u32>(), n).to_vec()),
                sys::GGUF_TYPE_INT32 => std::slice::from_raw_parts(data.cast::<i32>(), n).iter().map(|&v| u32::try_from(v).ok()).collect(),
                _ => None,
            };
            if let Some(v) = values {
                h.n_expert_used = v.iter().copied().max().unwrap_or(0);
                h.n_expert_used_per_layer = v;
            }
        }
        for i in 0..sys::gguf_get_n_tensors(g.0) {
            let name = CStr::from_ptr(sys::gguf_get_tensor_name(g.0, i)).to_string_lossy().into_owned();
            let ne = std::slice::from_raw_parts(sys::gguf_get_tensor_ne(g.0, i), 4);
            h.tensors.insert(name, [ne[0], ne[1], ne[2], ne[3]]);
        }
        check_length(flag, path, g.0, meta.len())?;
        if !KNOWN_ARCHS.contains(&h.arch.as_str()) {
            return Err(bad(
                flag,
                path,
                format!("architecture '{}' is not known to the pinned llama.cpp ({}), so it cannot load this model", h.arch, crate::llama::PIN_COMMIT),
            ));
        }
        Ok(OneFile { header: h, split, tensor_count })
    }
}

/// A file shorter than its tensors need.
///
/// # Safety
/// `g` is a live gguf context.
unsafe fn check_length(flag: &str, path: &Path, g: *mut sys::gguf_context, len: u64) -> Result<()> {
    let end = unsafe { data_end(g) };
    if end > len {
        return Err(bad(flag, path, format!("truncated: its tensors need {end} bytes but the file has {len} (an interrupted download or copy?)")));
    }
    Ok(())
}

/// Where the last tensor's data ends.
///
/// # Safety
/// `g` is a live gguf context.
unsafe fn data_end(g: *mut sys::gguf_context) -> u64 {
    let start = sys::gguf_get_data_offset(g) as u64;
    (0..sys::gguf_get_n_tensors(g))
        .map(|i| start + sys::gguf_get_tensor_offset(g, i) as u64 + sys::gguf_get_tensor_size(g, i) as u64)
        .max()
        .unwrap_or(start)
}

/// Checks a GGUF file just written: its header reads back and the file holds all its tensor
/// data. `gguf_write_to_file` ignores the result of its final `fclose`, so a disk that fills
/// during the last buffered write would otherwise leave a short file that looks written.
pub fn check_written(path: &Path) -> Result<()> {
    // a device written in place (`-o /dev/null`) keeps nothing to read back
    if crate::formats::atomic::in_place(path) {
        return Ok(());
    }
    check_complete(path).map_err(|e| anyhow!("{}: written incompletely ({e}; disk full?)", path.display()))
}

/// Checks, reading the header only, that a GGUF file holds all the tensor data its header
/// describes. Run before `gguf_init_from_file` with data: ggml allocates what the header says,
/// so a damaged size field would otherwise ask for gigabytes and abort the process.
pub fn check_complete(path: &Path) -> std::result::Result<(), String> {
    let len = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| "NUL in path".to_string())?;
    // SAFETY: valid C string; metadata only; freed below.
    unsafe {
        let g = sys::gguf_init_from_file(c.as_ptr(), sys::gguf_init_params { no_alloc: true, ctx: std::ptr::null_mut() });
        if g.is_null() {
            return Err("the GGUF header does not read".into());
        }
        let end = data_end(g);
        sys::gguf_free(g);
        if end > len {
            return Err(format!("the header describes {end} bytes, the file has {len}"));
        }
    }
    Ok(())
}


#[cfg(test)]
mod tests {
    use super::*;

    /// The list is the pin's: compare with src/llama-arch.cpp of the pinned tree when it is here.
    #[test]
    fn known_archs_are_the_pins() {
        let src = crate::fixture::pinned_tree().join("src/llama-arch.cpp");
        let Ok(text) = std::fs::read_to_string(&src) else {
            eprintln!("skipping: {} not present", src.display());
            return;
        };
        let start = text.find("LLM_ARCH_NAMES = {").expect("LLM_ARCH_NAMES");
        let body = &text[start..start + text[start..].find("\n};").unwrap()];
        let names: Vec<&str> = body.lines().filter_map(|l| l.split('"').nth(1)).filter(|n| *n != "(unknown)").collect();
        assert_eq!(names, KNOWN_ARCHS);
    }

    /// llama.cpp's naming (`llama_split_path`: `%s-%05d-of-%05d.gguf`), from any shard's name.
    #[test]
    fn split_paths_are_llama_cpps() {
        let p = |s: &str| std::path::PathBuf::from(s);
        let want = vec![p("/m/DeepSeek-V3-Q4_K-00001-of-00003.gguf"), p("/m/DeepSeek-V3-Q4_K-00002-of-00003.gguf"), p("/m/DeepSeek-V3-Q4_K-00003-of-00003.gguf")];
        assert_eq!(split_paths(Path::new("/m/DeepSeek-V3-Q4_K-00001-of-00003.gguf"), 0, 3).unwrap(), want);
        assert_eq!(split_paths(Path::new("/m/DeepSeek-V3-Q4_K-00002-of-00003.gguf"), 1, 3).unwrap(), want);
        // a renamed shard: llama.cpp could not find the others either
        let e = split_paths(Path::new("/m/model.gguf"), 0, 3).unwrap_err();
        assert!(e.contains("not named *-00001-of-00003.gguf"), "{e}");
        assert!(split_paths(Path::new("/m/x-00001-of-00004.gguf"), 0, 3).is_err());
    }
}
