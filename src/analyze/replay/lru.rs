//! LRU: evict the resident expert used longest ago. Each cache is an intrusive doubly linked
//! list over expert ids per layer (most recent at the head), so a hit and a miss are O(1)
//! apart from skipping the current token's own picks at the tail.

use super::engine::{Family, Shape, SimCounts, Step, NONE};

struct List {
    ne: usize,
    cap: Vec<usize>,
    len: Vec<usize>,
    head: Vec<u16>,
    tail: Vec<u16>,
    prev: Vec<u16>,
    next: Vec<u16>,
    resident: Vec<bool>,
    hits: Vec<u64>,
    misses: Vec<u64>,
}

impl List {
    fn new(shape: Shape, cap: &[usize]) -> Self {
        assert!(cap.iter().all(|&c| c >= shape.k && c <= shape.n_expert), "capacities {cap:?} must lie in [k, n_expert]");
        let n = shape.n_layers * shape.n_expert;
        List {
            ne: shape.n_expert,
            cap: cap.to_vec(),
            len: vec![0; shape.n_layers],
            head: vec![NONE; shape.n_layers],
            tail: vec![NONE; shape.n_layers],
            prev: vec![NONE; n],
            next: vec![NONE; n],
            resident: vec![false; n],
            hits: vec![0; shape.n_layers],
            misses: vec![0; shape.n_layers],
        }
    }

    #[inline]
    fn step(&mut self, s: &Step) {
        let li = s.li;
        let base = li * self.ne;
        let prev = &mut self.prev[base..base + self.ne];
        let next = &mut self.next[base..base + self.ne];
        let resident = &mut self.resident[base..base + self.ne];
        let head = &mut self.head[li];
        let tail = &mut self.tail[li];
        for &e in s.picks {
            if resident[e as usize] {
                self.hits[li] += 1;
                if *head == e {
                    continue;
                }
                unlink(prev, next, head, tail, e);
            } else {
                self.misses[li] += 1;
                if self.len[li] < self.cap[li] {
                    self.len[li] += 1;
                } else {
                    // the least recent expert that this token does not use
                    let mut v = *tail;
                    while s.cur[v as usize] == s.stamp {
                        v = prev[v as usize];
                    }
                    unlink(prev, next, head, tail, v);
                    resident[v as usize] = false;
                }
                resident[e as usize] = true;
            }
            // push front
            prev[e as usize] = NONE;
            next[e as usize] = *head;
            if *head != NONE {
                prev[*head as usize] = e;
            } else {
                *tail = e;
            }
            *head = e;
        }
    }
}

#[inline]
fn unlink(prev: &mut [u16], next: &mut [u16], head: &mut u16, tail: &mut u16, e: u16) {
    let (p, n) = (prev[e as usize], next[e as usize]);
    if p != NONE {
        next[p as usize] = n;
    } else {
        *head = n;
    }
    if n != NONE {
        prev[n as usize] = p;
    } else {
        *tail = p;
    }
}

pub struct Lru {
    lists: Vec<List>,
}

impl Lru {
    /// `caps[c][li]`: capacity c's size in layer li.
    pub fn new(shape: Shape, caps: &[Vec<usize>]) -> Self {
        Lru { lists: caps.iter().map(|c| List::new(shape, c)).collect() }
    }
}

impl Family for Lru {
    fn step(&mut self, s: &Step) {
        for l in &mut self.lists {
            l.step(s);
        }
    }
    fn counts(&self) -> Vec<SimCounts> {
        self.lists
            .iter()
            .enumerate()
            .map(|(c, l)| SimCounts { policy: "lru", capacity: c, hits: l.hits.clone(), misses: l.misses.clone() })
            .collect()
    }
}
