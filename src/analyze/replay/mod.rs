//! `reap-imatrix replay`: expert-cache simulation over a routing trace. Every policy and
//! capacity runs in one streaming pass over the memory-mapped trace (Belady adds one backward
//! pass for its next-use array). The policies are defined in docs/replay.md.

pub mod belady;
pub mod ema;
pub mod engine;
pub mod gguf;
pub mod lfu;
pub mod lru;
pub mod resident;
pub mod synthetic;
#[cfg(test)]
mod tests;

use crate::analyze::select::keep_map::{sha256_hex, KeepMap};
use crate::error::UsageError;
use crate::formats::atomic;
use crate::formats::saliency::Saliency;
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

    // ---- keep map
    let km = match &args.keep_map {
        None => None,
        Some(p) => {
            let mut m = KeepMap::read(p).map_err(|e| usage(format!("--keep-map: {e:#}")))?;
            without_blocks_after_the_trace(&mut m, &h.layers, p, &mut warnings);
            Some((p, m))
        }
    };
    let keep_flags = match &km {
        None => None,
        Some((p, m)) => Some(keep_flags(p, m, &h.layers, ne, k, &mut warnings)?),
    };
    let validity = match &km {
        None => None,
        Some((p, m)) => Some(validity(p, m, args.reap.as_deref(), &trace, &rows, &visit)?),
    };
    if let Some((_, note)) = &validity {
        eprintln!("note: {note}");
    }
    // DeepSeek-V4's hash-routed blocks: not re-routed (the pruned model's table keeps each
    // token's experts), and refused where the map drops one of the trace's picks there, as
    // prune refuses it
    // which blocks: the model's tables, else the map's hash_layer_count (select copies it from
    // the calibration's JSON)
    let map_hash = km.as_ref().and_then(|(_, m)| {
        let r = m.model.as_ref().filter(|r| r.hash_layer_count.is_some())?;
        Some(h.layers.iter().map(|&b| r.hash_routed(b) == Some(true)).collect::<Vec<bool>>())
    });
    if args.hash_remap && args.model.is_none() && map_hash.is_none() {
        return Err(usage(
            "--hash-remap needs --model, or a keep map that states the model's hash_layer_count (select writes it from a calibration \
             of this version): the model's tables say which blocks route by token id"
                .into(),
        ));
    }
    let hash = match (&km, &args.model, &keep_flags) {
        (Some((p, _)), model, Some(flags)) if model.is_some() || map_hash.is_some() => {
            let hash = match model {
                Some(model) => gguf::hash_blocks(model, &h.layers).map_err(|e| usage(format!("--model: {e:#}")))?,
                None => map_hash.clone().unwrap_or_default(),
            };
            if let Some(li) = hash.iter().position(|&x| x) {
                let how = if args.hash_remap {
                    "the trace's, a dropped one sent to the first kept expert of the map's stand_in the row lacks (--hash-remap)"
                } else {
                    hash_picks_kept(p, &trace, &hash, flags, ne)?;
                    "the trace's, not re-routed"
                };
                eprintln!("note: block {} routes by token id (ffn_gate_tid2eid): its picks are {how}", h.layers[li]);
            }
            Some(hash).filter(|v| v.iter().any(|&x| x))
        }
        _ => None,
    };
    if args.hash_remap && hash.is_none() {
        eprintln!("note: --hash-remap: the model has no hash-routed block (no blk.N.ffn_gate_tid2eid); the flag changes nothing");
    }
    // --hash-remap: each hash-routed layer's stand-in order
    let remap: Option<Vec<Vec<u16>>> = match (&hash, &km) {
        (Some(hash), Some((p, m))) if args.hash_remap => Some(
            m.layers
                .iter()
                .zip(hash)
                .zip(&h.layers)
                .map(|((l, &x), b)| match (l.stand_ins(), x) {
                    (Ok(r), _) => Ok(r.to_vec()),
                    (Err(_), false) => Ok(Vec::new()),
                    (Err(why), true) => Err(usage(format!("--keep-map {}: --hash-remap: block {b} routes by token id, and {why}", p.display()))),
                })
                .collect::<Result<_>>()?,
        ),
        _ => None,
    };
    // the selection bias (and whether the router is a softmax) that re-routing follows
    let reroute = match (&km, &args.model) {
        (Some(_), Some(model)) => reroute_by(model, &trace, args.reap.as_deref())?,
        _ => None,
    };
    // group-limited routing (DeepSeek-V3): modelled where the trace lists every expert
    let mut groups = None;
    let mut model_groups = None;
    if let (Some((p, m)), Some(model)) = (&km, &args.model) {
        if let Some((n, used)) = gguf::expert_groups(model).map_err(|e| usage(format!("--model: {e:#}")))? {
            model_groups = Some((n, used));
            // llama.cpp's own checks on loading (llama-model.cpp)
            if ne % n as usize != 0 || n as usize >= ne || used == 0 || used >= n {
                return Err(usage(format!(
                    "--model {}: {ne} experts in {n} expert groups, {used} used: llama.cpp refuses such a model (the groups must split the \
                     experts, and 0 < groups used < groups)",
                    model.display()
                )));
            }
            let keep: Vec<Vec<u16>> = m.layers.iter().map(|l| l.keep.clone()).collect();
            crate::analyze::prune::check_groups(&keep, &h.layers, p, ne as u64, n as u64, used as u64, k as u64)?;
            if (h.top_n as usize) < ne {
                let w = format!(
                    "the model routes within {used} of {n} expert groups (expert_group_count); re-routing for --keep-map {} needs \
                     every expert's score to choose the groups, and the trace lists the top {} of {ne}: the choice of groups is \
                     not modelled (trace again with --trace-top-n {ne})",
                    p.display(),
                    h.top_n
                );
                eprintln!("warning: {w}");
                warnings.push(w);
            } else {
                groups = Some((n as usize, used as usize));
            }
        }
    }
    let rerouting = format!(
        "{}{}",
        match &reroute {
            None => "probability",
            Some((_, false)) => "probability + selection bias",
            Some((_, true)) => "renormalised probability + selection bias",
        },
        if groups.is_some() { ", within the chosen expert groups" } else { "" }
    );
    let rerouting = rerouting.as_str();
    if let Some((p, _)) = &km {
        // (group masking moves picks below their first candidates too; the groups' own
        // warning or modelling covers it)
        if reroute.is_none() && model_groups.is_none() {
            let (off, scanned) = picks_off_candidates(&trace, &visit);
            if off > 0 {
                let w = match &args.model {
                    None => format!(
                        "{off} token-layers of {scanned} pick experts below their first k candidates: the router adds a selection \
                         bias or routes within expert groups, which re-routing for --keep-map {} ignores without the model (give \
                         --model GGUF to re-route by them)",
                        p.display()
                    ),
                    Some(m) => format!(
                        "{off} token-layers of {scanned} pick experts below their first k candidates, but --model {} has no \
                         selection bias (exp_probs_b): is the trace of this model?",
                        m.display()
                    ),
                };
                eprintln!("warning: {w}");
                warnings.push(w);
            }
        }
    }

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
        keep_flags.as_deref().map(|flags| Keep {
            flags,
            bias: reroute.as_ref().map(|(b, _)| b.as_slice()),
            renormalise: reroute.as_ref().is_some_and(|(_, r)| *r),
            groups,
            fixed: hash.as_deref(),
            remap: remap.as_deref(),
        }),
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
        km.as_ref().map(|(p, m)| (p.as_path(), m)),
        validity.as_ref().map(|v| &v.0),
        expert_bytes.as_deref(),
        near_pick_n,
        rerouting,
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

/// Token-layers with a pick below the trace's first k candidates (ranked lower, or not listed):
/// the mark of a selection bias (or of another trace's model), which re-routing by probability
/// order cannot follow. A pick tied with the k-th candidate is not counted (an exact tie may
/// fall either way). The bias is the model's, so where the replayed rows show none the trace's
/// first rows are looked at too. Returns the count and the rows it is of, in words.
fn picks_off_candidates(trace: &TraceReader, rows: &Rows) -> (u64, String) {
    let nl = trace.header.n_layers();
    let off_in = |row: u64| {
        let row = trace.row(row);
        (0..nl)
            .filter(|&li| {
                let (sel, cand, cp) = (row.sel_ids(li), row.cand_ids(li), row.cand_probs(li));
                let k = sel.len().min(cand.len());
                if k == 0 {
                    return false;
                }
                let p_k = cp[k - 1];
                sel.iter().any(|e| match cand.iter().position(|c| c == e) {
                    Some(r) => r >= k && cp[r] < p_k,
                    None => true,
                })
            })
            .count() as u64
    };
    let off: u64 = (0..rows.len()).map(|i| off_in(rows.get(i))).sum();
    if off > 0 {
        return (off, format!("{} replayed rows", rows.len()));
    }
    let first = trace.n_rows.min(4096);
    ((0..first).map(off_in).sum(), format!("the trace's first {first} rows (none among the replayed rows)"))
}

/// Every pick of the trace in a hash-routed layer (`hash[li]`) must be kept by the map
/// (`flags`, layer-major): the pruned model has no other expert for that token there.
fn hash_picks_kept(map: &Path, trace: &TraceReader, hash: &[bool], flags: &[bool], ne: usize) -> Result<()> {
    for i in 0..trace.n_rows {
        let row = trace.row(i);
        for (li, _) in hash.iter().enumerate().filter(|(_, &x)| x) {
            if let Some(&e) = row.sel_ids(li).iter().find(|&&e| !flags[li * ne + e as usize]) {
                return Err(usage(format!(
                    "--keep-map {}: block {} routes by token id (DeepSeek-V4's hash routing: ffn_gate_tid2eid), and the map drops expert {e}, \
                     which row {i} (token {}) is routed to there; prune refuses such a map unless given --hash-remap",
                    map.display(),
                    trace.header.layers[li],
                    row.token()
                )));
            }
        }
    }
    Ok(())
}

/// `replay --keep-map --model`: the model's selection bias per trace layer and whether its
/// router is a softmax (so that pruning renormalises p, which moves the choice once a bias is
/// added), or None when it has no bias. The model must be the trace's (its MoE blocks hold
/// the trace's expert count). A softmax's renormalisation needs every expert's p: a trace of
/// fewer candidates is refused.
fn reroute_by(model: &Path, trace: &TraceReader, reap: Option<&Path>) -> Result<Option<(Vec<f32>, bool)>> {
    let h = &trace.header;
    let ne = h.n_expert as usize;
    let bad = |e: anyhow::Error| usage(format!("--model: {e:#}"));
    gguf::expert_bytes(model, &h.layers, ne).map_err(bad)?;
    let hash = gguf::hash_blocks(model, &h.layers).map_err(bad)?;
    let Some(bias) = gguf::selection_bias(model, &h.layers, ne, &hash).map_err(bad)? else { return Ok(None) };
    // The router's kind: as the trace's run saw it in the graph (--reap's metadata.routing),
    // else the model's expert_gating_func (llama_expert_gating_func_type: 1 softmax; 2
    // sigmoid and 4 sqrt-softplus, elementwise; 3 selection by the raw logits, whose softmax
    // the trace holds; 0 or absent: the arch's own, which some graphs hard-code).
    enum Kind {
        Softmax,
        Elementwise,
        Logits,
    }
    let kind = match reap {
        Some(r) => {
            let sal = Saliency::read(r).map_err(|e| usage(format!("--reap {}: {e:#}", r.display())))?;
            let routing = sal.routing();
            match (routing.probs_from_logits, routing.probs_op.as_deref()) {
                (Some(true), _) => Kind::Logits,
                (_, Some("SOFT_MAX")) => Kind::Softmax,
                (_, Some(_)) => Kind::Elementwise,
                (_, None) => {
                    return Err(usage(format!(
                        "--reap {}: records no metadata.routing.probs_op (an older file); cannot tell whether {}'s router is a softmax",
                        r.display(),
                        model.display()
                    )))
                }
            }
        }
        None => match gguf::gating_func(model).map_err(bad)? {
            Some(1) => Kind::Softmax,
            Some(2 | 4) => Kind::Elementwise,
            Some(3) => Kind::Logits,
            _ => {
                return Err(usage(format!(
                    "--model {}: has a selection bias (exp_probs_b) but no expert_gating_func key: cannot tell whether its router \
                     is a softmax, which pruning renormalises; give --reap with the saliency JSON of the trace's run (it records the router's op)",
                    model.display()
                )))
            }
        },
    };
    let softmax = match kind {
        Kind::Softmax => true,
        Kind::Elementwise => false,
        Kind::Logits => {
            return Err(usage(format!(
                "--model {}: selects by the router's raw logits plus a selection bias (expert_gating_func 3); the trace holds their \
                 softmax, not the logits, so replay cannot re-route it",
                model.display()
            )))
        }
    };
    if softmax && (h.top_n as usize) < ne {
        return Err(usage(format!(
            "--model {}: a softmax router with a selection bias: the pruned model's probabilities are renormalised over the kept \
             experts, which needs every expert's p, and the trace lists the top {} of {ne}; trace again with --trace-top-n {ne}",
            model.display(),
            h.top_n
        )));
    }
    Ok(Some((bias, softmax)))
}

/// Ids must stay below engine::NONE.
const NONE_LIMIT: usize = engine::NONE as usize;

/// Drops the keep map's trailing entries named for blocks after the trace's last one: a
/// nextn/MTP block (`--nextn` calibrates it and `select` keeps its experts), which no trace
/// holds, as the forward pass never runs it. Noted, as `prune --drop-nextn` notes them.
fn without_blocks_after_the_trace(m: &mut KeepMap, blocks: &[u32], path: &Path, warnings: &mut Vec<String>) {
    let Some(&last) = blocks.last() else { return };
    let n = m.layers.iter().rev().take_while(|l| l.layer.is_some_and(|b| b > last)).count();
    if n == 0 || m.layers.len() - n != blocks.len() {
        return;
    }
    let dropped: Vec<u32> = m.layers.drain(m.layers.len() - n..).filter_map(|l| l.layer).collect();
    let w = format!("keep map {}: block(s) {dropped:?} come after the trace's last block {last} (a nextn/MTP block, which no trace holds): not replayed", path.display());
    eprintln!("note: {w}");
    warnings.push(w);
}

/// The keep map's survivors as `n_layers × n_expert` flags, checked against the trace.
fn keep_flags(path: &Path, m: &KeepMap, blocks: &[u32], ne: usize, k: usize, warnings: &mut Vec<String>) -> Result<Vec<bool>> {
    m.fits(blocks, ne, "the trace").map_err(|e| usage(format!("--keep-map {}: {e}", path.display())))?;
    let mut f = vec![false; blocks.len() * ne];
    for (li, (l, &b)) in m.layers.iter().zip(blocks).enumerate() {
        for &e in &l.keep {
            f[li * ne + e as usize] = true;
        }
        if l.keep.len() < k {
            let w =
                format!("keep map keeps {} experts in block {b}, fewer than k = {k}: every token there has forced misses", l.keep.len());
            eprintln!("warning: {w}");
            warnings.push(w);
        }
    }
    Ok(f)
}

/// Whether the replayed rows are tokens the keep map was fitted on (the audit's validity note).
/// The map's saliency file covers the first `source.tokens` tokens of its run, and a trace holds
/// the first tokens of its run, so rows below `source.tokens` of the same run are in-sample.
fn validity(path: &Path, m: &KeepMap, reap: Option<&Path>, trace: &TraceReader, rows: &Range<u64>, visit: &Rows) -> Result<(Value, String)> {
    let reap = reap.map(|r| read_reap(r, trace)).transpose()?;
    let Some(src) = &m.source else {
        let note = format!(
            "keep map {} records no source: cannot tell whether these rows are in-sample (replaying a map on the tokens it was fitted on is in-sample)",
            path.display()
        );
        return Ok((json!({"same_run": "unknown", "in_sample": Value::Null, "note": note}), note));
    };
    if trace.header.flags & crate::formats::trace::FLAG_DECODE != 0 {
        // trace-decode writes no saliency JSON: no keep map is fitted on its run
        let note = format!(
            "keep map fitted on {} ({} tokens of a calibration run); this trace was written by trace-decode over its own prompts and \
             generations: out-of-sample, unless those prompts appear in the text the map was fitted on",
            src.path, src.tokens
        );
        return Ok((
            json!({
                "source": {"path": src.path, "sha256": src.sha256, "tokens": src.tokens, "trace_tokens_written": src.trace_tokens_written},
                "same_run": "different", "decode_trace": true, "in_sample_rows": Value::Null, "in_sample": Value::Null, "note": note,
            }),
            note,
        ));
    }
    let h = &trace.header;
    let (same_run, why) = match reap {
        Some((sha, top_n)) => {
            if sha != src.sha256 {
                ("different", "--reap is not the keep map's source file, so the map was fitted on another run (or another checkpoint)".to_string())
            } else if src.trace_tokens_written == 0 {
                ("unknown", "--reap is the keep map's source, but that run wrote no trace: this trace is another run's".to_string())
            } else if let Some(n) = top_n.filter(|&n| n != h.top_n as u64) {
                let why = format!(
                    "--reap is the keep map's source, but that run traced the top-{n} candidates and this trace holds the top-{}: another run's trace",
                    h.top_n
                );
                ("unknown", why)
            } else if trace.n_rows >= src.trace_tokens_written {
                // a JSON of a checkpoint counts fewer rows than its run's trace goes on to hold
                ("confirmed", "--reap has the keep map's source sha256".to_string())
            } else {
                let why = format!(
                    "--reap is the keep map's source, but that run had traced {} rows and this trace holds {}: another run's trace",
                    src.trace_tokens_written, trace.n_rows
                );
                ("unknown", why)
            }
        }
        None if src.trace_tokens_written > 0 && src.trace_tokens_written == trace.n_rows => (
            "assumed",
            format!("the trace has exactly the {} rows the map's source run traced; pass --reap to confirm", src.trace_tokens_written),
        ),
        None => ("unknown", "pass --reap with the trace's saliency JSON to tell".to_string()),
    };
    let overlap = match visit {
        Rows::Range(_) => rows.end.min(src.tokens).saturating_sub(rows.start),
        Rows::List(l) => l.iter().filter(|&&i| i < src.tokens).count() as u64,
    };
    let in_sample = match same_run {
        "different" => Value::Null,
        _ => json!(overlap > 0),
    };
    let note = match same_run {
        "different" => format!(
            "keep map fitted on {} (sha256 {}…), {why}; in-sample only if that run saw these tokens",
            src.path,
            &src.sha256[..src.sha256.len().min(12)]
        ),
        _ => {
            let fair = if src.tokens < trace.n_rows {
                format!("a fair test replays rows ≥ {0} (--tokens {0}..) or a trace of other text", src.tokens)
            } else {
                "every row of this trace was in the fit: a fair test needs a trace of other text".to_string()
            };
            format!(
                "keep map fitted on the first {} tokens of the run that wrote {} (same run as this trace: {same_run}; {why}). \
                 Rows [{}, {}) include {overlap} of those tokens: {}; {fair}.",
                src.tokens,
                src.path,
                rows.start,
                rows.end,
                match (overlap > 0, same_run) {
                    (false, _) => "out-of-sample",
                    (true, "unknown") => "the replay is IN-SAMPLE if this trace is of that run",
                    (true, _) => "the replay is IN-SAMPLE",
                },
            )
        }
    };
    Ok((
        json!({
            "source": {"path": src.path, "sha256": src.sha256, "tokens": src.tokens, "trace_tokens_written": src.trace_tokens_written},
            "same_run": same_run,
            "in_sample_rows": overlap,
            "in_sample": in_sample,
            "note": note,
        }),
        note,
    ))
}

/// `--reap`: a saliency JSON of the trace's model (its MoE layers, experts and k; refused
/// otherwise), as its sha256 and the top-N its run traced (None where the file does not record
/// it).
fn read_reap(r: &Path, trace: &TraceReader) -> Result<(String, Option<u64>)> {
    let bytes = std::fs::read(r).map_err(|e| usage(format!("--reap {}: {e}", r.display())))?;
    let sal = serde_json::from_slice::<Value>(&bytes)
        .map_err(|e| anyhow!("not valid JSON: {e}"))
        .and_then(|v| Saliency::from_json(&v))
        .map_err(|e| usage(format!("--reap {}: not a saliency JSON: {e:#}", r.display())))?;
    let h = &trace.header;
    let blocks: Vec<u32> = sal.layers.iter().map(|l| l.layer).collect();
    if blocks != h.layers {
        return Err(usage(format!("--reap {}: its MoE layers {blocks:?} are not the trace's {:?}", r.display(), h.layers)));
    }
    if let Some(l) = sal.layers.iter().find(|l| l.n_expert != h.n_expert as usize || l.n_expert_used != h.k as usize) {
        return Err(usage(format!(
            "--reap {}: {} experts, k = {} in layer {}; the trace has {} experts per layer, k = {}",
            r.display(),
            l.n_expert,
            l.n_expert_used,
            l.layer,
            h.n_expert,
            h.k
        )));
    }
    // the run records the --trace-top-n asked for; its trace holds at most n_expert candidates
    let top_n = sal.metadata.get("run").and_then(|r| r.get("trace_top_n")).and_then(Value::as_u64).map(|n| n.min(h.n_expert as u64));
    Ok((sha256_hex(&bytes), top_n))
}

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
