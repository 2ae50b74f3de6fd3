//! Bytes of one routed expert per layer, from a GGUF's tensor infos (no tensor data is read):
//! the byte size of `blk.L.ffn_{gate,up,down}_exps.weight` (or a fused `ffn_gate_up_exps`)
//! divided by the expert count, in whatever type each tensor is stored.

use crate::llama::sys;
use anyhow::{bail, Result};
use std::ffi::CString;
use std::path::Path;

struct Gguf(*mut sys::gguf_context);

impl Drop for Gguf {
    fn drop(&mut self) {
        // SAFETY: created by gguf_init_from_file, freed once.
        unsafe { sys::gguf_free(self.0) }
    }
}

/// `(bytes per expert, tensor names)` for each block in `layers`.
pub fn expert_bytes(model: &Path, layers: &[u32], n_expert: usize) -> Result<Vec<u64>> {
    let Ok(c) = CString::new(model.to_string_lossy().as_bytes()) else { bail!("{}: path holds a NUL byte", model.display()) };
    if !model.is_file() {
        bail!("{}: no such file", model.display());
    }
    // SAFETY: valid C string; no_alloc reads only the header and tensor infos.
    let g = unsafe { sys::gguf_init_from_file(c.as_ptr(), sys::gguf_init_params { no_alloc: true, ctx: std::ptr::null_mut() }) };
    if g.is_null() {
        bail!("{}: not a readable GGUF file", model.display());
    }
    let g = Gguf(g);
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
