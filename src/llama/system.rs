//! What makes results machine-dependent: the CPU features ggml was built for and uses (it is
//! built with `GGML_NATIVE`, so the same source computes differently on AVX2 and AVX512), and
//! the backend devices tensors live on.

use super::sys;
use std::ffi::CStr;

/// llama.cpp's own one-line summary (`llama_print_system_info`).
pub fn system_info() -> String {
    super::init_backend();
    // SAFETY: returns a pointer to a static buffer, copied out at once.
    unsafe { CStr::from_ptr(sys::llama_print_system_info()).to_string_lossy().into_owned() }
}

/// The features switched on in `system_info` (`AVX2 = 1` → `AVX2`), in the order printed;
/// `KEY = 0` entries and non-feature fields are left out.
pub fn cpu_features(info: &str) -> Vec<String> {
    let mut out = Vec::new();
    for section in info.split('|') {
        // the first field of each backend section carries its name: "CPU : SSE3 = 1"
        let field = section.rsplit(':').next().unwrap_or(section);
        if let Some((k, v)) = field.split_once('=') {
            let (k, v) = (k.trim(), v.trim());
            if v == "1" && !k.is_empty() && !out.iter().any(|o| o == k) {
                out.push(k.to_string());
            }
        }
    }
    out
}

/// Every backend device llama.cpp can use now ("CPU: <description>", "RPC0: …").
pub fn devices() -> Vec<String> {
    super::init_backend();
    // SAFETY: registry queries; the returned strings are static to the device and copied out.
    unsafe {
        (0..sys::ggml_backend_dev_count())
            .map(|i| {
                let d = sys::ggml_backend_dev_get(i);
                let s = |p: *const std::ffi::c_char| if p.is_null() { String::new() } else { CStr::from_ptr(p).to_string_lossy().into_owned() };
                format!("{}: {}", s(sys::ggml_backend_dev_name(d)), s(sys::ggml_backend_dev_description(d)))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_are_read_from_llama_system_info() {
        let info = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX512 = 0 | AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ";
        assert_eq!(cpu_features(info), ["SSE3", "SSSE3", "AVX", "AVX2", "LLAMAFILE", "OPENMP", "REPACK"]);
        // and on this machine: whatever it has, the parse finds the CPU section
        assert!(system_info().contains("CPU"));
    }
}
