//! Split models (`llama-gguf-split`, `PREFIX-00001-of-0000N.gguf`), as models of hundreds of
//! billions of parameters are published: calibration reads every shard's header, records every
//! shard in the manifest, and gives the merged model's files; `prune` reads the shards in place
//! and writes one file, byte for byte what pruning the merged model writes, or shards, byte for
//! byte what llama-gguf-split makes of that file.

use super::util::*;
use reap_imatrix::formats::saliency::Saliency;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The glm4moe fixture (with its nextn block) split by upstream's llama-gguf-split into shards
/// of at most 20 tensors, and merged back by it, in `d`.
fn split_and_merged(d: &Path) -> (PathBuf, usize, PathBuf) {
    let model = fixture("glm4moe");
    run_ok(Command::new(reference_bin("llama-gguf-split")).current_dir(d).args(["--split", "--split-max-tensors", "20"]).arg(&model).arg("m"));
    let n = std::fs::read_dir(d).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("m-0000")).count();
    assert!(n >= 3, "{n} shards");
    let first = d.join(format!("m-00001-of-{n:05}.gguf"));
    run_ok(Command::new(reference_bin("llama-gguf-split")).current_dir(d).args(["--merge"]).arg(&first).arg("merged.gguf"));
    (first, n, d.join("merged.gguf"))
}

fn calibrate(dir: &Path, model: &Path) -> std::process::Output {
    std::fs::create_dir_all(dir).unwrap();
    run(Command::new(ours()).current_dir(dir).arg("-m").arg(model).arg("-f").arg(corpus()).args(["-t", "2", "--no-ppl", "-o", "i.gguf", "-c", "128", "--chunks", "3", "--nextn", "--trace-out", "t.bin"]))
}

#[test]
fn a_split_model_calibrates_and_prunes_as_the_merged_one() {
    let d = temp_dir("split");
    let (first, n, merged) = split_and_merged(&d);
    for (dir, model) in [("run-split", &first), ("run-merged", &merged)] {
        let out = calibrate(&d.join(dir), model);
        assert!(out.status.success(), "{dir}: {}", String::from_utf8_lossy(&out.stderr));
    }
    // the same files: imatrix and trace byte for byte (--nextn found the block's tensors in
    // a later shard), the sums equal
    assert_same_bytes(&d.join("run-split/i.gguf"), &d.join("run-merged/i.gguf"));
    assert_same_bytes(&d.join("run-split/t.bin"), &d.join("run-merged/t.bin"));
    let (a, b) = (Saliency::read(&d.join("run-split/i.reap.json")).unwrap(), Saliency::read(&d.join("run-merged/i.reap.json")).unwrap());
    assert_eq!(a.layers, b.layers);
    assert_eq!(a.nextn_blocks, vec![4]);
    // every shard in the manifest; a changed shard is named by reproduce before anything runs
    let m = reap_imatrix::formats::manifest::Manifest::read(&d.join("run-split/i.manifest.json")).unwrap();
    let shards: Vec<String> = m.inputs.iter().filter(|f| f.role == "model_shard").map(|f| f.path.to_string_lossy().into_owned()).collect();
    let want: Vec<String> = (2..=n).map(|i| d.join(format!("m-{i:05}-of-{n:05}.gguf")).to_string_lossy().into_owned()).collect();
    assert_eq!(shards, want);
    // hashed beside the compute (cached), the files' own sha256
    for f in m.inputs.iter().filter(|f| f.role == "model_shard") {
        assert_eq!(f.sha256, reap_imatrix::formats::sha256::sha256_file(&f.path).unwrap(), "{}", f.path.display());
        assert_eq!(f.size, std::fs::metadata(&f.path).unwrap().len());
    }
    let last = d.join(format!("m-{n:05}-of-{n:05}.gguf"));
    let original = read(&last);
    let mut changed = original.clone();
    *changed.last_mut().unwrap() ^= 1;
    std::fs::write(&last, &changed).unwrap();
    let r = run(Command::new(ours()).args(["reproduce"]).arg(d.join("run-split/i.manifest.json")));
    let text = String::from_utf8_lossy(&r.stdout);
    assert_ne!(r.status.code(), Some(0), "{text}");
    assert!(text.contains(&format!("input model_shard {}: CHANGED", last.display())), "{text}");
    // the saliency JSON names every shard with its sha256, select's map carries them, and
    // prune refuses the map for a model whose shard changed
    let listed = a.metadata["model"]["shards"].as_array().expect("metadata.model.shards").clone();
    assert_eq!(listed.len(), n - 1);
    assert!(listed.iter().zip(&m.inputs[1..]).all(|(l, f)| l["sha256"] == f.sha256.as_str()), "{listed:?}");
    run_ok(Command::new(ours()).current_dir(d.join("run-split")).args(["select", "--reap", "i.reap.json", "--method", "reap_mean", "--k", "16", "--out-dir", "maps"]));
    let map: serde_json::Value = serde_json::from_slice(&read(&d.join("run-split/maps/keep_reap_mean_k16.json"))).unwrap();
    assert_eq!(map["model"]["shards"].as_array().map(Vec::len), Some(n - 1));
    let r = run(Command::new(ours()).current_dir(d.join("run-split")).args(["prune", "-m"]).arg(&first).args(["--keep-map", "maps/keep_reap_mean_k16.json", "-o", "changed.gguf"]));
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("whose shard {} has sha256", last.display())), "{err}");
    let r = run(Command::new(ours()).current_dir(d.join("run-split")).args(["prune", "-m"]).arg(&merged).args(["--keep-map", "maps/keep_reap_mean_k16.json", "-o", "one.gguf"]));
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(err.contains("made for the model with sha256"), "{err}");
    std::fs::write(&last, &original).unwrap();

    // prune from the shards: the bytes of pruning the merged model (one file; split.count 0
    // as the merge writes it), which upstream's llama-perplexity runs
    let prune = |dir: &str, model: &Path, out: &str| {
        let dir = d.join(dir);
        run_ok(Command::new(ours()).current_dir(&dir).args(["select", "--reap", "i.reap.json", "--method", "reap_mean", "--k", "16", "--out-dir", "maps"]));
        run_ok(Command::new(ours()).current_dir(&dir).args(["prune", "-m"]).arg(model).args(["--keep-map", "maps/keep_reap_mean_k16.json", "-o", out, "--imatrix", "i.gguf", "--imatrix-out", "p.imatrix.gguf"]));
        dir.join(out)
    };
    let (ps, pm) = (prune("run-split", &first, "p.gguf"), prune("run-merged", &merged, "p.gguf"));
    assert_same_bytes(&ps, &pm);
    assert_same_bytes(&d.join("run-split/p.imatrix.gguf"), &d.join("run-merged/p.imatrix.gguf"));
    let ppl = super::prune::upstream_ppl(&ps);
    assert!(ppl.is_finite());

    // and written as shards: the files llama-gguf-split makes of the one-file output, by
    // tensor count and by size, which upstream runs to the same perplexity
    for (i, rule) in [["--split-max-tensors", "20"], ["--split-max-size", "20M"]].iter().enumerate() {
        let (ours_dir, up_dir) = (d.join(format!("shards-{i}")), d.join(format!("upstream-{i}")));
        std::fs::create_dir_all(&ours_dir).unwrap();
        std::fs::create_dir_all(&up_dir).unwrap();
        let out = run_ok(Command::new(ours()).current_dir(d.join("run-split")).args(["prune", "-m"]).arg(&first).args(["--keep-map", "maps/keep_reap_mean_k16.json", "-o"]).arg(ours_dir.join("p.gguf")).args(rule));
        assert!(String::from_utf8_lossy(&out.stdout).contains("shards)"), "{}", String::from_utf8_lossy(&out.stdout));
        run_ok(Command::new(reference_bin("llama-gguf-split")).arg("--split").args(rule).arg(&ps).arg(up_dir.join("p")));
        let names = |dir: &Path| {
            let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
            v.sort();
            v
        };
        let (ours_names, up_names) = (names(&ours_dir), names(&up_dir));
        assert_eq!(ours_names, up_names, "{rule:?}");
        assert!(ours_names.len() >= 2, "{rule:?}: {ours_names:?}");
        for name in &ours_names {
            assert_same_bytes(&ours_dir.join(name), &up_dir.join(name));
        }
        assert_eq!(super::prune::upstream_ppl(&ours_dir.join(&ours_names[0])), ppl, "{rule:?}");
    }
    // a shard already there (not replaced without --force), a first tensor over the size
    let again = run(Command::new(ours()).current_dir(d.join("run-split")).args(["prune", "-m"]).arg(&first).args(["--keep-map", "maps/keep_reap_mean_k16.json", "-o"]).arg(d.join("shards-0/p.gguf")).args(["--split-max-tensors", "20"]));
    let err = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(2), "{err}");
    assert!(err.contains("shards-0/p-00001-of-") && err.contains("already exists (pass --force to replace it)"), "{err}");
    for (size, want) in [("1M", "exceed --split-max-size: the first shard would hold no tensor"), ("5K", "--split-max-size 5K: expected N followed by M or G")] {
        let r = run(Command::new(ours()).current_dir(d.join("run-split")).args(["prune", "-m"]).arg(&first).args(["--keep-map", "maps/keep_reap_mean_k16.json", "-o", "small.gguf", "--split-max-size", size]));
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{err}");
        assert!(err.contains(want), "{want}: {err}");
    }
}

/// A later shard given as -m, a shard missing, an output over a shard: refused by name before
/// anything is written (calibration and prune).
#[test]
fn a_split_model_is_refused_where_its_shards_do_not_add_up() {
    let d = temp_dir("split-bad");
    let (first, n, _) = split_and_merged(&d);
    let second = d.join(format!("m-00002-of-{n:05}.gguf"));
    let refused = |args: &[std::ffi::OsString], want: &str| {
        let out = run(Command::new(ours()).current_dir(&d).args(args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{want}: {err}");
        assert!(err.contains(want), "{want}: {err}");
    };
    let map = d.join("map.json");
    let layers: Vec<serde_json::Value> = (1..=4).map(|b| serde_json::json!({"layer": b, "keep": (0..16).collect::<Vec<u32>>()})).collect();
    std::fs::write(&map, serde_json::to_vec(&serde_json::json!({"format": "reap-keep-map", "version": 1, "method": "m", "k": 16, "layers": layers})).unwrap()).unwrap();
    let calib = |m: &Path| vec![std::ffi::OsString::from("-m"), m.into(), "-f".into(), corpus().into(), "-o".into(), "i.gguf".into()];
    let prune = |m: &Path, o: &Path| vec![std::ffi::OsString::from("prune"), "-m".into(), m.into(), "--keep-map".into(), map.clone().into(), "-o".into(), o.into()];
    refused(&calib(&second), &format!("shard 2 of {n} of a split model: give the first shard ({})", first.display()));
    refused(&prune(&second, &d.join("p.gguf")), &format!("shard 2 of {n} of a split model: give the first shard"));
    let mut over = prune(&first, &second);
    over.push("--force".into());
    refused(&over, "is the model's shard");
    std::fs::rename(&second, d.join("away.gguf")).unwrap();
    refused(&calib(&first), &format!("-m {}: cannot read the model file", second.display()));
    refused(&prune(&first, &d.join("p.gguf")), &format!("-m (a shard) {}", second.display()));
    assert!(!d.join("i.gguf").exists() && !d.join("p.gguf").exists());
}
