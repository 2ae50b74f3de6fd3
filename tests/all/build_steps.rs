//! The build steps that don't need a full build: the patch step (build/patch.rs, compiled in
//! here as-is) and the fetch (vendor/fetch.py).

#[path = "../../build/patch.rs"]
#[allow(dead_code)]
mod patch;

use super::util::{repo, temp_dir};
use std::process::Command;

fn tree_with_file(name: &str) -> std::path::PathBuf {
    let d = temp_dir(name);
    std::fs::create_dir_all(d.join("tree/src")).unwrap();
    std::fs::write(d.join("tree/src/a.c"), "int a = 1;\n").unwrap();
    d
}

const GOOD: &str = "Why: a test patch.\n\ndiff --git a/src/a.c b/src/a.c\n--- a/src/a.c\n+++ b/src/a.c\n@@ -1 +1 @@\n-int a = 1;\n+int a = 2;\n";
const BAD: &str = "Why: a stale patch.\n\ndiff --git a/src/a.c b/src/a.c\n--- a/src/a.c\n+++ b/src/a.c\n@@ -1 +1 @@\n-int a = 7;\n+int a = 8;\n";

#[test]
fn patches_apply_in_name_order() {
    let d = tree_with_file("patch-good");
    std::fs::create_dir_all(d.join("patches")).unwrap();
    std::fs::write(d.join("patches/0001-good.patch"), GOOD).unwrap();
    std::fs::write(d.join("patches/README.md"), "not a patch").unwrap();
    let list = patch::list_patches(&d.join("patches")).unwrap();
    assert_eq!(list.len(), 1);
    patch::apply_patches(&d.join("tree"), &list).unwrap();
    assert_eq!(std::fs::read_to_string(d.join("tree/src/a.c")).unwrap(), "int a = 2;\n");
}

#[test]
fn a_patch_that_does_not_apply_stops_the_build_with_its_name() {
    let d = tree_with_file("patch-bad");
    std::fs::create_dir_all(d.join("patches")).unwrap();
    std::fs::write(d.join("patches/0001-good.patch"), GOOD).unwrap();
    std::fs::write(d.join("patches/0002-stale-hunk.patch"), BAD).unwrap();
    let list = patch::list_patches(&d.join("patches")).unwrap();
    let err = patch::apply_patches(&d.join("tree"), &list).unwrap_err();
    assert!(err.contains("0002-stale-hunk.patch"), "error does not name the patch: {err}");
    assert!(err.contains("does not apply"), "{err}");
}

#[test]
fn copy_tree_leaves_out_models_and_docs() {
    let d = temp_dir("copy-tree");
    for f in ["src/x.c", "models/big.gguf", "docs/a.md", "ggml/include/ggml.h"] {
        let p = d.join("from").join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, f).unwrap();
    }
    patch::copy_tree(&d.join("from"), &d.join("to")).unwrap();
    assert!(d.join("to/src/x.c").is_file());
    assert!(d.join("to/ggml/include/ggml.h").is_file());
    assert!(!d.join("to/models").exists());
    assert!(!d.join("to/docs").exists());
}

#[test]
fn patch_digest_changes_with_content() {
    let d = temp_dir("patch-digest");
    let p = d.join("0001-x.patch");
    std::fs::write(&p, GOOD).unwrap();
    let a = patch::digest(std::slice::from_ref(&p)).unwrap();
    std::fs::write(&p, BAD).unwrap();
    let b = patch::digest(std::slice::from_ref(&p)).unwrap();
    assert_ne!(a, b);
    assert_eq!(a.len(), 64);
    assert_ne!(patch::digest(&[]).unwrap(), a);
}

#[test]
fn fetch_refuses_a_tarball_whose_sha256_does_not_match_the_pin() {
    let d = temp_dir("fetch-bad-sha");
    let fake = d.join("llama_cpp_python-0.3.36.tar.gz");
    std::fs::write(&fake, b"not the real sdist").unwrap();
    let out = Command::new("python3")
        .arg(repo().join("vendor/fetch.py"))
        .arg("--cache")
        .arg(d.join("cache"))
        .arg("--tarball")
        .arg(&fake)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sha256 mismatch"), "{err}");
    assert!(!d.join("cache/llama.cpp-0c1e57098").exists(), "a refused tarball must not be unpacked");
}

#[test]
fn fetch_reports_the_pinned_tree_it_built_against() {
    // the tree build.rs used must carry the stamp of the pinned sha256
    let out = Command::new("python3").arg(repo().join("vendor/fetch.py")).arg("--quiet").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tree = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let stamp = std::fs::read_to_string(tree.join(".reap-pin")).unwrap();
    let pin = std::fs::read_to_string(repo().join("vendor/llama.cpp.pin")).unwrap();
    let sha = pin.lines().find_map(|l| l.strip_prefix("sha256=")).unwrap();
    assert_eq!(stamp.trim(), sha);
    assert!(tree.join("tools/imatrix/imatrix.cpp").is_file());
    assert_eq!(reap_imatrix::llama::PIN_SHA256, sha);
}

/// `scripts/setup --check` against a fake file system root: the detection looks for what
/// bindgen loads, so a new machine's `libclang-cpp.so.14` alone must read as libclang missing.
#[test]
fn setup_detects_libclang_by_what_bindgen_loads() {
    let d = temp_dir("setup-root");
    let touch = |rel: &str| {
        let p = d.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"").unwrap();
    };
    let check = || {
        let out = Command::new(repo().join("scripts/setup"))
            .arg("--check")
            .env("REAP_SETUP_ROOT", &d)
            .env_remove("LIBCLANG_PATH")
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect::<Vec<_>>())
    };
    // a new machine: libclang-cpp only, and no tools
    touch("usr/lib/x86_64-linux-gnu/libclang-cpp.so.14");
    touch("usr/lib/llvm-14/lib/libclang-cpp.so.14");
    let (code, missing) = check();
    assert_eq!(code, Some(1));
    assert!(missing.contains(&"libclang-dev".to_string()), "{missing:?}");
    assert!(missing.contains(&"cmake".to_string()), "{missing:?}");
    // the library bindgen loads, but not clang's resource headers: still missing
    touch("usr/lib/x86_64-linux-gnu/libclang-14.so.1");
    assert!(check().1.contains(&"libclang-dev".to_string()));
    // both, and the tools: nothing missing
    touch("usr/lib/llvm-14/lib/clang/14.0.6/include/stddef.h");
    for tool in ["cmake", "git", "python3", "c++", "make"] {
        let p = d.join("usr/bin").join(tool);
        touch(&format!("usr/bin/{tool}"));
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    assert_eq!(check(), (Some(0), vec![]));
    // `libclang.so` in an llvm folder counts too
    std::fs::remove_file(d.join("usr/lib/x86_64-linux-gnu/libclang-14.so.1")).unwrap();
    assert_eq!(check().0, Some(1));
    touch("usr/lib/llvm-14/lib/libclang.so");
    assert_eq!(check().0, Some(0));
}
