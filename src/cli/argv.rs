//! llama.cpp spells many long flags with one dash (`-ngl 99`, `-ub 512`, `-fa on`); clap
//! cannot. Before parsing, those spellings are rewritten to their double-dash long forms,
//! so `--help` stays readable and the audited command lines run unchanged.

use std::ffi::OsString;

/// Single-dash spellings of llama-imatrix's flags → the long form we parse.
pub const SINGLE_DASH_LONG: &[(&str, &str)] = &[
    ("-ngl", "--n-gpu-layers"),
    ("-ub", "--ubatch-size"),
    ("-fa", "--flash-attn"),
    ("-tb", "--threads-batch"),
    ("-sm", "--split-mode"),
    ("-ts", "--tensor-split"),
    ("-mg", "--main-gpu"),
    ("-lm", "--load-mode"),
    ("-ofreq", "--output-frequency"),
    ("-lv", "--verbosity"),
    ("-np", "--parallel"),
    ("-fit", "--fit"),
    ("-nr", "--no-repack"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-kvo", "--kv-offload"),
    ("-nkvo", "--no-kv-offload"),
    ("-ot", "--override-tensor"),
    ("-dev", "--device"),
    ("-cmoe", "--cpu-moe"),
    ("-ncmoe", "--n-cpu-moe"),
    ("-ncffn", "--n-cpu-ffn"),
];

/// Flags whose every occurrence counts, as upstream's handlers append them: no "only the last
/// value is used" warning for these.
pub const CUMULATIVE: &[&str] = &["-ot", "--override-tensor", "-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe", "-ncffn", "--n-cpu-ffn"];

/// Every flag spelling of upstream's `llama-imatrix` at the pin. Those we do not parse are
/// refused by name: clap's "unexpected argument" would be less clear, and clap would read a
/// multi-letter short flag as a bundle (`-hff` as `-h`, printing the help; `-bs` as `-b s`).
pub fn upstream_flags() -> impl Iterator<Item = &'static str> {
    include_str!("llama-imatrix-flags.txt").lines().filter(|l| !l.is_empty() && !l.starts_with('#'))
}

/// The first argument (after the program name) that is one of upstream's flags but not one
/// that `known` (our parser's names) accepts.
pub fn unsupported(argv: &[OsString], known: impl Fn(&str) -> bool) -> Option<String> {
    argv.iter().skip(1).filter_map(|a| a.to_str()).map(|a| a.split_once('=').map_or(a, |(f, _)| f)).find(|f| !known(f) && upstream_flags().any(|u| u == *f)).map(String::from)
}

/// Flags given more than once, as typed (upstream warns about each: "specified multiple
/// times … only last value will be used"; `--in-file` it appends all the same).
pub fn repeated(given: &[String]) -> Vec<String> {
    let mut seen: Vec<&str> = Vec::new();
    let mut twice = Vec::new();
    for a in given {
        let flag = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
        // a flag, not a negative number given as a value (`--seed -1`)
        if !flag.starts_with('-') || flag.len() < 2 || flag[1..].starts_with(|c: char| c.is_ascii_digit() || c == '.') {
            continue;
        }
        if seen.contains(&flag) {
            if !twice.iter().any(|t: &String| t == flag) {
                twice.push(flag.to_string());
            }
        } else {
            seen.push(flag);
        }
    }
    twice
}

/// Rewrites argv (program name first) so clap can parse it.
pub fn normalize(argv: Vec<OsString>) -> Vec<OsString> {
    let mut out = Vec::with_capacity(argv.len());
    let mut iter = argv.into_iter().peekable();
    if let Some(prog) = iter.next() {
        out.push(prog);
    }
    while let Some(arg) = iter.next() {
        let Some(s) = arg.to_str() else {
            out.push(arg);
            continue;
        };
        // `-flag=value` as well as `-flag value`
        let (flag, value) = match s.split_once('=') {
            Some((f, v)) if f.starts_with('-') => (f, Some(v)),
            _ => (s, None),
        };
        if let Some((_, long)) = SINGLE_DASH_LONG.iter().find(|(short, _)| *short == flag) {
            // a bare `-fa` (no value) means on, as upstream's truthy default
            if *long == "--flash-attn" && value.is_none() {
                let next_is_value = iter.peek().and_then(|n| n.to_str()).is_some_and(|n| !n.starts_with('-'));
                if !next_is_value {
                    out.push("--flash-attn=on".into());
                    continue;
                }
            }
            match value {
                Some(v) => out.push(format!("{long}={v}").into()),
                None => out.push((*long).into()),
            }
            continue;
        }
        out.push(arg);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(args: &[&str]) -> Vec<String> {
        let v = std::iter::once("prog").chain(args.iter().copied()).map(OsString::from).collect();
        normalize(v).into_iter().skip(1).map(|s| s.into_string().unwrap()).collect()
    }

    #[test]
    fn repeated_flags_are_named_once_as_typed() {
        let given: Vec<String> = ["-c", "64", "--seed", "-1", "-c=128", "--ctx-size", "9", "-v", "-v", "-v", "--seed", "-1"].map(String::from).to_vec();
        assert_eq!(repeated(&given), ["-c", "-v", "--seed"]);
    }

    #[test]
    fn rewrites_single_dash_long_flags() {
        assert_eq!(norm(&["-ngl", "99", "-ub", "128", "-m", "x"]), ["--n-gpu-layers", "99", "--ubatch-size", "128", "-m", "x"]);
        assert_eq!(norm(&["-tb=2", "-ofreq", "5"]), ["--threads-batch=2", "--output-frequency", "5"]);
    }

    #[test]
    fn bare_flash_attn_means_on() {
        assert_eq!(norm(&["-fa", "-m", "x"]), ["--flash-attn=on", "-m", "x"]);
        assert_eq!(norm(&["-fa", "off"]), ["--flash-attn", "off"]);
        assert_eq!(norm(&["-fa"]), ["--flash-attn=on"]);
    }

    #[test]
    fn leaves_values_alone() {
        // a value that happens to look like a short flag is not rewritten when it follows -f
        assert_eq!(norm(&["-f", "corpus.txt", "--chunks", "64"]), ["-f", "corpus.txt", "--chunks", "64"]);
    }

    #[test]
    fn reports_unsupported_upstream_flags() {
        let v: Vec<OsString> = ["prog", "-m", "x", "--rope-scale=2", "-hff", "f"].iter().map(OsString::from).collect();
        assert_eq!(unsupported(&v, |f| f == "-m").as_deref(), Some("--rope-scale"));
        assert_eq!(unsupported(&v, |f| f == "-m" || f == "--rope-scale").as_deref(), Some("-hff"));
        // values are not flags, and our own flags are not upstream's
        let v: Vec<OsString> = ["prog", "--chunk", "-1", "--reap-out", "r.json", "-p"].iter().map(OsString::from).collect();
        assert_eq!(unsupported(&v, |f| f == "--chunk").as_deref(), Some("-p"));
    }
}
