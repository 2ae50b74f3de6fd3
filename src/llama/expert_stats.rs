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
pub fn wanted(params: &super::ModelParams) -> bool {
    match std::env::var("REAP_EXPERT_STATS").as_deref() {
        Ok("device") => return true,
        Ok("host") => return false,
        _ => {}
    }
    // `-dev` names only devices to offload to; `-dev none`, none
    let devices_allowed = params.devices.as_ref().is_none_or(|d| !d.is_empty());
    params.n_gpu_layers != 0 && devices_allowed && offload_device_present()
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

/// Whether a layer's router is read through patch 0003's nodes when its probabilities are
/// off-host: with the reads deferred to the end of the graph (`keep`, [`keep_wanted`]), which
/// keeps the probabilities for the rows the candidates do not decide. `REAP_ROUTER=host` reads
/// the whole probabilities (tests, debugging).
pub fn router_wanted(keep: bool) -> bool {
    keep && std::env::var("REAP_ROUTER").map_or(true, |v| v != "host")
}

/// Whether the reads at the end of the graph are copied all at once (`llama::prefetch`): with
/// `keep` ([`keep_wanted`]); `REAP_PREFETCH=0` copies one tensor at a time.
pub fn prefetch_wanted(keep: bool) -> bool {
    keep && std::env::var("REAP_PREFETCH").map_or(true, |v| v != "0")
}

/// Whether `--imatrix-on-device`'s reductions run on the device while the host copies and sums
/// REAP's reads at the end of the graph (the observer's `overlap`): with `keep`
/// ([`keep_wanted`]); `REAP_OVERLAP=0` runs them first and waits.
pub fn overlap_wanted(keep: bool) -> bool {
    keep && std::env::var("REAP_OVERLAP").map_or(true, |v| v != "0")
}

/// The candidates per token patch 0003 should compute for a trace of `top_n` (None: no trace)
/// of a model with `n_expert` experts: top-n + 1 (the extra one tells a tie at the boundary),
/// where that copies no more than the whole probabilities (8 bytes a candidate, its id and
/// value, against 4 an expert); else 0 and the probabilities are read whole.
pub fn router_candidates(top_n: Option<usize>, n_expert: Option<usize>) -> usize {
    match (top_n, n_expert) {
        (Some(n), Some(e)) if n > 0 && 2 * (n + 1) <= e => n + 1,
        _ => 0,
    }
}

/// Sets patch 0003's candidate count for graphs built from now on (process-wide; 0: none).
pub fn set_router_candidates(n: usize) {
    // SAFETY: stores a count the graph builder reads.
    unsafe { sys::llama_reap_set_router_candidates(n.min(i32::MAX as usize) as i32) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_only_where_they_copy_no_more_than_the_probabilities() {
        // 64 of 512 experts: 65 candidates
        assert_eq!(router_candidates(Some(64), Some(512)), 65);
        // 64 of 128: 65 × 8 bytes > 128 × 4, the probabilities are read whole
        assert_eq!(router_candidates(Some(64), Some(128)), 0);
        assert_eq!(router_candidates(Some(7), Some(16)), 8);
        assert_eq!(router_candidates(Some(8), Some(16)), 0);
        assert_eq!(router_candidates(None, Some(512)), 0);
        assert_eq!(router_candidates(Some(8), None), 0);
    }
}
