//! `MIX.domains.tsv`: which byte ranges of a calibration text belong to which domain (source).
//!
//! A header line `start<TAB>end<TAB>domain<TAB>tokens`, then one line per document: the byte range
//! `[start, end)` in the text, the domain name, and the document's token count (informative;
//! readers do not need it, and a file with only the first three columns is accepted). Ranges
//! are ascending and do not overlap; they need not cover the whole text (bytes outside every
//! range belong to no domain: see docs/corpus.md for how calibration counts them).

use crate::error::UsageError;
use anyhow::Result;
use std::path::Path;

pub const HEADER: &str = "start\tend\tdomain\ttokens";

/// The domain of tokens that start outside every range (calibration lists it when there are
/// any); a file may not use the name itself.
pub const NO_DOMAIN: &str = "(none)";

/// Calibration stores each token's domain as a u16, one value kept for [NO_DOMAIN].
pub const MAX_DOMAINS: usize = u16::MAX as usize;

/// One document's range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Range {
    pub start: u64,
    pub end: u64,
    pub domain: String,
    /// the token count the file states (None when the column is absent)
    pub tokens: Option<u64>,
    /// 1-based line of the file it was read from, for messages (blank lines make it differ
    /// from the index); for a range made in memory, the line `to_tsv` writes it on
    pub line: usize,
}

/// A parsed, validated domains file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Domains {
    pub ranges: Vec<Range>,
}

impl Domains {
    /// Domain names in order of first appearance.
    pub fn names(&self) -> Vec<String> {
        self.name_ids().1
    }

    /// Each range's index into the names, and the names in order of first appearance.
    fn name_ids(&self) -> (Vec<usize>, Vec<String>) {
        let mut index: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        let mut names = Vec::new();
        let ids = self
            .ranges
            .iter()
            .map(|r| {
                *index.entry(&r.domain).or_insert_with(|| {
                    names.push(r.domain.clone());
                    names.len() - 1
                })
            })
            .collect();
        (ids, names)
    }

    /// Parses `text` (the file's contents); `name` names the file in errors; `text_len` is the
    /// size of the calibration text the ranges refer to.
    pub fn parse(text: &str, name: &str, text_len: u64) -> std::result::Result<Domains, String> {
        let mut lines = text.lines().enumerate();
        match lines.next() {
            Some((_, h)) if h == HEADER || h == "start\tend\tdomain" => {}
            Some((_, h)) => return Err(format!("{name}:1: expected the header line \"{}\", got \"{h}\"", HEADER.replace('\t', "\\t"))),
            None => return Err(format!("{name}: empty file (expected the header line)")),
        }
        let mut ranges: Vec<Range> = Vec::new();
        for (i, line) in lines {
            let at = format!("{name}:{}", i + 1);
            if line.is_empty() {
                continue;
            }
            let f: Vec<&str> = line.split('\t').collect();
            if f.len() != 3 && f.len() != 4 {
                return Err(format!("{at}: expected 3 or 4 tab-separated fields (start, end, domain, tokens), got {}", f.len()));
            }
            let num = |s: &str, what: &str| s.parse::<u64>().map_err(|_| format!("{at}: {what} \"{s}\" is not a non-negative integer"));
            let (start, end) = (num(f[0], "start")?, num(f[1], "end")?);
            let tokens = if f.len() == 4 { Some(num(f[3], "tokens")?) } else { None };
            if f[2].is_empty() {
                return Err(format!("{at}: empty domain name"));
            }
            if f[2] == NO_DOMAIN {
                return Err(format!("{at}: the domain name \"{NO_DOMAIN}\" is kept for tokens outside every range"));
            }
            if start >= end {
                return Err(format!("{at}: empty or reversed range [{start}, {end})"));
            }
            if end > text_len {
                return Err(format!("{at}: range [{start}, {end}) does not fit the text ({text_len} bytes)"));
            }
            if let Some(prev) = ranges.last() {
                if start < prev.end {
                    return Err(format!(
                        "{at}: range [{start}, {end}) overlaps or comes before the previous range [{}, {}) (ranges must be ascending and disjoint)",
                        prev.start, prev.end
                    ));
                }
            }
            ranges.push(Range { start, end, domain: f[2].to_string(), tokens, line: i + 1 });
        }
        let d = Domains { ranges };
        let n = d.name_ids().1.len();
        if n > MAX_DOMAINS {
            return Err(format!("{name}: {n} distinct domain names; calibration keeps at most {MAX_DOMAINS}"));
        }
        Ok(d)
    }

    /// Reads and validates `path` against a text of `text_len` bytes.
    pub fn read(path: &Path, text_len: u64) -> Result<Domains> {
        let text = std::fs::read_to_string(path).map_err(|e| UsageError(format!("--domains {}: {e}", path.display())))?;
        Ok(Self::parse(&text, &path.display().to_string(), text_len).map_err(UsageError)?)
    }

    pub fn to_tsv(&self) -> String {
        let mut s = String::from(HEADER);
        s.push('\n');
        for r in &self.ranges {
            s += &format!("{}\t{}\t{}\t{}\n", r.start, r.end, r.domain, r.tokens.unwrap_or(0));
        }
        s
    }

    /// Tokens per range (token start offsets, ascending), each counted in the last range that
    /// starts at or before it (a token before the first range, such as an added BOS at offset
    /// 0, counts in the first): the counts `corpus` writes, where the ranges tile the text.
    /// Only right for such a file: with gaps, a gap's tokens land in the range before it.
    pub fn tokens_per_range(&self, offsets: &[u64]) -> Vec<u64> {
        let mut out = vec![0u64; self.ranges.len()];
        let mut i = 0;
        for &o in offsets {
            while i + 1 < self.ranges.len() && self.ranges[i].end <= o {
                i += 1;
            }
            if !self.ranges.is_empty() {
                out[i] += 1;
            }
        }
        out
    }

    /// The first range whose stated token count is not its count in `offsets`: (index,
    /// stated, counted). A file written by `corpus` for this text, tokenised as calibration
    /// tokenises it with `--parse-special`, has none. Only tokens inside a range count in it
    /// (as calibration attributes them): a file with gaps leaves the gaps' tokens out.
    pub fn first_count_mismatch(&self, offsets: &[u64]) -> Option<(usize, u64, u64)> {
        let mut counted = vec![0u64; self.ranges.len()];
        for i in self.range_of_offsets(offsets).into_iter().flatten() {
            counted[i] += 1;
        }
        self.ranges.iter().zip(counted).enumerate().find_map(|(i, (r, n))| r.tokens.filter(|&t| t != n).map(|t| (i, t, n)))
    }

    /// For each byte offset in `offsets` (ascending), the index into `names()` of the range
    /// holding it, or None for bytes outside every range.
    pub fn domain_of_offsets(&self, offsets: &[u64]) -> Vec<Option<u16>> {
        let ids: Vec<u16> = self.name_ids().0.into_iter().map(|i| i as u16).collect();
        self.range_of_offsets(offsets).into_iter().map(|r| r.map(|i| ids[i])).collect()
    }

    /// For each byte offset in `offsets` (ascending), the index of the range holding it, or
    /// None for bytes outside every range.
    fn range_of_offsets(&self, offsets: &[u64]) -> Vec<Option<usize>> {
        let mut out = Vec::with_capacity(offsets.len());
        let mut i = 0;
        for &o in offsets {
            while i < self.ranges.len() && self.ranges[i].end <= o {
                i += 1;
            }
            out.push((i < self.ranges.len() && self.ranges[i].start <= o).then_some(i));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_maps_offsets() {
        let d = Domains::parse("start\tend\tdomain\ttokens\n0\t5\ta\t2\n5\t9\tb\t1\n12\t15\ta\t3\n", "d.tsv", 20).unwrap();
        assert_eq!(d.names(), ["a", "b"]);
        assert_eq!(Domains::parse(&d.to_tsv(), "x", 20).unwrap(), d);
        assert_eq!(d.domain_of_offsets(&[0, 4, 5, 8, 9, 11, 12, 14, 15, 19]), [Some(0), Some(0), Some(1), Some(1), None, None, Some(0), Some(0), None, None]);
    }

    /// With gaps between ranges, a range's count is of the tokens inside it: the gap's tokens
    /// are no range's (they used to land in the range before the gap).
    #[test]
    fn counts_are_compared_inside_the_ranges() {
        let d = Domains::parse("start\tend\tdomain\ttokens\n0\t5\ta\t2\n9\t12\tb\t1\n", "d.tsv", 20).unwrap();
        // tokens at 5 and 7 fall in the gap [5, 9), the one at 14 after the last range
        assert_eq!(d.first_count_mismatch(&[0, 3, 5, 7, 9, 14]), None);
        assert_eq!(d.first_count_mismatch(&[0, 3, 4, 9]), Some((0, 2, 3)));
        assert_eq!(d.first_count_mismatch(&[0, 3, 9, 10]), Some((1, 1, 2)));
    }

    /// Each range keeps its line in the file, blank lines counted, for messages.
    #[test]
    fn ranges_keep_their_line_in_the_file() {
        let d = Domains::parse("start\tend\tdomain\ttokens\n\n0\t5\ta\t2\n\n\n5\t9\tb\t1\n", "d.tsv", 20).unwrap();
        assert_eq!(d.ranges.iter().map(|r| r.line).collect::<Vec<_>>(), [3, 6]);
    }

    #[test]
    fn bad_ranges_are_named() {
        let e = Domains::parse("start\tend\tdomain\ttokens\n0\t30\ta\t1\n", "d.tsv", 20).unwrap_err();
        assert!(e.contains("d.tsv:2") && e.contains("does not fit the text (20 bytes)"), "{e}");
        let e = Domains::parse("start\tend\tdomain\ttokens\n0\t10\ta\t1\n5\t12\tb\t1\n", "d.tsv", 20).unwrap_err();
        assert!(e.contains("d.tsv:3") && e.contains("overlaps"), "{e}");
        let e = Domains::parse("0\t10\ta\n", "d.tsv", 20).unwrap_err();
        assert!(e.contains("header"), "{e}");
        let e = Domains::parse("start\tend\tdomain\n4\t4\ta\n", "d.tsv", 20).unwrap_err();
        assert!(e.contains("empty or reversed"), "{e}");
        let e = Domains::parse("start\tend\tdomain\nx\t4\ta\n", "d.tsv", 20).unwrap_err();
        assert!(e.contains("start \"x\""), "{e}");
        let e = Domains::parse("start\tend\tdomain\n0\t4\t(none)\n", "d.tsv", 20).unwrap_err();
        assert!(e.contains("d.tsv:2") && e.contains("kept for tokens outside every range"), "{e}");
    }

    #[test]
    fn more_domains_than_a_u16_holds_are_refused_and_the_most_allowed_map_right() {
        let file = |n: usize| {
            let mut s = format!("{HEADER}\n");
            for i in 0..n {
                s += &format!("{i}\t{}\td{i}\t1\n", i + 1);
            }
            s
        };
        let e = Domains::parse(&file(MAX_DOMAINS + 1), "d.tsv", 1 << 20).unwrap_err();
        assert!(e.contains("d.tsv: 65536 distinct domain names; calibration keeps at most 65535"), "{e}");
        let d = Domains::parse(&file(MAX_DOMAINS), "d.tsv", 1 << 20).unwrap();
        let offsets: Vec<u64> = (0..MAX_DOMAINS as u64 + 1).collect();
        let ids = d.domain_of_offsets(&offsets);
        assert!(ids[..MAX_DOMAINS].iter().enumerate().all(|(i, &id)| id == Some(i as u16)));
        assert_eq!(ids[MAX_DOMAINS], None);
    }
}
