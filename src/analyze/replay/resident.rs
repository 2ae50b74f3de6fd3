//! The resident set of one cache for the score-based policies (lfu, the emas, belady): per
//! layer a compact array of resident ids with, per slot, the eviction key `(key, tie)` copied
//! from the policy's per-expert state. A miss on a full layer scans these two contiguous
//! arrays for the smallest `(key, tie)`, with no gathers in the loop.
//!
//! The token's own picks are pinned for the token: their slots hold `(u64::MAX, u64::MAX)`,
//! which no real key reaches, from `pin` until `settle` writes their new keys back.

use super::engine::{Shape, SimCounts, NONE};

/// Above every real key (keys are f64 bits of non-negative scores, counts, or u32 distances,
/// all below i64::MAX), so the scan can compare keys as i64.
pub const PINNED: u64 = i64::MAX as u64;

pub struct Resident {
    ne: usize,
    cmax: usize,
    cap: Vec<usize>,
    len: Vec<usize>,
    res: Vec<u16>,
    key: Vec<u64>,
    tie: Vec<u64>,
    /// per expert: its slot, NONE when not resident
    slot: Vec<u16>,
    pub hits: Vec<u64>,
    pub misses: Vec<u64>,
}

/// The hit and miss counts of one policy's caches, one entry per capacity (by index).
pub fn counts(policy: &'static str, caches: &[Resident]) -> Vec<SimCounts> {
    caches
        .iter()
        .enumerate()
        .map(|(c, r)| SimCounts { policy, capacity: c, hits: r.hits.clone(), misses: r.misses.clone() })
        .collect()
}

impl Resident {
    /// `cap[li]`: the capacity of each layer (≤ n_expert, ≥ k).
    pub fn new(shape: Shape, cap: &[usize]) -> Self {
        assert!(cap.iter().all(|&c| c >= shape.k && c <= shape.n_expert), "capacities {cap:?} must lie in [k, n_expert]");
        let cmax = cap.iter().copied().max().unwrap_or(0);
        let n = shape.n_layers * cmax;
        Resident {
            ne: shape.n_expert,
            cmax,
            cap: cap.to_vec(),
            len: vec![0; shape.n_layers],
            res: vec![NONE; n],
            // one spare entry at the end: `update` writes there for experts not resident
            key: vec![PINNED; n + 1],
            tie: vec![PINNED; n + 1],
            slot: vec![NONE; shape.n_layers * shape.n_expert],
            hits: vec![0; shape.n_layers],
            misses: vec![0; shape.n_layers],
        }
    }

    /// Fetches a token's picks in layer `li`: pins the resident ones, then counts hits and
    /// misses in order, a miss on a full layer evicting the smallest `(key, tie)`. Call
    /// `settle` afterwards with the picks' new keys.
    #[inline]
    pub fn access(&mut self, li: usize, picks: &[u16]) {
        let slot = &mut self.slot[li * self.ne..(li + 1) * self.ne];
        let base = li * self.cmax;
        let res = &mut self.res[base..base + self.cmax];
        let key = &mut self.key[base..base + self.cmax];
        let tie = &mut self.tie[base..base + self.cmax];
        for &e in picks {
            let s = slot[e as usize];
            if s != NONE {
                key[s as usize] = PINNED;
                tie[s as usize] = PINNED;
            }
        }
        let cap = self.cap[li];
        let mut misses = 0;
        for &e in picks {
            if slot[e as usize] != NONE {
                continue;
            }
            misses += 1;
            let n = self.len[li];
            let at = if n < cap {
                self.len[li] = n + 1;
                n
            } else {
                let bi = argmin(&key[..n], &tie[..n]);
                slot[res[bi] as usize] = NONE;
                bi
            };
            res[at] = e;
            slot[e as usize] = at as u16;
            key[at] = PINNED;
            tie[at] = PINNED;
        }
        self.hits[li] += (picks.len() - misses) as u64;
        self.misses[li] += misses as u64;
    }

    /// Writes the picks' keys back after `access` (they are all resident then).
    #[inline]
    pub fn settle(&mut self, li: usize, picks: &[u16], f: impl Fn(usize) -> (u64, u64)) {
        let slot = &self.slot[li * self.ne..(li + 1) * self.ne];
        let base = li * self.cmax;
        for &e in picks {
            let s = base + slot[e as usize] as usize;
            (self.key[s], self.tie[s]) = f(e as usize);
        }
    }

    /// A resident expert's key changed outside its own token (a near-pick credit); a no-op for
    /// an expert that is not resident (branch-free: it writes the spare entry).
    #[inline]
    pub fn update(&mut self, li: usize, e: usize, k: (u64, u64)) {
        let s = self.slot[li * self.ne + e];
        let spare = self.key.len() - 1;
        let at = if s != NONE { li * self.cmax + s as usize } else { spare };
        self.key[at] = k.0;
        self.tie[at] = k.1;
    }

    /// Recomputes every resident key (after a rescale); `f(li, e)`.
    pub fn refresh(&mut self, f: impl Fn(usize, usize) -> (u64, u64)) {
        for li in 0..self.len.len() {
            let base = li * self.cmax;
            for s in base..base + self.len[li] {
                (self.key[s], self.tie[s]) = f(li, self.res[s] as usize);
            }
        }
    }
}

/// The slot with the smallest `(key, tie)`: the minimum key (vectorised), then the slots
/// holding it, the smallest tie among them (ties of keys are rare).
#[inline]
fn argmin(keys: &[u64], ties: &[u64]) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { argmin_avx2(keys, ties) };
        }
    }
    argmin_plain(keys, ties)
}

#[inline(always)]
fn min_key(keys: &[u64]) -> u64 {
    // keys ≤ i64::MAX: the signed minimum is the unsigned one, and it vectorises
    keys.iter().fold(i64::MAX, |a, &k| a.min(k as i64)) as u64
}

#[inline(always)]
fn argmin_plain(keys: &[u64], ties: &[u64]) -> usize {
    let m = min_key(keys);
    debug_assert!(m != PINNED, "every resident expert is pinned: capacity below k");
    let mut bi = keys.iter().position(|&k| k == m).unwrap();
    let mut bt = ties[bi];
    for i in bi + 1..keys.len() {
        if keys[i] == m && ties[i] < bt {
            bi = i;
            bt = ties[i];
        }
    }
    bi
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn argmin_avx2(keys: &[u64], ties: &[u64]) -> usize {
    use std::arch::x86_64::*;
    let m = min_key(keys);
    debug_assert!(m != PINNED, "every resident expert is pinned: capacity below k");
    let mv = _mm256_set1_epi64x(m as i64);
    let (mut bi, mut bt) = (usize::MAX, u64::MAX);
    // blocks of 64 slots: one bit mask of the slots holding the minimum, built branch-free
    for base in (0..keys.len()).step_by(64) {
        let block = &keys[base..keys.len().min(base + 64)];
        let full = block.len() / 4;
        let mut mask = 0u64;
        for c in 0..full {
            // SAFETY: 4·c + 3 < block.len(); unaligned load.
            let v = _mm256_loadu_si256(block.as_ptr().add(4 * c) as *const __m256i);
            mask |= (_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(v, mv))) as u64) << (4 * c);
        }
        for (i, &k) in block.iter().enumerate().skip(4 * full) {
            mask |= ((k == m) as u64) << i;
        }
        while mask != 0 {
            let i = base + mask.trailing_zeros() as usize;
            mask &= mask - 1;
            if bi == usize::MAX || ties[i] < bt {
                bi = i;
                bt = ties[i];
            }
        }
    }
    bi
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmin_breaks_key_ties_by_the_smaller_tie() {
        let keys = [5u64, 3, 9, 3, 3, PINNED];
        let ties = [0u64, 7, 0, 2, 4, 0];
        assert_eq!(argmin(&keys, &ties), 3);
        assert_eq!(argmin(&[PINNED, 1], &[0, 9]), 1);
        let many: Vec<u64> = (0..137).map(|i| 1000 - i * 3 % 17).collect();
        let want = (0..137).min_by_key(|&i| (many[i], i)).unwrap();
        assert_eq!(argmin(&many, &vec![0; 137]), want);
        assert_eq!(argmin_plain(&many, &vec![0; 137]), want);
        let ties: Vec<u64> = (0..137).map(|i| (i * 11 % 5) as u64).collect();
        let want = (0..137).min_by_key(|&i| (many[i], ties[i], i)).unwrap();
        assert_eq!(argmin(&many, &ties), want);
        assert_eq!(argmin_plain(&many, &ties), want);
    }
}
