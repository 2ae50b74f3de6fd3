//! `reap-imatrix reproduce MANIFEST`: runs a recorded run again, in the recorded working
//! folder but with every output sent to a scratch folder, and reports whether each output is
//! byte-identical to the recorded one. Exit 0 only when all are.

use crate::error::UsageError;
use crate::formats::manifest::{FileRecord, Manifest};
use anyhow::{bail, Context as _, Result};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct ReproduceArgs {
    /// the run manifest (`<stem>.manifest.json`)
    #[arg(value_name = "MANIFEST")]
    pub manifest: PathBuf,
    /// where the re-run writes its outputs (default: a fresh folder under the system temp dir)
    #[arg(long = "work-dir", value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    /// keep the re-run's outputs
    #[arg(long = "keep")]
    pub keep: bool,
}

/// Flags whose value names an output file, in every spelling the drop-in parser takes.
const OUTPUT_FLAGS: &[(&str, &str)] = &[
    ("-o", "imatrix"),
    ("--output-file", "imatrix"),
    ("--output", "imatrix"),
    ("--reap-out", "reap"),
    ("--trace-out", "trace"),
    ("--manifest-out", "manifest"),
];

/// Where the re-run writes what the recorded run wrote at `path`: the same path under `dir`
/// (an absolute one without its root, `..` as `up`), so two outputs never meet in one file.
pub fn redirected(dir: &Path, path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = dir.to_path_buf();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => out.push("up"),
            Component::RootDir | Component::Prefix(_) | Component::CurDir => {}
        }
    }
    out
}

/// The recorded argv with each output redirected into `dir` ([redirected]), and a manifest
/// path added if none was given. A device the run wrote in place (`-o /dev/null`) is left as it
/// is: it holds nothing to compare. Returns the new argv.
pub fn redirect_outputs(argv: &[String], dir: &Path, cwd: &Path) -> Vec<String> {
    let to_dir = |v: &str| {
        let full = cwd.join(v);
        if crate::formats::atomic::in_place(&full) {
            return v.to_string();
        }
        redirected(dir, Path::new(v)).to_string_lossy().into_owned()
    };
    let mut out = Vec::with_capacity(argv.len() + 2);
    let mut i = 0;
    let mut saw_output = false;
    let mut saw_manifest = false;
    while i < argv.len() {
        let a = &argv[i];
        // `-oPATH`, the short flag with its value attached (clap takes it), but not a
        // single-dash long flag such as `-ofreq`
        let name = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
        if a.len() > 2 && a.starts_with("-o") && !a.starts_with("-o=") && !crate::cli::argv::SINGLE_DASH_LONG.iter().any(|(s, _)| *s == name) {
            saw_output = true;
            out.push(format!("-o{}", to_dir(&a[2..])));
            i += 1;
            continue;
        }
        let flag = OUTPUT_FLAGS.iter().find(|(f, _)| a == f || a.starts_with(&format!("{f}=")));
        match flag {
            Some((f, role)) => {
                saw_output |= *role == "imatrix";
                saw_manifest |= *role == "manifest";
                if let Some(v) = a.strip_prefix(&format!("{f}=")) {
                    out.push(format!("{f}={}", to_dir(v)));
                } else {
                    out.push(a.clone());
                    if let Some(v) = argv.get(i + 1) {
                        out.push(to_dir(v));
                        i += 1;
                    }
                }
            }
            None => out.push(a.clone()),
        }
        i += 1;
    }
    if !saw_output {
        out.push("-o".into());
        out.push(to_dir("imatrix.gguf"));
    }
    if !saw_manifest {
        out.push("--manifest-out".into());
        out.push(to_dir("reproduced.manifest.json"));
    }
    out
}

pub fn run(args: &ReproduceArgs) -> Result<i32> {
    let m = Manifest::read(&args.manifest).map_err(|e| UsageError(format!("{e:#}")))?;
    if m.outputs.is_empty() {
        // nothing to compare: "reproduced" would be vacuous
        bail!(UsageError(format!("{}: records no outputs, so there is nothing to reproduce", args.manifest.display())));
    }
    if let Some(i) = &m.interrupted {
        bail!(UsageError(format!(
            "{}: the recorded run was stopped by {} at chunk {} ({} tokens evaluated): its outputs are partial, and a re-run would compute the whole run",
            args.manifest.display(),
            i.signal,
            i.chunk,
            i.tokens
        )));
    }
    println!("reproduce {}: reap-imatrix {} on llama.cpp {}", args.manifest.display(), m.tool_version, m.llama_cpp_commit);
    if m.tool_version != env!("CARGO_PKG_VERSION") || m.llama_cpp_commit != crate::llama::PIN_COMMIT || m.patches_sha256 != crate::llama::PATCHES_SHA256 {
        println!(
            "  warning: recorded with reap-imatrix {} / llama.cpp {} / patches {}, this is {} / {} / {}: outputs may differ",
            m.tool_version,
            m.llama_cpp_commit,
            short(&m.patches_sha256),
            env!("CARGO_PKG_VERSION"),
            crate::llama::PIN_COMMIT,
            short(crate::llama::PATCHES_SHA256)
        );
    }
    match &m.platform {
        Some(recorded) => {
            if let Some(diff) = crate::formats::manifest::Platform::current().cpu_difference(recorded) {
                println!("  warning: outputs may differ: {diff} (ggml is built for the CPU it runs on)");
            }
        }
        None => println!("  note: the manifest does not record the CPU it ran on; outputs may differ on another CPU"),
    }
    if !m.cwd.is_dir() {
        bail!(UsageError(format!("{}: the recorded working folder {} does not exist", args.manifest.display(), m.cwd.display())));
    }
    let mut inputs_ok = true;
    for f in &m.inputs {
        match FileRecord::of(&f.role, &f.path, &m.cwd) {
            Ok(now) if now.sha256 == f.sha256 => println!("  input {} {}: unchanged", f.role, f.path.display()),
            Ok(now) => {
                inputs_ok = false;
                println!("  input {} {}: CHANGED (sha256 {} recorded, {} now)", f.role, f.path.display(), short(&f.sha256), short(&now.sha256));
            }
            Err(e) => {
                inputs_ok = false;
                println!("  input {} {}: MISSING ({e:#})", f.role, f.path.display());
            }
        }
    }
    if !inputs_ok {
        println!("not reproduced: the inputs differ from the recorded ones");
        return Ok(crate::error::EXIT_FAILURE);
    }
    let dir = match &args.work_dir {
        // the re-run runs in the recorded folder: a relative --work-dir means this one's
        Some(d) => std::path::absolute(d).with_context(|| format!("--work-dir {}", d.display()))?,
        None => std::env::temp_dir().join(format!("reap-reproduce-{}", std::process::id())),
    };
    if dir.exists() && !dir.is_dir() {
        bail!(UsageError(format!("--work-dir {}: exists and is not a folder", dir.display())));
    }
    let argv = redirect_outputs(&m.argv, &dir, &m.cwd);
    let manifest = redirected_manifest(&argv);
    let rerun_files: Vec<PathBuf> = m.outputs.iter().map(|f| redirected(&dir, &f.path)).chain(manifest).collect();
    // the re-run would write over such a file and reproduce then remove it: with --work-dir
    // at the recorded run's own folder, that is the recorded outputs themselves
    if let Some(p) = rerun_files.iter().find(|p| p.exists()) {
        bail!(UsageError(format!(
            "--work-dir {}: already holds {}, which the re-run would write over; give an empty or new folder",
            dir.display(),
            p.display()
        )));
    }
    // a folder that exists already may hold other files: then only what the re-run wrote goes
    let created = !dir.exists();
    // the folders the re-run's files go in that do not exist yet, deepest first
    let mut new_dirs: Vec<PathBuf> = Vec::new();
    for p in &rerun_files {
        for a in p.ancestors().skip(1).take_while(|a| a.starts_with(&dir)) {
            if !a.exists() && !new_dirs.iter().any(|d| d == a) {
                new_dirs.push(a.to_path_buf());
            }
        }
    }
    new_dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    for d in new_dirs.iter().rev() {
        std::fs::create_dir_all(d).map_err(|e| UsageError(format!("--work-dir: creating {}: {e}", d.display())))?;
    }
    let exe = std::env::current_exe().context("locating this program")?;
    // a signal that ends reproduce goes to the re-run first, then takes what it wrote (and the
    // folders reproduce made) with it
    let on_signal: Vec<_> = rerun_files.iter().chain(&new_dirs).map(|p| crate::interrupt::remove_on_signal(p)).collect();
    let unarmed = on_signal.iter().filter(|g| !g.armed()).count();
    if unarmed > 0 {
        println!("  note: {unarmed} of the re-run's {} paths are beyond what a signal can clean up; if reproduce is stopped, remove {} by hand", on_signal.len(), dir.display());
    }
    // the re-run's files, then the folders made for them (see on_signal)
    let remove_rerun = || {
        for p in &rerun_files {
            let _ = std::fs::remove_file(p);
        }
        if created {
            let _ = std::fs::remove_dir_all(&dir);
        } else {
            for d in &new_dirs {
                let _ = std::fs::remove_dir(d);
            }
        }
    };
    let child = std::process::Command::new(exe)
        .args(&argv)
        .current_dir(&m.cwd)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("re-running the recorded command")?;
    let run = {
        let _passed_on = crate::interrupt::child(child.id());
        child.wait_with_output().context("re-running the recorded command")?
    };
    if !run.status.success() {
        let wrote = rerun_files.iter().any(|p| p.exists()) || (created && holds_files(&dir));
        let kept = if wrote {
            format!("what it wrote is in {}", dir.display())
        } else {
            remove_rerun();
            "it wrote nothing".to_string()
        };
        bail!("the re-run failed ({}); {kept}:\n{}", run.status, String::from_utf8_lossy(&run.stderr).trim_end());
    }
    let mut all_same = true;
    for f in &m.outputs {
        let again = redirected(&dir, &f.path);
        match FileRecord::of(&f.role, &again, &m.cwd) {
            Ok(now) if now.sha256 == f.sha256 => println!("  output {} {}: identical ({} bytes)", f.role, f.path.display(), now.size),
            Ok(now) => {
                all_same = false;
                println!("  output {} {}: DIFFERENT (sha256 {} recorded, {} again)", f.role, f.path.display(), short(&f.sha256), short(&now.sha256));
            }
            Err(_) => {
                all_same = false;
                println!("  output {} {}: NOT WRITTEN by the re-run", f.role, f.path.display());
            }
        }
    }
    // the manifest vouches for the run; the files now at its paths may have been replaced since
    for f in &m.outputs {
        let full = if f.path.is_absolute() { f.path.clone() } else { m.cwd.join(&f.path) };
        let replaced = match std::fs::metadata(&full) {
            Ok(md) if md.len() != f.size => true,
            Ok(_) => FileRecord::of(&f.role, &f.path, &m.cwd).is_ok_and(|now| now.sha256 != f.sha256),
            Err(_) => {
                println!("  note: {} (the {} this manifest records) no longer exists", f.path.display(), f.role);
                false
            }
        };
        if replaced {
            println!("  note: {} on disk is not the {} this manifest records (written over since, e.g. by a later run)", f.path.display(), f.role);
        }
    }
    if args.keep || !all_same {
        println!("  re-run outputs kept in {}", dir.display());
    } else {
        remove_rerun();
    }
    println!("{}", if all_same { "reproduced: every output is byte-identical" } else { "NOT reproduced" });
    Ok(if all_same { 0 } else { crate::error::EXIT_FAILURE })
}

/// Whether a folder holds a file, at any depth (the folders made for the re-run do not count).
fn holds_files(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| entries.flatten().any(|e| if e.path().is_dir() { holds_files(&e.path()) } else { true }))
}

/// The re-run's `--manifest-out` (redirect_outputs always gives one).
fn redirected_manifest(argv: &[String]) -> Option<PathBuf> {
    argv.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--manifest-out") {
        Some("") => argv.get(i + 1).map(PathBuf::from),
        Some(v) => v.strip_prefix('=').map(PathBuf::from),
        None => None,
    })
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_redirected_in_every_spelling() {
        let argv: Vec<String> = ["-m", "m.gguf", "-o", "out/i.gguf", "--reap-out=r.json", "--trace-out", "/abs/t.bin", "-f", "c.txt"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let cwd = Path::new("/nonexistent-cwd");
        let got = redirect_outputs(&argv, Path::new("/w"), cwd);
        assert_eq!(
            got,
            ["-m", "m.gguf", "-o", "/w/out/i.gguf", "--reap-out=/w/r.json", "--trace-out", "/w/abs/t.bin", "-f", "c.txt", "--manifest-out", "/w/reproduced.manifest.json"]
        );
        // no -o given: upstream's default name, in the scratch folder
        let got = redirect_outputs(&["-m".into(), "m.gguf".into()], Path::new("/w"), cwd);
        assert_eq!(got, ["-m", "m.gguf", "-o", "/w/imatrix.gguf", "--manifest-out", "/w/reproduced.manifest.json"]);
        // the value attached to -o; -ofreq is another flag
        let argv: Vec<String> = ["-oout/i.gguf", "-ofreq", "5", "-o=j.gguf", "-ot", "exps=CPU", "-ot=attn=CPU"].iter().map(|s| s.to_string()).collect();
        assert_eq!(
            redirect_outputs(&argv, Path::new("/w"), cwd),
            ["-o/w/out/i.gguf", "-ofreq", "5", "-o=/w/j.gguf", "-ot", "exps=CPU", "-ot=attn=CPU", "--manifest-out", "/w/reproduced.manifest.json"]
        );
        // two outputs of one name in two folders stay two files; a device is written in place
        let argv: Vec<String> = ["-o", "x/out", "--trace-out", "y/out", "--reap-out", "../r.json", "-o", "/dev/null"].iter().map(|s| s.to_string()).collect();
        assert_eq!(
            redirect_outputs(&argv, Path::new("/w"), cwd),
            ["-o", "/w/x/out", "--trace-out", "/w/y/out", "--reap-out", "/w/up/r.json", "-o", "/dev/null", "--manifest-out", "/w/reproduced.manifest.json"]
        );
    }
}
