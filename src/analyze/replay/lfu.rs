//! LFU: evict the resident expert with the fewest uses so far (counted over the whole replay,
//! resident or not: "perfect" LFU), ties to the one used longest ago.

use super::engine::{Family, Shape, SimCounts, Step};
use super::resident::{self, Resident};

pub struct Lfu {
    ne: usize,
    k: usize,
    freq: Vec<u64>,
    /// last use, as `t·k + slot + 1` (0: never)
    last: Vec<u64>,
    caches: Vec<Resident>,
}

impl Lfu {
    pub fn new(shape: Shape, caps: &[Vec<usize>]) -> Self {
        let n = shape.n_layers * shape.n_expert;
        Lfu {
            ne: shape.n_expert,
            k: shape.k,
            freq: vec![0; n],
            last: vec![0; n],
            caches: caps.iter().map(|c| Resident::new(shape, c)).collect(),
        }
    }
}

impl Family for Lfu {
    fn step(&mut self, s: &Step) {
        let base = s.li * self.ne;
        let freq = &mut self.freq[base..base + self.ne];
        let last = &mut self.last[base..base + self.ne];
        let seq = s.t as u64 * self.k as u64 + 1;
        for (j, &e) in s.picks.iter().enumerate() {
            freq[e as usize] += 1;
            last[e as usize] = seq + j as u64;
        }
        let (freq, last) = (&*freq, &*last);
        for c in &mut self.caches {
            c.access(s.li, s.picks);
            c.settle(s.li, s.picks, |e| (freq[e], last[e]));
        }
    }
    fn counts(&self) -> Vec<SimCounts> {
        resident::counts("lfu", &self.caches)
    }
}
