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
}

/// Belady's next-use array for rows `rows` (one backward pass): entry `((t·L + li)·k + j)` is
/// the relative token index of the next use of pick j of (t, li) in layer li, `u32::MAX` when
/// never. Slots a token does not fill stay unused.
pub fn next_uses(trace: &TraceReader, rows: std::ops::Range<u64>, shape: Shape, keep: Option<&[bool]>) -> Result<Vec<u32>> {
    let (nl, ne, k) = (shape.n_layers, shape.n_expert, shape.k);
    let n = (rows.end - rows.start) as usize;
    let mut next = vec![u32::MAX; n * nl * k];
    let mut seen = vec![u32::MAX; nl * ne];
    let mut router = Router::new(shape, keep, false);
    for ti in (0..n).rev() {
        if ti % PROGRESS_ROWS == 0 {
            crate::progress::add(PROGRESS_ROWS.min(n - ti) as u64);
        }
        let row = trace.row(rows.start + ti as u64);
        for li in 0..nl {
            let r = router.route(&row, li);
            check_ids(r.picks, ne, rows.start + ti as u64, li)?;
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
#[inline]
fn check_ids(ids: &[u16], ne: usize, row: u64, li: usize) -> Result<()> {
    if ids.iter().any(|&e| e as usize >= ne) {
        bail!(
            "row {row}, MoE layer slot {li}: expert id {:?} is not below n_expert {ne} (damaged trace)",
            ids.iter().find(|&&e| e as usize >= ne)
        );
    }
    Ok(())
}

/// Runs every family over rows `rows` in one forward pass.
pub fn run(
    trace: &TraceReader,
    rows: std::ops::Range<u64>,
    shape: Shape,
    keep: Option<&[bool]>,
    families: &mut [Box<dyn Family + '_>],
) -> Result<Forced> {
    let (nl, ne) = (shape.n_layers, shape.n_expert);
    let depth = families.iter().map(|f| f.candidate_depth()).max().unwrap_or(0);
    let want_ranks = depth > 0;
    let mut router = Router::new(shape, keep, want_ranks);
    let mut cur = vec![0u32; nl * ne];
    let mut forced = Forced { forced: vec![0; nl], tokens_short: vec![0; nl] };
    // candidates read per (token, layer): what the policies ask for, and the keep map's
    // re-routing (usually within the first 2k)
    let depth = depth.max(if keep.is_some() { 2 * shape.k } else { 0 }).min(trace.header.top_n as usize);
    let reads_candidates = depth > 0;
    let end = rows.end;
    for (ti, t) in rows.enumerate() {
        if ti % PROGRESS_ROWS == 0 {
            crate::progress::add(PROGRESS_ROWS.min((end - t) as usize) as u64);
        }
        let row = trace.row(t);
        if reads_candidates && t + 1 < end {
            // each layer's candidates sit a page or more apart in every row, beyond what the
            // hardware prefetchers follow: ask for the next row's while this one runs
            let next = trace.row(t + 1);
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
    Ok(forced)
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
    rows: std::ops::Range<u64>,
    shape: Shape,
    keep: Option<&[bool]>,
    caps: &[Vec<usize>],
) -> Result<belady::Belady> {
    Ok(belady::Belady::new(shape, caps, next_uses(trace, rows, shape, keep)?))
}
