//! The replay loop: route each (token, layer) once, then hand it to every policy family, each
//! of which runs one cache per capacity. One forward pass over the mapped trace; Belady adds a
//! backward pass before it (its next-use array is the only memory that grows with the trace).

use super::belady;
use crate::formats::trace::{Row, TraceReader};
use anyhow::{bail, Result};

/// An expert id that is not there (no rank, no link, not resident).
pub const NONE: u16 = u16::MAX;

/// Rows between two progress counts (each pass adds its rows as it goes).
const PROGRESS_ROWS: usize = 4096;

/// The rows a replay visits, in order: a range of the trace, or (`--phase`) the rows of one
/// phase within it. Token time t counts the visited rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rows {
    Range(std::ops::Range<u64>),
    List(Vec<u64>),
}

impl Rows {
    pub fn len(&self) -> usize {
        match self {
            Rows::Range(r) => (r.end - r.start) as usize,
            Rows::List(l) => l.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    #[inline]
    pub fn get(&self, i: usize) -> u64 {
        match self {
            Rows::Range(r) => r.start + i as u64,
            Rows::List(l) => l[i],
        }
    }
}

impl From<std::ops::Range<u64>> for Rows {
    fn from(r: std::ops::Range<u64>) -> Self {
        Rows::Range(r)
    }
}

/// One simulator's hits and misses split by the phase of the row (`[prefill, decode]`, per
/// layer); the two add up to its totals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PhaseSplit {
    pub hits: [Vec<u64>; 2],
    pub misses: [Vec<u64>; 2],
}

/// One (token, layer) as the policies see it. Slices are the layer's own (length n_expert for
/// per-expert arrays).
pub struct Step<'a> {
    pub li: usize,
    /// token index counted from the first replayed row
    pub t: u32,
    /// `t + 1`: `cur[e] == stamp` marks this token's picks
    pub stamp: u32,
    /// experts this token fetches, in order (the model's top-k, or the re-routed picks)
    pub picks: &'a [u16],
    /// each pick's rank among the router candidates, `NONE` when not among them (filled only
    /// when some policy reads router probabilities)
    pub pick_ranks: &'a [u16],
    pub cand_ids: &'a [u16],
    pub cand_probs: &'a [f32],
    pub cur: &'a [u32],
    /// the keep map's survivors of this layer, when one is given
    pub keep: Option<&'a [bool]>,
}

/// The shape every simulator shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub n_layers: usize,
    pub n_expert: usize,
    pub k: usize,
}

/// Per-capacity counts of one policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimCounts {
    pub policy: &'static str,
    /// index into the run's capacity list
    pub capacity: usize,
    pub hits: Vec<u64>,
    pub misses: Vec<u64>,
}

/// A policy family: one score/recency state shared by its caches, one cache per capacity.
pub trait Family {
    /// Called once per token, before its layers.
    fn begin_token(&mut self, _t: u32) {}
    fn step(&mut self, s: &Step);
    fn counts(&self) -> Vec<SimCounts>;
    /// How many router candidates per (token, layer) the family reads (0: none; then the
    /// picks' ranks are not looked up either).
    fn candidate_depth(&self) -> usize {
        0
    }
}

impl<F: Family + ?Sized> Family for &mut F {
    fn begin_token(&mut self, t: u32) {
        (**self).begin_token(t)
    }
    fn step(&mut self, s: &Step) {
        (**self).step(s)
    }
    fn counts(&self) -> Vec<SimCounts> {
        (**self).counts()
    }
    fn candidate_depth(&self) -> usize {
        (**self).candidate_depth()
    }
}

/// Routing of one (token, layer): the model's own picks, or with a keep map the first k
/// surviving candidates in router order.
pub struct Router<'a> {
    pub shape: Shape,
    /// `n_layers × n_expert` survivor flags
    pub keep: Option<&'a [bool]>,
    pub want_ranks: bool,
    ids: Vec<u16>,
    ranks: Vec<u16>,
}

/// What `Router::route` hands back.
pub struct Routed<'r> {
    pub picks: &'r [u16],
    pub ranks: &'r [u16],
    /// slots the token could not fill from its candidates (forced misses)
    pub forced: usize,
}

impl<'a> Router<'a> {
    pub fn new(shape: Shape, keep: Option<&'a [bool]>, want_ranks: bool) -> Self {
        Router { shape, keep, want_ranks, ids: vec![0; shape.k], ranks: vec![NONE; shape.k] }
    }

    pub fn keep_layer(&self, li: usize) -> Option<&'a [bool]> {
        let ne = self.shape.n_expert;
        self.keep.map(|k| &k[li * ne..(li + 1) * ne])
    }

    #[inline]
    pub fn route<'r>(&'r mut self, row: &Row<'r>, li: usize) -> Routed<'r> {
        let k = self.shape.k;
        match self.keep_layer(li) {
            None => {
                let sel = row.sel_ids(li);
                if self.want_ranks {
                    let cand = row.cand_ids(li);
                    for (j, &e) in sel.iter().enumerate() {
                        // without a selection bias the j-th pick is the j-th candidate
                        self.ranks[j] =
                            if cand.get(j) == Some(&e) { j as u16 } else { cand.iter().position(|&c| c == e).map_or(NONE, |r| r as u16) };
                    }
                }
                Routed { picks: sel, ranks: &self.ranks[..sel.len()], forced: 0 }
            }
            Some(keep) => {
                let mut n = 0;
                for (r, &e) in row.cand_ids(li).iter().enumerate() {
                    if keep.get(e as usize).copied().unwrap_or(false) {
                        self.ids[n] = e;
                        self.ranks[n] = r as u16;
                        n += 1;
                        if n == k {
                            break;
                        }
                    }
                }
                Routed { picks: &self.ids[..n], ranks: &self.ranks[..n], forced: k - n }
            }
        }
    }
}

/// Engine-level counts, the same for every policy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forced {
    /// per layer: slots no candidate could fill
    pub forced: Vec<u64>,
    /// per layer: tokens with fewer than k survivors among the candidates
    pub tokens_short: Vec<u64>,
    /// per phase (`[prefill, decode]`): rows replayed, and forced misses per layer
    pub phase_rows: [u64; 2],
    pub phase_forced: [Vec<u64>; 2],
}

/// Belady's next-use array for rows `rows` (one backward pass): entry `((t·L + li)·k + j)` is
/// the relative token index of the next use of pick j of (t, li) in layer li, `u32::MAX` when
/// never. Slots a token does not fill stay unused.
pub fn next_uses(trace: &TraceReader, rows: &Rows, shape: Shape, keep: Option<&[bool]>) -> Result<Vec<u32>> {
    let (nl, ne, k) = (shape.n_layers, shape.n_expert, shape.k);
    let n = rows.len();
    let mut next = vec![u32::MAX; n * nl * k];
    let mut seen = vec![u32::MAX; nl * ne];
    let mut router = Router::new(shape, keep, false);
    for ti in (0..n).rev() {
        if ti % PROGRESS_ROWS == 0 {
            crate::progress::add(PROGRESS_ROWS.min(n - ti) as u64);
        }
        let row = trace.row(rows.get(ti));
        for li in 0..nl {
            let r = router.route(&row, li);
            check_ids(r.picks, ne, rows.get(ti), li)?;
            let base = (ti * nl + li) * k;
            let seen = &mut seen[li * ne..(li + 1) * ne];
            for (j, &e) in r.picks.iter().enumerate() {
                next[base + j] = seen[e as usize];
            }
            for &e in r.picks {
                seen[e as usize] = ti as u32;
            }
        }
    }
    Ok(next)
}

/// A trace naming an expert id ≥ n_expert is damaged: say where instead of indexing past.
/// (`select --trace` refuses such a trace with the same words.)
#[inline]
pub fn check_ids(ids: &[u16], ne: usize, row: u64, li: usize) -> Result<()> {
    if let Some(e) = ids.iter().find(|&&e| e as usize >= ne) {
        bail!("row {row}, MoE layer slot {li}: expert id {e} is not below n_expert {ne} (damaged trace)");
    }
    Ok(())
}

/// Runs every family over rows `rows` in one forward pass. Returns the engine's counts and,
/// per simulator (in the order of the families' `counts()`), hits and misses split by phase.
pub fn run(
    trace: &TraceReader,
    rows: impl Into<Rows>,
    shape: Shape,
    keep: Option<&[bool]>,
    families: &mut [Box<dyn Family + '_>],
) -> Result<(Forced, Vec<PhaseSplit>)> {
    let rows: Rows = rows.into();
    let (nl, ne) = (shape.n_layers, shape.n_expert);
    let depth = families.iter().map(|f| f.candidate_depth()).max().unwrap_or(0);
    let want_ranks = depth > 0;
    let mut router = Router::new(shape, keep, want_ranks);
    let mut cur = vec![0u32; nl * ne];
    let mut forced = Forced {
        forced: vec![0; nl],
        tokens_short: vec![0; nl],
        phase_rows: [0; 2],
        phase_forced: [vec![0; nl], vec![0; nl]],
    };
    // counts are attributed to a phase by snapshots at each change of phase (twice per
    // sequence of a decode trace, never in a calibration trace)
    let mut splits: Vec<PhaseSplit> = Vec::new();
    let mut last: Vec<SimCounts> = Vec::new();
    let mut last_forced = vec![0u64; nl];
    let mut phase = None;
    let mut close_phase = |ph: usize, families: &mut [Box<dyn Family + '_>], forced: &mut Forced| {
        let now: Vec<SimCounts> = families.iter().flat_map(|f| f.counts()).collect();
        if splits.is_empty() {
            splits = now.iter().map(|c| PhaseSplit { hits: [vec![0; c.hits.len()], vec![0; c.hits.len()]], misses: [vec![0; c.hits.len()], vec![0; c.hits.len()]] }).collect();
        }
        for (i, c) in now.iter().enumerate() {
            for li in 0..c.hits.len() {
                let (h0, m0) = last.get(i).map_or((0, 0), |p| (p.hits[li], p.misses[li]));
                splits[i].hits[ph][li] += c.hits[li] - h0;
                splits[i].misses[ph][li] += c.misses[li] - m0;
            }
        }
        for li in 0..nl {
            forced.phase_forced[ph][li] += forced.forced[li] - last_forced[li];
            last_forced[li] = forced.forced[li];
        }
        last = now;
    };
    // candidates read per (token, layer): what the policies ask for, and the keep map's
    // re-routing (usually within the first 2k)
    let depth = depth.max(if keep.is_some() { 2 * shape.k } else { 0 }).min(trace.header.top_n as usize);
    let reads_candidates = depth > 0;
    let n = rows.len();
    for ti in 0..n {
        if ti % PROGRESS_ROWS == 0 {
            crate::progress::add(PROGRESS_ROWS.min(n - ti) as u64);
        }
        let t = rows.get(ti);
        let row = trace.row(t);
        let ph = (row.phase() == crate::formats::trace::PHASE_DECODE) as usize;
        if phase != Some(ph) {
            if let Some(p) = phase {
                close_phase(p, families, &mut forced);
            }
            phase = Some(ph);
        }
        forced.phase_rows[ph] += 1;
        if reads_candidates && ti + 1 < n {
            // each layer's candidates sit a page or more apart in every row, beyond what the
            // hardware prefetchers follow: ask for the next row's while this one runs
            let next = trace.row(rows.get(ti + 1));
            for li in 0..nl {
                let (ids, probs) = (next.cand_ids(li), next.cand_probs(li));
                for i in (0..depth).step_by(32) {
                    prefetch(ids[i..].as_ptr().cast());
                }
                for i in (0..depth).step_by(16) {
                    prefetch(probs[i..].as_ptr().cast());
                }
            }
        }
        let ti = ti as u32;
        for f in families.iter_mut() {
            f.begin_token(ti);
        }
        for li in 0..nl {
            let keep_l = router.keep_layer(li);
            let r = router.route(&row, li);
            check_ids(r.picks, ne, t, li)?;
            if depth > 0 {
                check_ids(&row.cand_ids(li)[..depth], ne, t, li)?;
            }
            if r.forced > 0 {
                forced.forced[li] += r.forced as u64;
                forced.tokens_short[li] += 1;
            }
            let cur_l = &mut cur[li * ne..(li + 1) * ne];
            for &e in r.picks {
                cur_l[e as usize] = ti + 1;
            }
            let step = Step {
                li,
                t: ti,
                stamp: ti + 1,
                picks: r.picks,
                pick_ranks: r.ranks,
                cand_ids: row.cand_ids(li),
                cand_probs: row.cand_probs(li),
                cur: cur_l,
                keep: keep_l,
            };
            for f in families.iter_mut() {
                f.step(&step);
            }
        }
    }
    close_phase(phase.unwrap_or(0), families, &mut forced);
    Ok((forced, splits))
}

#[inline(always)]
fn prefetch(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p, std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Builds the Belady family (runs its backward pass).
pub fn belady_family(
    trace: &TraceReader,
    rows: &Rows,
    shape: Shape,
    keep: Option<&[bool]>,
    caps: &[Vec<usize>],
) -> Result<belady::Belady> {
    Ok(belady::Belady::new(shape, caps, next_uses(trace, rows, shape, keep)?))
}
