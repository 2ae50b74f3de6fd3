//! Build script: pinned llama.cpp → copied into a build folder → our patches applied →
//! static libraries built with CMake (Release, upstream's default flags) → bindgen bindings.
//!
//! Each step is a small module; every failure is reported as one message that says what to
//! install or set, not as a backtrace.

mod bindings;
mod config;
mod native;
mod patch;
mod source;

use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("\nreap-imatrix build failed:\n{msg}\n");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let cfg = config::Config::from_env()?;
    let pristine = source::locate_pristine(&cfg)?;
    let libs = native::build_llama(&cfg, &pristine)?;
    bindings::generate(&cfg, &libs.source_dir)?;
    libs.emit_link_lines(&cfg);
    // exported to the crate so the manifest can record exactly what was built
    println!("cargo:rustc-env=REAP_LLAMA_COMMIT={}", cfg.pin.commit);
    println!("cargo:rustc-env=REAP_LLAMA_SHA256={}", cfg.pin.sha256);
    println!("cargo:rustc-env=REAP_PATCHES_SHA256={}", libs.patches_digest);
    Ok(())
}
