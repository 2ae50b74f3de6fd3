//! Per-domain views of a keep map (saliency files written with `--domains`): how much of each
//! domain's routing a map keeps, and `--domain-weights` for `reap_l2_sum` (docs/select.md).

use crate::formats::saliency::Saliency;

/// One domain's part of what a keep map keeps.
#[derive(Clone, Debug, PartialEq)]
pub struct DomainKept {
    pub name: String,
    /// Σ_layers Σ_{e kept} count_d[e] / Σ_layers Σ_e count_d[e] (1 for a domain with no slots)
    pub slots_kept: f64,
    /// the layer where the domain keeps the smallest share: (block, share)
    pub worst: (u32, f64),
}

/// For each domain of `s`, the share of its top-k slots that `keep` (per layer) keeps.
pub fn kept(s: &Saliency, keep: &[Vec<u16>]) -> Vec<DomainKept> {
    s.domains
        .iter()
        .map(|d| {
            let (mut kept, mut all) = (0u64, 0u64);
            let mut worst = (s.layers.first().map_or(0, |l| l.layer), 1.0f64);
            for (dl, k) in d.layers.iter().zip(keep) {
                let total: u64 = dl.count.iter().sum();
                let here: u64 = k.iter().map(|&e| dl.count[e as usize]).sum();
                kept += here;
                all += total;
                let share = if total > 0 { here as f64 / total as f64 } else { 1.0 };
                if share < worst.1 {
                    worst = (dl.layer, share);
                }
            }
            DomainKept { name: d.name.clone(), slots_kept: if all > 0 { kept as f64 / all as f64 } else { 1.0 }, worst }
        })
        .collect()
}

/// `NAME=W,NAME=W…` → one weight per domain of `s` (unlisted domains weigh 1).
pub fn parse_weights(spec: &str, s: &Saliency) -> Result<Vec<f64>, String> {
    if s.domains.is_empty() {
        return Err("--domain-weights: the saliency file has no per-domain sums (calibrate with --domains)".into());
    }
    let mut w = vec![1.0; s.domains.len()];
    for item in spec.split(',').filter(|x| !x.is_empty()) {
        let (name, v) = item.split_once('=').ok_or_else(|| format!("--domain-weights {item}: expected NAME=W"))?;
        let v: f64 = v.parse().map_err(|_| format!("--domain-weights {item}: W is not a number"))?;
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("--domain-weights {item}: W must be a finite number ≥ 0"));
        }
        let i = s.domains.iter().position(|d| d.name == name).ok_or_else(|| {
            let names: Vec<&str> = s.domains.iter().map(|d| d.name.as_str()).collect();
            format!("--domain-weights {item}: no domain {name} in the saliency file (it has {})", names.join(", "))
        })?;
        w[i] = v;
    }
    Ok(w)
}

/// `s` with every layer's `reap_l2_sum` replaced by Σ_d w_d · reap_l2_sum_d, the score
/// `reap_l2_sum` ranks by under `--domain-weights`.
pub fn weighted(s: &Saliency, w: &[f64]) -> Saliency {
    let mut out = s.clone();
    for (li, l) in out.layers.iter_mut().enumerate() {
        for e in 0..l.n_expert {
            l.reap_l2_sum[e] = s.domains.iter().zip(w).map(|(d, &wd)| wd * d.layers[li].reap_l2_sum[e]).sum();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::saliency::{DomainLayer, DomainSums, LayerSums};

    fn sal() -> Saliency {
        let mut l = LayerSums::new(2, 3, 1);
        l.count = vec![4, 4, 2];
        l.reap_l2_sum = vec![4.0, 3.0, 2.0];
        let dl = |count: Vec<u64>, r: Vec<f64>| DomainLayer { layer: 2, count, prob_sum: vec![0.0; 3], reap_l2_sum: r };
        Saliency {
            layers: vec![l],
            domains: vec![
                DomainSums { name: "en".into(), tokens: 6, layers: vec![dl(vec![4, 2, 0], vec![4.0, 1.0, 0.0])] },
                DomainSums { name: "ja".into(), tokens: 4, layers: vec![dl(vec![0, 2, 2], vec![0.0, 2.0, 2.0])] },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn kept_shares_per_domain() {
        // keep experts 0 and 1: en keeps 6 of 6 slots, ja 2 of 4
        let k = kept(&sal(), &[vec![0, 1]]);
        assert_eq!(k[0].slots_kept, 1.0);
        assert_eq!(k[1].slots_kept, 0.5);
        assert_eq!(k[1].worst, (2, 0.5));
    }

    #[test]
    fn weights_rescore_reap_l2_sum() {
        let s = sal();
        let w = parse_weights("ja=3", &s).unwrap();
        assert_eq!(w, [1.0, 3.0]);
        // en 1·(4, 1, 0) + ja 3·(0, 2, 2) = (4, 7, 6)
        assert_eq!(weighted(&s, &w).layers[0].reap_l2_sum, [4.0, 7.0, 6.0]);
        assert!(parse_weights("fr=1", &s).unwrap_err().contains("no domain fr"));
        assert!(parse_weights("ja=-1", &s).unwrap_err().contains("≥ 0"));
        assert!(parse_weights("ja=1", &Saliency::default()).unwrap_err().contains("calibrate with --domains"));
    }
}
