//! Where the REAP expert-output statistics are computed (patches/0001-reap-expert-stats.patch).
//!
//! On the host the eval callback reads each MoE layer's expert outputs `[n_embd, k, T]` in
//! place. When layers are offloaded (a GPU, or `--rpc`), each read is a device-to-host copy of
//! that whole tensor, so the patch can add two `[1, k, T]` nodes per layer, the L2 norm and the
//! largest element of every selected expert's output, computed where the outputs live; the
//! callback then copies n_embd times less. The observer decides per layer, by where that
//! layer's outputs are, which it reads; the norms agree to float rounding (f32 sums on the
//! device, f64 on the host), the maxima exactly.

use super::sys;

/// Whether graphs should carry the device-side statistics: only when layers are offloaded to a
/// non-host device (`n_gpu_layers` not 0 and a GPU-type device, which RPC servers are), so the
/// CPU graph stays upstream's. `REAP_EXPERT_STATS=host|device` overrides (tests, debugging).
pub fn wanted(n_gpu_layers: i32) -> bool {
    match std::env::var("REAP_EXPERT_STATS").as_deref() {
        Ok("device") => return true,
        Ok("host") => return false,
        _ => {}
    }
    n_gpu_layers != 0 && offload_device_present()
}

fn offload_device_present() -> bool {
    super::init_backend();
    // SAFETY: registry queries.
    unsafe {
        (0..sys::ggml_backend_dev_count()).any(|i| {
            let t = sys::ggml_backend_dev_type(sys::ggml_backend_dev_get(i));
            t == sys::GGML_BACKEND_DEVICE_TYPE_GPU || t == sys::GGML_BACKEND_DEVICE_TYPE_IGPU
        })
    }
}

/// Switches the patch's nodes on or off for graphs built from now on (process-wide).
pub fn set(on: bool) {
    // SAFETY: stores a flag the graph builder reads.
    unsafe { sys::llama_reap_set_expert_stats(on) };
}

/// Whether graphs should keep what the callback reads to their end (patch 0002), so the
/// observer reads it all there instead of stopping the graph at every node: when layers are
/// offloaded (`offloaded`: [`wanted`]) and something reads device tensors often (REAP, or
/// `--imatrix-on-device`). `REAP_DEFER=0` reads node by node (more device waits, less memory).
pub fn keep_wanted(offloaded: bool, reads_device: bool) -> bool {
    offloaded && reads_device && std::env::var("REAP_DEFER").map_or(true, |v| v != "0")
}

/// Switches patch 0002's marking on or off for graphs built from now on (process-wide).
pub fn set_keep(on: bool) {
    // SAFETY: stores a flag the graph builder reads.
    unsafe { sys::llama_reap_set_keep_collected(on) };
}
