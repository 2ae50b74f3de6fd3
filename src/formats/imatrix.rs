//! The imatrix files upstream writes and reads: GGUF (`<name>.in_sum2`, `<name>.counts`,
//! `general.type`, `imatrix.*`) and the legacy `dat` format. Written through the same gguf C
//! API upstream uses, so the bytes match.

use super::atomic;
use crate::llama::sys;
use anyhow::{bail, Context as _, Result};
use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::path::Path;

/// Σx² per column and the number of rows that contributed, per expert (or one for a dense
/// matrix). `values` is `[n_mat][n_cols]` row-major.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub values: Vec<f32>,
    pub counts: Vec<i64>,
}

/// The whole imatrix state as a file holds it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Imatrix {
    /// by weight name (`blk.0.ffn_down_exps.weight`); sorted, as every writer sorts
    pub stats: BTreeMap<String, Stats>,
    /// datasets of merged input files, in load order
    pub datasets: Vec<String>,
    pub last_chunk: i32,
}

pub const KV_DATASETS: &str = "imatrix.datasets";
pub const KV_CHUNK_COUNT: &str = "imatrix.chunk_count";
pub const KV_CHUNK_SIZE: &str = "imatrix.chunk_size";

/// One entry of a loaded file: raw sums and counts (legacy: pre-scaled sums, `{ncall}`).
#[derive(Clone, Debug, Default)]
pub struct Entry {
    pub sums: Vec<f32>,
    pub counts: Vec<i64>,
}

/// A file as upstream's `common_imatrix_load` reads it.
#[derive(Clone, Debug, Default)]
pub struct Loaded {
    pub entries: BTreeMap<String, Entry>,
    pub datasets: Vec<String>,
    pub chunk_count: i32,
    pub chunk_size: i32,
    pub is_legacy: bool,
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).with_context(|| format!("{s:?} contains a NUL byte"))
}

/// The warnings upstream's writers print about entries some experts never reached
/// (`save_imatrix`: "has partial data (87.50%)"; the legacy writer also "has no data -
/// skipping"): for MoE calibration the sign that experts went unexercised.
pub fn partial_data_warnings(m: &Imatrix, legacy: bool) -> Vec<String> {
    let func = if legacy { "save_imatrix_legacy" } else { "save_imatrix" };
    let mut out = Vec::new();
    for (name, s) in &m.stats {
        let n_all = s.counts.len();
        let n_zeros = s.counts.iter().filter(|&&c| c == 0).count();
        if legacy && n_all == 0 {
            continue;
        }
        if legacy && n_zeros == n_all {
            out.push(format!("{func}: entry '{name:>40}' has no data - skipping"));
        } else if n_zeros > 0 {
            let share = 100.0f32 * (n_all - n_zeros) as f32 / n_all as f32;
            out.push(format!("{func}: entry '{name:>40}' has partial data ({share:.2}%)"));
        }
    }
    out
}

/// Writes the GGUF imatrix (upstream's `save_imatrix`), atomically.
/// `prompt_file` is the `-f` path as given (empty in combine-only mode).
pub fn write_gguf(path: &Path, m: &Imatrix, prompt_file: &str, chunk_size: i32) -> Result<()> {
    let mut datasets: Vec<CString> = m.datasets.iter().map(|d| cstr(d)).collect::<Result<_>>()?;
    if !prompt_file.is_empty() {
        datasets.push(cstr(prompt_file)?);
    }
    let ptrs: Vec<*const std::ffi::c_char> = datasets.iter().map(|d| d.as_ptr()).collect();
    let pad = |n: usize| n.div_ceil(sys::GGML_MEM_ALIGN as usize) * sys::GGML_MEM_ALIGN as usize;
    // SAFETY: pure size query.
    let overhead = unsafe { sys::ggml_tensor_overhead() };
    let data_size: usize = m
        .stats
        .values()
        .map(|s| pad(overhead + 4 * s.values.len()) + pad(overhead + 4 * s.counts.len()))
        .sum();
    atomic::replace_with(path, |tmp| {
        let fname = cstr(&tmp.to_string_lossy())?;
        // SAFETY: a private ggml context sized for our tensors, and a gguf context, both freed
        // below; every pointer passed in outlives the calls.
        unsafe {
            let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: data_size, mem_buffer: std::ptr::null_mut(), no_alloc: false });
            if ctx.is_null() {
                bail!("ggml_init failed for {} bytes", data_size);
            }
            let g = sys::gguf_init_empty();
            sys::gguf_set_val_str(g, c"general.type".as_ptr(), c"imatrix".as_ptr());
            let k = cstr(KV_DATASETS)?;
            sys::gguf_set_arr_str(g, k.as_ptr(), ptrs.as_ptr() as *mut _, ptrs.len());
            let k = cstr(KV_CHUNK_COUNT)?;
            sys::gguf_set_val_u32(g, k.as_ptr(), m.last_chunk as u32);
            let k = cstr(KV_CHUNK_SIZE)?;
            sys::gguf_set_val_u32(g, k.as_ptr(), chunk_size as u32);
            for (name, s) in &m.stats {
                let (nval, nmat) = (s.values.len() as i64, s.counts.len() as i64);
                if nval == 0 || nmat == 0 {
                    continue;
                }
                let in_sum2 = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, nval / nmat, nmat);
                let counts = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, 1, nmat);
                sys::ggml_set_name(in_sum2, cstr(&format!("{name}.in_sum2"))?.as_ptr());
                sys::ggml_set_name(counts, cstr(&format!("{name}.counts"))?.as_ptr());
                std::ptr::copy_nonoverlapping(s.values.as_ptr(), (*in_sum2).data as *mut f32, s.values.len());
                let c = (*counts).data as *mut f32;
                for (j, &n) in s.counts.iter().enumerate() {
                    *c.add(j) = n as f32;
                }
                sys::gguf_add_tensor(g, in_sum2);
                sys::gguf_add_tensor(g, counts);
            }
            let ok = sys::gguf_write_to_file(g, fname.as_ptr(), false);
            // errno of the failed fwrite/fopen (ENOSPC on a full disk), before anything else runs
            let why = std::io::Error::last_os_error();
            sys::gguf_free(g);
            sys::ggml_free(ctx);
            if !ok {
                bail!("could not write {}: {why}", tmp.display());
            }
        }
        super::gguf_header::check_written(tmp)
    })
    .with_context(|| format!("writing imatrix {}", path.display()))
}

/// Writes the legacy `dat` imatrix (upstream's `save_imatrix_legacy`), atomically.
/// Entries without any data are left out, as upstream does.
pub fn write_dat(path: &Path, m: &Imatrix, prompt_file: &str, chunk_size: i32) -> Result<()> {
    let stored: Vec<(&String, &Stats)> = m
        .stats
        .iter()
        .filter(|(_, s)| !s.counts.is_empty() && s.counts.iter().any(|&c| c != 0))
        .collect();
    let mut out = Vec::new();
    out.extend_from_slice(&(stored.len() as i32).to_le_bytes());
    for (name, s) in &stored {
        out.extend_from_slice(&(name.len() as i32).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        let max = *s.counts.iter().max().unwrap();
        // ceiling division to avoid accidental zeros
        let ncall = ((max + (chunk_size as i64 - 1)) / chunk_size as i64) as i32;
        out.extend_from_slice(&ncall.to_le_bytes());
        let nval = s.values.len() as i32;
        let nmat = s.counts.len() as i32;
        out.extend_from_slice(&nval.to_le_bytes());
        if nval > 0 && nmat > 0 {
            let per = (nval / nmat) as usize;
            for (i, &v) in s.values.iter().enumerate() {
                let (mut value, mut count) = (v, s.counts[i / per] as f32);
                if count == 0.0 {
                    // store 1 for partial data
                    value = 1.0;
                    count = 1.0;
                }
                out.extend_from_slice(&((value / count) * ncall as f32).to_le_bytes());
            }
        }
    }
    out.extend_from_slice(&m.last_chunk.to_le_bytes());
    // the dataset: the prompt file, or in combine-only mode the last merged dataset
    let dataset = if prompt_file.is_empty() { m.datasets.last().map(String::as_str).unwrap_or("") } else { prompt_file };
    out.extend_from_slice(&(dataset.len() as i32).to_le_bytes());
    out.extend_from_slice(dataset.as_bytes());
    atomic::write_bytes(path, &out).with_context(|| format!("writing imatrix {}", path.display()))
}

/// Reads an imatrix file, GGUF or legacy, as upstream's `common_imatrix_load` does.
pub fn load(path: &Path) -> Result<Loaded> {
    let mut magic = [0u8; 4];
    let n = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut magic))
        .with_context(|| format!("imatrix file {}", path.display()))?;
    if n == 4 && &magic == b"GGUF" {
        // the header's sizes against the file first (a damaged one must not size an allocation)
        super::gguf_header::check_complete(path).map_err(|e| anyhow::anyhow!("imatrix file {}: not a readable GGUF file ({e})", path.display()))?;
        if !has_imatrix_entries(path) {
            // before ggml reads the data: a model given here would be loaded whole
            bail!("imatrix file {}: a GGUF file without any NAME.in_sum2 entry: not an imatrix (a model?)", path.display());
        }
        load_gguf(path)
    } else {
        let bytes = std::fs::read(path).with_context(|| format!("imatrix file {}", path.display()))?;
        load_legacy(path, &bytes)
    }
}

/// Whether a GGUF's header names an imatrix entry (`*.in_sum2`); the header only, no data.
/// An unreadable header answers yes, so that load_gguf names what is wrong with it.
fn has_imatrix_entries(path: &Path) -> bool {
    let Ok(fname) = cstr(&path.to_string_lossy()) else { return true };
    // SAFETY: no_alloc reads the header and tensor infos only; freed before returning.
    unsafe {
        let g = sys::gguf_init_from_file(fname.as_ptr(), sys::gguf_init_params { no_alloc: true, ctx: std::ptr::null_mut() });
        if g.is_null() {
            return true;
        }
        let found = (0..sys::gguf_get_n_tensors(g)).any(|i| std::ffi::CStr::from_ptr(sys::gguf_get_tensor_name(g, i)).to_bytes().ends_with(b".in_sum2"));
        sys::gguf_free(g);
        found
    }
}

fn load_gguf(path: &Path) -> Result<Loaded> {
    // the sizes in the header are checked against the file before ggml allocates them
    super::gguf_header::check_complete(path).map_err(|e| anyhow::anyhow!("imatrix file {}: not a readable GGUF file ({e})", path.display()))?;
    let fname = cstr(&path.to_string_lossy())?;
    let mut out = Loaded::default();
    // SAFETY: gguf reads into a ggml context it allocates; both are freed before returning and
    // every pointer read from them is copied out first.
    unsafe {
        let mut ctx: *mut sys::ggml_context = std::ptr::null_mut();
        let g = sys::gguf_init_from_file(fname.as_ptr(), sys::gguf_init_params { no_alloc: false, ctx: &mut ctx });
        if g.is_null() {
            bail!("imatrix file {}: not a readable GGUF file", path.display());
        }
        let free = |g, ctx| {
            sys::gguf_free(g);
            sys::ggml_free(ctx);
        };
        if sys::gguf_get_n_tensors(g) < 1 {
            free(g, ctx);
            bail!("imatrix file {}: no data in file", path.display());
        }
        let key = |k: &str| sys::gguf_find_key(g, CString::new(k).unwrap().as_ptr());
        let kd = key(KV_DATASETS);
        if kd != -1 && sys::gguf_get_kv_type(g, kd) == sys::GGUF_TYPE_ARRAY && sys::gguf_get_arr_type(g, kd) == sys::GGUF_TYPE_STRING {
            for i in 0..sys::gguf_get_arr_n(g, kd) {
                out.datasets.push(CStr::from_ptr(sys::gguf_get_arr_str(g, kd, i)).to_string_lossy().into_owned());
            }
        }
        let (kc, ks) = (key(KV_CHUNK_COUNT), key(KV_CHUNK_SIZE));
        // ggml's typed getters abort on a type mismatch, so the type is checked first
        for (k, name) in [(kc, KV_CHUNK_COUNT), (ks, KV_CHUNK_SIZE)] {
            if k != -1 && sys::gguf_get_kv_type(g, k) != sys::GGUF_TYPE_UINT32 {
                free(g, ctx);
                bail!("imatrix file {}: key {name} must be a uint32", path.display());
            }
        }
        out.chunk_count = if kc != -1 { sys::gguf_get_val_u32(g, kc) as i32 } else { 0 };
        out.chunk_size = if ks != -1 { sys::gguf_get_val_u32(g, ks) as i32 } else { 0 };
        let mut pairs: BTreeMap<String, (Option<*mut sys::ggml_tensor>, Option<*mut sys::ggml_tensor>)> = BTreeMap::new();
        let mut t = sys::ggml_get_first_tensor(ctx);
        while !t.is_null() {
            let name = CStr::from_ptr((*t).name.as_ptr()).to_string_lossy().into_owned();
            if let Some(base) = name.strip_suffix(".in_sum2") {
                pairs.entry(base.to_string()).or_default().0 = Some(t);
            } else if let Some(base) = name.strip_suffix(".counts") {
                pairs.entry(base.to_string()).or_default().1 = Some(t);
            }
            t = sys::ggml_get_next_tensor(ctx, t);
        }
        for (name, pair) in pairs {
            let (Some(s), Some(c)) = pair else {
                free(g, ctx);
                bail!("imatrix file {}: mismatched sums and counts for {name}", path.display());
            };
            if (*s).type_ != sys::GGML_TYPE_F32 || (*c).type_ != sys::GGML_TYPE_F32 {
                free(g, ctx);
                bail!("imatrix file {}: sums and counts for {name} must be F32", path.display());
            }
            let ns = sys::ggml_nelements(s) as usize;
            let nc = sys::ggml_nelements(c) as usize;
            let sums = std::slice::from_raw_parts((*s).data as *const f32, ns).to_vec();
            let counts = std::slice::from_raw_parts((*c).data as *const f32, nc).iter().map(|&v| v.round() as i64).collect();
            out.entries.insert(name, Entry { sums, counts });
        }
        free(g, ctx);
    }
    Ok(out)
}

fn load_legacy(path: &Path, b: &[u8]) -> Result<Loaded> {
    let bad = |what: &str| anyhow::anyhow!("imatrix file {}: {what} (neither GGUF nor a legacy imatrix)", path.display());
    let mut pos = 0usize;
    let i32_at = |pos: &mut usize| -> Option<i32> {
        let v = b.get(*pos..*pos + 4)?;
        *pos += 4;
        Some(i32::from_le_bytes(v.try_into().unwrap()))
    };
    let n_entries = i32_at(&mut pos).filter(|&n| n >= 1).ok_or_else(|| bad("no data in file"))?;
    let mut out = Loaded { is_legacy: true, ..Default::default() };
    for i in 0..n_entries {
        let len = i32_at(&mut pos).filter(|&l| l >= 0).ok_or_else(|| bad(&format!("failed reading name for entry {}", i + 1)))? as usize;
        let name = b.get(pos..pos + len).ok_or_else(|| bad(&format!("failed reading name for entry {}", i + 1)))?;
        let name = String::from_utf8_lossy(name.split(|&c| c == 0).next().unwrap_or(name)).into_owned();
        pos += len;
        let ncall = i32_at(&mut pos).ok_or_else(|| bad(&format!("failed reading number of values for entry {i}")))?;
        let nval = i32_at(&mut pos).filter(|&n| n >= 1).ok_or_else(|| bad(&format!("failed reading number of values for entry {i}")))? as usize;
        let data = b.get(pos..pos + 4 * nval).ok_or_else(|| bad(&format!("failed reading data for entry {i}")))?;
        pos += 4 * nval;
        let sums = data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        out.entries.insert(name, Entry { sums, counts: vec![ncall as i64] });
    }
    // the trailing chunk count and dataset name are optional
    if let Some(n) = i32_at(&mut pos) {
        out.chunk_count = n;
        if let Some(len) = i32_at(&mut pos).filter(|&l| l > 0) {
            if let Some(d) = b.get(pos..pos + len as usize) {
                out.datasets.push(String::from_utf8_lossy(d.split(|&c| c == 0).next().unwrap_or(d)).into_owned());
            }
        }
    }
    Ok(out)
}
