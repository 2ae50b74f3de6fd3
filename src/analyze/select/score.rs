//! Per-expert scores and the ranking that turns them into keep sets. The formulas are in
//! docs/select.md; every one reads only the saliency sums of one layer.

use crate::formats::saliency::LayerSums;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Method {
    /// count: times the expert was in the model's top-k
    #[value(name = "frequency")]
    Frequency,
    /// reap_l2_sum / count (the REAP paper's score); 0 for count 0
    #[value(name = "reap_mean")]
    ReapMean,
    /// Σ g·‖f‖
    #[value(name = "reap_l2_sum")]
    ReapL2Sum,
    /// Σ ‖f‖
    #[value(name = "ean_sum")]
    EanSum,
    /// per-expert mean shrunk toward a prior (--prior)
    #[value(name = "reap_shrink")]
    ReapShrink,
    /// average of the reap_l2_sum and reap_shrink ranks
    #[value(name = "reap_hybrid")]
    ReapHybrid,
    /// reap_softmax_l2_sum / count: REAP weighted by the router's softmax probability (what
    /// CerebrasResearch/reap computes by default); 0 for count 0
    #[value(name = "reap_softmax_mean")]
    ReapSoftmaxMean,
    /// Σ p·‖f‖
    #[value(name = "reap_softmax_l2_sum")]
    ReapSoftmaxL2Sum,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Frequency => "frequency",
            Method::ReapMean => "reap_mean",
            Method::ReapL2Sum => "reap_l2_sum",
            Method::EanSum => "ean_sum",
            Method::ReapShrink => "reap_shrink",
            Method::ReapHybrid => "reap_hybrid",
            Method::ReapSoftmaxMean => "reap_softmax_mean",
            Method::ReapSoftmaxL2Sum => "reap_softmax_l2_sum",
        }
    }
    /// Whether the method reads the REAP reference's statistics (absent from older files).
    pub fn uses_reference(self) -> bool {
        matches!(self, Method::ReapSoftmaxMean | Method::ReapSoftmaxL2Sum)
    }
    /// Whether the method's scores depend on --prior, --z, --shrink-m.
    pub fn uses_prior(self) -> bool {
        matches!(self, Method::ReapShrink | Method::ReapHybrid)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Prior {
    /// shrink toward the median of the live experts' means
    Median,
    /// score = mean − z·sd/√count (a lower confidence bound; no pseudo-count)
    Lcb { z: f64 },
    /// Σreap_l2_sum / Σcount: the audited script's prior, which scores a zero-hit expert above
    /// most live ones. Not offered on the command line; kept to test that the others fix it.
    CountWeightedMean,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    pub prior: Prior,
    /// pseudo-count m of the shrink; None: the median count of the layer's live experts
    pub shrink_m: Option<f64>,
    /// experts with count < min_count rank below every expert with count ≥ min_count
    pub min_count: u64,
    /// expert groups the model routes within (`expert_group_count`; 1: none): each keeps k/groups
    pub groups: usize,
}

/// Median of a non-empty list (mean of the two middle values for an even length).
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

fn means(l: &LayerSums) -> Vec<f64> {
    per_count(l, &l.reap_l2_sum)
}

/// `sum / count` per expert, 0 where count is 0.
fn per_count(l: &LayerSums, sum: &[f64]) -> Vec<f64> {
    (0..l.n_expert).map(|i| if l.count[i] > 0 { sum[i] / l.count[i] as f64 } else { 0.0 }).collect()
}

/// The softmax-weighted sums; a file without them gets zeros here (`select` refuses such a
/// file for these methods before scoring).
fn softmax_sums(l: &LayerSums) -> Vec<f64> {
    l.reference.as_ref().map_or_else(|| vec![0.0; l.n_expert], |r| r.reap_softmax_l2_sum.clone())
}

/// The pseudo-count the shrink uses in this layer.
pub fn shrink_m(l: &LayerSums, p: &Params) -> f64 {
    p.shrink_m.unwrap_or_else(|| median(l.count.iter().filter(|&&c| c > 0).map(|&c| c as f64).collect()).unwrap_or(0.0))
}

/// The prior the shrink pulls toward (None for the LCB, which has none).
pub fn prior_value(l: &LayerSums, prior: Prior) -> Option<f64> {
    let mean = means(l);
    match prior {
        Prior::Median => Some(median((0..l.n_expert).filter(|&i| l.count[i] > 0).map(|i| mean[i]).collect()).unwrap_or(0.0)),
        Prior::CountWeightedMean => {
            let n: u64 = l.count.iter().sum();
            Some(if n > 0 { l.reap_l2_sum.iter().sum::<f64>() / n as f64 } else { 0.0 })
        }
        Prior::Lcb { .. } => None,
    }
}

/// reap_shrink's score of every expert of one layer.
pub fn shrink_scores(l: &LayerSums, p: &Params) -> Vec<f64> {
    let mean = means(l);
    match p.prior {
        Prior::Lcb { z } => {
            // sample sd for count ≥ 2; count 1 borrows the median sd of the experts that have one
            let sd: Vec<Option<f64>> = (0..l.n_expert)
                .map(|i| {
                    let n = l.count[i] as f64;
                    (l.count[i] >= 2).then(|| ((l.reap_l2_sq_sum[i] - n * mean[i] * mean[i]) / (n - 1.0)).max(0.0).sqrt())
                })
                .collect();
            let pooled = median(sd.iter().flatten().copied().collect());
            (0..l.n_expert)
                .map(|i| match l.count[i] {
                    0 => f64::NEG_INFINITY,
                    n => {
                        let s = sd[i].or(pooled).unwrap_or(mean[i]);
                        mean[i] - z * s / (n as f64).sqrt()
                    }
                })
                .collect()
        }
        prior => {
            let mu = prior_value(l, prior).unwrap_or(0.0);
            let m = shrink_m(l, p);
            (0..l.n_expert)
                .map(|i| {
                    let d = l.count[i] as f64 + m;
                    if d > 0.0 {
                        (l.reap_l2_sum[i] + m * mu) / d
                    } else {
                        0.0
                    }
                })
                .collect()
        }
    }
}

/// 1-based ranks, best (highest score) first; tied scores share the average of their ranks.
pub fn average_ranks(scores: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut ranks = vec![0.0; scores.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && scores[idx[j + 1]] == scores[idx[i]] {
            j += 1;
        }
        let r = (i + j) as f64 / 2.0 + 1.0;
        for &e in &idx[i..=j] {
            ranks[e] = r;
        }
        i = j + 1;
    }
    ranks
}

/// The method's score of every expert of one layer: higher is more worth keeping.
pub fn scores(l: &LayerSums, method: Method, p: &Params) -> Vec<f64> {
    match method {
        Method::Frequency => l.count.iter().map(|&c| c as f64).collect(),
        Method::ReapMean => means(l),
        Method::ReapL2Sum => l.reap_l2_sum.clone(),
        Method::EanSum => l.ean_sum.clone(),
        Method::ReapShrink => shrink_scores(l, p),
        Method::ReapHybrid => {
            // dead experts rank last under both, below every live one: the median prior gives a
            // dead expert the prior itself, above every live expert below the prior, and a dead
            // expert's reap_l2_sum of 0 ties with a live expert's 0; either way the live
            // experts' ranks would move with the number of dead ones
            let dead_last = |v: Vec<f64>| -> Vec<f64> { v.into_iter().zip(&l.count).map(|(s, &c)| if c == 0 { f64::NEG_INFINITY } else { s }).collect() };
            let a = average_ranks(&dead_last(l.reap_l2_sum.clone()));
            let b = average_ranks(&dead_last(shrink_scores(l, p)));
            a.iter().zip(&b).map(|(x, y)| -(x + y) / 2.0).collect()
        }
        Method::ReapSoftmaxMean => per_count(l, &softmax_sums(l)),
        Method::ReapSoftmaxL2Sum => softmax_sums(l),
    }
}

/// Experts best first: by tier (count ≥ max(min_count, 1), then 0 < count < min_count, then
/// count 0), then by score, then by id. A dead expert therefore never precedes a live one.
pub fn order(l: &LayerSums, scores: &[f64], min_count: u64) -> Vec<usize> {
    let tier = |i: usize| match l.count[i] {
        0 => 0u8,
        c if c < min_count => 1,
        _ => 2,
    };
    let mut idx: Vec<usize> = (0..l.n_expert).collect();
    idx.sort_by(|&a, &b| tier(b).cmp(&tier(a)).then(scores[b].total_cmp(&scores[a])).then(a.cmp(&b)));
    idx
}

/// Scores only, no tiers: how the audited script ranked (used to show what the tiers fix).
pub fn order_by_score_only(scores: &[f64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx
}

/// The kept experts in the order `prune --hash-remap` tries them as a stand-in for a dropped
/// expert that a hash-routed token's row names: the smallest mean REAP contribution per routed
/// token (reap_l2_sum / count: gate × ‖output‖) first, so the stand-in adds as little as can be
/// to what the dropped expert's small contribution was; experts never routed (nothing
/// measured) last; ties by id.
pub fn stand_in_order(l: &LayerSums, keep: &[u16]) -> Vec<u16> {
    let key = |e: u16| {
        let c = l.count[e as usize];
        (c == 0, if c == 0 { 0.0 } else { l.reap_l2_sum[e as usize] / c as f64 })
    };
    let mut v = keep.to_vec();
    v.sort_by(|&a, &b| {
        let (x, y) = (key(a), key(b));
        x.0.cmp(&y.0).then(x.1.total_cmp(&y.1)).then(a.cmp(&b))
    });
    v
}

/// The first `k` of an order, sorted ascending.
pub fn keep_set(order: &[usize], k: usize) -> Vec<u16> {
    let mut keep: Vec<u16> = order[..k].iter().map(|&i| i as u16).collect();
    keep.sort_unstable();
    keep
}

/// The keep set of a model that routes within `groups` equal groups of consecutive ids
/// (DeepSeek-V3's `n_group`): the first `k / groups` of the order in each group, so every group
/// keeps as many experts and stays a group of consecutive ids after pruning. `groups` ≤ 1: as
/// [keep_set]. The caller checks that `groups` divides `k` and the expert count.
pub fn keep_set_grouped(order: &[usize], k: usize, groups: usize) -> Vec<u16> {
    if groups <= 1 {
        return keep_set(order, k);
    }
    let per_group = order.len() / groups;
    let mut taken = vec![0usize; groups];
    let mut keep: Vec<u16> = Vec::with_capacity(k);
    for &i in order {
        let g = i / per_group;
        if taken[g] < k / groups {
            taken[g] += 1;
            keep.push(i as u16);
        }
    }
    keep.sort_unstable();
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The audit's L47 shape: a few heavy hitters with a large mean pull the count-weighted mean
    /// above most experts' own means, and some experts never fire.
    fn skewed_layer() -> LayerSums {
        let n = 32;
        let mut l = LayerSums::new(47, n, 4);
        for i in 0..n {
            let (count, mean) = match i {
                0..=2 => (20_000u64, 10.0),                        // heavy hitters, big outputs
                3..=5 => (0, 0.0),                                 // dead
                6..=9 => (3, 1.5),                                 // rare
                _ => (500 + 37 * i as u64, 1.0 + 0.05 * i as f64), // the bulk
            };
            l.count[i] = count;
            l.reap_l2_sum[i] = mean * count as f64;
            // spread: sd 0.3·mean
            l.reap_l2_sq_sum[i] = count as f64 * (mean * mean + (0.3 * mean) * (0.3 * mean));
            l.ean_sum[i] = 2.0 * mean * count as f64;
        }
        l
    }

    /// By hand from [skewed_layer]'s means: the rare (1.5; a tie, so by id) before the bulk
    /// (1.0 + 0.05·i: 1.55, 1.6, 2.55) before a heavy hitter (10.0); the dead (3, 4) last.
    #[test]
    fn stand_ins_are_the_smallest_mean_contribution_first_and_the_dead_last() {
        let l = skewed_layer();
        assert_eq!(stand_in_order(&l, &[0, 3, 4, 6, 7, 11, 12, 31]), vec![6, 7, 11, 12, 31, 0, 3, 4]);
    }

    fn params(prior: Prior) -> Params {
        Params { prior, shrink_m: None, min_count: 0, groups: 1 }
    }

    #[test]
    fn count_weighted_prior_scores_dead_experts_high_and_median_lcb_do_not_keep_them() {
        let l = skewed_layer();
        let dead = [3usize, 4, 5];
        let live: Vec<usize> = (0..32).filter(|i| !dead.contains(i)).collect();
        let k = 16;

        // the bug: with the count-weighted prior a zero-hit expert scores μ, above most live experts
        let cw = shrink_scores(&l, &params(Prior::CountWeightedMean));
        let mu = prior_value(&l, Prior::CountWeightedMean).unwrap();
        for &d in &dead {
            assert_eq!(cw[d], mu);
        }
        let below = live.iter().filter(|&&i| cw[i] < mu).count();
        assert!(below * 10 > live.len() * 7, "{below} of {} live experts score below μ", live.len());
        let by_score = keep_set(&order_by_score_only(&cw), k);
        assert!(dead.iter().all(|d| by_score.contains(&(*d as u16))), "ranking by score alone keeps the dead experts: {by_score:?}");

        // median prior: a dead expert scores the median; LCB: −∞
        let med = shrink_scores(&l, &params(Prior::Median));
        let pm = prior_value(&l, Prior::Median).unwrap();
        assert!(pm < mu);
        for &d in &dead {
            assert_eq!(med[d], pm);
        }
        let lcb = shrink_scores(&l, &params(Prior::Lcb { z: 1.0 }));
        for &d in &dead {
            assert_eq!(lcb[d], f64::NEG_INFINITY);
        }
        let by_score = keep_set(&order_by_score_only(&lcb), k);
        assert!(dead.iter().all(|d| !by_score.contains(&(*d as u16))));

        // and with the ranking's tiers no method, whatever the prior, keeps one while a live one is out
        for prior in [Prior::Median, Prior::Lcb { z: 1.0 }, Prior::CountWeightedMean] {
            for m in <Method as clap::ValueEnum>::value_variants().iter().copied() {
                for k in [4, 16, 28, 29, 30, 32] {
                    let s = scores(&l, m, &params(prior));
                    let keep = keep_set(&order(&l, &s, 0), k);
                    let dead_kept = keep.iter().filter(|&&i| l.count[i as usize] == 0).count();
                    assert_eq!(dead_kept, k.saturating_sub(live.len()), "{m:?} {prior:?} K={k}: {keep:?}");
                }
            }
        }
    }

    #[test]
    fn softmax_methods_read_the_softmax_sums() {
        let mut l = LayerSums::new(0, 3, 1);
        l.count = vec![4, 1, 0];
        l.reap_l2_sum = vec![8.0, 5.0, 0.0];
        l.reference.as_mut().unwrap().reap_softmax_l2_sum = vec![2.0, 3.0, 0.0];
        let p = params(Prior::Median);
        assert_eq!(scores(&l, Method::ReapSoftmaxL2Sum, &p), vec![2.0, 3.0, 0.0]);
        assert_eq!(scores(&l, Method::ReapSoftmaxMean, &p), vec![0.5, 3.0, 0.0]);
        // the applied-gate sum ranks the two live experts the other way round
        assert_eq!(order(&l, &scores(&l, Method::ReapSoftmaxL2Sum, &p), 0), vec![1, 0, 2]);
        assert_eq!(order(&l, &scores(&l, Method::ReapL2Sum, &p), 0), vec![0, 1, 2]);
    }

    #[test]
    fn shrink_formula_and_pseudo_count() {
        let mut l = LayerSums::new(0, 4, 1);
        l.count = vec![1, 3, 5, 0];
        l.reap_l2_sum = vec![4.0, 3.0, 10.0, 0.0];
        // means 4, 1, 2 → median 2; median live count 3
        let p = Params { prior: Prior::Median, shrink_m: None, min_count: 0, groups: 1 };
        assert_eq!(shrink_m(&l, &p), 3.0);
        let s = shrink_scores(&l, &p);
        assert_eq!(s, vec![(4.0 + 6.0) / 4.0, (3.0 + 6.0) / 6.0, (10.0 + 6.0) / 8.0, 2.0]);
        let p = Params { shrink_m: Some(1.0), ..p };
        assert_eq!(shrink_scores(&l, &p)[0], (4.0 + 2.0) / 2.0);
    }

    #[test]
    fn lcb_uses_the_sample_sd_and_borrows_it_for_single_hits() {
        let mut l = LayerSums::new(0, 3, 1);
        // expert 0: values 1, 3 (mean 2, sample sd √2); expert 1: one value 5; expert 2: values 2,2,2,2
        l.count = vec![2, 1, 4];
        l.reap_l2_sum = vec![4.0, 5.0, 8.0];
        l.reap_l2_sq_sum = vec![10.0, 25.0, 16.0];
        let s = shrink_scores(&l, &Params { prior: Prior::Lcb { z: 2.0 }, shrink_m: None, min_count: 0, groups: 1 });
        let sd0 = 2f64.sqrt();
        assert!((s[0] - (2.0 - 2.0 * sd0 / 2f64.sqrt())).abs() < 1e-12);
        // pooled sd: median of {√2, 0} = √2/2
        assert!((s[1] - (5.0 - 2.0 * sd0 / 2.0)).abs() < 1e-12);
        assert!((s[2] - 2.0).abs() < 1e-12);
    }

    /// Dead experts rank last under both of the hybrid's rankings, so the order of the live
    /// experts does not depend on how many dead ones the layer has (under the median prior a
    /// dead expert's shrunk score is the prior itself, above every live expert below it).
    #[test]
    fn hybrid_order_of_live_experts_ignores_dead_ones() {
        let p = Params { prior: Prior::Median, shrink_m: None, min_count: 0, groups: 1 };
        let mut flipped = 0;
        for seed in 0..50u64 {
            let mut rng = crate::fixture::rng::Rng::stream(seed, "hybrid");
            let n_live = 12;
            let live: Vec<(u64, f64)> = (0..n_live).map(|_| (1 + (rng.uniform() * 200.0) as u64, rng.uniform() * 10.0)).collect();
            let layer = |n_dead: usize| {
                let mut l = LayerSums::new(0, n_live + n_dead, 2);
                for (i, &(c, mean)) in live.iter().enumerate() {
                    l.count[i] = c;
                    l.reap_l2_sum[i] = c as f64 * mean;
                    l.reap_l2_sq_sum[i] = c as f64 * mean * mean;
                }
                l
            };
            let live_order = |l: &LayerSums| -> Vec<usize> {
                order(l, &scores(l, Method::ReapHybrid, &p), 0).into_iter().filter(|&i| i < n_live).collect()
            };
            let (a, b) = (live_order(&layer(0)), live_order(&layer(6)));
            flipped += (a != b) as usize;
        }
        assert_eq!(flipped, 0, "live orders that changed with 6 dead experts added, of 50 layers");
    }

    /// A live expert whose reap_l2_sum is 0 ranks above the dead experts under reap_l2_sum
    /// too, so adding dead experts does not change which live experts reap_hybrid keeps.
    #[test]
    fn hybrid_live_expert_with_zero_l2_sum_ignores_dead_ones() {
        let p = Params { prior: Prior::Median, shrink_m: None, min_count: 0, groups: 1 };
        let keep = |n_dead: usize| {
            let mut l = LayerSums::new(0, 5 + n_dead, 1);
            l.count[..5].copy_from_slice(&[1, 1000, 100, 100, 100]);
            l.reap_l2_sum[..5].copy_from_slice(&[0.0, 10.0, 100.0, 120.0, 80.0]);
            keep_set(&order(&l, &scores(&l, Method::ReapHybrid, &p), 0), 4)
        };
        // expert 0 ranks 5th under reap_l2_sum and 4th under the shrink, expert 1 4th and
        // 5th: a tie, broken by id
        assert_eq!(keep(0), vec![0, 2, 3, 4]);
        for n_dead in [1, 3, 10] {
            assert_eq!(keep(n_dead), vec![0, 2, 3, 4], "{n_dead} dead experts");
        }
    }

    #[test]
    fn hybrid_averages_ranks_and_ties_break_by_id() {
        assert_eq!(average_ranks(&[3.0, 1.0, 3.0, 0.5]), vec![1.5, 3.0, 1.5, 4.0]);
        let mut l = LayerSums::new(0, 4, 1);
        l.count = vec![10, 10, 10, 10];
        l.reap_l2_sum = vec![100.0, 1.0, 50.0, 50.0];
        let p = Params { prior: Prior::Median, shrink_m: Some(0.0), min_count: 0, groups: 1 };
        // m = 0: shrink = mean, same order as l2_sum here
        let h = scores(&l, Method::ReapHybrid, &p);
        assert_eq!(h, vec![-1.0, -4.0, -2.5, -2.5]);
        assert_eq!(order(&l, &h, 0), vec![0, 2, 3, 1]);
        // min_count sends experts below it after all others, dead ones last
        l.count = vec![10, 10, 2, 0];
        l.reap_l2_sum = vec![1.0, 2.0, 100.0, 0.0];
        let s = scores(&l, Method::ReapMean, &p);
        assert_eq!(order(&l, &s, 5), vec![1, 0, 2, 3]);
        assert_eq!(order(&l, &s, 0), vec![2, 1, 0, 3]);
    }
}
