//! Generated fixtures: upstream's own tools load and run them.

use super::util::*;
use std::process::Command;

#[test]
fn upstream_perplexity_runs_every_fixture_arch() {
    for arch in ["qwen3moe", "qwen2moe", "gpt-oss", "glm4moe", "deepseek2", "glm-dsa", "deepseek32", "qwen35moe", "qwen3next", "minimax-m2", "nemotron_h_moe", "cohere2moe", "step35", "mimo2", "hy_v3", "bailingmoe3", "gemma4", "deepseek4"] {
        let model = fixture(arch);
        let out = run_ok(Command::new(reference_bin("llama-perplexity")).arg("-m").arg(&model).arg("-f").arg(corpus()).args(["-c", "256", "--chunks", "3", "-t", "2"]).args(cpu_flags(arch)));
        // llama-perplexity prints the final estimate through its logger (stderr)
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let ppl: f64 = text
            .split("Final estimate: PPL = ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{arch}: no final PPL in output:\n{text}"));
        assert!(ppl.is_finite() && ppl > 1.0, "{arch}: PPL {ppl}");
    }
}

#[test]
fn fixture_generation_is_deterministic() {
    let d = temp_dir("fixture-determinism");
    let gen = |name: &str, seed: &str| {
        let p = d.join(name);
        run_ok(Command::new(ours()).args(["fixture", "--layers", "2", "--seed", seed, "-o"]).arg(&p));
        read(&p)
    };
    let (a, b, c) = (gen("a.gguf", "7"), gen("b.gguf", "7"), gen("c.gguf", "8"));
    assert_eq!(a, b, "same seed, different bytes");
    assert_ne!(a, c, "different seed, same bytes");
}

/// Both outputs are checked before the model is generated: the summary onto the model, or
/// into a folder that does not exist, is refused and nothing is written.
#[test]
fn fixture_outputs_are_checked_first() {
    let d = temp_dir("fixture-outputs");
    for (summary, says) in [("./m.gguf", "is -o too"), ("no/such/s.json", "does not exist")] {
        let out = run(Command::new(ours()).current_dir(&d).args(["fixture", "--layers", "1", "-o", "m.gguf", "--summary-json", summary]));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(says), "{err}");
        assert!(!d.join("m.gguf").exists());
    }
    // a poisoned token past the vocabulary would poison nothing
    let out = run(Command::new(ours()).current_dir(&d).args(["fixture", "--layers", "1", "-o", "m.gguf", "--poison-token", "151936"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the vocabulary has 151936 tokens"));
    assert!(!d.join("m.gguf").exists());
}
