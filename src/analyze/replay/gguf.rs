//! What replay reads from the model GGUF: the bytes of one routed expert per layer, from the
//! tensor infos (the byte size of `blk.L.ffn_{gate,up,down}_exps.weight`, or a fused
//! `ffn_gate_up_exps`, divided by the expert count, in whatever type each tensor is stored),
//! and the router's selection bias (`blk.L.exp_probs_b.bias`, hy_v3's `blk.L.exp_probs_b`,
//! n_expert f32), the only tensor
//! data it reads.

use crate::llama::sys;
use anyhow::{bail, Context as _, Result};
use std::ffi::CString;
use std::path::Path;

struct Gguf(*mut sys::gguf_context);

impl Drop for Gguf {
    fn drop(&mut self) {
        // SAFETY: created by gguf_init_from_file, freed once.
        unsafe { sys::gguf_free(self.0) }
    }
}

fn open(model: &Path) -> Result<Gguf> {
    let Ok(c) = CString::new(model.to_string_lossy().as_bytes()) else { bail!("{}: path holds a NUL byte", model.display()) };
    if !model.is_file() {
        bail!("{}: no such file", model.display());
    }
    // SAFETY: valid C string; no_alloc reads only the header and tensor infos.
    let g = unsafe { sys::gguf_init_from_file(c.as_ptr(), sys::gguf_init_params { no_alloc: true, ctx: std::ptr::null_mut() }) };
    if g.is_null() {
        bail!("{}: not a readable GGUF file", model.display());
    }
    Ok(Gguf(g))
}

/// Which blocks of `layers` route by token id (DeepSeek-V4's `blk.L.ffn_gate_tid2eid.weight`).
pub fn hash_blocks(model: &Path, layers: &[u32]) -> Result<Vec<bool>> {
    let g = open(model)?;
    Ok(layers
        .iter()
        .map(|l| {
            let cn = CString::new(format!("blk.{l}.ffn_gate_tid2eid.weight")).unwrap();
            // SAFETY: g is a live context.
            unsafe { sys::gguf_find_tensor(g.0, cn.as_ptr()) >= 0 }
        })
        .collect())
}

/// The selection bias of each block in `layers` (`layers.len() × n_expert`, layer-major), or
/// None when the model has none (a router that selects by its probabilities alone). A model
/// with the bias in some of those blocks only is refused, naming the first block without it,
/// but for the hash-routed blocks (`hash`), which have none (zeros there: never re-routed).
pub fn selection_bias(model: &Path, layers: &[u32], n_expert: usize, hash: &[bool]) -> Result<Option<Vec<f32>>> {
    use std::os::unix::fs::FileExt as _;
    let g = open(model)?;
    let file = std::fs::File::open(model).with_context(|| format!("{}", model.display()))?;
    let mut out = Vec::with_capacity(layers.len() * n_expert);
    let (mut missing, mut found) = (None, 0);
    for (li, &l) in layers.iter().enumerate() {
        if hash.get(li) == Some(&true) {
            out.extend(std::iter::repeat_n(0.0, n_expert));
            continue;
        }
        // `.bias` as most loaders name it; hy_v3's loader without the suffix
        let found_name = [format!("blk.{l}.exp_probs_b.bias"), format!("blk.{l}.exp_probs_b")].into_iter().find_map(|name| {
            let cn = CString::new(name.clone()).unwrap();
            // SAFETY: g is a live context.
            let id = unsafe { sys::gguf_find_tensor(g.0, cn.as_ptr()) };
            (id >= 0).then_some((name, id))
        });
        let Some((name, id)) = found_name else {
            missing.get_or_insert(l);
            continue;
        };
        found += 1;
        // SAFETY: g is a live context; id comes from gguf_find_tensor; ne points at 4 i64.
        let (ne, ty, off) = unsafe {
            let ne = std::slice::from_raw_parts(sys::gguf_get_tensor_ne(g.0, id), 4).to_vec();
            (ne, sys::gguf_get_tensor_type(g.0, id), sys::gguf_get_data_offset(g.0) + sys::gguf_get_tensor_offset(g.0, id))
        };
        if ty != sys::GGML_TYPE_F32 || ne[0] as usize != n_expert || ne[1..].iter().any(|&n| n != 1) {
            bail!("{}: {name} is not {n_expert} f32 values (type {ty}, shape {ne:?}); the trace has {n_expert} experts", model.display());
        }
        let mut bytes = vec![0u8; n_expert * 4];
        file.read_exact_at(&mut bytes, off as u64).with_context(|| format!("{}: reading {name} (truncated file?)", model.display()))?;
        let at = out.len();
        out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        if let Some(e) = out[at..].iter().position(|b| !b.is_finite()) {
            bail!("{}: {name} holds {} for expert {e} (a damaged model?)", model.display(), out[at + e]);
        }
    }
    match missing {
        None => Ok(Some(out)),
        Some(_) if found == 0 => Ok(None),
        Some(l) => bail!("{}: block {l} has no blk.{l}.exp_probs_b.bias, other MoE blocks have one (a model of another layout?)", model.display()),
    }
}

/// A u32 key `<arch>.NAME` of the model, where present.
fn arch_u32(g: &Gguf, name: &str) -> Option<u32> {
    // SAFETY: g is a live context; keys are looked up before their values are read, with the
    // types checked.
    unsafe {
        let arch_key = CString::new("general.architecture").unwrap();
        let id = sys::gguf_find_key(g.0, arch_key.as_ptr());
        if id < 0 || sys::gguf_get_kv_type(g.0, id) != sys::GGUF_TYPE_STRING {
            return None;
        }
        let arch = std::ffi::CStr::from_ptr(sys::gguf_get_val_str(g.0, id)).to_string_lossy().into_owned();
        let key = CString::new(format!("{arch}.{name}")).ok()?;
        let id = sys::gguf_find_key(g.0, key.as_ptr());
        if id < 0 || sys::gguf_get_kv_type(g.0, id) != sys::GGUF_TYPE_UINT32 {
            return None;
        }
        Some(sys::gguf_get_val_u32(g.0, id))
    }
}

/// `(<arch>.expert_group_count, <arch>.expert_group_used_count)` where the model has more than
/// one group (DeepSeek-V3's group-limited routing); a missing used count reads as 0, as
/// llama.cpp reads it (which then refuses the model).
pub fn expert_groups(model: &Path) -> Result<Option<(u32, u32)>> {
    let g = open(model)?;
    let groups = arch_u32(&g, "expert_group_count").unwrap_or(0);
    let used = arch_u32(&g, "expert_group_used_count").unwrap_or(0);
    Ok(Some((groups, used)).filter(|&(n, _)| n > 1))
}

/// `<arch>.expert_gating_func` (llama_expert_gating_func_type), where present.
pub fn gating_func(model: &Path) -> Result<Option<u32>> {
    Ok(arch_u32(&open(model)?, "expert_gating_func"))
}

/// `(bytes per expert, tensor names)` for each block in `layers`.
pub fn expert_bytes(model: &Path, layers: &[u32], n_expert: usize) -> Result<Vec<u64>> {
    let g = open(model)?;
    let mut out = Vec::with_capacity(layers.len());
    for &l in layers {
        let mut bytes = 0u64;
        let mut found = Vec::new();
        for part in ["gate", "up", "down", "gate_up"] {
            let name = format!("blk.{l}.ffn_{part}_exps.weight");
            let cn = CString::new(name.clone()).unwrap();
            // SAFETY: g is a live context; ids come from gguf_find_tensor; ne points at 4 i64.
            unsafe {
                let id = sys::gguf_find_tensor(g.0, cn.as_ptr());
                if id < 0 {
                    continue;
                }
                let ne = std::slice::from_raw_parts(sys::gguf_get_tensor_ne(g.0, id), 4);
                if ne[2] as usize != n_expert {
                    bail!("{}: {name} holds {} experts, the trace has {n_expert}", model.display(), ne[2]);
                }
                bytes += sys::gguf_get_tensor_size(g.0, id) as u64;
            }
            found.push(name);
        }
        if found.is_empty() {
            bail!("{}: no expert tensors for block {l} (looked for blk.{l}.ffn_{{gate,up,down}}_exps.weight)", model.display());
        }
        out.push(bytes / n_expert as u64);
    }
    Ok(out)
}
