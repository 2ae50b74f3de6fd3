//! The run manifest and `reproduce`.

use super::util::*;
use std::process::Command;

#[test]
fn a_run_reproduces_byte_for_byte_and_changes_are_reported() {
    let d = temp_dir("reproduce");
    std::fs::copy(fixture("qwen2moe"), d.join("m.gguf")).unwrap();
    std::fs::copy(corpus(), d.join("c.txt")).unwrap();
    run_ok(Command::new(ours()).current_dir(&d).args([
        "-m", "m.gguf", "-f", "c.txt", "-c", "256", "-b", "256", "--chunks", "4", "-t", "2", "--no-ppl", "-o", "i.gguf",
        "--trace-out", "t.bin", "--save-frequency", "2",
    ]));
    let m: serde_json::Value = serde_json::from_slice(&read(&d.join("i.manifest.json"))).unwrap();
    let roles: Vec<&str> = m["outputs"].as_array().unwrap().iter().map(|o| o["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["imatrix", "reap", "trace", "imatrix_at", "imatrix_at"]);
    let out = run(Command::new(ours()).args(["reproduce"]).arg(d.join("i.manifest.json")));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(text.matches(": identical").count(), 5, "{text}");

    // a recorded output that does not match what the run gives
    let mut bad = m.clone();
    bad["outputs"][1]["sha256"] = "0".repeat(64).into();
    std::fs::write(d.join("bad.manifest.json"), serde_json::to_vec(&bad).unwrap()).unwrap();
    let out = run(Command::new(ours()).args(["reproduce"]).arg(d.join("bad.manifest.json")));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("output reap i.reap.json: DIFFERENT"));

    // an input that changed since: refused before running
    let mut text = read(&d.join("c.txt"));
    text.extend_from_slice(b"\nmore text\n");
    std::fs::write(d.join("c.txt"), text).unwrap();
    let out = run(Command::new(ours()).args(["reproduce"]).arg(d.join("i.manifest.json")));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("input corpus c.txt: CHANGED"));
}
