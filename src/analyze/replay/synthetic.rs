//! A synthetic routing trace for the benchmark (`ci/bench-replay`) and tests: per layer a
//! Zipf-like expert popularity, a "topic" bias redrawn every ~256 tokens (so caches see
//! locality) and per-token noise; candidates are the top-N by router probability, the picks
//! their first k. Deterministic in the seed.

use crate::formats::trace::{RowData, TraceFile, TraceHeader, FLAG_NORMALISED};
use anyhow::Result;
use std::path::Path;

#[derive(Clone, Copy, Debug)]
pub struct Spec {
    pub tokens: u64,
    pub layers: usize,
    pub experts: usize,
    pub k: usize,
    pub top_n: usize,
    pub seed: u64,
}

/// SplitMix64.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// uniform in [0, 1)
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn write(path: &Path, s: &Spec) -> Result<()> {
    anyhow::ensure!(
        s.k >= 1 && s.k <= s.top_n && s.top_n <= s.experts && s.experts <= u16::MAX as usize,
        "implausible synthetic shape {s:?}"
    );
    let header = TraceHeader {
        layers: (0..s.layers as u32).collect(),
        n_expert: s.experts as u32,
        k: s.k as u32,
        top_n: s.top_n as u32,
        n_tokens: 0,
        flags: FLAG_NORMALISED,
    };
    let layout = header.layout();
    let mut file = TraceFile::create_staged(path, header)?;
    let mut rng = Rng::new(s.seed);
    let (ne, nl) = (s.experts, s.layers);
    // per layer: popularity −0.6·ln(1 + rank) over a random permutation
    let mut base = vec![0f64; nl * ne];
    for l in 0..nl {
        let mut perm: Vec<usize> = (0..ne).collect();
        for i in (1..ne).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        for (rank, &e) in perm.iter().enumerate() {
            base[l * ne + e] = -0.6 * (1.0 + rank as f64).ln();
        }
    }
    let mut topic = vec![0f64; nl * ne];
    let (mut sel_w, mut cand_p) = (vec![0f32; nl * s.k], vec![0f32; nl * s.top_n]);
    let (mut sel_id, mut cand_id) = (vec![0u16; nl * s.k], vec![0u16; nl * s.top_n]);
    let mut logit = vec![0f64; ne];
    let mut idx: Vec<u16> = (0..ne as u16).collect();
    let mut buf = Vec::new();
    let mut pending = 0u64;
    for t in 0..s.tokens {
        if t % 256 == 0 || rng.unit() < 1.0 / 256.0 {
            for x in &mut topic {
                *x = 3.0 * rng.unit() - 1.5;
            }
        }
        for l in 0..nl {
            let mut mx = f64::MIN;
            for e in 0..ne {
                logit[e] = base[l * ne + e] + topic[l * ne + e] + 5.0 * rng.unit();
                mx = mx.max(logit[e]);
            }
            let mut z = 0.0;
            for x in logit.iter_mut() {
                *x = (*x - mx).exp();
                z += *x;
            }
            idx.select_nth_unstable_by(s.top_n - 1, |&a, &b| logit[b as usize].total_cmp(&logit[a as usize]).then(a.cmp(&b)));
            idx[..s.top_n].sort_unstable_by(|&a, &b| logit[b as usize].total_cmp(&logit[a as usize]).then(a.cmp(&b)));
            let mut zk = 0.0;
            for r in 0..s.top_n {
                let e = idx[r];
                cand_id[l * s.top_n + r] = e;
                cand_p[l * s.top_n + r] = (logit[e as usize] / z) as f32;
                if r < s.k {
                    zk += logit[e as usize];
                }
            }
            for j in 0..s.k {
                let e = idx[j];
                sel_id[l * s.k + j] = e;
                sel_w[l * s.k + j] = (logit[e as usize] / zk) as f32;
            }
        }
        layout.encode(
            &RowData {
                chunk: (t / 512) as u32,
                pos: (t % 512) as u32,
                token: (t % 1000) as i32,
                phase: 0,
                sel_weight: &sel_w,
                cand_prob: &cand_p,
                sel_id: &sel_id,
                cand_id: &cand_id,
            },
            &mut buf,
        );
        pending += 1;
        if pending == 1024 {
            file.append(&buf, pending)?;
            buf.clear();
            pending = 0;
        }
    }
    if pending > 0 {
        file.append(&buf, pending)?;
    }
    file.publish()
}
