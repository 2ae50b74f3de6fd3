//! `reap-imatrix check`: every invariant we know of a saliency JSON, and of its imatrix and
//! trace when given. Prints a report; exit 0 only when all hold (1 when one fails, 2 for a
//! file that cannot be read).

use crate::error::UsageError;
use crate::formats::imatrix as imatrix_file;
use crate::formats::saliency::{AppliedGate, LayerSums, ReferenceSums, Saliency};
use crate::formats::trace::{phase_name, TraceReader, FLAG_DECODE, FLAG_NORMALISED, PHASE_DECODE, PHASE_PREFILL};
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// saliency JSON (from --reap-out)
    #[arg(long = "reap", value_name = "FILE")]
    pub reap: Option<PathBuf>,
    /// the imatrix of the same run: its ffn_down_exps counts must equal the JSON's counts
    #[arg(long = "imatrix", value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// a routing trace: checked on its own, and against --reap (the same run's, or for a
    /// trace-decode trace any run of the same model)
    #[arg(long = "trace", value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// slot share of the heaviest experts: how many to list per layer
    #[arg(long = "top", value_name = "N", default_value_t = 3)]
    pub top: usize,
}

/// One verdict line.
#[derive(Debug, Clone)]
pub struct Finding {
    pub ok: bool,
    pub what: String,
}

#[derive(Debug, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub notes: Vec<String>,
}

impl Report {
    fn check(&mut self, ok: bool, what: impl Into<String>) {
        self.findings.push(Finding { ok, what: what.into() });
    }
    pub fn all_hold(&self) -> bool {
        self.findings.iter().all(|f| f.ok)
    }
}

/// Relative closeness for sums of many f32 values accumulated in f64.
fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1.0)
}

/// What the file's metadata says about the gate weights, as far as the invariants need it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Gating {
    /// the applied gates are the top-k-normalised router probabilities (and nothing else)
    pub normalised: Option<bool>,
    /// the router probabilities p are a softmax over all experts
    pub softmax: bool,
    /// the applied gate is p itself (`ffn_moe_weights-N`: neither normalised nor scaled)
    pub gate_is_p: bool,
}

impl Gating {
    /// From the saliency JSON's `metadata.routing`. Files without `probs_op` are taken as
    /// softmax-gated under normalised gating (what the normalisation presupposes).
    pub fn from_metadata(s: &Saliency) -> Gating {
        let routing = s.routing();
        let normalised = routing.normalised;
        let softmax = routing.softmax().unwrap_or(normalised == Some(true));
        let gate_is_p = softmax && routing.applied_gate() == Some(AppliedGate::Probability);
        Gating { normalised, softmax, gate_is_p }
    }
}

/// The invariants of one JSON, on its own.
pub fn check_saliency(s: &Saliency, gating: Gating, top: usize, rep: &mut Report) {
    rep.check(!s.layers.is_empty(), format!("{} MoE layers present", s.layers.len()));
    let blocks: Vec<u32> = s.layers.iter().map(|l| l.layer).collect();
    rep.check(blocks.windows(2).all(|w| w[0] < w[1]), format!("layers in block order, each once: {blocks:?}"));
    // a nextn block has its own pass (`--nextn`), which a signal can stop a batch earlier
    let drops_total: u64 = s.trunk().iter().map(|l| s.tokens.saturating_sub(l.tokens)).sum();
    rep.check(
        drops_total == s.nonfinite_drops,
        format!("nonfinite_drops = {} equals Σ over layers of (tokens − layer tokens) = {drops_total}", s.nonfinite_drops),
    );
    for l in &s.layers {
        check_layer(l, s.tokens, gating, top, rep);
    }
    if s.layers.iter().any(|l| l.reference.is_none()) {
        rep.notes.push("no reap_softmax_l2_sum / max_activation (a file from before they were collected): their invariants not checked".into());
    }
    if !s.domains.is_empty() {
        check_domains(s, rep);
    }
    for l in &s.layers[s.trunk().len()..] {
        rep.notes.push(format!(
            "layer {}: a nextn/MTP block, run in its own pass over {} of the {} tokens; not in the trace",
            l.layer, l.tokens, s.tokens
        ));
    }
}

/// Per-domain sums (`--domains`) add up to the whole run: tokens and counts exactly, the float
/// sums up to the order of addition.
fn check_domains(s: &Saliency, rep: &mut Report) {
    let tokens: u64 = s.domains.iter().map(|d| d.tokens).sum();
    rep.check(tokens == s.tokens, format!("domains: Σ tokens over {} domains = {tokens} = tokens {}", s.domains.len(), s.tokens));
    for (slot, l) in s.layers.iter().enumerate() {
        let id = format!("layer {}", l.layer);
        let parts: Vec<&crate::formats::saliency::DomainLayer> = s.domains.iter().filter_map(|d| d.layers.get(slot)).collect();
        let shaped = parts.len() == s.domains.len() && parts.iter().all(|p| p.layer == l.layer && p.count.len() == l.n_expert);
        rep.check(shaped, format!("{id}: every domain has this layer with {} experts", l.n_expert));
        if !shaped {
            continue;
        }
        let count_off: Vec<usize> = (0..l.n_expert).filter(|&e| parts.iter().map(|p| p.count[e]).sum::<u64>() != l.count[e]).collect();
        rep.check(count_off.is_empty(), format!("{id}: Σ_domains count = count{}", list_if_any(&count_off)));
        for (name, whole, part) in [
            ("prob_sum", &l.prob_sum, parts.iter().map(|p| &p.prob_sum).collect::<Vec<_>>()),
            ("reap_l2_sum", &l.reap_l2_sum, parts.iter().map(|p| &p.reap_l2_sum).collect()),
        ] {
            let off: Vec<usize> = (0..l.n_expert).filter(|&e| !close(part.iter().map(|p| p[e]).sum(), whole[e], 1e-9)).collect();
            rep.check(off.is_empty(), format!("{id}: Σ_domains {name} = {name}{}", list_if_any(&off)));
        }
    }
}

fn check_layer(l: &LayerSums, tokens: u64, gating: Gating, top: usize, rep: &mut Report) {
    let normalised = gating.normalised;
    let id = format!("layer {}", l.layer);
    let sum_count: u64 = l.count.iter().sum();
    rep.check(l.tokens <= tokens, format!("{id}: layer tokens {} ≤ tokens {tokens}", l.tokens));
    rep.check(
        sum_count == l.tokens * l.n_expert_used as u64,
        format!("{id}: Σcount = {sum_count} = tokens {} × k {}", l.tokens, l.n_expert_used),
    );
    if normalised == Some(true) {
        let sp: f64 = l.prob_sum.iter().sum();
        rep.check(close(sp, l.tokens as f64, 1e-5), format!("{id}: Σprob_sum = {sp:.6} = tokens {} (normalised gating)", l.tokens));
    }
    let arrays = l.float_arrays();
    let nonfinite: Vec<&str> = arrays.iter().filter(|(_, v)| v.iter().any(|x| !x.is_finite())).map(|(n, _)| *n).collect();
    rep.check(nonfinite.is_empty(), format!("{id}: all values finite{}", if nonfinite.is_empty() { String::new() } else { format!(" (not: {})", nonfinite.join(", ")) }));
    let negative: Vec<&str> = arrays.iter().filter(|(_, v)| v.iter().any(|x| *x < 0.0)).map(|(n, _)| *n).collect();
    rep.check(negative.is_empty(), format!("{id}: no negative sums{}", if negative.is_empty() { String::new() } else { format!(" (not: {})", negative.join(", ")) }));
    let zero_mismatch: Vec<usize> = (0..l.n_expert).filter(|&e| (l.count[e] == 0) != (l.reap_l2_sum[e] == 0.0)).collect();
    rep.check(zero_mismatch.is_empty(), format!("{id}: count = 0 ⇔ reap_l2_sum = 0{}", list_if_any(&zero_mismatch)));
    // an expert never routed has nothing summed into any of its arrays
    let dead_nonzero: Vec<&str> =
        arrays.iter().filter(|(_, v)| (0..l.n_expert).any(|e| l.count[e] == 0 && v[e] != 0.0)).map(|(n, _)| *n).collect();
    rep.check(
        dead_nonzero.is_empty(),
        format!("{id}: count = 0 ⇒ every sum = 0{}", if dead_nonzero.is_empty() { String::new() } else { format!(" (not: {})", dead_nonzero.join(", ")) }),
    );
    // Cauchy–Schwarz: Σx² ≥ (Σx)²/n, up to rounding of the f64 sums
    let cs: Vec<usize> = (0..l.n_expert)
        .filter(|&e| l.count[e] > 0 && l.reap_l2_sq_sum[e] < l.reap_l2_sum[e].powi(2) / l.count[e] as f64 * (1.0 - 1e-12))
        .collect();
    rep.check(cs.is_empty(), format!("{id}: reap_l2_sq_sum ≥ reap_l2_sum²/count{}", list_if_any(&cs)));
    if let Some(r) = &l.reference {
        check_reference(l, r, gating, &id, rep);
    }
    let dead: Vec<usize> = (0..l.n_expert).filter(|&e| l.count[e] == 0).collect();
    let mut order: Vec<usize> = (0..l.n_expert).collect();
    order.sort_by(|&a, &b| l.count[b].cmp(&l.count[a]).then(a.cmp(&b)));
    let heavy: Vec<String> = order
        .iter()
        .take(top)
        .map(|&e| format!("{e} ({:.1}%)", 100.0 * l.count[e] as f64 / sum_count.max(1) as f64))
        .collect();
    rep.notes.push(format!("{id}: {} dead experts {:?}; heaviest slot shares: {}", dead.len(), dead, heavy.join(", ")));
}

/// The REAP reference's statistics (p = router probability, CONTRACT §6) against each other and
/// against the applied-gate sums. Inequalities get a relative slack of 1e-6 for f32 rounding of
/// p and g; the equalities are exact (the same f32 values summed in the same order).
fn check_reference(l: &LayerSums, r: &ReferenceSums, gating: Gating, id: &str, rep: &mut Report) {
    let experts = 0..l.n_expert;
    let le = |a: f64, b: f64| a <= b + 1e-6 * b.abs();
    let failing = |f: &dyn Fn(usize) -> bool| -> Vec<usize> { experts.clone().filter(|&e| !f(e)).collect() };

    let zero = failing(&|e| {
        let dead = l.count[e] == 0;
        dead == (r.reap_softmax_l2_sum[e] == 0.0) && dead == (r.reap_softmax_l2_sq_sum[e] == 0.0)
    });
    rep.check(zero.is_empty(), format!("{id}: count = 0 ⇔ reap_softmax_l2_sum = 0 ⇔ reap_softmax_l2_sq_sum = 0{}", list_if_any(&zero)));
    let null = failing(&|e| (l.count[e] == 0) == r.max_activation[e].is_none());
    rep.check(null.is_empty(), format!("{id}: count = 0 ⇔ max_activation is null{}", list_if_any(&null)));
    let finite = failing(&|e| r.max_activation[e].map_or(true, f64::is_finite));
    rep.check(finite.is_empty(), format!("{id}: max_activation finite{}", list_if_any(&finite)));
    let cs = failing(&|e| {
        l.count[e] == 0 || r.reap_softmax_l2_sq_sum[e] >= r.reap_softmax_l2_sum[e].powi(2) / l.count[e] as f64 * (1.0 - 1e-12)
    });
    rep.check(cs.is_empty(), format!("{id}: reap_softmax_l2_sq_sum ≥ reap_softmax_l2_sum²/count{}", list_if_any(&cs)));
    // no element exceeds its vector's norm: |max element| ≤ max ‖f‖₂ (exact: x² is exact in f64)
    let within = failing(&|e| r.max_activation[e].map_or(true, |m| m.abs() <= l.max_l2[e]));
    rep.check(within.is_empty(), format!("{id}: |max_activation| ≤ max_l2{}", list_if_any(&within)));

    if gating.softmax {
        // p ≤ 1, so p·‖f‖ ≤ ‖f‖ term by term
        let below = failing(&|e| le(r.reap_softmax_l2_sum[e], l.ean_sum[e]));
        rep.check(below.is_empty(), format!("{id}: reap_softmax_l2_sum ≤ ean_sum (p ≤ 1){}", list_if_any(&below)));
        // a token's picks hold at most the whole softmax mass: Σ over picks of p ≤ 1
        let sp: f64 = l.router_prob_sum.iter().sum();
        rep.check(le(sp, l.tokens as f64), format!("{id}: Σrouter_prob_sum = {sp:.6} ≤ tokens {} (Σ over a token's picks of p ≤ 1)", l.tokens));
    }
    if gating.softmax && gating.normalised == Some(true) {
        // g = p / Σ over picks of p ≥ p, pick by pick
        let ge = failing(&|e| {
            le(l.router_prob_sum[e], l.prob_sum[e])
                && le(r.reap_softmax_l2_sum[e], l.reap_l2_sum[e])
                && le(r.reap_softmax_l2_sq_sum[e], l.reap_l2_sq_sum[e])
        });
        rep.check(
            ge.is_empty(),
            format!("{id}: softmax sums ≤ applied-gate sums (router_prob_sum ≤ prob_sum, reap_softmax_* ≤ reap_*; normalised gating){}", list_if_any(&ge)),
        );
    }
    if gating.gate_is_p {
        let same = failing(&|e| {
            r.reap_softmax_l2_sum[e] == l.reap_l2_sum[e] && r.reap_softmax_l2_sq_sum[e] == l.reap_l2_sq_sum[e] && l.router_prob_sum[e] == l.prob_sum[e]
        });
        rep.check(same.is_empty(), format!("{id}: softmax sums = applied-gate sums exactly (the model applies p itself){}", list_if_any(&same)));
    }
}

fn list_if_any(v: &[usize]) -> String {
    if v.is_empty() {
        String::new()
    } else {
        format!(" (fails for experts {v:?})")
    }
}

pub fn run(args: &CheckArgs) -> Result<i32> {
    if args.reap.is_none() && args.trace.is_none() {
        return Err(UsageError("give --reap FILE, --trace FILE, or both".into()).into());
    }
    if args.imatrix.is_some() && args.reap.is_none() {
        return Err(UsageError("--imatrix is compared with the saliency JSON: give --reap too".into()).into());
    }
    let s = match &args.reap {
        Some(p) => Some(Saliency::read(p).map_err(|e| UsageError(format!("{e:#}")))?),
        None => None,
    };
    let mut rep = Report::default();
    let gating = s.as_ref().map(Gating::from_metadata);
    let normalised = gating.and_then(|g| g.normalised);
    if let (Some(s), Some(g)) = (&s, gating) {
        check_saliency(s, g, args.top, &mut rep);
    }

    if let (Some(p), Some(s)) = (&args.imatrix, &s) {
        let im = imatrix_file::load(p).map_err(|e| UsageError(format!("{e:#}")))?;
        compare_imatrix(&im, p, s, &mut rep);
    }

    let mut trace_rows = None;
    if let Some(p) = &args.trace {
        let t = TraceReader::open(p).map_err(|e| UsageError(format!("{e:#}")))?;
        if t.header_count_missing {
            rep.notes.push(format!("trace {}: header says 0 rows; read the {} rows present", p.display(), t.n_rows));
        }
        trace_rows = Some(t.n_rows);
        // the candidates' upper bound, where the JSON says what the router computes
        let at_most_one = s.as_ref().and_then(|s| s.routing().probs_at_most_one());
        let phases = check_trace(&t, args.top, at_most_one, &mut rep);
        if let Some(s) = &s {
            compare_trace(&t, s, normalised, &phases, &mut rep);
        }
    }

    print_report(args, s.as_ref(), trace_rows, &rep);
    Ok(if rep.all_hold() { 0 } else { crate::error::EXIT_FAILURE })
}

/// The imatrix against the JSON: the same MoE layers and expert counts always; the same
/// routing counts (`ffn_down_exps.counts` = `count`) where both are of the same moment.
fn compare_imatrix(im: &imatrix_file::Loaded, p: &std::path::Path, s: &Saliency, rep: &mut Report) {
    let down = |name: &str| name.strip_prefix("blk.")?.strip_suffix(".ffn_down_exps.weight")?.parse::<u32>().ok();
    let mut im_blocks: Vec<u32> = im.entries.keys().filter_map(|n| down(n)).collect();
    im_blocks.sort_unstable();
    // a nextn block (`--nextn`) has its entries since they were collected; files written
    // before that hold the trunk's only
    let nextn = &s.layers[s.trunk().len()..];
    let (with, without): (Vec<&LayerSums>, Vec<&LayerSums>) = nextn.iter().partition(|l| im_blocks.contains(&l.layer));
    for l in &without {
        rep.notes.push(format!("layer {}: a nextn/MTP block without entries in imatrix {} (written before --nextn collected them)", l.layer, p.display()));
    }
    let compared: Vec<&LayerSums> = s.trunk().iter().chain(with).collect();
    let mut json_blocks: Vec<u32> = compared.iter().map(|l| l.layer).collect();
    json_blocks.sort_unstable();
    rep.check(
        im_blocks == json_blocks,
        format!("imatrix {}: its MoE layers (ffn_down_exps) {im_blocks:?} are the JSON's {json_blocks:?}", p.display()),
    );
    if im.is_legacy {
        rep.notes.push(format!(
            "imatrix {} is a legacy .dat file: it keeps one call count per matrix, not the experts' counts: counts not compared",
            p.display()
        ));
        return;
    }
    let im_tokens = im.chunk_count as i64 * im.chunk_size as i64;
    // a run killed between writing its imatrix and its JSON leaves them one checkpoint
    // apart: both are complete, but they count different tokens
    let same_point = im.chunk_size <= 0 || im_tokens == s.tokens as i64;
    if !same_point {
        rep.notes.push(format!(
            "imatrix {} covers {} chunks × {} = {im_tokens} tokens, the JSON {} tokens (checkpoints of different moments): counts not compared",
            p.display(),
            im.chunk_count,
            im.chunk_size,
            s.tokens
        ));
    }
    for l in compared {
        let name = format!("blk.{}.ffn_down_exps.weight", l.layer);
        let Some(e) = im.entries.get(&name) else {
            rep.check(false, format!("layer {}: imatrix {} has no {name}", l.layer, p.display()));
            continue;
        };
        if e.counts.len() != l.n_expert {
            rep.check(false, format!("layer {}: {name} has counts for {} experts, the JSON {}", l.layer, e.counts.len(), l.n_expert));
        } else if same_point {
            let same = e.counts.iter().zip(&l.count).all(|(&a, &b)| a >= 0 && a as u64 == b);
            rep.check(same, format!("layer {}: count equals the imatrix counts of {name}", l.layer));
        }
    }
}

/// Per phase (prefill, decode): rows, and per MoE layer the times each expert was selected.
pub struct PhaseCounts {
    pub rows: [u64; 2],
    /// `[phase][layer][expert]`
    pub counts: [Vec<Vec<u64>>; 2],
}

/// What a trace must satisfy on its own (any trace; a decode trace also its sequence layout).
/// Returns the selection counts recomputed from its rows, per phase.
/// `at_most_one`: the router's probabilities are at most 1 (softmax, sigmoid), not bounded
/// (sqrt-softplus), or not known (no JSON): then only ≥ 0 is checked.
pub fn check_trace(t: &TraceReader, top: usize, at_most_one: Option<bool>, rep: &mut Report) -> PhaseCounts {
    let bound = if at_most_one == Some(true) { 1.0 } else { f32::INFINITY };
    let h = &t.header;
    let (nl, ne, k) = (h.n_layers(), h.n_expert as usize, h.k as usize);
    let decode_trace = h.flags & FLAG_DECODE != 0;
    let mut pc = PhaseCounts { rows: [0; 2], counts: [vec![vec![0; ne]; nl], vec![vec![0; ne]; nl]] };
    // first offending row of each invariant
    let (mut bad_id, mut dup, mut bad_w, mut bad_norm, mut bad_cand, mut bad_phase, mut bad_seq) =
        (None, None, None, None, None, None, None::<(u64, String)>);
    let mut prev: Option<(u32, u32, u32)> = None; // (sequence, pos, phase)
    let mut seen = vec![u64::MAX; ne];
    for i in 0..t.n_rows {
        let r = t.row(i);
        let phase = r.phase();
        if phase > PHASE_DECODE || (!decode_trace && phase != PHASE_PREFILL) {
            bad_phase.get_or_insert(i);
            continue;
        }
        pc.rows[phase as usize] += 1;
        if decode_trace {
            // each sequence: positions 0, 1, … in order, its prompt (prefill) before its
            // generated tokens; sequences numbered 0, 1, … in order
            let ok = match prev {
                None => r.chunk() == 0 && r.pos() == 0 && phase == PHASE_PREFILL,
                Some((s, pos, ph)) if r.chunk() == s => r.pos() == pos + 1 && phase >= ph,
                Some((s, _, _)) => r.chunk() == s + 1 && r.pos() == 0 && phase == PHASE_PREFILL,
            };
            if !ok && bad_seq.is_none() {
                bad_seq = Some((i, format!("sequence {} pos {} phase {}", r.chunk(), r.pos(), phase_name(phase))));
            }
            prev = Some((r.chunk(), r.pos(), phase));
        }
        for li in 0..nl {
            let (sel, w) = (r.sel_ids(li), r.sel_weights(li));
            let (cand, cp) = (r.cand_ids(li), r.cand_probs(li));
            if sel.iter().chain(cand).any(|&e| e as usize >= ne) {
                bad_id.get_or_insert(i);
                continue;
            }
            let stamp = i * nl as u64 + li as u64;
            for &e in sel {
                if seen[e as usize] == stamp {
                    dup.get_or_insert(i);
                }
                seen[e as usize] = stamp;
                pc.counts[phase as usize][li][e as usize] += 1;
            }
            if w.iter().any(|x| !x.is_finite() || *x < 0.0) {
                bad_w.get_or_insert(i);
            } else if h.flags & FLAG_NORMALISED != 0 && !close(w.iter().map(|&x| x as f64).sum(), 1.0, 1e-4) {
                bad_norm.get_or_insert(i);
            }
            if cp.iter().any(|p| !p.is_finite() || !(0.0..=bound).contains(p)) || cp.windows(2).any(|x| x[1] > x[0]) {
                bad_cand.get_or_insert(i);
            }
        }
    }
    let at = |r: Option<u64>| r.map_or(String::new(), |r| format!(" (fails at row {r})"));
    rep.check(bad_phase.is_none(), format!(
        "every row's phase is {}{}",
        if decode_trace { "prefill or decode" } else { "prefill (not a trace-decode trace)" },
        at(bad_phase)
    ));
    rep.check(bad_id.is_none(), format!("every selected and candidate expert id is below n_expert {ne}{}", at(bad_id)));
    rep.check(dup.is_none(), format!("the {k} selected experts of each token and layer are distinct{}", at(dup)));
    rep.check(bad_w.is_none(), format!("gate weights finite and ≥ 0{}", at(bad_w)));
    if h.flags & FLAG_NORMALISED != 0 {
        rep.check(bad_norm.is_none(), format!("gate weights sum to 1 over the top-k (normalised gating){}", at(bad_norm)));
    }
    let range = match at_most_one {
        Some(true) => "probabilities in [0, 1]",
        Some(false) => "scores ≥ 0 (sqrt(softplus): not bounded by 1)",
        None => "probabilities ≥ 0 (the bound 1 needs the JSON's routing)",
    };
    rep.check(bad_cand.is_none(), format!("router candidates' {range}, best first{}", at(bad_cand)));
    if decode_trace {
        let what = "sequences 0, 1, … in order, each at positions 0, 1, …, its prompt (prefill) before its generated tokens (decode)";
        match &bad_seq {
            None => rep.check(true, what),
            Some((i, row)) => rep.check(false, format!("{what} (fails at row {i}: {row})")),
        }
    }
    for (ph, name) in [(0usize, "prefill"), (1, "decode")] {
        if pc.rows[ph] == 0 {
            continue;
        }
        rep.notes.push(format!("trace phase {name}: {} rows", pc.rows[ph]));
        for (li, c) in pc.counts[ph].iter().enumerate() {
            let unused: Vec<usize> = (0..ne).filter(|&e| c[e] == 0).collect();
            let total: u64 = c.iter().sum();
            let mut order: Vec<usize> = (0..ne).collect();
            order.sort_by(|&a, &b| c[b].cmp(&c[a]).then(a.cmp(&b)));
            let heavy: Vec<String> =
                order.iter().take(top).map(|&e| format!("{e} ({:.1}%)", 100.0 * c[e] as f64 / total.max(1) as f64)).collect();
            rep.notes.push(format!("  {name} layer {}: {} experts never selected; heaviest slot shares: {}", h.layers[li], unused.len(), heavy.join(", ")));
        }
    }
    pc
}

/// A trace against a saliency JSON: the same MoE layout always; the same tokens (row count,
/// counts) only for the run that wrote both. A decode trace comes from trace-decode, never
/// from the calibration run: its counts are set beside the JSON's, not compared.
fn compare_trace(t: &TraceReader, s: &Saliency, normalised: Option<bool>, pc: &PhaseCounts, rep: &mut Report) {
    let layers_match = t.header.layers == s.trunk().iter().map(|l| l.layer).collect::<Vec<_>>();
    rep.check(layers_match, format!("trace layers {:?} are the JSON's MoE layers", t.header.layers));
    let shape_match = layers_match && s.trunk().iter().all(|l| l.n_expert == t.header.n_expert as usize && l.n_expert_used == t.header.k as usize);
    if layers_match {
        rep.check(shape_match, format!("trace shape ({} experts, k = {}) is the JSON's", t.header.n_expert, t.header.k));
    }
    if let Some(n) = normalised {
        rep.check((t.header.flags & FLAG_NORMALISED != 0) == n, "trace and JSON agree on normalised gating");
    }
    if !shape_match {
        return;
    }
    if t.header.flags & FLAG_DECODE != 0 {
        for (li, l) in s.trunk().iter().enumerate() {
            let revived: Vec<usize> = (0..l.n_expert).filter(|&e| l.count[e] == 0 && pc.counts[1][li][e] > 0).collect();
            if !revived.is_empty() {
                rep.notes.push(format!("layer {}: experts unused in the JSON's run but selected while decoding: {revived:?}", l.layer));
            }
        }
        rep.notes.push("decode trace (trace-decode): not the JSON's run, so its rows and counts are not compared with the JSON's".into());
        return;
    }
    // the trace is appended between checkpoints, so after a kill (or with the JSON of an
    // earlier checkpoint) it may hold more rows than the JSON counted, never fewer
    rep.check(t.n_rows >= s.trace_tokens_written, format!("trace rows {} ≥ trace_tokens_written {}", t.n_rows, s.trace_tokens_written));
    if t.n_rows > s.trace_tokens_written {
        rep.notes.push(format!(
            "trace holds {} rows, {} more than this JSON's checkpoint counted (the run went on after it, or was stopped): its first {} rows are compared",
            t.n_rows,
            t.n_rows - s.trace_tokens_written,
            s.trace_tokens_written
        ));
    }
    if s.trace_tokens_written == s.tokens && t.n_rows >= s.tokens && s.nonfinite_drops == 0 {
        // a calibration trace is all prefill: its prefill counts are the whole trace's
        let counts = if t.n_rows == s.tokens { pc.counts[0].clone() } else { counts_of_first_rows(t, s, s.tokens) };
        for (li, l) in s.trunk().iter().enumerate() {
            rep.check(counts[li] == l.count, format!("layer {}: counts recomputed from the trace equal the JSON's", l.layer));
        }
    } else {
        rep.notes.push(format!(
            "trace covers {} of {} tokens: counts not recomputed from it (only a whole-run trace can match)",
            t.n_rows, s.tokens
        ));
    }
}

/// Selection counts per layer and expert over the first `n` rows of a trace.
fn counts_of_first_rows(t: &TraceReader, s: &Saliency, n: u64) -> Vec<Vec<u64>> {
    let k = t.header.k as usize;
    let mut counts: Vec<Vec<u64>> = s.trunk().iter().map(|l| vec![0; l.n_expert]).collect();
    for r in t.rows().take(n as usize) {
        for (li, c) in counts.iter_mut().enumerate() {
            for &e in &r.sel_ids(li)[..k] {
                if let Some(x) = c.get_mut(e as usize) {
                    *x += 1;
                }
            }
        }
    }
    counts
}

fn print_report(args: &CheckArgs, s: Option<&Saliency>, trace_rows: Option<u64>, rep: &Report) {
    match (s, &args.reap) {
        (Some(s), Some(p)) => {
            println!("check {}: {} tokens, {} MoE layers, {} non-finite drops", p.display(), s.tokens, s.layers.len(), s.nonfinite_drops)
        }
        _ => println!("check {}: {} rows", args.trace.as_deref().unwrap_or(std::path::Path::new("?")).display(), trace_rows.unwrap_or(0)),
    }
    for f in &rep.findings {
        println!("  [{}] {}", if f.ok { "ok" } else { "FAIL" }, f.what);
    }
    for n in &rep.notes {
        println!("  note: {n}");
    }
    let failed = rep.findings.iter().filter(|f| !f.ok).count();
    if failed == 0 {
        println!("all {} invariants hold", rep.findings.len());
    } else {
        println!("{failed} of {} invariants FAIL", rep.findings.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer() -> LayerSums {
        let mut l = LayerSums::new(0, 4, 2);
        l.tokens = 3;
        l.count = vec![3, 2, 1, 0];
        l.prob_sum = vec![1.5, 1.0, 0.5, 0.0];
        l.reap_l2_sum = vec![3.0, 2.0, 1.0, 0.0];
        l.reap_l2_sq_sum = vec![3.0, 2.0, 1.0, 0.0];
        l.ean_sum = vec![6.0, 4.0, 2.0, 0.0];
        // every pick: ‖f‖ = 2, g = 0.5, p = 0.4
        l.max_l2 = vec![2.0, 2.0, 2.0, 0.0];
        l.router_prob_sum = vec![1.2, 0.8, 0.4, 0.0];
        l.reference = Some(ReferenceSums {
            reap_softmax_l2_sum: vec![2.4, 1.6, 0.8, 0.0],
            reap_softmax_l2_sq_sum: vec![1.92, 1.28, 0.64, 0.0],
            max_activation: vec![Some(1.5), Some(-0.5), Some(2.0), None],
        });
        l
    }

    #[test]
    fn domain_parts_must_add_up() {
        use crate::formats::saliency::{DomainLayer, DomainSums};
        let l = layer();
        let part = |count: Vec<u64>, p: Vec<f64>, r: Vec<f64>| DomainLayer { layer: 0, count, prob_sum: p, reap_l2_sum: r };
        let mut s = Saliency { tokens: 3, layers: vec![l], ..Default::default() };
        s.domains = vec![
            DomainSums { name: "a".into(), tokens: 2, layers: vec![part(vec![2, 1, 1, 0], vec![1.0, 0.5, 0.5, 0.0], vec![2.0, 1.0, 1.0, 0.0])] },
            DomainSums { name: "b".into(), tokens: 1, layers: vec![part(vec![1, 1, 0, 0], vec![0.5, 0.5, 0.0, 0.0], vec![1.0, 1.0, 0.0, 0.0])] },
        ];
        let mut r = Report::default();
        check_saliency(&s, NORMALISED, 2, &mut r);
        assert!(r.all_hold(), "{:?}", r.findings);
        s.domains[1].layers[0].count[1] = 2;
        s.domains[1].layers[0].reap_l2_sum[0] = 1.5;
        s.domains[0].tokens = 3;
        let mut r = Report::default();
        check_saliency(&s, NORMALISED, 2, &mut r);
        let failed: Vec<&str> = r.findings.iter().filter(|f| !f.ok).map(|f| f.what.as_str()).collect();
        assert_eq!(failed.len(), 3, "{failed:?}");
        assert!(failed[1].contains("count = count (fails for experts [1])") && failed[2].contains("reap_l2_sum (fails for experts [0])"), "{failed:?}");
    }

    const NORMALISED: Gating = Gating { normalised: Some(true), softmax: true, gate_is_p: false };

    fn verdict_with(l: LayerSums, tokens: u64, drops: u64, gating: Gating) -> Report {
        let s = Saliency { tokens, nonfinite_drops: drops, layers: vec![l], ..Default::default() };
        let mut r = Report::default();
        check_saliency(&s, gating, 2, &mut r);
        r
    }

    fn verdict(l: LayerSums, tokens: u64, drops: u64) -> Report {
        verdict_with(l, tokens, drops, NORMALISED)
    }

    /// Asserts that the finding containing `what` fails (others may fail with it: a tampered
    /// value often breaks more than one relation).
    fn fails(r: &Report, what: &str) {
        let failed: Vec<&str> = r.findings.iter().filter(|f| !f.ok).map(|f| f.what.as_str()).collect();
        assert!(failed.iter().any(|f| f.contains(what)), "expected «{what}» to fail, failed: {failed:#?}");
    }

    #[test]
    fn each_broken_reference_invariant_is_caught() {
        let base = layer();
        assert!(verdict(base.clone(), 3, 0).all_hold());
        let tamper = |f: &dyn Fn(&mut LayerSums)| {
            let mut l = base.clone();
            f(&mut l);
            l
        };
        fn r(l: &mut LayerSums) -> &mut ReferenceSums {
            l.reference.as_mut().unwrap()
        }
        // a dead expert with a softmax sum, or a live one without
        fails(&verdict(tamper(&|l| r(l).reap_softmax_l2_sum[3] = 0.1), 3, 0), "count = 0 ⇔ reap_softmax_l2_sum = 0");
        fails(&verdict(tamper(&|l| r(l).reap_softmax_l2_sq_sum[2] = 0.0), 3, 0), "count = 0 ⇔ reap_softmax_l2_sum = 0");
        // max_activation null exactly for the dead
        fails(&verdict(tamper(&|l| r(l).max_activation[3] = Some(0.0)), 3, 0), "max_activation is null");
        fails(&verdict(tamper(&|l| r(l).max_activation[1] = None), 3, 0), "max_activation is null");
        fails(&verdict(tamper(&|l| r(l).max_activation[1] = Some(f64::NAN)), 3, 0), "max_activation finite");
        // Cauchy–Schwarz: Σx² ≥ (Σx)²/n = 2.4²/3 = 1.92
        fails(&verdict(tamper(&|l| r(l).reap_softmax_l2_sq_sum[0] = 1.9), 3, 0), "reap_softmax_l2_sq_sum ≥");
        // an element larger than its vector's norm
        fails(&verdict(tamper(&|l| r(l).max_activation[0] = Some(2.5)), 3, 0), "|max_activation| ≤ max_l2");
        fails(&verdict(tamper(&|l| r(l).max_activation[0] = Some(-2.01)), 3, 0), "|max_activation| ≤ max_l2");
        // p ≤ 1: p·‖f‖ ≤ ‖f‖ (under unnormalised softmax gating, so only this one applies)
        let softmax = Gating { normalised: None, softmax: true, gate_is_p: false };
        let big = tamper(&|l| {
            r(l).reap_softmax_l2_sum[2] = 2.5;
            r(l).reap_softmax_l2_sq_sum[2] = 6.25;
        });
        fails(&verdict_with(big.clone(), 3, 0, softmax), "reap_softmax_l2_sum ≤ ean_sum");
        // and without softmax gating, nothing is said about p's size
        assert!(verdict_with(big, 3, 0, Gating::default()).all_hold());
        // Σ over a token's picks of p ≤ 1: Σrouter_prob_sum ≤ tokens
        fails(&verdict_with(tamper(&|l| l.router_prob_sum = vec![1.5, 1.0, 0.6, 0.0]), 3, 0, softmax), "Σ over a token's picks of p ≤ 1");
        // normalised gating: g ≥ p pick by pick, so every softmax sum is at most its gate sum
        fails(&verdict(tamper(&|l| l.router_prob_sum[0] = 1.6), 3, 0), "softmax sums ≤ applied-gate sums");
        fails(&verdict(tamper(&|l| r(l).reap_softmax_l2_sum[1] = 2.01), 3, 0), "softmax sums ≤ applied-gate sums");
        fails(&verdict(tamper(&|l| r(l).reap_softmax_l2_sq_sum[1] = 2.1), 3, 0), "softmax sums ≤ applied-gate sums");
    }

    #[test]
    fn where_the_model_applies_p_the_two_sums_are_equal() {
        let gate_is_p = Gating { normalised: Some(false), softmax: true, gate_is_p: true };
        let mut l = layer();
        l.router_prob_sum = l.prob_sum.clone();
        let rs = l.reference.as_mut().unwrap();
        rs.reap_softmax_l2_sum = l.reap_l2_sum.clone();
        rs.reap_softmax_l2_sq_sum = l.reap_l2_sq_sum.clone();
        assert!(verdict_with(l.clone(), 3, 0, gate_is_p).all_hold());
        l.reference.as_mut().unwrap().reap_softmax_l2_sum[0] = 3.0000000000000004;
        fails(&verdict_with(l, 3, 0, gate_is_p), "softmax sums = applied-gate sums exactly");
    }

    #[test]
    fn gating_is_read_from_the_metadata() {
        let with = |routing: serde_json::Value| {
            let mut s = Saliency::default();
            s.metadata.insert("routing".into(), routing);
            Gating::from_metadata(&s)
        };
        use serde_json::json;
        let g = with(json!({"probs_op": "SOFT_MAX", "weights_node": "ffn_moe_weights-0", "normalised": false}));
        assert_eq!(g, Gating { normalised: Some(false), softmax: true, gate_is_p: true });
        let g = with(json!({"probs_op": "SOFT_MAX", "weights_node": "ffn_moe_weights_norm-0", "normalised": true}));
        assert_eq!(g, Gating { normalised: Some(true), softmax: true, gate_is_p: false });
        let g = with(json!({"probs_op": "UNARY", "weights_node": "ffn_moe_weights-0", "normalised": false}));
        assert_eq!(g, Gating { normalised: Some(false), softmax: false, gate_is_p: false });
        // older files without probs_op: softmax presumed only under normalised gating
        assert!(with(json!({"normalised": true})).softmax);
        assert!(!with(json!({})).softmax);
    }

    #[test]
    fn a_file_without_reference_statistics_passes_with_a_note() {
        let mut l = layer();
        l.reference = None;
        let r = verdict(l, 3, 0);
        assert!(r.all_hold(), "{:?}", r.findings);
        assert!(r.notes.iter().any(|n| n.contains("not checked")), "{:?}", r.notes);
    }

    #[test]
    fn a_consistent_layer_passes() {
        let r = verdict(layer(), 3, 0);
        assert!(r.all_hold(), "{:?}", r.findings);
        assert!(r.notes[0].contains("1 dead experts [3]"), "{:?}", r.notes);
    }

    #[test]
    fn each_broken_invariant_is_caught() {
        let mut l = layer();
        l.count[0] = 4; // Σcount ≠ tokens·k
        assert!(!verdict(l, 3, 0).all_hold());
        let mut l = layer();
        l.prob_sum[0] = 2.5; // Σprob ≠ tokens
        assert!(!verdict(l, 3, 0).all_hold());
        let mut l = layer();
        l.reap_l2_sum[3] = 0.1; // dead expert with saliency
        assert!(!verdict(l, 3, 0).all_hold());
        let mut l = layer();
        l.reap_l2_sq_sum[0] = 2.0; // below (Σx)²/n = 3
        assert!(!verdict(l, 3, 0).all_hold());
        let mut l = layer();
        l.ean_sum[1] = f64::NAN;
        assert!(!verdict(l, 3, 0).all_hold());
        // drops must account for the missing tokens
        assert!(!verdict(layer(), 4, 0).all_hold());
        assert!(verdict(layer(), 4, 1).all_hold());
    }
}
