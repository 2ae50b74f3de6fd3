//! Exact and near-duplicate detection, and the overlap test against evaluation documents.
//!
//! - **Normalised text**: every run of whitespace becomes one space, leading and trailing
//!   whitespace is dropped. Two documents are *exact duplicates* when their normalised texts
//!   are equal (compared in full; a 64-bit hash only finds the candidates).
//! - **Units and shingles**: the normalised text, lowercased, split at whitespace into words;
//!   a word holding CJK characters (kana, kanji, hangul, full-width forms) is split further
//!   into one unit per such character, since those scripts do not put spaces between words.
//!   A shingle is [`SHINGLE`] consecutive units; a document with fewer units has one shingle
//!   (all of them). Shingles are kept as 64-bit hashes; a document's shingle set is sorted and
//!   deduplicated.
//! - **Near duplicates**: Jaccard similarity of the shingle sets ≥ [`JACCARD`]. Candidates come
//!   from MinHash LSH ([`BANDS`] bands of [`ROWS`] of the [`BANDS`]·[`ROWS`] MinHash values; a
//!   pair at Jaccard 0.8 shares a band with probability 1 − (1 − 0.8⁴)¹⁶ ≈ 0.9998), and each
//!   candidate is then verified with the exact Jaccard of the two sets, so nothing is dropped on
//!   an estimate.
//! - **Eval overlap**: a document overlaps an evaluation document when the normalised texts are
//!   equal, or when they share at least [`EVAL_OVERLAP`] of the shingles of the smaller of the
//!   two (overlap coefficient |A∩B| / min(|A|, |B|)): a calibration document that contains an
//!   evaluation text, or is contained in one, counts. Computed exactly over an index of every
//!   evaluation shingle. A text of fewer than [`SHINGLE`] units has only the shingle of all its
//!   units, which no window of a longer text matches: for such a text (either side) the test is
//!   instead whether its unit sequence occurs, whole and in order, in the other's units (found
//!   by hashing the other's windows of that length, then compared unit by unit).
//!
//! Documents are visited in a fixed order (sources in command-line order, lines in file order);
//! the first of a group of duplicates is kept.

use crate::fixture::rng::mix64;
use std::collections::HashMap;

/// Units per shingle.
pub const SHINGLE: usize = 5;
/// Jaccard similarity at or above which two documents are near duplicates.
pub const JACCARD: f64 = 0.8;
/// Overlap coefficient at or above which a document overlaps an evaluation document.
pub const EVAL_OVERLAP: f64 = 0.5;
pub const BANDS: usize = 16;
pub const ROWS: usize = 4;
const PERMS: usize = BANDS * ROWS;

/// Whitespace runs → one space; trimmed.
pub fn normalise(text: &str) -> String {
    let mut s = String::with_capacity(text.len());
    for w in text.split_whitespace() {
        if !s.is_empty() {
            s.push(' ');
        }
        s.push_str(w);
    }
    s
}

fn is_cjk(c: char) -> bool {
    matches!(c as u32, 0x2E80..=0x9FFF | 0xAC00..=0xD7AF | 0xF900..=0xFAFF | 0xFF00..=0xFFEF | 0x20000..=0x2FFFF)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// The hashes of a text's units (see the module doc).
fn unit_hashes(normalised: &str) -> Vec<u64> {
    let mut out = Vec::new();
    let mut buf = String::new();
    for w in normalised.split(' ').filter(|w| !w.is_empty()) {
        for c in w.chars() {
            if is_cjk(c) {
                if !buf.is_empty() {
                    out.push(fnv1a(buf.as_bytes()));
                    buf.clear();
                }
                let mut b = [0u8; 4];
                out.push(fnv1a(c.encode_utf8(&mut b).as_bytes()));
            } else {
                buf.extend(c.to_lowercase());
            }
        }
        if !buf.is_empty() {
            out.push(fnv1a(buf.as_bytes()));
            buf.clear();
        }
    }
    out
}

/// The hash of a run of units (a shingle, or a short text's whole sequence).
fn combine(w: &[u64]) -> u64 {
    w.iter().fold(0x5151_5151_u64, |h, &u| mix64(h.rotate_left(17) ^ u))
}

/// A document's sorted, deduplicated shingle hashes.
pub fn shingles(normalised: &str) -> Vec<u64> {
    shingles_of(&unit_hashes(normalised))
}

fn shingles_of(units: &[u64]) -> Vec<u64> {
    let mut v: Vec<u64> = if units.len() < SHINGLE {
        if units.is_empty() {
            Vec::new()
        } else {
            vec![combine(units)]
        }
    } else {
        units.windows(SHINGLE).map(combine).collect()
    };
    v.sort_unstable();
    v.dedup();
    v
}

/// |A ∩ B| of two sorted sets.
pub fn intersection(a: &[u64], b: &[u64]) -> usize {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

pub fn jaccard(a: &[u64], b: &[u64]) -> f64 {
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    let i = intersection(a, b);
    i as f64 / (a.len() + b.len() - i) as f64
}

/// MinHash signature: for each of the PERMS hash functions x ↦ a·x + b (odd a, mod 2⁶⁴) the
/// minimum over the set.
fn minhash(set: &[u64]) -> [u64; PERMS] {
    let mut sig = [u64::MAX; PERMS];
    let ab: [(u64, u64); PERMS] = std::array::from_fn(|i| (mix64(0xA5A5 + i as u64) | 1, mix64(0x5A5A + i as u64)));
    for &s in set {
        let x = mix64(s);
        for (m, &(a, b)) in sig.iter_mut().zip(&ab) {
            let h = a.wrapping_mul(x).wrapping_add(b);
            if h < *m {
                *m = h;
            }
        }
    }
    sig
}

/// A document prepared for comparison.
pub struct Prepared {
    pub normalised: String,
    pub exact: u64,
    /// the unit hashes, in order (containment of a text shorter than a shingle); empty where
    /// no such test needs them (see [`EvalIndex::prepare`])
    pub units: Vec<u64>,
    pub shingles: Vec<u64>,
}

pub fn prepare(text: &str) -> Prepared {
    let normalised = normalise(text);
    let exact = fnv1a(normalised.as_bytes());
    let units = unit_hashes(&normalised);
    let shingles = shingles_of(&units);
    Prepared { normalised, exact, units, shingles }
}

/// Texts shorter than a shingle, keyed by (unit count, hash of the units), for finding them
/// whole inside other texts.
struct Short {
    by_seq: HashMap<(usize, u64), Vec<u32>>,
    /// the unit counts present, ascending
    lens: Vec<usize>,
}

impl Short {
    fn new<'a>(docs: impl Iterator<Item = (usize, &'a Prepared)>) -> Self {
        let mut by_seq: HashMap<(usize, u64), Vec<u32>> = HashMap::new();
        for (i, d) in docs {
            let n = d.units.len();
            if n > 0 && n < SHINGLE {
                by_seq.entry((n, combine(&d.units))).or_default().push(i as u32);
            }
        }
        let mut lens: Vec<usize> = by_seq.keys().map(|k| k.0).collect();
        lens.sort_unstable();
        lens.dedup();
        Short { by_seq, lens }
    }

    /// Calls `hit(i)` for every indexed text `i` whose units `is_units(i)` occur whole in
    /// `units`.
    fn scan<'u>(&self, units: &[u64], is_units: impl Fn(u32) -> &'u [u64], mut hit: impl FnMut(u32)) {
        for &n in &self.lens {
            for w in units.windows(n) {
                if let Some(v) = self.by_seq.get(&(n, combine(w))) {
                    for &i in v.iter().filter(|&&i| is_units(i) == w) {
                        hit(i);
                    }
                }
            }
        }
    }
}

/// The fate of one document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    /// an exact or near duplicate of the kept document with this index
    Duplicate(usize),
    /// overlaps the evaluation document with this index
    EvalOverlap(usize),
}

/// The evaluation documents, indexed.
pub struct EvalIndex {
    exact: HashMap<u64, Vec<usize>>,
    docs: Vec<Prepared>,
    by_shingle: HashMap<u64, Vec<u32>>,
    /// the evaluation texts shorter than a shingle
    short: Short,
}

impl EvalIndex {
    pub fn new(docs: Vec<Prepared>) -> Self {
        let mut exact: HashMap<u64, Vec<usize>> = HashMap::new();
        let mut by_shingle: HashMap<u64, Vec<u32>> = HashMap::new();
        for (i, d) in docs.iter().enumerate() {
            exact.entry(d.exact).or_default().push(i);
            for &s in &d.shingles {
                by_shingle.entry(s).or_default().push(i as u32);
            }
        }
        let short = Short::new(docs.iter().enumerate());
        EvalIndex { exact, docs, by_shingle, short }
    }

    /// A calibration document prepared for [`dedupe`] against this index: its units are kept
    /// only where a containment test reads them (the index holds evaluation texts shorter than
    /// a shingle, or the document is shorter), since they double the shingles' memory.
    pub fn prepare(&self, text: &str) -> Prepared {
        let mut p = prepare(text);
        if self.short.lens.is_empty() && p.units.len() >= SHINGLE {
            p.units = Vec::new();
        }
        p
    }

    /// For each of `docs`, the first evaluation document that holds the whole of it, for the
    /// documents shorter than a shingle (None for the others). One pass over the evaluation
    /// texts, in parallel parts, each part giving its first hit per document.
    pub fn containing(&self, docs: &[Prepared]) -> Vec<Option<usize>> {
        let mut out = vec![None; docs.len()];
        let short = Short::new(docs.iter().enumerate());
        if short.lens.is_empty() {
            return out;
        }
        let parts: Vec<std::ops::Range<usize>> = (0..self.docs.len()).step_by(256).map(|a| a..(a + 256).min(self.docs.len())).collect();
        let found = crate::corpus::par::map(&parts, |r| {
            let mut first: HashMap<u32, usize> = HashMap::new();
            for e in r.clone() {
                short.scan(&self.docs[e].units, |i| &docs[i as usize].units, |i| {
                    first.entry(i).or_insert(e);
                });
            }
            first
        });
        // parts in ascending order: the first part to hold a document holds its first hit
        for part in found {
            for (i, e) in part {
                out[i as usize].get_or_insert(e);
            }
        }
        out
    }

    /// The first evaluation document `d` overlaps, if any.
    pub fn overlap(&self, d: &Prepared) -> Option<usize> {
        if let Some(v) = self.exact.get(&d.exact) {
            if let Some(&i) = v.iter().find(|&&i| self.docs[i].normalised == d.normalised) {
                return Some(i);
            }
        }
        let mut shared: HashMap<u32, usize> = HashMap::new();
        for s in &d.shingles {
            if let Some(v) = self.by_shingle.get(s) {
                for &e in v {
                    *shared.entry(e).or_default() += 1;
                }
            }
        }
        let mut hits: Vec<u32> = shared
            .iter()
            .filter(|(&e, &n)| {
                let small = d.shingles.len().min(self.docs[e as usize].shingles.len());
                small > 0 && n as f64 >= EVAL_OVERLAP * small as f64
            })
            .map(|(&e, _)| e)
            .collect();
        // evaluation texts shorter than a shingle that occur whole in the document
        self.short.scan(&d.units, |e| &self.docs[e as usize].units, |e| hits.push(e));
        hits.into_iter().min().map(|e| e as usize)
    }
}

/// Decides every document's fate, in order (see the module doc).
pub fn dedupe(docs: &[Prepared], eval: &EvalIndex) -> Vec<Verdict> {
    let sigs: Vec<[u64; PERMS]> = crate::corpus::par::map(docs, |d| minhash(&d.shingles));
    let contained = eval.containing(docs);
    let overlaps: Vec<Option<usize>> = crate::corpus::par::map(docs, |d| eval.overlap(d));
    // a document shorter than a shingle, held whole by an evaluation text: the first of both
    let overlaps: Vec<Option<usize>> = overlaps.into_iter().zip(contained).map(|(a, b)| a.into_iter().chain(b).min()).collect();
    let mut exact: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut bands: Vec<HashMap<u64, Vec<u32>>> = vec![HashMap::new(); BANDS];
    let mut out = Vec::with_capacity(docs.len());
    let mut cands: Vec<u32> = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        if let Some(e) = overlaps[i] {
            out.push(Verdict::EvalOverlap(e));
            continue;
        }
        if let Some(&k) = exact.get(&d.exact).and_then(|v| v.iter().find(|&&k| docs[k].normalised == d.normalised)) {
            out.push(Verdict::Duplicate(k));
            continue;
        }
        let keys: Vec<u64> = (0..BANDS).map(|b| sigs[i][b * ROWS..(b + 1) * ROWS].iter().fold(mix64(b as u64), |h, &x| mix64(h ^ x))).collect();
        cands.clear();
        if !d.shingles.is_empty() {
            for (b, k) in keys.iter().enumerate() {
                if let Some(v) = bands[b].get(k) {
                    cands.extend_from_slice(v);
                }
            }
        }
        cands.sort_unstable();
        cands.dedup();
        if let Some(&k) = cands.iter().find(|&&k| jaccard(&d.shingles, &docs[k as usize].shingles) >= JACCARD) {
            out.push(Verdict::Duplicate(k as usize));
            continue;
        }
        exact.entry(d.exact).or_default().push(i);
        if !d.shingles.is_empty() {
            for (b, k) in keys.into_iter().enumerate() {
                bands[b].entry(k).or_default().push(i as u32);
            }
        }
        out.push(Verdict::Keep);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(n: usize, seed: u64) -> Vec<String> {
        let mut r = crate::fixture::rng::Rng::new(seed);
        (0..n).map(|_| format!("w{}", r.below(5000))).collect()
    }

    #[test]
    fn normalising_and_units() {
        assert_eq!(normalise("  a\t b\n\n c  "), "a b c");
        // CJK characters are units of their own; Latin words are lowercased
        assert_eq!(unit_hashes("Hello 東京です"), unit_hashes("hello 東 京 で す"));
        assert_eq!(shingles("a b c").len(), 1);
        assert_eq!(shingles("a b c d e f g").len(), 3);
    }

    #[test]
    fn exact_near_and_distinct_documents() {
        let base = words(200, 1);
        let text = base.join(" ");
        // the same with different whitespace: an exact duplicate
        let spaced = base.join("  \n");
        // 3 of 200 words changed: near duplicate (Jaccard 181/211 ≈ 0.86)
        let mut near = base.clone();
        for i in [20, 100, 180] {
            near[i] = "changed".into();
        }
        let near = near.join(" ");
        // a quarter of the words changed: not a near duplicate
        let mut far = base.clone();
        for i in (0..200).step_by(4) {
            far[i] = format!("x{i}");
        }
        let far = far.join(" ");
        let other = words(200, 2).join(" ");
        let docs: Vec<Prepared> = [&text, &spaced, &near, &far, &other].iter().map(|t| prepare(t)).collect();
        let j = jaccard(&docs[0].shingles, &docs[2].shingles);
        assert!(j >= JACCARD, "{j}");
        assert!(jaccard(&docs[0].shingles, &docs[3].shingles) < JACCARD);
        let v = dedupe(&docs, &EvalIndex::new(Vec::new()));
        assert_eq!(v, [Verdict::Keep, Verdict::Duplicate(0), Verdict::Duplicate(0), Verdict::Keep, Verdict::Keep]);
    }

    /// The verdicts equal a brute-force all-pairs computation on a set with many near pairs.
    #[test]
    fn lsh_finds_what_all_pairs_finds() {
        let mut texts = Vec::new();
        let mut r = crate::fixture::rng::Rng::new(7);
        for i in 0..60 {
            let mut w = words(120, 100 + (i % 20) as u64);
            let changes = r.below(30) as usize;
            for _ in 0..changes {
                let at = r.below(120) as usize;
                w[at] = format!("c{}", r.below(1000));
            }
            texts.push(w.join(" "));
        }
        let docs: Vec<Prepared> = texts.iter().map(|t| prepare(t)).collect();
        let got = dedupe(&docs, &EvalIndex::new(Vec::new()));
        let mut kept: Vec<usize> = Vec::new();
        for (i, d) in docs.iter().enumerate() {
            let dup = kept.iter().any(|&k| jaccard(&d.shingles, &docs[k].shingles) >= JACCARD);
            assert_eq!(got[i] != Verdict::Keep, dup, "doc {i}");
            if !dup {
                kept.push(i);
            }
        }
    }

    #[test]
    fn eval_overlap_exact_contained_and_near() {
        let e1 = words(100, 11).join(" ");
        let e2 = words(80, 12).join(" ");
        let eval = EvalIndex::new(vec![prepare(&e1), prepare(&e2)]);
        // exact, whitespace aside
        assert_eq!(eval.overlap(&prepare(&format!(" {e1}\n"))), Some(0));
        // a calibration document that contains the eval text within much more text
        let big = format!("{} {} {}", words(300, 13).join(" "), e2, words(300, 14).join(" "));
        assert_eq!(eval.overlap(&prepare(&big)), Some(1));
        // unrelated
        assert_eq!(eval.overlap(&prepare(&words(100, 15).join(" "))), None);
    }

    /// A text shorter than a shingle has one shingle of all its units, which no window of a
    /// longer text matches: it counts when the other text holds its units whole, in order,
    /// either way round.
    #[test]
    fn short_texts_are_found_whole_inside_longer_ones() {
        let eval = EvalIndex::new(vec![prepare(&words(100, 21).join(" ")), prepare("Name two primes."), prepare("What is the capital of France?"), prepare("東京都")]);
        // a calibration document holding a short evaluation text (case and spacing aside)
        assert_eq!(eval.overlap(&prepare("Quiz: name  two\nPRIMES. Answer: 2 and 3.")), Some(1));
        assert_eq!(eval.overlap(&prepare("私は東京都に住んでいます。")), Some(3));
        // the units must be consecutive and whole
        assert_eq!(eval.overlap(&prepare("Name two more primes. Answer: 5 and 7.")), None);
        assert_eq!(eval.overlap(&prepare("Name two primes and one square.")), None);
        // short calibration documents held by an evaluation text, and one that is not
        let docs: Vec<Prepared> = ["What is the capital", "東京", "capital of France? Paris.", "Quiz: Name two primes. Answer: 2 and 3.", &words(50, 22).join(" ")].iter().map(|t| prepare(t)).collect();
        assert_eq!(eval.containing(&docs), [Some(2), Some(3), None, None, None]);
        let v = dedupe(&docs, &eval);
        assert_eq!(v, [Verdict::EvalOverlap(2), Verdict::EvalOverlap(3), Verdict::Keep, Verdict::EvalOverlap(1), Verdict::Keep]);
    }
}
