//! Belady's MIN: evict the resident expert whose next use is farthest in the future (never
//! used again counts as farthest; ties to the lowest id). Optimal offline for a cache that must
//! hold every fetched expert, so its miss count bounds every other policy's from below.
//!
//! Next uses come from one backward pass over the trace (`engine::next_uses`): 4 bytes per
//! (token, layer, slot), the only memory of the replay that grows with the trace.

use super::engine::{Family, Shape, SimCounts, Step};
use super::resident::{self, Resident};

pub struct Belady {
    ne: usize,
    k: usize,
    n_layers: usize,
    next_use: Vec<u32>,
    /// per expert: the next use after its latest use
    nxt: Vec<u32>,
    caches: Vec<Resident>,
}

impl Belady {
    pub fn new(shape: Shape, caps: &[Vec<usize>], next_use: Vec<u32>) -> Self {
        Belady {
            ne: shape.n_expert,
            k: shape.k,
            n_layers: shape.n_layers,
            next_use,
            nxt: vec![u32::MAX; shape.n_layers * shape.n_expert],
            caches: caps.iter().map(|c| Resident::new(shape, c)).collect(),
        }
    }
}

impl Family for Belady {
    fn step(&mut self, s: &Step) {
        let base = s.li * self.ne;
        let nxt = &mut self.nxt[base..base + self.ne];
        let at = (s.t as usize * self.n_layers + s.li) * self.k;
        for (j, &e) in s.picks.iter().enumerate() {
            nxt[e as usize] = self.next_use[at + j];
        }
        let nxt = &*nxt;
        for c in &mut self.caches {
            // smallest key = farthest next use, then lowest id
            c.access(s.li, s.picks);
            c.settle(s.li, s.picks, |e| ((u32::MAX - nxt[e]) as u64, e as u64));
        }
    }
    fn counts(&self) -> Vec<SimCounts> {
        resident::counts("belady", &self.caches)
    }
}
