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
mod toolchain;

use std::process::ExitCode;

fn main() -> ExitCode {
    // A panic inside a build dependency (bindgen, the cmake crate) is caught and reported as our
    // one message; its default hook would print a backtrace first.
    std::panic::set_hook(Box::new(|_| {}));
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
    toolchain::check()?;
    let pristine = source::locate_pristine(&cfg)?;
    let libs = native::build_llama(&cfg, &pristine)?;
    bindings::generate(&cfg, &libs.source_dir)?;
    libs.emit_link_lines(&cfg);
    // exported to the crate so the manifest can record exactly what was built
    println!("cargo:rustc-env=REAP_LLAMA_COMMIT={}", cfg.pin.commit);
    println!("cargo:rustc-env=REAP_LLAMA_SHA256={}", cfg.pin.sha256);
    println!("cargo:rustc-env=REAP_PATCHES_SHA256={}", libs.patches_digest);
    // the unpatched tree the build used: the fixture generator takes its vocab files from there
    println!("cargo:rustc-env=REAP_LLAMA_TREE={}", pristine.display());
    Ok(())
}

/// Runs `f`, turning a panic into its message.
pub fn quiet_panics<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic without a message".into())
    })
}
