//! Which chunks of the tokenised corpus a run evaluates (`--chunk-sampling`), and what share
//! of the corpus (and of each `--domains` domain) that is.
//!
//! The corpus is cut into `chunks_total = tokens / n_ctx` whole chunks (after `--chunk N`
//! removed the first N), numbered from 0. `--chunks K` of them are evaluated:
//! - `prefix` (default, upstream): chunks 0..K;
//! - `even`: chunk `round(i·(chunks_total − 1)/(K − 1))` for i = 0..K (the first and the last
//!   chunk always, evenly spaced between; K = 1 gives chunk 0);
//! - `seeded`: K chunks drawn without replacement (a seeded Fisher–Yates prefix, `--seed`),
//!   evaluated in ascending order.
//! The evaluation order is always ascending, so `prefix` is exactly upstream's run.

use serde_json::{json, Value};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ChunkSampling {
    #[default]
    Prefix,
    Even,
    Seeded,
}

impl ChunkSampling {
    pub fn name(self) -> &'static str {
        match self {
            ChunkSampling::Prefix => "prefix",
            ChunkSampling::Even => "even",
            ChunkSampling::Seeded => "seeded",
        }
    }
}

/// The ascending chunk indices evaluated: `k` of `total` (k ≤ total).
pub fn chunk_indices(mode: ChunkSampling, total: usize, k: usize, seed: u64) -> Vec<usize> {
    assert!(k <= total);
    match mode {
        ChunkSampling::Prefix => (0..k).collect(),
        ChunkSampling::Even if k <= 1 => (0..k).collect(),
        ChunkSampling::Even => {
            let (span, gaps) = ((total - 1) as u128, (k - 1) as u128);
            (0..k as u128).map(|i| ((i * span + gaps / 2) / gaps) as usize).collect()
        }
        ChunkSampling::Seeded => {
            let mut rng = crate::fixture::rng::Rng::stream(seed, "chunk-sampling");
            let mut all: Vec<usize> = (0..total).collect();
            for i in 0..k {
                let j = i + rng.below((total - i) as u64) as usize;
                all.swap(i, j);
            }
            let mut v = all[..k].to_vec();
            v.sort_unstable();
            v
        }
    }
}

/// What the run sees, for the printout, the saliency JSON and the manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct Coverage {
    pub sampling: ChunkSampling,
    pub seed: u64,
    pub n_ctx: usize,
    pub corpus_tokens: u64,
    pub chunks_total: usize,
    pub chunk_indices: Vec<usize>,
    /// per domain: (name, corpus tokens, evaluated tokens)
    pub domains: Vec<(String, u64, u64)>,
}

impl Coverage {
    pub fn evaluated_tokens(&self) -> u64 {
        (self.chunk_indices.len() * self.n_ctx) as u64
    }

    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "sampling": self.sampling.name(),
            "seed": self.seed,
            "n_ctx": self.n_ctx,
            "corpus_tokens": self.corpus_tokens,
            "chunks_total": self.chunks_total,
            "chunk_indices": self.chunk_indices,
            "evaluated_tokens": self.evaluated_tokens(),
        });
        if !self.domains.is_empty() {
            v["domains"] = self
                .domains
                .iter()
                .map(|(n, c, e)| json!({"name": n, "corpus_tokens": c, "evaluated_tokens": e}))
                .collect();
        }
        v
    }

    /// The lines printed before computing.
    pub fn describe(&self) -> Vec<String> {
        let pct = |a: u64, b: u64| if b == 0 { 0.0 } else { 100.0 * a as f64 / b as f64 };
        let mut out = vec![format!(
            "coverage: corpus {} tokens, {} chunks of {}; evaluating {} chunks ({} tokens, {:.1}% of the corpus), --chunk-sampling {}",
            self.corpus_tokens,
            self.chunks_total,
            self.n_ctx,
            self.chunk_indices.len(),
            self.evaluated_tokens(),
            pct(self.evaluated_tokens(), self.corpus_tokens),
            self.sampling.name()
        )];
        for (n, c, e) in &self.domains {
            out.push(format!("coverage:   domain {n}: {c} corpus tokens, {e} evaluated ({:.1}%)", pct(*e, *c)));
        }
        if self.sampling == ChunkSampling::Prefix && 2 * self.evaluated_tokens() < self.corpus_tokens {
            out.push(format!(
                "coverage: note: prefix sampling sees only the first {:.1}% of the corpus; --chunk-sampling even spreads the {} chunks over all of it",
                pct(self.evaluated_tokens(), self.corpus_tokens),
                self.chunk_indices.len()
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_even_and_seeded() {
        assert_eq!(chunk_indices(ChunkSampling::Prefix, 10, 3, 0), [0, 1, 2]);
        assert_eq!(chunk_indices(ChunkSampling::Even, 10, 4, 0), [0, 3, 6, 9]);
        assert_eq!(chunk_indices(ChunkSampling::Even, 10, 10, 0), (0..10).collect::<Vec<_>>());
        assert_eq!(chunk_indices(ChunkSampling::Even, 7, 1, 0), [0]);
        // the last chunk is always evaluated, indices strictly ascending
        for total in 1..60 {
            for k in 2..=total {
                let v = chunk_indices(ChunkSampling::Even, total, k, 0);
                assert_eq!((v[0], *v.last().unwrap(), v.len()), (0, total - 1, k));
                assert!(v.windows(2).all(|w| w[0] < w[1]), "{total} {k} {v:?}");
            }
        }
        let a = chunk_indices(ChunkSampling::Seeded, 100, 10, 5);
        assert_eq!(a, chunk_indices(ChunkSampling::Seeded, 100, 10, 5));
        assert_ne!(a, chunk_indices(ChunkSampling::Seeded, 100, 10, 6));
        assert!(a.windows(2).all(|w| w[0] < w[1]) && a.iter().all(|&i| i < 100));
        assert_eq!(chunk_indices(ChunkSampling::Seeded, 5, 5, 1), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn prefix_under_half_names_even() {
        let c = Coverage { sampling: ChunkSampling::Prefix, seed: 0, n_ctx: 10, corpus_tokens: 100, chunks_total: 10, chunk_indices: vec![0, 1], domains: vec![] };
        assert!(c.describe().last().unwrap().contains("--chunk-sampling even"));
        let c = Coverage { chunk_indices: (0..5).collect(), ..c };
        assert_eq!(c.describe().len(), 1);
    }
}
