//! `reap-imatrix replay`: expert-cache simulation over a routing trace. Every policy and
//! capacity runs in one streaming pass over the memory-mapped trace (Belady adds one backward
//! pass for its next-use array). The policies are defined in docs/replay.md.

pub mod belady;
pub mod ema;
pub mod engine;
pub mod gguf;
pub mod keep;
pub mod lfu;
pub mod lru;
pub mod resident;
pub mod synthetic;
#[cfg(test)]
mod tests;

use crate::analyze::select::keep_map::KeepMap;
use crate::error::UsageError;
use crate::formats::atomic;
use crate::formats::trace::TraceReader;
use anyhow::{anyhow, Result};
use engine::{Family, Forced, Keep, Rows, Shape, SimCounts};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// least recently used
    Lru,
    /// least frequently used (whole-replay counts), ties to least recent
    Lfu,
    /// lowest decayed pick count (--ema-decay)
    Ema,
    /// ema, plus credit for candidates ranked just below the picks (--near-pick-n, --near-pick-weight)
    #[value(name = "near-pick-ema", alias = "near_pick_ema")]
    NearPickEma,
    /// ema with each pick credited its router probability
    #[value(name = "inverse-router-ema", alias = "inverse_router_ema")]
    InverseRouterEma,
    /// optimal offline eviction (farthest next use): the lower bound
    Belady,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Lfu => "lfu",
            Policy::Ema => "ema",
            Policy::NearPickEma => "near-pick-ema",
            Policy::InverseRouterEma => "inverse-router-ema",
            Policy::Belady => "belady",
        }
    }
}

/// `--phase`: which rows of a trace the cache sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PhaseSel {
    All,
    Prefill,
    Decode,
}

impl PhaseSel {
    pub fn name(self) -> &'static str {
        match self {
            PhaseSel::All => "all",
            PhaseSel::Prefill => "prefill",
            PhaseSel::Decode => "decode",
        }
    }
}

/// The rows of `range` in the selected phase (all of them for `all`).
pub fn select_rows(trace: &TraceReader, range: Range<u64>, sel: PhaseSel) -> Rows {
    let want = match sel {
        PhaseSel::All => return Rows::Range(range),
        PhaseSel::Prefill => crate::formats::trace::PHASE_PREFILL,
        PhaseSel::Decode => crate::formats::trace::PHASE_DECODE,
    };
    Rows::List(range.filter(|&i| trace.row(i).phase() == want).collect())
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Policies: lru, lfu, ema, near-pick-ema, inverse-router-ema, belady (defined in docs/replay.md).\n\
Belady (the optimal offline bound) is always run alongside unless --no-belady.")]
pub struct ReplayArgs {
    /// Routing trace (--trace-out of a calibration run)
    #[arg(long, value_name = "FILE", required_unless_present = "synthetic_trace")]
    pub trace: Option<PathBuf>,
    /// Eviction policies, comma-separated
    #[arg(long = "policy", value_name = "P[,P…]", value_delimiter = ',', value_enum, required_unless_present = "synthetic_trace")]
    pub policies: Vec<Policy>,
    /// Cache sizes in experts per layer, comma-separated
    #[arg(long = "capacity", value_name = "N[,N…]", value_delimiter = ',')]
    pub capacity: Vec<usize>,
    /// Cache sizes in MiB per layer, comma-separated: floor(M MiB / expert bytes) experts (needs --model)
    #[arg(long = "capacity-mib", value_name = "M[,M…]", value_delimiter = ',')]
    pub capacity_mib: Vec<f64>,
    /// The model GGUF: each layer's expert byte size (--capacity-mib) and the router's selection
    /// bias, which --keep-map re-routes by (GLM-4.5, DeepSeek-V3: exp_probs_b)
    #[arg(long, value_name = "GGUF")]
    pub model: Option<PathBuf>,
    /// Re-route every token as the pruned model would: its first k candidates that the keep map
    /// keeps; with --model and a selection bias, the kept picks certain by p' + bias (p' = p,
    /// or renormalised over the kept experts for a softmax router, which needs a trace of
    /// every expert), the other slots forced misses (docs/replay.md)
    #[arg(long = "keep-map", value_name = "FILE")]
    pub keep_map: Option<PathBuf>,
    /// With --keep-map: in a hash-routed block (DeepSeek-V4's `ffn_gate_tid2eid`; told by
    /// --model, else by the map's hash_layer_count), send a pick the map drops where `prune
    /// --hash-remap` sends it (the first kept expert of the map's `stand_in` list the token's
    /// row lacks), instead of refusing the map
    #[arg(long = "hash-remap", requires = "keep_map")]
    pub hash_remap: bool,
    /// The saliency JSON of the trace's run: confirms whether the keep map was fitted on it
    #[arg(long, value_name = "FILE")]
    pub reap: Option<PathBuf>,
    /// Write the results as JSON here
    #[arg(long, value_name = "OUT")]
    pub json: Option<PathBuf>,
    /// Decay d per token of the ema policies, 0 < d ≤ 1
    #[arg(long = "ema-decay", default_value_t = 0.99, value_name = "D")]
    pub ema_decay: f64,
    /// near-pick-ema: candidates (in router order, picks included) that earn credit
    #[arg(long = "near-pick-n", default_value_t = 48, value_name = "N")]
    pub near_pick_n: usize,
    /// near-pick-ema: credit w of a near pick as likely as the weakest pick
    #[arg(long = "near-pick-weight", default_value_t = 1.0, value_name = "W")]
    pub near_pick_weight: f64,
    /// Replay rows A..B of the trace (half-open, 0-based; A.. or ..B allowed)
    #[arg(long, value_name = "A..B")]
    pub tokens: Option<String>,
    /// Do not run Belady's bound alongside
    #[arg(long = "no-belady")]
    pub no_belady: bool,
    /// Rows to replay by phase: all (the cache sees prompts and generation, miss rates are
    /// reported per phase too), or only the prompt (prefill) or generated (decode) rows
    #[arg(long = "phase", value_enum, default_value_t = PhaseSel::All)]
    pub phase: PhaseSel,

    /// (benchmark helper) write a synthetic trace here and exit
    #[arg(long = "synthetic-trace", value_name = "OUT", hide = true)]
    pub synthetic_trace: Option<PathBuf>,
    #[arg(long = "synthetic-tokens", default_value_t = 30000, hide = true)]
    pub synthetic_tokens: u64,
    #[arg(long = "synthetic-layers", default_value_t = 48, hide = true)]
    pub synthetic_layers: usize,
    #[arg(long = "synthetic-experts", default_value_t = 128, hide = true)]
    pub synthetic_experts: usize,
    #[arg(long = "synthetic-k", default_value_t = 8, hide = true)]
    pub synthetic_k: usize,
    #[arg(long = "synthetic-top-n", default_value_t = 64, hide = true)]
    pub synthetic_top_n: usize,
    #[arg(long = "synthetic-seed", default_value_t = 1, hide = true)]
    pub synthetic_seed: u64,
}

fn usage(msg: String) -> anyhow::Error {
    anyhow!(UsageError(msg))
}

/// `A..B`, `A..`, `..B` → [A, B) within `n` rows.
pub fn parse_range(s: &str, n: u64) -> Result<Range<u64>> {
    let bad = || usage(format!("--tokens {s}: expected A..B (0-based, B exclusive)"));
    let (a, b) = s.split_once("..").ok_or_else(bad)?;
    let a: u64 = if a.trim().is_empty() { 0 } else { a.trim().parse().map_err(|_| bad())? };
    let b: u64 = if b.trim().is_empty() { n } else { b.trim().parse().map_err(|_| bad())? };
    if a >= b {
        return Err(usage(format!("--tokens {s}: empty range")));
    }
    if b > n {
        return Err(usage(format!("--tokens {s}: the trace has only {n} rows")));
    }
    Ok(a..b)
}

/// One capacity setting: its label and its size in each layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Capacity {
    pub label: String,
    pub per_layer: Vec<usize>,
    pub mib: Option<f64>,
}

/// What a replay found, per simulator.
pub struct Outcome {
    pub policy: &'static str,
    pub capacity: usize,
    pub hits: Vec<u64>,
    pub misses: Vec<u64>,
    /// the same, split by the rows' phase
    pub phases: engine::PhaseSplit,
}

/// Builds the families for `policies` (deduplicated, in order) and runs them.
#[allow(clippy::too_many_arguments)]
pub fn simulate(
    trace: &TraceReader,
    rows: impl Into<Rows>,
    keep: Option<Keep>,
    policies: &[Policy],
    caps: &[Vec<usize>],
    decay: f64,
    near_pick_n: usize,
    near_pick_weight: f64,
) -> Result<(Vec<Outcome>, Forced)> {
    let rows: Rows = rows.into();
    let h = &trace.header;
    let shape = Shape { n_layers: h.n_layers(), n_expert: h.n_expert as usize, k: h.k as usize };
    let mut fams: Vec<Box<dyn Family>> = Vec::new();
    let mut seen = Vec::new();
    for &p in policies {
        if seen.contains(&p) {
            continue;
        }
        seen.push(p);
        fams.push(match p {
            Policy::Lru => Box::new(lru::Lru::new(shape, caps)),
            Policy::Lfu => Box::new(lfu::Lfu::new(shape, caps)),
            Policy::Ema => Box::new(ema::Ema::new(shape, caps, decay, ema::Credit::Pick)),
            Policy::NearPickEma => {
                Box::new(ema::Ema::new(shape, caps, decay, ema::Credit::NearPick { n: near_pick_n, w: near_pick_weight }))
            }
            Policy::InverseRouterEma => Box::new(ema::Ema::new(shape, caps, decay, ema::Credit::Router)),
            Policy::Belady => Box::new(engine::belady_family(trace, &rows, shape, keep, caps)?),
        });
    }
    let (forced, splits) = engine::run(trace, rows, shape, keep, &mut fams)?;
    let outcomes = fams
        .iter()
        .flat_map(|f| f.counts())
        .zip(splits)
        .map(|(SimCounts { policy, capacity, hits, misses }, phases)| Outcome { policy, capacity, hits, misses, phases })
        .collect();
    Ok((outcomes, forced))
}

fn rate(m: u64, a: u64) -> f64 {
    if a > 0 {
        m as f64 / a as f64
    } else {
        0.0
    }
}

pub fn run(args: &ReplayArgs) -> Result<i32> {
    if let Some(out) = &args.synthetic_trace {
        let spec = synthetic::Spec {
            tokens: args.synthetic_tokens,
            layers: args.synthetic_layers,
            experts: args.synthetic_experts,
            k: args.synthetic_k,
            top_n: args.synthetic_top_n,
            seed: args.synthetic_seed,
        };
        synthetic::write(out, &spec).map_err(|e| usage(format!("--synthetic-trace {}: {e:#}", out.display())))?;
        println!("wrote synthetic trace {} ({spec:?})", out.display());
        return Ok(0);
    }
    let trace_path = args.trace.as_ref().expect("clap requires --trace");
    // each is read only for what another flag asks: alone it would be ignored without a word
    if let (Some(r), None) = (&args.reap, &args.keep_map) {
        return Err(usage(format!(
            "--reap {}: needs --keep-map (the saliency JSON only tells whether a keep map was fitted on this trace's run)",
            r.display()
        )));
    }
    if let (Some(m), true, None) = (&args.model, args.capacity_mib.is_empty(), &args.keep_map) {
        return Err(usage(format!(
            "--model {}: needs --capacity-mib or --keep-map (the model is read only for the experts' byte sizes and the router's selection bias)",
            m.display()
        )));
    }
    // a replay of a long trace takes a while: a --json it cannot write fails now, not after it
    if let Some(out) = &args.json {
        atomic::check_writable(out).map_err(|e| usage(format!("--json {e}")))?;
    }
    let trace = TraceReader::open(trace_path).map_err(|e| usage(format!("--trace: {e:#}")))?;
    let h = trace.header.clone();
    let (nl, ne, k) = (h.n_layers(), h.n_expert as usize, h.k as usize);
    if ne >= NONE_LIMIT {
        return Err(usage(format!("--trace {}: {ne} experts per layer; replay handles at most {}", trace_path.display(), NONE_LIMIT - 1)));
    }
    let mut warnings = Vec::new();
    if trace.header_count_missing {
        let w = format!("trace header says 0 tokens; using the {} complete rows present", trace.n_rows);
        eprintln!("warning: {}: {w}", trace_path.display());
        warnings.push(w);
    }
    if trace.n_rows == 0 {
        return Err(usage(format!("--trace {}: no rows to replay", trace_path.display())));
    }
    let rows = match &args.tokens {
        Some(s) => parse_range(s, trace.n_rows)?,
        None => 0..trace.n_rows,
    };
    if rows.end - rows.start > u32::MAX as u64 - 1 {
        return Err(usage(format!("--tokens: at most {} rows per replay", u32::MAX - 1)));
    }
    let visit = select_rows(&trace, rows.clone(), args.phase);
    if visit.is_empty() {
        return Err(usage(format!(
            "--phase {}: no {} rows in rows [{}, {}) of {}{}",
            args.phase.name(),
            args.phase.name(),
            rows.start,
            rows.end,
            trace_path.display(),
            if trace.header.flags & crate::formats::trace::FLAG_DECODE == 0 { " (a calibration trace is all prefill; trace-decode writes decode rows)" } else { "" }
        )));
    }

    // ---- knobs
    if !(args.ema_decay > 0.0 && args.ema_decay <= 1.0) {
        return Err(usage(format!("--ema-decay {}: must be in (0, 1]", args.ema_decay)));
    }
    if !(args.near_pick_weight.is_finite() && args.near_pick_weight >= 0.0) {
        return Err(usage(format!("--near-pick-weight {}: must be a finite number ≥ 0", args.near_pick_weight)));
    }
    let near_pick_n = args.near_pick_n.min(h.top_n as usize);
    if args.near_pick_n > h.top_n as usize && args.policies.contains(&Policy::NearPickEma) {
        let w = format!("--near-pick-n {} exceeds the trace's top-N {}; using {}", args.near_pick_n, h.top_n, h.top_n);
        eprintln!("note: {w}");
        warnings.push(w);
    }

    // ---- capacities
    let mut caps: Vec<Capacity> = Vec::new();
    for &c in &args.capacity {
        caps.push(Capacity { label: c.to_string(), per_layer: vec![c.min(ne); nl], mib: None });
    }
    let mut expert_bytes = None;
    if !args.capacity_mib.is_empty() {
        let model = args.model.as_ref().ok_or_else(|| usage("--capacity-mib needs --model GGUF (for the experts' byte sizes)".into()))?;
        let bytes = gguf::expert_bytes(model, &h.layers, ne).map_err(|e| usage(format!("--model: {e:#}")))?;
        for &m in &args.capacity_mib {
            if !(m.is_finite() && m > 0.0) {
                return Err(usage(format!("--capacity-mib {m}: must be a positive number")));
            }
            let per_layer = bytes.iter().map(|&b| (((m * 1048576.0) / b.max(1) as f64).floor() as usize).min(ne)).collect();
            caps.push(Capacity { label: format!("{m}MiB"), per_layer, mib: Some(m) });
        }
        expert_bytes = Some(bytes);
    }
    if caps.is_empty() {
        return Err(usage("give --capacity N[,N…] and/or --capacity-mib M[,M…] (with --model)".into()));
    }
    let mut seen_labels = Vec::new();
    caps.retain(|c| {
        let new = !seen_labels.contains(&c.label);
        seen_labels.push(c.label.clone());
        new
    });
    for c in &caps {
        if let Some((li, &n)) = c.per_layer.iter().enumerate().find(|(_, &n)| n < k) {
            return Err(usage(format!(
                "capacity {}: {n} experts in layer {} is below k = {k} (a token needs its k experts resident at once)",
                c.label, h.layers[li]
            )));
        }
    }
    let cap_layers: Vec<Vec<usize>> = caps.iter().map(|c| c.per_layer.clone()).collect();

    // ---- keep map: how the pruned model would route
    let rerouting = keep::rerouting(args, &trace, &rows, &visit, &mut warnings)?;

    // ---- run
    let mut policies: Vec<Policy> = Vec::new();
    for &p in &args.policies {
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    let bound = !args.no_belady;
    let mut run_policies = policies.clone();
    if bound && !run_policies.contains(&Policy::Belady) {
        run_policies.push(Policy::Belady);
    }
    let (t0, c0) = (std::time::Instant::now(), thread_cpu_seconds());
    // every row once forward, and once backward for Belady's next-use array
    let passes = 1 + run_policies.contains(&Policy::Belady) as u64;
    let bar = crate::progress::start(passes * (rows.end - rows.start), crate::progress::Unit::Rows);
    let (outcomes, forced) = simulate(
        &trace,
        visit,
        rerouting.as_ref().map(keep::Rerouting::keep),
        &run_policies,
        &cap_layers,
        args.ema_decay,
        near_pick_n,
        args.near_pick_weight,
    )
    .map_err(|e| usage(format!("--trace {}: {e:#}", trace_path.display())))?;
    bar.finish();
    let (secs, cpu) = (t0.elapsed().as_secs_f64(), thread_cpu_seconds() - c0);
    let slots: u64 = outcomes.first().map(|o| o.hits.iter().chain(&o.misses).sum()).unwrap_or(0);
    let lookups = slots * outcomes.len() as u64;
    // on stderr, not in the JSON, so that the JSON depends on the inputs only
    eprintln!(
        "replay: {} simulator(s) [{}] × {slots} expert-slot lookups = {lookups} in {secs:.3} s wall, {cpu:.3} s cpu: {:.1} M lookups/s per cpu second",
        outcomes.len(),
        run_policies.iter().map(|p| p.name()).collect::<Vec<_>>().join(","),
        lookups as f64 / cpu.max(1e-9) / 1e6
    );

    // ---- report
    let (text, json) = report(
        args,
        trace_path,
        &trace,
        &rows,
        &caps,
        &outcomes,
        &forced,
        &policies,
        bound,
        rerouting.as_ref().map(|r| (r.path.as_path(), &r.map)),
        rerouting.as_ref().map(|r| &r.validity.0),
        expert_bytes.as_deref(),
        near_pick_n,
        rerouting.as_ref().map_or(keep::described(&None), |r| r.by.as_str()),
        &warnings,
    );
    crate::analyze::select::print_stdout(&text)?;
    if let Some(out) = &args.json {
        let mut s = serde_json::to_string_pretty(&json)?;
        s.push('\n');
        atomic::write_bytes(out, s.as_bytes())?;
    }
    Ok(0)
}

/// CPU time of the calling thread (the replay is single-threaded), for the speed line.
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer; CLOCK_THREAD_CPUTIME_ID is always available on Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Ids must stay below engine::NONE.
const NONE_LIMIT: usize = engine::NONE as usize;

#[allow(clippy::too_many_arguments)]
fn report(
    args: &ReplayArgs,
    trace_path: &Path,
    trace: &TraceReader,
    rows: &Range<u64>,
    caps: &[Capacity],
    outcomes: &[Outcome],
    forced: &Forced,
    policies: &[Policy],
    bound: bool,
    km: Option<(&Path, &KeepMap)>,
    validity: Option<&Value>,
    expert_bytes: Option<&[u64]>,
    near_pick_n: usize,
    rerouting: &str,
    warnings: &[String],
) -> (String, Value) {
    let h = &trace.header;
    let nl = h.n_layers();
    let mut t = String::new();
    let _ = writeln!(
        t,
        "replay: {}: rows [{}, {}) of {}, {} MoE layers, {} experts, k = {}, top-N {}",
        trace_path.display(),
        rows.start,
        rows.end,
        trace.n_rows,
        nl,
        h.n_expert,
        h.k,
        h.top_n
    );
    let [n_pre, n_dec] = forced.phase_rows;
    let _ = writeln!(
        t,
        "phase: {} ({n_pre} prefill rows, {n_dec} decode rows replayed{})",
        args.phase.name(),
        if args.phase == PhaseSel::All { "" } else { "; the cache sees only these" }
    );
    let forced_total: u64 = forced.forced.iter().sum();
    let short_total: u64 = forced.tokens_short.iter().sum();
    if let Some((p, m)) = km {
        let _ = writeln!(
            t,
            "keep map: {} ({} K={}, re-routed by {rerouting}): {short_total} token-layers with fewer than k = {} survivors in the top-{}{}, {forced_total} forced misses",
            p.display(),
            if m.method.is_empty() { "?" } else { &m.method },
            m.k,
            h.k,
            h.top_n,
            if rerouting == "probability" { "" } else { " named for certain" }
        );
    }
    let totals = |o: &Outcome| {
        let hits: u64 = o.hits.iter().sum();
        let misses: u64 = o.misses.iter().sum::<u64>() + forced_total;
        (hits + misses, hits, misses)
    };
    let belady_of = |c: usize| outcomes.iter().find(|o| o.policy == "belady" && o.capacity == c);
    let order: Vec<&Outcome> = (0..caps.len())
        .flat_map(|c| {
            let mut v: Vec<&Outcome> =
                policies.iter().filter_map(|p| outcomes.iter().find(|o| o.policy == p.name() && o.capacity == c)).collect();
            if bound && !policies.contains(&Policy::Belady) {
                v.extend(belady_of(c));
            }
            v
        })
        .collect();
    let _ = writeln!(
        t,
        "\n{:<20} {:>10} {:>14} {:>14} {:>14} {:>12} {:>10} {:>10}",
        "policy", "capacity", "accesses", "hits", "misses", "forced", "miss rate", "belady"
    );
    for o in &order {
        let (a, hh, m) = totals(o);
        let b = belady_of(o.capacity).map(|b| {
            let (a, _, m) = totals(b);
            format!("{:.2}%", 100.0 * rate(m, a))
        });
        let _ = writeln!(
            t,
            "{:<20} {:>10} {:>14} {:>14} {:>14} {:>12} {:>9.2}% {:>10}",
            o.policy,
            caps[o.capacity].label,
            a,
            hh,
            m,
            forced_total,
            100.0 * rate(m, a),
            b.unwrap_or_else(|| "-".into())
        );
    }
    // per phase: the same simulation, each access counted under its row's phase
    let phase_totals = |o: &Outcome, ph: usize| {
        let hits: u64 = o.phases.hits[ph].iter().sum();
        let misses: u64 = o.phases.misses[ph].iter().sum::<u64>() + forced.phase_forced[ph].iter().sum::<u64>();
        (hits + misses, hits, misses)
    };
    if n_pre > 0 && n_dec > 0 {
        let _ = writeln!(t, "\nper-phase miss rate (one simulation; each access counted under its row's phase)");
        let _ = writeln!(
            t,
            "{:<20} {:>10} {:>14} {:>10} {:>10} {:>14} {:>10} {:>10}",
            "policy", "capacity", "prefill acc", "miss rate", "belady", "decode acc", "miss rate", "belady"
        );
        for o in &order {
            let mut line = format!("{:<20} {:>10}", o.policy, caps[o.capacity].label);
            for ph in 0..2 {
                let (a, _, m) = phase_totals(o, ph);
                let b = belady_of(o.capacity).map_or("-".to_string(), |b| {
                    let (a, _, m) = phase_totals(b, ph);
                    format!("{:.2}%", 100.0 * rate(m, a))
                });
                line += &format!(" {a:>14} {:>9.2}% {b:>10}", 100.0 * rate(m, a));
            }
            let _ = writeln!(t, "{line}");
        }
    }
    // per layer miss rates
    let _ = writeln!(t, "\nper-layer miss rate");
    let mut hdr = format!("{:>6}", "layer");
    for o in &order {
        hdr += &format!(" {:>14}", format!("{}@{}", short_name(o.policy), caps[o.capacity].label));
    }
    let _ = writeln!(t, "{hdr}");
    for li in 0..nl {
        let mut line = format!("{:>6}", h.layers[li]);
        for o in &order {
            let a = o.hits[li] + o.misses[li] + forced.forced[li];
            line += &format!(" {:>13.2}%", 100.0 * rate(o.misses[li] + forced.forced[li], a));
        }
        let _ = writeln!(t, "{line}");
    }

    let phase_json = |o: &Outcome, ph: usize| {
        let (a, hh, m) = phase_totals(o, ph);
        json!({
            "rows": forced.phase_rows[ph], "accesses": a, "hits": hh, "misses": m,
            "forced_misses": forced.phase_forced[ph].iter().sum::<u64>(), "miss_rate": rate(m, a),
            "belady_miss_rate": belady_of(o.capacity).map(|b| { let (a, _, m) = phase_totals(b, ph); rate(m, a) }),
        })
    };
    let result_json = |o: &Outcome| {
        let (a, hh, m) = totals(o);
        let layers: Vec<Value> = (0..nl)
            .map(|li| {
                let misses = o.misses[li] + forced.forced[li];
                let acc = o.hits[li] + misses;
                json!({"layer": h.layers[li], "accesses": acc, "hits": o.hits[li], "misses": misses, "forced_misses": forced.forced[li], "miss_rate": rate(misses, acc)})
            })
            .collect();
        let c = &caps[o.capacity];
        json!({
            "policy": o.policy,
            "capacity": c.label,
            "capacity_mib": c.mib,
            "capacity_per_layer": c.per_layer,
            "total": {"accesses": a, "hits": hh, "misses": m, "forced_misses": forced_total, "miss_rate": rate(m, a)},
            "belady_miss_rate": belady_of(o.capacity).map(|b| { let (a, _, m) = totals(b); rate(m, a) }),
            "phases": {
                "prefill": phase_json(o, 0),
                "decode": phase_json(o, 1),
            },
            "layers": layers,
        })
    };
    let json = json!({
        "format": "reap-replay",
        "version": 1,
        "trace": {
            "path": trace_path.display().to_string(),
            "rows": trace.n_rows,
            "header_count_missing": trace.header_count_missing,
            "layers": h.layers,
            "n_expert": h.n_expert,
            "k": h.k,
            "top_n": h.top_n,
        },
        "tokens": [rows.start, rows.end],
        "phase": args.phase.name(),
        "rows_by_phase": {"prefill": n_pre, "decode": n_dec},
        "parameters": {
            "ema_decay": args.ema_decay,
            "near_pick_n": near_pick_n,
            "near_pick_weight": args.near_pick_weight,
            "rescale_at": ema::RESCALE_AT,
        },
        "expert_bytes": expert_bytes,
        "keep_map": km.map(|(p, m)| json!({
            "path": p.display().to_string(),
            "method": m.method,
            "k": m.k,
            "rerouting": rerouting,
            "tokens_short": short_total,
            "forced_misses": forced_total,
            "layers": (0..nl).map(|li| json!({"layer": h.layers[li], "tokens_short": forced.tokens_short[li], "forced_misses": forced.forced[li]})).collect::<Vec<_>>(),
        })),
        "validity": validity,
        "warnings": warnings,
        "results": order.iter().map(|o| result_json(o)).collect::<Vec<_>>(),
    });
    (t, json)
}

fn short_name(p: &str) -> &str {
    match p {
        "near-pick-ema" => "npema",
        "inverse-router-ema" => "irema",
        p => p,
    }
}
