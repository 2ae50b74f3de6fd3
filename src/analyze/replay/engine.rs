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

/// What a keep map re-routes by: its survivor flags (`n_layers × n_expert`) and, for a router
/// whose choice adds a selection bias to its probabilities (`exp_probs_b`, GLM-4.5 and
/// DeepSeek-V3), that bias (same layout).
#[derive(Clone, Copy, Debug)]
pub struct Keep<'a> {
    pub flags: &'a [bool],
    pub bias: Option<&'a [f32]>,
    /// the router's probabilities are a softmax over the experts, so the pruned model's are
    /// renormalised over the kept ones (with a bias that changes the choice)
    pub renormalise: bool,
    /// group-limited routing (DeepSeek-V3): `(groups, groups used)`; the experts of group g
    /// are ids `g·n/groups .. (g+1)·n/groups`. Needs a trace listing every expert.
    pub groups: Option<(usize, usize)>,
    /// per layer: routed by a fixed table, not by scores (DeepSeek-V4's hash-routed blocks,
    /// `ffn_gate_tid2eid`): the pruned model's picks there are the trace's own (renumbered), so
    /// those layers are not re-routed. The caller checks that the map keeps every such pick,
    /// unless `remap` is given.
    pub fixed: Option<&'a [bool]>,
    /// per layer: the kept experts in stand-in order (the keep map's `stand_in`; `--hash-remap`):
    /// in a `fixed` layer a pick the map drops goes where `prune --hash-remap` sends it
    pub remap: Option<&'a [Vec<u16>]>,
}

impl<'a> From<&'a [bool]> for Keep<'a> {
    fn from(flags: &'a [bool]) -> Self {
        Keep { flags, bias: None, renormalise: false, groups: None, fixed: None, remap: None }
    }
}

/// Routing of one (token, layer): the model's own picks, or with a keep map the first k
/// surviving candidates in router order (with a selection bias: the k best surviving
/// candidates by probability + bias, as many of them as are sure to beat every expert the
/// trace does not list).
pub struct Router<'a> {
    pub shape: Shape,
    pub keep: Option<Keep<'a>>,
    pub want_ranks: bool,
    ids: Vec<u16>,
    ranks: Vec<u16>,
    /// with a bias: the chosen survivors' scores, best first
    scores: Vec<f32>,
    /// with a bias, per layer: the largest bias of a kept expert, and the kept experts by
    /// bias, largest first (for the bound on an expert the trace does not list)
    max_bias: Vec<f32>,
    by_bias: Vec<Vec<u16>>,
    /// `listed[e] == stamp`: e is among this (token, layer)'s candidates
    listed: Vec<u32>,
    stamp: u32,
    /// the bounds of the unlisted kept experts of this (token, layer), largest first
    bounds: Vec<f32>,
    renormalise: bool,
    /// group-limited routing: per expert (score, candidate rank; NONE where not kept), per
    /// group (score, group), and the chosen groups' kept experts (score, id, rank)
    full: Vec<(f32, u16)>,
    group_scores: Vec<(f32, usize)>,
    pool: Vec<(f32, u16, u16)>,
}

/// What `Router::route` hands back.
pub struct Routed<'r> {
    pub picks: &'r [u16],
    pub ranks: &'r [u16],
    /// slots the token could not fill from its candidates (forced misses)
    pub forced: usize,
}

impl<'a> Router<'a> {
    pub fn new(shape: Shape, keep: Option<Keep<'a>>, want_ranks: bool) -> Self {
        let (ne, nl) = (shape.n_expert, shape.n_layers);
        let (mut max_bias, mut by_bias) = (Vec::new(), Vec::new());
        if let Some(Keep { flags, bias: Some(b), .. }) = keep {
            for li in 0..nl {
                let (f, b) = (&flags[li * ne..(li + 1) * ne], &b[li * ne..(li + 1) * ne]);
                let mut kept: Vec<u16> = (0..ne as u16).filter(|&e| f[e as usize]).collect();
                kept.sort_by(|&x, &y| b[y as usize].total_cmp(&b[x as usize]));
                max_bias.push(kept.first().map_or(f32::NEG_INFINITY, |&e| b[e as usize]));
                by_bias.push(kept);
            }
        }
        let listed = if max_bias.is_empty() { Vec::new() } else { vec![0; ne] };
        let (ids, ranks, scores) = (vec![0; shape.k + 1], vec![NONE; shape.k + 1], vec![0.0; shape.k + 1]);
        let renormalise = keep.is_some_and(|k| k.renormalise);
        Router {
            shape,
            keep,
            want_ranks,
            ids,
            ranks,
            scores,
            max_bias,
            by_bias,
            listed,
            stamp: 0,
            bounds: Vec::new(),
            renormalise,
            full: Vec::new(),
            group_scores: Vec::new(),
            pool: Vec::new(),
        }
    }

    pub fn keep_layer(&self, li: usize) -> Option<&'a [bool]> {
        let ne = self.shape.n_expert;
        self.keep.map(|k| &k.flags[li * ne..(li + 1) * ne])
    }

    #[inline]
    pub fn route<'r>(&'r mut self, row: &Row<'r>, li: usize) -> Routed<'r> {
        let k = self.shape.k;
        let ne = self.shape.n_expert;
        // a table-routed layer keeps the trace's picks (all kept: checked by the caller)
        let fixed = self.keep.and_then(|kp| kp.fixed).is_some_and(|f| f.get(li) == Some(&true));
        match self.keep_layer(li).filter(|_| !fixed) {
            None if fixed && self.keep.is_some_and(|kp| kp.remap.is_some()) => {
                let (kp, sel) = (self.keep.unwrap(), row.sel_ids(li));
                let flags = &kp.flags[li * ne..(li + 1) * ne];
                let ids = &mut self.ids[..sel.len()];
                ids.copy_from_slice(sel);
                crate::analyze::prune::plan::hash_remap_row(ids, |e| flags[e as usize], &kp.remap.unwrap()[li]);
                if self.want_ranks {
                    let cand = row.cand_ids(li);
                    for (j, e) in ids.iter().enumerate() {
                        self.ranks[j] = cand.iter().position(|c| c == e).map_or(NONE, |r| r as u16);
                    }
                }
                Routed { picks: &self.ids[..sel.len()], ranks: &self.ranks[..sel.len()], forced: 0 }
            }
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
            Some(keep) => match self.keep.and_then(|kp| kp.bias) {
                _ if self.keep.is_some_and(|kp| kp.groups.is_some()) => {
                    let b = self.keep.and_then(|kp| kp.bias).map(|b| &b[li * ne..(li + 1) * ne]);
                    let n = self.route_grouped(row, li, keep, b);
                    Routed { picks: &self.ids[..n], ranks: &self.ranks[..n], forced: k - n }
                }
                Some(b) => {
                    let n = self.route_biased(row, li, keep, &b[li * ne..(li + 1) * ne]);
                    Routed { picks: &self.ids[..n], ranks: &self.ranks[..n], forced: k - n }
                }
                None => {
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
            },
        }
    }

    /// The pruned model's choice under group-limited routing, as llama.cpp's build_moe_ffn
    /// makes it, from a trace that lists every expert: each kept expert scores p' + b (b = 0
    /// without a bias; p' as in [Router::route_biased]); a group scores the sum of its best two
    /// kept experts; the `used` best groups stay, and the picks are the top k kept experts of
    /// those. An exact tie between the last group in and the first out names no pick; an
    /// expert is named only when fewer than k others in the chosen groups score as much.
    /// Returns how many are named (the best first).
    fn route_grouped(&mut self, row: &Row, li: usize, keep: &[bool], b: Option<&[f32]>) -> usize {
        let (k, ne) = (self.shape.k, self.shape.n_expert);
        let Some(Keep { groups: Some((g, used)), .. }) = self.keep else { return 0 };
        let (cand, cp) = (row.cand_ids(li), row.cand_probs(li));
        if cand.len() < ne || g == 0 || ne % g != 0 || used == 0 || used > g {
            return 0; // replay refuses such a trace or model before it gets here
        }
        let per = ne / g;
        // a softmax pruned: p' = p / S over the kept experts (the same for every expert of the
        // token, so it matters only with a bias)
        let scale = if self.renormalise {
            match kept_share(cand, cp, keep) {
                Some(s) => s,
                None => return 0,
            }
        } else {
            1.0
        };
        self.full.clear();
        self.full.resize(ne, (f32::NEG_INFINITY, NONE));
        for (r, (&e, &p)) in cand.iter().zip(cp).enumerate() {
            if !keep.get(e as usize).copied().unwrap_or(false) {
                continue;
            }
            let p = if self.renormalise { p / scale } else { p };
            let s = p + b.map_or(0.0, |b| b[e as usize]);
            if s.is_nan() {
                return 0;
            }
            self.full[e as usize] = (s, r as u16);
        }
        // each group's score: its best two kept experts' sum (f32, as ggml_sum_rows adds them)
        self.group_scores.clear();
        for gi in 0..g {
            let (mut a, mut c) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &(s, r) in &self.full[gi * per..(gi + 1) * per] {
                if r == NONE {
                    continue;
                }
                if s > a {
                    c = a;
                    a = s;
                } else if s > c {
                    c = s;
                }
            }
            self.group_scores.push((a + c, gi));
        }
        self.group_scores.sort_by(|x, y| y.0.total_cmp(&x.0));
        if used < g && self.group_scores[used - 1].0.partial_cmp(&self.group_scores[used].0) != Some(std::cmp::Ordering::Greater) {
            return 0; // which group is in is a tie (or no group has two kept experts)
        }
        // the kept experts of the chosen groups, best first
        self.pool.clear();
        for &(_, gi) in &self.group_scores[..used] {
            for (j, &(s, r)) in self.full[gi * per..(gi + 1) * per].iter().enumerate() {
                if r != NONE {
                    self.pool.push((s, (gi * per + j) as u16, r));
                }
            }
        }
        self.pool.sort_by(|x, y| y.0.total_cmp(&x.0));
        let picks = self.pool.len().min(k);
        let mut named = 0;
        for j in 0..picks {
            let s = self.pool[j].0;
            // others in the chosen groups scoring as much: those before j, and ties after it
            let others = j + self.pool[j + 1..].iter().take_while(|x| x.0 >= s).count();
            if others >= k {
                break;
            }
            self.ids[j] = self.pool[j].1;
            self.ranks[j] = self.pool[j].2;
            named += 1;
        }
        named
    }

    /// The pruned model's choice under a selection bias, as llama.cpp makes it: the top k of
    /// p' + b over the kept experts, p' the pruned router's probability (p itself for an
    /// elementwise gate such as sigmoid; for a softmax p / Σ over the kept experts of p, which
    /// needs every expert listed) and the f32 addition the graph's.
    ///
    /// The trace lists the top-N candidates by p; an expert it does not list has p at most the
    /// last candidate's, so it scores at most that plus its bias. A surviving candidate is named
    /// a pick only when it is one whatever those unknown scores are and however exact ties
    /// fall: when fewer than k kept experts (listed ones by score, unlisted ones by their bound)
    /// can score at least as much. Returns how many are named (the best first); the other
    /// slots are unknown and count as forced misses. A NaN score names none.
    fn route_biased(&mut self, row: &Row, li: usize, keep: &[bool], b: &[f32]) -> usize {
        let k = self.shape.k;
        let (cand, cp) = (row.cand_ids(li), row.cand_probs(li));
        let all_listed = cand.len() >= self.shape.n_expert;
        // a softmax router pruned: p' = p / S, S the kept experts' share of the probability
        if self.renormalise && !all_listed {
            return 0; // S is not known (replay refuses such a trace before it gets here)
        }
        let scale = if self.renormalise {
            match kept_share(cand, cp, keep) {
                Some(s) => Some(s),
                None => return 0,
            }
        } else {
            None
        };
        let max_b = self.max_bias[li];
        // the best k + 1 surviving candidates by score (the one after the picks settles ties)
        let mut n = 0;
        for (r, (&e, &p)) in cand.iter().zip(cp).enumerate() {
            let p = scale.map_or(p, |s| p / s);
            // candidates come best p first: none after this one can beat the (k+1)-th
            if n == k + 1 && p + max_b < self.scores[k] {
                break;
            }
            if !keep.get(e as usize).copied().unwrap_or(false) {
                continue;
            }
            let s = p + b[e as usize];
            if s.is_nan() {
                return 0;
            }
            if n == k + 1 && s <= self.scores[k] {
                continue;
            }
            let mut j = if n <= k {
                n += 1;
                n - 1
            } else {
                k
            };
            while j > 0 && s > self.scores[j - 1] {
                self.scores[j] = self.scores[j - 1];
                self.ids[j] = self.ids[j - 1];
                self.ranks[j] = self.ranks[j - 1];
                j -= 1;
            }
            self.scores[j] = s;
            self.ids[j] = e;
            self.ranks[j] = r as u16;
        }
        let picks = n.min(k);
        if picks == 0 {
            return 0;
        }
        let runner_up = if n > k { self.scores[k] } else { f32::NEG_INFINITY };
        // the unlisted kept experts' bounds, largest first (only the first k can matter)
        self.bounds.clear();
        if !all_listed {
            let p_last = cp[cand.len() - 1];
            if p_last + max_b >= self.scores[picks - 1] {
                self.stamp = self.stamp.wrapping_add(1);
                if self.stamp == 0 {
                    self.listed.fill(0);
                    self.stamp = 1;
                }
                for &e in cand {
                    if let Some(m) = self.listed.get_mut(e as usize) {
                        *m = self.stamp;
                    }
                }
                let (listed, stamp) = (&self.listed, self.stamp);
                self.bounds.extend(self.by_bias[li].iter().filter(|&&e| listed[e as usize] != stamp).take(k).map(|&e| p_last + b[e as usize]));
            }
        }
        // pick j is certain when fewer than k other kept experts can score as much
        let s_last = self.scores[picks - 1];
        if runner_up < s_last && self.bounds.first().is_none_or(|&u| u < s_last) {
            return picks;
        }
        (0..picks)
            .take_while(|&j| {
                let s = self.scores[j];
                let listed = (0..picks).filter(|&i| i != j && self.scores[i] >= s).count() + (runner_up >= s) as usize;
                let unlisted = self.bounds.iter().take_while(|&&u| u >= s).count();
                listed + unlisted < k
            })
            .count()
    }
}

/// Σ p over the kept candidates: a pruned softmax's denominator S (p' = p / S) when every
/// expert is listed; None where it is not a positive number.
fn kept_share(cand: &[u16], cp: &[f32], keep: &[bool]) -> Option<f32> {
    let s: f32 = cand.iter().zip(cp).filter(|(&e, _)| keep.get(e as usize).copied().unwrap_or(false)).map(|(_, &p)| p).sum();
    (s > 0.0).then_some(s)
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
pub fn next_uses(trace: &TraceReader, rows: &Rows, shape: Shape, keep: Option<Keep>) -> Result<Vec<u32>> {
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
    keep: Option<Keep>,
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
    // (with a selection bias, possibly all of them)
    let reroute_depth = match keep {
        Some(Keep { bias: Some(_), .. } | Keep { groups: Some(_), .. }) => trace.header.top_n as usize,
        Some(_) => 2 * shape.k,
        None => 0,
    };
    let depth = depth.max(reroute_depth).min(trace.header.top_n as usize);
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
    keep: Option<Keep>,
    caps: &[Vec<usize>],
) -> Result<belady::Belady> {
    Ok(belady::Belady::new(shape, caps, next_uses(trace, rows, shape, keep)?))
}
