//! What the build needs from the machine, checked before anything slow starts: a missing tool
//! must cost seconds, not a four-minute llama.cpp compile followed by a bindgen failure.

use std::process::Command;

const INSTALL_HINT: &str = "Install what is missing with `apt-get install cmake libclang-dev` (Debian), or run \
                            scripts/setup, which installs everything the build needs.";

pub fn check() -> Result<(), String> {
    check_cmake()?;
    check_libclang()
}

fn check_cmake() -> Result<(), String> {
    let cmake = std::env::var("CMAKE").unwrap_or_else(|_| "cmake".into());
    match Command::new(&cmake).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err(format!("`{cmake}` was not found; llama.cpp is built with CMake. {INSTALL_HINT}")),
    }
}

/// A trial, not a file-name probe: bindgen is run on a header that includes what llama.h needs
/// from clang itself, so the check loads exactly the libclang (and finds exactly the resource
/// headers) the real bindgen step will.
fn check_libclang() -> Result<(), String> {
    let trial = crate::quiet_panics(|| {
        bindgen::Builder::default()
            .header_contents("reap_trial.h", "#include <stddef.h>\n#include <stdbool.h>\n#include <stdint.h>\n")
            .allowlist_type("size_t")
            .generate()
    });
    match trial {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!(
            "bindgen found libclang but not clang's own headers ({e}). {INSTALL_HINT}"
        )),
        Err(why) => Err(format!(
            "bindgen could not load libclang ({why}). A libclang-cpp.so alone is not enough: bindgen \
             needs libclang.so. {INSTALL_HINT} If libclang is installed elsewhere, set LIBCLANG_PATH."
        )),
    }
}
