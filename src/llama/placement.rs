//! Where a model's tensors go: `-dev`'s devices and `-ot`'s buffer types, looked up by the
//! names llama.cpp gives them (after `--rpc` has added its servers' devices), and
//! `--list-devices`.

use super::sys;
use anyhow::{bail, Context as _, Result};
use std::ffi::CString;

/// One `-ot PATTERN=BUFFER_TYPE`: tensors whose names the (ECMAScript) regex finds a match in
/// go to that buffer type, named as llama.cpp names a device's (`CPU`, `CUDA0`,
/// `RPC0[host:port]`).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorOverride {
    pub pattern: String,
    pub buffer_type: String,
}

/// Each override's pattern and buffer type, looked up by name among the devices' buffer types
/// as upstream's `-ot` does (after `--rpc` has added its servers' devices). A name that is not
/// one is refused with the list of those there are.
pub(crate) fn buffer_overrides(list: &[TensorOverride]) -> Result<Vec<(CString, sys::ggml_backend_buffer_type_t)>> {
    if list.is_empty() {
        return Ok(Vec::new());
    }
    // SAFETY: a plain query.
    let max = unsafe { sys::llama_max_tensor_buft_overrides() };
    if list.len() >= max {
        bail!("-ot: {} tensor overrides, llama.cpp takes at most {}", list.len(), max - 1);
    }
    let mut types: Vec<(String, sys::ggml_backend_buffer_type_t)> = Vec::new();
    // SAFETY: registry queries; names are static C strings.
    unsafe {
        for i in 0..sys::ggml_backend_dev_count() {
            let buft = sys::ggml_backend_dev_buffer_type(sys::ggml_backend_dev_get(i));
            if !buft.is_null() {
                let name = std::ffi::CStr::from_ptr(sys::ggml_backend_buft_name(buft)).to_string_lossy().into_owned();
                if !types.iter().any(|(n, _)| *n == name) {
                    types.push((name, buft));
                }
            }
        }
    }
    list.iter()
        .map(|o| {
            let Some(&(_, buft)) = types.iter().find(|(n, _)| *n == o.buffer_type) else {
                let names: Vec<&str> = types.iter().map(|(n, _)| n.as_str()).collect();
                bail!(crate::error::UsageError(format!("-ot {}={}: unknown buffer type (available: {})", o.pattern, o.buffer_type, names.join(", "))));
            };
            let pattern = CString::new(o.pattern.as_str()).with_context(|| format!("-ot {}: the pattern contains a NUL byte", o.pattern))?;
            Ok((pattern, buft))
        })
        .collect()
}

/// `-dev` names → devices, as upstream's `parse_device_list` takes them (after `--rpc` has
/// added its servers'): the CPU is not one to offload to; an unknown name is refused with the
/// list of those there are.
pub(crate) fn offload_devices(names: &[String]) -> Result<Vec<sys::ggml_backend_dev_t>> {
    names
        .iter()
        .map(|name| {
            let c = CString::new(name.as_str()).with_context(|| format!("-dev {name}: contains a NUL byte"))?;
            // SAFETY: registry queries.
            let dev = unsafe { sys::ggml_backend_dev_by_name(c.as_ptr()) };
            if dev.is_null() || unsafe { sys::ggml_backend_dev_type(dev) } == sys::GGML_BACKEND_DEVICE_TYPE_CPU {
                let known: Vec<String> = offload_device_list().into_iter().map(|(n, _, _, _)| n).collect();
                bail!(crate::error::UsageError(format!(
                    "-dev {name}: not a device to offload to (available: {}; -dev none keeps every layer on the host)",
                    if known.is_empty() { "none".to_string() } else { known.join(", ") }
                )));
            }
            Ok(dev)
        })
        .collect()
}

/// The devices layers can be offloaded to (not the CPU): name, description, free and total
/// bytes, as upstream's `--list-devices` prints them.
pub fn offload_device_list() -> Vec<(String, String, usize, usize)> {
    super::init_backend();
    let s = |p: *const std::ffi::c_char| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: registry queries; names are static C strings.
    unsafe {
        (0..sys::ggml_backend_dev_count())
            .map(|i| sys::ggml_backend_dev_get(i))
            .filter(|&d| sys::ggml_backend_dev_type(d) != sys::GGML_BACKEND_DEVICE_TYPE_CPU)
            .map(|d| {
                let (mut free, mut total) = (0usize, 0usize);
                sys::ggml_backend_dev_memory(d, &mut free, &mut total);
                (s(sys::ggml_backend_dev_name(d)), s(sys::ggml_backend_dev_description(d)), free, total)
            })
            .collect()
    }
}

/// `--list-devices` (after `--rpc` has added its servers'), in upstream's words.
pub fn print_offload_devices(rpc: Option<&str>) -> Result<()> {
    if let Some(servers) = rpc {
        super::context::add_rpc_devices(servers)?;
    }
    println!("Available devices:");
    let list = offload_device_list();
    if list.is_empty() {
        println!("  (none)");
    }
    const MIB: usize = 1024 * 1024;
    for (name, description, free, total) in list {
        println!("  {name}: {description} ({} MiB, {} MiB free)", total / MIB, free / MIB);
    }
    Ok(())
}

