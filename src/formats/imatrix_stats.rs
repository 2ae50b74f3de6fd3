//! `--show-statistics`: upstream's per-tensor and per-layer tables for one imatrix file,
//! computed with the same f32 arithmetic and printed with the same printf formats.

use super::imatrix::Stats;
use std::collections::BTreeMap;
use std::path::Path;

/// One row of the table.
#[derive(Clone, Debug)]
pub struct TensorStats {
    pub tensor: String,
    pub values: Vec<f32>,
    pub total_sqract: f32,
    pub mean_sqract: f32,
    pub max_sqract: f32,
    pub min_sqract: f32,
    pub elements: i32,
    pub stddev: f32,
    pub active: f32,
    pub entropy: f32,
    pub zd: f32,
    pub cossim: f32,
}

/// `blk.12.ffn_up.weight` → ("12", "ffn_up"); no block → "-"; no `weight` → the whole name.
pub fn split_tensor_name(input: &str) -> (String, String) {
    let parts: Vec<&str> = input.split('.').collect();
    let layer = parts.iter().position(|p| *p == "blk").and_then(|i| parts.get(i + 1)).map(|s| s.to_string());
    let tensor = parts.iter().position(|p| *p == "weight").filter(|&i| i > 0).map(|i| parts[i - 1].to_string());
    (layer.unwrap_or_else(|| "-".into()), tensor.unwrap_or_else(|| input.to_string()))
}

/// Upstream's `compute_statistics`; None (with upstream's message) when there is nothing to do.
pub fn compute(name: &str, e: &Stats) -> Option<TensorStats> {
    if e.counts.is_empty() {
        eprintln!("compute_statistics: there are no activations for tensor {name}. The imatrix may be suboptimal");
        return None;
    }
    if e.values.len() % e.counts.len() != 0 {
        eprintln!("compute_statistics: activation size mismatch for tensor {name} ({} vs {})", e.counts.len(), e.values.len());
        return None;
    }
    let row = e.values.len() / e.counts.len();
    let mut act: Vec<f32> = Vec::with_capacity(e.values.len());
    for (i, &c) in e.counts.iter().enumerate() {
        if c != 0 {
            act.extend(e.values[i * row..(i + 1) * row].iter().map(|&v| v / c as f32));
        }
    }
    if act.is_empty() {
        eprintln!("compute_statistics: all counts are zero for tensor {name}, skipping statistics computation");
        return None;
    }
    let n = act.len() as f32;
    let total = act.iter().fold(0.0f32, |s, &v| s + v);
    let max = act.iter().copied().fold(act[0], |m, v| if m < v { v } else { m });
    let min = act.iter().copied().fold(act[0], |m, v| if v < m { v } else { m });
    let mean = total / n;
    let sqr_total = act.iter().fold(0.0f32, |s, &v| s + v * v);
    let var = sqr_total / n - mean * mean;
    let dev = var.max(0.0).sqrt();
    let inactive = act.iter().filter(|v| v.abs() <= 1e-5).count();
    let active = 1.0 - inactive as f32 / n;
    let mut entropy = 0.0f32;
    if total > 0.0 {
        for &a in &act {
            let p = a / total;
            if p > 0.0 {
                entropy -= p * p.log2();
            }
        }
    }
    let mut z = 0;
    if dev > 0.0 {
        z = act.iter().filter(|&&a| (a - mean) / dev > 1.0).count();
    }
    Some(TensorStats {
        tensor: name.to_string(),
        values: e.values.clone(),
        total_sqract: total,
        mean_sqract: mean,
        max_sqract: max,
        min_sqract: min,
        elements: act.len() as i32,
        stddev: dev,
        active,
        entropy,
        zd: z as f32 / act.len() as f32,
        cossim: 0.0,
    })
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |s, (x, y)| s + x * y)
}

/// Cosine similarity of each `blk.N.*` tensor's sums with the same tensor of block N−1.
pub fn compute_cossim(ts: &mut [TensorStats]) {
    let prev_names: Vec<Option<String>> = ts
        .iter()
        .map(|t| {
            let i = t.tensor.find("blk.")?;
            let rest = &t.tensor[i + 4..];
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            if digits.is_empty() || !rest[digits.len()..].starts_with('.') {
                return None;
            }
            let blk: i64 = digits.parse().ok()?;
            Some(format!("{}blk.{}{}", &t.tensor[..i], blk - 1, &rest[digits.len()..]))
        })
        .collect();
    for k in 0..ts.len() {
        let Some(pn) = &prev_names[k] else {
            ts[k].cossim = 0.0;
            continue;
        };
        if let Some(p) = ts.iter().position(|t| &t.tensor == pn) {
            let (cur, prev) = (&ts[k].values, &ts[p].values);
            let dp = dot(cur, prev);
            let cm = dot(cur, cur).sqrt();
            let pm = dot(prev, prev).sqrt();
            ts[k].cossim = dp / (cm * pm);
        }
    }
}

/// printf's `%W.Pf` for f32 promoted to double, including glibc's nan/inf spellings.
pub fn fmt_f(v: f32, width: usize, prec: usize) -> String {
    let v = v as f64;
    let s = if v.is_nan() {
        if v.is_sign_negative() { "-nan".to_string() } else { "nan".to_string() }
    } else if v.is_infinite() {
        if v < 0.0 { "-inf".to_string() } else { "inf".to_string() }
    } else {
        format!("{v:.prec$}")
    };
    format!("{s:>width$}")
}

/// Upstream's row order: by tensor kind (`ffn_up`, …), then Σ(Act²) descending. Upstream's
/// `std::sort` leaves rows with equal keys in an unspecified order (and whether two sums tie
/// exactly depends on the CPU's float arithmetic); ours breaks ties by layer number, then by
/// full tensor name, so the same file always prints the same table.
pub fn sort_rows(ts: &mut [TensorStats]) {
    let key = |t: &TensorStats| {
        let (layer, kind) = split_tensor_name(&t.tensor);
        (kind, layer.parse::<i64>().unwrap_or(-1))
    };
    ts.sort_by(|a, b| {
        let ((ka, la), (kb, lb)) = (key(a), key(b));
        ka.cmp(&kb)
            .then(b.total_sqract.partial_cmp(&a.total_sqract).unwrap_or(std::cmp::Ordering::Equal))
            .then(la.cmp(&lb))
            .then(a.tensor.cmp(&b.tensor))
    });
}

/// The two tables, as upstream prints them.
pub fn render(path: &Path, ts: &[TensorStats]) -> String {
    let mut o = String::new();
    o += &format!("\nComputing statistics for {} ({} tensors)\n", path.display(), ts.len());
    o += &format!(
        "\n{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
        " Layer", "       Tensor", "          Σ(Act²)", "  Min", "            Max", "           μ", "   σ", " % Active", "N", "   Entropy", "E (norm)", "ZD", "  CosSim"
    );
    o += &"=".repeat(110 + 59);
    o += "\n";
    #[derive(Default)]
    struct W {
        bias: f32,
        zd: f32,
        cossim: f32,
        n: i32,
    }
    let mut ws: BTreeMap<i32, W> = BTreeMap::new();
    for t in ts {
        let (layer, name) = split_tensor_name(&t.tensor);
        let blk: i32 = layer.parse().unwrap_or(-1);
        // std::log2(int) is the double overload: the ratio is computed in double
        let en = if t.elements > 0 { (100.0 * (t.entropy as f64 / (t.elements as f64).log2())) as f32 } else { 0.0 };
        o += &format!(
            "{layer:>5}\t{name:<20}\t{}\t{}\t{}\t{}\t{}\t{}%\t{:>6}\t{}\t{}%\t{}%\t{}\n",
            fmt_f(t.total_sqract, 10, 2),
            fmt_f(t.min_sqract, 8, 4),
            fmt_f(t.max_sqract, 11, 4),
            fmt_f(t.mean_sqract, 6, 2),
            fmt_f(t.stddev, 6, 2),
            fmt_f(t.active * 100.0, 8, 2),
            t.elements,
            fmt_f(t.entropy, 10, 4),
            fmt_f(en, 6, 2),
            fmt_f(100.0 * t.zd, 10, 2),
            fmt_f(t.cossim, 8, 4),
        );
        let w = ws.entry(blk).or_default();
        w.bias += t.elements as f32 * t.total_sqract;
        w.zd += t.elements as f32 * t.zd;
        w.cossim += t.elements as f32 * t.cossim;
        w.n += t.elements;
    }
    let layers = ws.keys().filter(|&&k| k >= 0).count();
    o += &format!("\nComputing weighted average statistics per layer ({layers} layers)\n");
    o += &format!("\n{}\t{}\t{}\t{}\n", "  Layer", "     μΣ(Act²)", "      μZD", "μCosSim");
    o += "================================================\n";
    for (layer, w) in &ws {
        if w.n == 0 || *layer < 0 {
            continue;
        }
        let n = w.n as f32;
        o += &format!("{layer:>5}\t{}\t{}%\t{}\n", fmt_f(w.bias / n, 14, 2), fmt_f(100.0 * (w.zd / n), 10, 4), fmt_f(w.cossim / n, 6, 4));
    }
    o += "\n";
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, total: f32) -> TensorStats {
        compute(name, &Stats { values: vec![total, 0.0], counts: vec![1] }).unwrap()
    }

    #[test]
    fn ties_are_broken_by_layer_number_then_name() {
        let mut ts = vec![
            row("blk.10.attn_k.weight", 64.0),
            row("blk.2.attn_k.weight", 64.0),
            row("blk.3.attn_k.weight", 80.0),
            row("blk.0.ffn_up.weight", 1.0),
            row("blk.1.attn_k.weight", 64.0),
        ];
        sort_rows(&mut ts);
        let names: Vec<&str> = ts.iter().map(|t| t.tensor.as_str()).collect();
        assert_eq!(
            names,
            ["blk.3.attn_k.weight", "blk.1.attn_k.weight", "blk.2.attn_k.weight", "blk.10.attn_k.weight", "blk.0.ffn_up.weight"]
        );
    }
}
