//! `reap-imatrix imatrix-diff A B`: how far two imatrix files are apart, in the terms
//! `llama-quantize` reads them: per weight and expert, the mean Σx²/count of every column.
//! Byte equality (`cmp`) says only yes or no; this says by how much and where, for the fast
//! mode (`--imatrix-on-device`) against the exact one, one backend or build against another.
//!
//! Exit 0 when both files hold the same weights with the same shapes, whatever the values;
//! 1 when they do not, or when `--max-rel` is given and exceeded; 2 for an unreadable file.

use crate::error::UsageError;
use crate::formats::atomic;
use crate::formats::imatrix::{self, Loaded};
use anyhow::{anyhow, Result};
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(after_help = "Relative difference of two means a and b: |a - b| / max(|a|, |b|) (0 where both are 0).\n\
Only matrices (experts) with a nonzero count in both files are compared value by value; the others are counted.")]
pub struct ImatrixDiffArgs {
    /// First imatrix file (GGUF or legacy .dat)
    #[arg(value_name = "A")]
    pub a: PathBuf,
    /// Second imatrix file
    #[arg(value_name = "B")]
    pub b: PathBuf,
    /// Exit 1 when the largest relative difference exceeds this
    #[arg(long, value_name = "X")]
    pub max_rel: Option<f64>,
    /// Also write the figures as JSON (atomically)
    #[arg(long, value_name = "OUT.json")]
    pub json: Option<PathBuf>,
}

/// Upper bounds of the histogram's buckets of relative differences (the last bucket: above
/// the last bound).
pub const BUCKETS: [f64; 6] = [0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3];

/// Where the largest relative difference is.
#[derive(Clone, Debug, PartialEq)]
pub struct Worst {
    pub tensor: String,
    /// the matrix (expert) within the weight
    pub matrix: usize,
    pub column: usize,
    pub a: f64,
    pub b: f64,
    pub rel: f64,
}

/// What differs between two imatrix files.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Diff {
    pub only_a: Vec<String>,
    pub only_b: Vec<String>,
    /// weights in both whose sums or counts have other lengths
    pub shapes_differ: Vec<String>,
    pub weights_compared: usize,
    /// false where one file is a legacy `.dat`, which keeps one call count per weight
    pub counts_compared: bool,
    pub matrices: u64,
    /// matrices whose counts differ, and the largest difference of a count with where it is
    pub counts_differ: u64,
    pub largest_count_diff: Option<(String, usize, i64, i64)>,
    /// matrices counted in one file only (count 0 in the other): their values are not compared
    pub counted_in_one: u64,
    pub values: u64,
    /// per bucket of [`BUCKETS`] and one above: how many values fall there
    pub histogram: [u64; BUCKETS.len() + 1],
    pub rel_sum: f64,
    pub worst: Option<Worst>,
}

impl Diff {
    pub fn comparable(&self) -> bool {
        self.only_a.is_empty() && self.only_b.is_empty() && self.shapes_differ.is_empty()
    }

    pub fn max_rel(&self) -> f64 {
        self.worst.as_ref().map_or(0.0, |w| w.rel)
    }
}

/// |a - b| / max(|a|, |b|), 0 where both are 0 (and infinite where one is not finite and
/// they differ).
pub fn relative(a: f64, b: f64) -> f64 {
    // NaN against NaN: the same value (a file against itself differs nowhere)
    if a == b || (a.is_nan() && b.is_nan()) {
        return 0.0;
    }
    let d = (a - b).abs() / a.abs().max(b.abs());
    if d.is_nan() {
        f64::INFINITY
    } else {
        d
    }
}

/// Compares two loaded files, value by value, as means Σx²/count.
pub fn compare(a: &Loaded, b: &Loaded) -> Diff {
    // a legacy .dat keeps its sums pre-scaled and one call count for all of a weight's
    // matrices (as llama-quantize reads it, mean = stored / ncall): beside a GGUF it takes the
    // GGUF's matrix layout, and the counts are not compared
    let mixed = a.is_legacy != b.is_legacy;
    let mut d = Diff {
        only_a: a.entries.keys().filter(|k| !b.entries.contains_key(*k)).cloned().collect(),
        only_b: b.entries.keys().filter(|k| !a.entries.contains_key(*k)).cloned().collect(),
        counts_compared: !mixed,
        ..Default::default()
    };
    let count = |e: &crate::formats::imatrix::Entry, legacy: bool, m: usize| if mixed && legacy { e.counts[0] } else { e.counts[m] };
    for (name, ea) in &a.entries {
        let Some(eb) = b.entries.get(name) else { continue };
        let n_mat = if mixed && a.is_legacy { eb.counts.len() } else { ea.counts.len() };
        let counts_fit = if mixed { ea.counts.len().min(eb.counts.len()) == 1 } else { eb.counts.len() == n_mat };
        if eb.sums.len() != ea.sums.len() || !counts_fit || n_mat == 0 || ea.sums.len() % n_mat != 0 {
            d.shapes_differ.push(name.clone());
            continue;
        }
        d.weights_compared += 1;
        let cols = ea.sums.len() / n_mat;
        for m in 0..n_mat {
            d.matrices += 1;
            let (ca, cb) = (count(ea, a.is_legacy, m), count(eb, b.is_legacy, m));
            if mixed {
                // a GGUF matrix never counted holds no means; the .dat stored 1s there
                if ca <= 0 || cb <= 0 {
                    continue;
                }
            } else if ca != cb {
                d.counts_differ += 1;
                let diff = (ca - cb).abs();
                if d.largest_count_diff.as_ref().map_or(true, |l| diff > (l.2 - l.3).abs()) {
                    d.largest_count_diff = Some((name.clone(), m, ca, cb));
                }
            }
            if ca == 0 || cb == 0 {
                if ca != cb {
                    d.counted_in_one += 1;
                }
                continue;
            }
            let (sa, sb) = (&ea.sums[m * cols..(m + 1) * cols], &eb.sums[m * cols..(m + 1) * cols]);
            for (j, (&x, &y)) in sa.iter().zip(sb).enumerate() {
                let (ma, mb) = (x as f64 / ca as f64, y as f64 / cb as f64);
                let rel = relative(ma, mb);
                d.values += 1;
                d.rel_sum += if rel.is_finite() { rel } else { 0.0 };
                let bucket = BUCKETS.iter().position(|&u| rel <= u).unwrap_or(BUCKETS.len());
                d.histogram[bucket] += 1;
                if d.worst.as_ref().map_or(true, |w| rel > w.rel) {
                    d.worst = Some(Worst { tensor: name.clone(), matrix: m, column: j, a: ma, b: mb, rel });
                }
            }
        }
    }
    d
}

/// The report's lines (what `imatrix-diff` prints).
pub fn render(d: &Diff, a: &Loaded, b: &Loaded) -> String {
    let mut s = String::new();
    let list = |v: &[String]| if v.len() <= 5 { v.join(", ") } else { format!("{}, … ({} in all)", v[..5].join(", "), v.len()) };
    s += &format!("weights: {} compared", d.weights_compared);
    if !d.only_a.is_empty() {
        s += &format!("; in A only: {}", list(&d.only_a));
    }
    if !d.only_b.is_empty() {
        s += &format!("; in B only: {}", list(&d.only_b));
    }
    if !d.shapes_differ.is_empty() {
        s += &format!("; shapes differ: {}", list(&d.shapes_differ));
    }
    s += &format!("\nchunks: {} and {}\n", a.chunk_count, b.chunk_count);
    match &d.largest_count_diff {
        _ if !d.counts_compared => {
            s += &format!("counts: not compared ({} matrices): a legacy .dat keeps one call count per weight\n", d.matrices)
        }
        None => s += &format!("counts: identical ({} matrices)\n", d.matrices),
        Some((t, m, ca, cb)) => {
            s += &format!("counts: differ in {} of {} matrices (largest difference {}: {t} matrix {m}, {ca} vs {cb})", d.counts_differ, d.matrices, (ca - cb).abs());
            if d.counted_in_one > 0 {
                s += &format!("; {} counted in one file only (not compared)", d.counted_in_one);
            }
            s += "\n";
        }
    }
    let mean = if d.values > 0 { d.rel_sum / d.values as f64 } else { 0.0 };
    match &d.worst {
        Some(w) => {
            s += &format!(
                "values: {} compared (Σx²/count per column); largest relative difference {:.3e} ({} matrix {} column {}: {:.6e} vs {:.6e}); mean {:.3e}\n",
                d.values, w.rel, w.tensor, w.matrix, w.column, w.a, w.b, mean
            )
        }
        None => s += "values: none compared\n",
    }
    let mut parts = vec![format!("0: {}", d.histogram[0])];
    for (u, n) in BUCKETS.iter().zip(&d.histogram).skip(1) {
        parts.push(format!("≤{u:.0e}: {n}"));
    }
    parts.push(format!(">{:.0e}: {}", BUCKETS[BUCKETS.len() - 1], d.histogram[BUCKETS.len()]));
    s += &format!("relative differences: {}\n", parts.join(", "));
    s
}

fn to_json(d: &Diff, args: &ImatrixDiffArgs) -> serde_json::Value {
    let mut hist = serde_json::Map::new();
    hist.insert("0".into(), json!(d.histogram[0]));
    for (u, n) in BUCKETS.iter().zip(&d.histogram).skip(1) {
        hist.insert(format!("le_{u:.0e}"), json!(n));
    }
    hist.insert(format!("gt_{:.0e}", BUCKETS[BUCKETS.len() - 1]), json!(d.histogram[BUCKETS.len()]));
    json!({
        "a": args.a.to_string_lossy(),
        "b": args.b.to_string_lossy(),
        "comparable": d.comparable(),
        "only_a": d.only_a,
        "only_b": d.only_b,
        "shapes_differ": d.shapes_differ,
        "weights_compared": d.weights_compared,
        "matrices": d.matrices,
        "counts_compared": d.counts_compared,
        "counts_differ": d.counts_differ,
        "counted_in_one": d.counted_in_one,
        "values": d.values,
        // null where nothing was compared or the largest is not finite (JSON has no infinity)
        "max_rel": d.worst.as_ref().map(|w| w.rel).filter(|r| r.is_finite()),
        "max_rel_at": d.worst.as_ref().map(|w| json!({"tensor": w.tensor, "matrix": w.matrix, "column": w.column, "a": w.a, "b": w.b})),
        "mean_rel": if d.values > 0 { Some(d.rel_sum / d.values as f64) } else { None },
        "histogram": hist,
    })
}

pub fn run(args: &ImatrixDiffArgs) -> Result<i32> {
    if let Some(x) = args.max_rel.filter(|x| !(x.is_finite() && *x >= 0.0)) {
        return Err(anyhow!(UsageError(format!("--max-rel {x}: a bound must be a number ≥ 0"))));
    }
    let load = |p: &PathBuf| imatrix::load(p).map_err(|e| anyhow!(UsageError(format!("{e:#}"))));
    let (a, b) = (load(&args.a)?, load(&args.b)?);
    if let Some(j) = &args.json {
        atomic::check_writable(j).map_err(|e| anyhow!(UsageError(format!("--json {e}"))))?;
    }
    let d = compare(&a, &b);
    println!("imatrix-diff: A {} against B {}", args.a.display(), args.b.display());
    print!("{}", render(&d, &a, &b));
    if let Some(j) = &args.json {
        atomic::write_json(j, &to_json(&d, args), "imatrix-diff")?;
    }
    if !d.comparable() {
        println!("not comparable: the files hold other weights or shapes");
        return Ok(1);
    }
    if let Some(x) = args.max_rel.filter(|&x| d.max_rel() > x) {
        println!("largest relative difference {:.3e} exceeds --max-rel {x:e}", d.max_rel());
        return Ok(1);
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::imatrix::Entry;

    fn loaded(entries: &[(&str, Vec<f32>, Vec<i64>)]) -> Loaded {
        Loaded {
            entries: entries.iter().map(|(n, s, c)| (n.to_string(), Entry { sums: s.clone(), counts: c.clone() })).collect(),
            chunk_count: 2,
            ..Default::default()
        }
    }

    #[test]
    fn relative_is_symmetric_and_zero_for_equal_values() {
        assert_eq!(relative(0.0, 0.0), 0.0);
        assert_eq!(relative(2.0, 2.0), 0.0);
        assert_eq!(relative(1.0, 1.5), relative(1.5, 1.0));
        assert!((relative(1.0, 1.5) - 0.5 / 1.5).abs() < 1e-15);
        assert_eq!(relative(0.0, 3.0), 1.0);
        assert_eq!(relative(f64::NAN, 1.0), f64::INFINITY);
        assert_eq!(relative(f64::NAN, f64::NAN), 0.0);
    }

    /// Means, not raw sums, are compared; the worst value is found where it is; counts that
    /// differ and matrices counted in one file only are reported, not compared.
    #[test]
    fn compares_means_per_matrix_and_finds_the_worst() {
        // two experts of three columns; expert 1 has twice the rows and twice the sums in B
        let a = loaded(&[("blk.0.ffn_up_exps.weight", vec![1.0, 2.0, 4.0, 3.0, 3.0, 3.0], vec![1, 3]), ("blk.0.attn_q.weight", vec![8.0, 8.0], vec![4])]);
        let b = loaded(&[("blk.0.ffn_up_exps.weight", vec![1.0, 2.0, 4.002, 6.0, 6.0, 6.0], vec![1, 6]), ("blk.0.attn_q.weight", vec![8.0, 8.0], vec![4])]);
        let d = compare(&a, &b);
        assert!(d.comparable());
        assert_eq!((d.weights_compared, d.matrices, d.values), (2, 3, 8));
        assert_eq!(d.counts_differ, 1);
        assert_eq!(d.largest_count_diff, Some(("blk.0.ffn_up_exps.weight".into(), 1, 3, 6)));
        let w = d.worst.clone().unwrap();
        assert_eq!((w.tensor.as_str(), w.matrix, w.column), ("blk.0.ffn_up_exps.weight", 0, 2));
        assert!((w.rel - 0.002 / 4.002).abs() < 1e-7, "{}", w.rel);
        // 7 equal means (expert 1's are 1.0 in both), one at 5e-4
        assert_eq!(d.histogram, [7, 0, 0, 0, 0, 1, 0]);
        let text = render(&d, &a, &b);
        assert!(text.contains("counts: differ in 1 of 3 matrices (largest difference 3: blk.0.ffn_up_exps.weight matrix 1, 3 vs 6)"), "{text}");
        assert!(text.contains("largest relative difference 4.997e-4 (blk.0.ffn_up_exps.weight matrix 0 column 2: 4.000000e0 vs 4.002000e0)"), "{text}");

        // an expert never routed in A is counted, not compared
        let c = loaded(&[("blk.0.ffn_up_exps.weight", vec![1.0, 2.0, 4.0, 0.0, 0.0, 0.0], vec![1, 0]), ("blk.0.attn_q.weight", vec![8.0, 8.0], vec![4])]);
        let d = compare(&c, &b);
        assert_eq!((d.counted_in_one, d.values), (1, 5));
    }

    /// A legacy .dat beside a GGUF of the same sums: its one call count scales every matrix
    /// (stored = mean · ncall); a matrix the GGUF never counted is skipped.
    #[test]
    fn a_legacy_dat_compares_with_a_gguf_by_its_means() {
        let gguf = loaded(&[("e.weight", vec![2.0, 4.0, 0.0, 0.0, 9.0, 3.0], vec![2, 0, 3])]);
        // the .dat of the same run, ncall 5: (sum / count) · 5, and 1 · 5 for the empty matrix
        let mut dat = loaded(&[("e.weight", vec![5.0, 10.0, 5.0, 5.0, 15.0, 5.0 * 1.001], vec![5])]);
        dat.is_legacy = true;
        for (x, y) in [(&gguf, &dat), (&dat, &gguf)] {
            let d = compare(x, y);
            assert!(d.comparable() && !d.counts_compared, "{d:?}");
            assert_eq!((d.weights_compared, d.matrices, d.values), (1, 3, 4));
            let w = d.worst.clone().unwrap();
            assert_eq!((w.matrix, w.column), (2, 1));
            assert!((w.rel - 0.001 / 1.001).abs() < 1e-6, "{}", w.rel);
            assert!(render(&d, x, y).contains("counts: not compared (3 matrices): a legacy .dat"));
        }
    }

    #[test]
    fn other_weights_or_shapes_are_not_comparable() {
        let a = loaded(&[("x.weight", vec![1.0, 2.0], vec![1]), ("y.weight", vec![1.0], vec![1])]);
        let b = loaded(&[("x.weight", vec![1.0, 2.0, 3.0, 4.0], vec![1, 1]), ("z.weight", vec![1.0], vec![1])]);
        let d = compare(&a, &b);
        assert!(!d.comparable());
        assert_eq!(d.only_a, vec!["y.weight".to_string()]);
        assert_eq!(d.only_b, vec!["z.weight".to_string()]);
        assert_eq!(d.shapes_differ, vec!["x.weight".to_string()]);
        assert_eq!(d.values, 0);
    }
}
