//! `--split-max-tensors N`, `--split-max-size N(M|G)`: the pruned model written as shards,
//! laid out as upstream's `llama-gguf-split --split` lays out a file (tools/gguf-split at the
//! pin): the same cut points, names, keys and padding, so the shards are byte for byte what
//! splitting the one-file output would give, without writing that file first (a pruned
//! 400B model is still hundreds of GB, and model hubs take files of 50 GB at most).
//!
//! - A new shard starts before tensor i when, by tensors, `i > 0 && i % N == 0`; by size, when
//!   the shard's tensor data so far plus tensor i's (each padded to 32 bytes, the header not
//!   counted) would exceed N bytes (`M` = 10^6, `G` = 10^9, as upstream reads them).
//! - Shard i is `PREFIX-{i+1:05}-of-{n:05}.gguf`, PREFIX the `-o` path without `.gguf`.
//! - The first shard holds every key; each shard ends with `split.no` (u16),
//!   `split.tensors.count` (i32, all shards' tensors) and `split.count` (u16) in that order
//!   (upstream sets them, each set removing a key and appending it, and `split.count` last).

use std::path::{Path, PathBuf};

/// How to cut the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitRule {
    /// at most this many tensors a shard
    Tensors(usize),
    /// at most this many bytes of tensor data a shard
    Bytes(u64),
}

/// The keys llama-gguf-split writes into every shard.
pub const SPLIT_KEYS: [&str; 3] = ["split.no", "split.count", "split.tensors.count"];

/// `N(M|G)` as llama-gguf-split reads `--split-max-size`: megabytes and gigabytes of 10^6 and
/// 10^9 bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (n, unit) = match s.char_indices().last() {
        Some((i, 'M')) => (&s[..i], 1_000_000u64),
        Some((i, 'G')) => (&s[..i], 1_000_000_000u64),
        _ => return Err(format!("--split-max-size {s}: expected N followed by M or G (megabytes, gigabytes), as llama-gguf-split takes it")),
    };
    match n.parse::<u64>() {
        Ok(n) if n > 0 => n.checked_mul(unit).ok_or_else(|| format!("--split-max-size {s}: too large")),
        _ => Err(format!("--split-max-size {s}: the size must be a positive whole number")),
    }
}

/// The shard of each tensor, from their data sizes. An error where a shard would be empty
/// (a tensor larger than the size limit), as upstream refuses it.
pub fn assign(rule: SplitRule, nbytes: &[u64]) -> Result<Vec<usize>, String> {
    let mut shard = 0usize;
    let mut size = 0u64;
    let mut out = Vec::with_capacity(nbytes.len());
    for (i, &b) in nbytes.iter().enumerate() {
        let padded = b.div_ceil(32) * 32;
        let next = size + padded;
        let cut = match rule {
            SplitRule::Tensors(k) => i > 0 && i % k == 0,
            SplitRule::Bytes(max) => next > max,
        };
        if cut {
            // only the first tensor can find its shard empty (a later one cuts after another)
            if i == 0 {
                return Err(format!("the first tensor's {b} bytes exceed --split-max-size: the first shard would hold no tensor"));
            }
            shard += 1;
            size = padded;
        } else {
            size = next;
        }
        out.push(shard);
    }
    Ok(out)
}

/// Shard `i` of `n` of the output `out`.
pub fn shard_path(out: &Path, i: usize, n: usize) -> PathBuf {
    let s = out.as_os_str().to_string_lossy();
    let prefix = s.strip_suffix(".gguf").unwrap_or(&s);
    PathBuf::from(format!("{prefix}-{:05}-of-{n:05}.gguf", i + 1))
}

/// The keys of shard `i` of `n`: with `all` (name, raw pair) for the first, less any split keys
/// they hold, then the three split keys.
pub fn shard_kvs(all: &[(&str, &[u8])], i: usize, n: usize, n_tensors: usize) -> Vec<Vec<u8>> {
    use crate::formats::gguf::{encode_i32_kv, encode_u16_kv};
    let mut out: Vec<Vec<u8>> = if i == 0 { all.iter().filter(|(k, _)| !SPLIT_KEYS.contains(k)).map(|(_, b)| b.to_vec()).collect() } else { Vec::new() };
    out.push(encode_u16_kv("split.no", i as u16));
    out.push(encode_i32_kv("split.tensors.count", n_tensors as i32));
    out.push(encode_u16_kv("split.count", n as u16));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_llama_gguf_split_reads_them() {
        assert_eq!(parse_size("50G"), Ok(50_000_000_000));
        assert_eq!(parse_size("300M"), Ok(300_000_000));
        for bad in ["", "50", "50K", "0M", "-3G", "1.5G", "M"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    /// Upstream's rules: by tensors every N-th starts a shard; by size the padded data of a
    /// shard stays within the limit, a tensor larger than it alone in a shard, refused where
    /// it is the first (upstream: "one of splits have 0 tensors").
    #[test]
    fn cut_points_are_upstreams() {
        assert_eq!(assign(SplitRule::Tensors(2), &[1, 1, 1, 1, 1]).unwrap(), [0, 0, 1, 1, 2]);
        assert_eq!(assign(SplitRule::Tensors(5), &[1, 1, 1]).unwrap(), [0, 0, 0]);
        // 40 pads to 64: 64 + 64 > 100
        assert_eq!(assign(SplitRule::Bytes(100), &[40, 30, 40, 1]).unwrap(), [0, 0, 1, 1]);
        assert_eq!(assign(SplitRule::Bytes(128), &[64, 64, 64]).unwrap(), [0, 0, 1]);
        assert!(assign(SplitRule::Bytes(100), &[200, 1]).is_err());
        assert_eq!(assign(SplitRule::Bytes(100), &[10, 200, 200, 1]).unwrap(), [0, 1, 2, 3]);
    }

    #[test]
    fn names_and_keys() {
        assert_eq!(shard_path(Path::new("/o/pruned.gguf"), 1, 12), PathBuf::from("/o/pruned-00002-of-00012.gguf"));
        assert_eq!(shard_path(Path::new("pruned"), 0, 1), PathBuf::from("pruned-00001-of-00001.gguf"));
        let a = crate::formats::gguf::encode_u16_kv("a.b", 7);
        let old = crate::formats::gguf::encode_u16_kv("split.count", 0);
        let all: Vec<(&str, &[u8])> = vec![("a.b", &a), ("split.count", &old)];
        let k0 = shard_kvs(&all, 0, 3, 10);
        assert_eq!(k0.len(), 4);
        assert_eq!(k0[0], a);
        assert_eq!(k0[3], crate::formats::gguf::encode_u16_kv("split.count", 3));
        assert_eq!(shard_kvs(&all, 2, 3, 10).len(), 3);
    }
}
