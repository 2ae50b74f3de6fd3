//! Where the pristine llama.cpp tree comes from: `LLAMA_CPP_DIR`, or the sdist fetched and
//! verified by `vendor/fetch.py` (the same step the reference build uses).

use crate::config::Config;
use std::path::PathBuf;
use std::process::Command;

pub fn locate_pristine(cfg: &Config) -> Result<PathBuf, String> {
    if let Some(dir) = &cfg.llama_cpp_dir {
        if !dir.join("include/llama.h").is_file() {
            return Err(format!(
                "LLAMA_CPP_DIR={} does not look like a llama.cpp tree (no include/llama.h).\n\
                 Point it at a checkout of upstream commit {}, or unset it to fetch the pin.",
                dir.display(),
                cfg.pin.commit
            ));
        }
        return Ok(dir.clone());
    }
    let script = cfg.manifest_dir.join("vendor/fetch.py");
    println!("cargo:rerun-if-changed={}", script.display());
    let out = Command::new("python3")
        .arg(&script)
        .arg("--cache")
        .arg(&cfg.cache_dir)
        .output()
        .map_err(|e| format!("could not run python3 {}: {e}\nInstall Debian's python3.", script.display()))?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        // fetch.py's own messages say what to do; the LLAMA_CPP_DIR way only where they do not
        let other_way = if why.contains("LLAMA_CPP_DIR") {
            String::new()
        } else {
            format!("\nOr set LLAMA_CPP_DIR to a llama.cpp checkout at commit {} to build without the fetch.", cfg.pin.commit)
        };
        return Err(format!("fetching the pinned llama.cpp failed:\n{}{other_way}", why.trim()));
    }
    let tree = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    Ok(tree)
}
