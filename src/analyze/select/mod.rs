//! `reap-imatrix select`: keep maps (which experts each MoE layer keeps) from a saliency JSON,
//! one per method and K, and a report on what each map gives up. See docs/select.md.

pub mod domains;
pub mod keep_map;
pub mod score;
pub mod screen;

use crate::error::UsageError;
use crate::formats::atomic;
use crate::formats::saliency::Saliency;
use crate::formats::trace::TraceReader;
use anyhow::{anyhow, Result};
use keep_map::{sha256_hex, KeepLayer, KeepMap, ModelRef, Source};
use score::{Method, Params, Prior};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PriorArg {
    /// median of the live experts' means (default)
    Median,
    /// lower confidence bound mean − z·sd/√count (see --z)
    Lcb,
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Methods: frequency, reap_mean, reap_l2_sum, ean_sum, reap_shrink, reap_hybrid, reap_softmax_mean, reap_softmax_l2_sum\n\
(formulas in docs/select.md).\n\
Writes DIR/keep_<method>_k<K>.json per method and K, and DIR/select_report.json; prints the report.")]
pub struct SelectArgs {
    /// Saliency JSON (--reap-out of a calibration run)
    #[arg(long, value_name = "FILE")]
    pub reap: PathBuf,
    /// Scoring methods, comma-separated
    #[arg(long = "method", value_name = "M[,M…]", value_delimiter = ',', required = true, value_enum)]
    pub methods: Vec<Method>,
    /// Experts to keep per layer, comma-separated
    #[arg(long = "k", value_name = "K[,K…]", value_delimiter = ',', required = true)]
    pub ks: Vec<usize>,
    /// Folder for the keep maps and select_report.json (created if missing)
    #[arg(long = "out-dir", value_name = "DIR")]
    pub out_dir: PathBuf,
    /// Routing trace of the same model: adds the substitution screen to the report
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Prior of reap_shrink (and so of reap_hybrid)
    #[arg(long, value_enum, default_value = "median")]
    pub prior: PriorArg,
    /// z of the lower confidence bound (--prior lcb) [default: 1]
    #[arg(long, value_name = "Z")]
    pub z: Option<f64>,
    /// Pseudo-count m of the shrink (--prior median) [default: the layer's median live count]
    #[arg(long = "shrink-m", value_name = "M")]
    pub shrink_m: Option<f64>,
    /// Experts with count < C rank below all others (every method)
    #[arg(long = "min-count", default_value_t = 0, value_name = "C")]
    pub min_count: u64,
    /// reap_l2_sum scores experts by Σ_d W_d · reap_l2_sum_d over the saliency file's domains
    /// (unlisted domains weigh 1; needs a calibration with --domains)
    #[arg(long = "domain-weights", value_name = "NAME=W[,NAME=W…]")]
    pub domain_weights: Option<String>,
    /// Also print the per-layer tables (select_report.json always has them)
    #[arg(long = "per-layer")]
    pub per_layer: bool,
}

fn usage(msg: String) -> anyhow::Error {
    anyhow!(UsageError(msg))
}

/// Everything one map's report needs, per layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStats {
    pub layer: u32,
    pub count_share: f64,
    pub l2_share: f64,
    pub min_kept_count: u64,
    pub dead_kept: usize,
}

impl LayerStats {
    pub fn slot_replacement(&self) -> f64 {
        1.0 - self.count_share
    }
}

pub fn layer_stats(l: &crate::formats::saliency::LayerSums, keep: &[u16]) -> LayerStats {
    let total: u64 = l.count.iter().sum();
    let kept: u64 = keep.iter().map(|&i| l.count[i as usize]).sum();
    let l2: f64 = l.reap_l2_sum.iter().sum();
    let l2_kept: f64 = keep.iter().map(|&i| l.reap_l2_sum[i as usize]).sum();
    LayerStats {
        layer: l.layer,
        count_share: if total > 0 { kept as f64 / total as f64 } else { 1.0 },
        l2_share: if l2 > 0.0 { l2_kept / l2 } else { 1.0 },
        min_kept_count: keep.iter().map(|&i| l.count[i as usize]).min().unwrap_or(0),
        dead_kept: keep.iter().filter(|&&i| l.count[i as usize] == 0).count(),
    }
}

/// Keep sets of one method for every K: `[k_index][layer]`.
pub fn select_method(s: &Saliency, method: Method, ks: &[usize], p: &Params) -> Vec<Vec<Vec<u16>>> {
    let orders: Vec<Vec<usize>> = s.layers.iter().map(|l| score::order(l, &score::scores(l, method, p), p.min_count)).collect();
    ks.iter().map(|&k| orders.iter().map(|o| score::keep_set_grouped(o, k, p.groups)).collect()).collect()
}

/// The first layer (index into `layers`) where a smaller K's set is not inside the next K's.
pub fn nesting_violation(sets: &[Vec<Vec<u16>>]) -> Option<(usize, usize)> {
    for ki in 1..sets.len() {
        for (li, (small, big)) in sets[ki - 1].iter().zip(&sets[ki]).enumerate() {
            if !small.iter().all(|e| big.binary_search(e).is_ok()) {
                return Some((ki, li));
            }
        }
    }
    None
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

pub fn run(args: &SelectArgs) -> Result<i32> {
    // ---- inputs
    let bytes = std::fs::read(&args.reap).map_err(|e| usage(format!("--reap {}: {e}", args.reap.display())))?;
    let sha = sha256_hex(&bytes);
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| usage(format!("--reap {}: not valid JSON: {e}", args.reap.display())))?;
    let sal = Saliency::from_json(&value).map_err(|e| usage(format!("--reap {}: {e:#}", args.reap.display())))?;
    if sal.layers.is_empty() {
        return Err(usage(format!("--reap {}: no MoE layers", args.reap.display())));
    }
    if let Some(why) = sal.value_problem() {
        return Err(usage(format!("--reap {}: {why}", args.reap.display())));
    }
    let mut methods: Vec<Method> = Vec::new();
    for m in &args.methods {
        if !methods.contains(m) {
            methods.push(*m);
        }
    }
    if let Some(m) = methods.iter().find(|m| m.uses_reference()) {
        if sal.layers.iter().any(|l| l.reference.is_none()) {
            return Err(usage(format!(
                "--method {}: {} has no reap_softmax_l2_sum (written before reap-imatrix collected it); calibrate again to use it",
                m.name(),
                args.reap.display()
            )));
        }
    }
    let mut ks = args.ks.clone();
    ks.sort_unstable();
    ks.dedup();
    for &k in &ks {
        for l in &sal.layers {
            if k > l.n_expert {
                return Err(usage(format!("--k {k}: larger than layer {}'s {} experts (in {})", l.layer, l.n_expert, args.reap.display())));
            }
            if k < l.n_expert_used.max(1) {
                return Err(usage(format!(
                    "--k {k}: fewer than the {} experts each token uses in layer {} (in {})",
                    l.n_expert_used,
                    l.layer,
                    args.reap.display()
                )));
            }
        }
    }
    let (groups, groups_used) = expert_groups(&sal);
    if groups > 1 {
        let ne = sal.layers[0].n_expert;
        if ne % groups != 0 {
            return Err(usage(format!("--reap {}: {ne} experts do not split into {groups} expert groups", args.reap.display())));
        }
        for &k in &ks {
            // llama.cpp scores a group by its best two experts, then takes the top k among the
            // experts of the groups_used best groups: both must still be possible
            let per = k / groups;
            let need = sal.layers.iter().map(|l| l.n_expert_used).max().unwrap_or(0);
            if k % groups != 0 || per < 2 || per * groups_used < need {
                return Err(usage(format!(
                    "--k {k}: the model routes within {groups} expert groups ({groups_used} used per token, in {}), so every group keeps K/{groups}: K must be a multiple of {groups}, with at least 2 per group and {groups_used} groups holding the {need} experts a token uses",
                    args.reap.display()
                )));
            }
        }
    }
    let z = args.z.unwrap_or(1.0);
    if !(z.is_finite() && z >= 0.0) {
        return Err(usage(format!("--z {z}: must be a finite number ≥ 0")));
    }
    // a flag that changes nothing is said, not recorded as if it had been used
    let prior_used = methods.iter().any(|m| m.uses_prior());
    let unused = [
        (args.z.is_some() && args.prior != PriorArg::Lcb, "--z is the lower confidence bound's (--prior lcb)"),
        (args.shrink_m.is_some() && args.prior == PriorArg::Lcb, "--shrink-m is the median prior's (--prior median)"),
        (!prior_used && (args.prior != PriorArg::Median || args.z.is_some() || args.shrink_m.is_some()), "--prior, --z and --shrink-m are reap_shrink's and reap_hybrid's, and neither is among the methods"),
    ];
    for (_, why) in unused.iter().filter(|(hit, _)| *hit) {
        eprintln!("warning: {why}: it has no effect here");
    }
    if let Some(m) = args.shrink_m {
        if !(m.is_finite() && m >= 0.0) {
            return Err(usage(format!("--shrink-m {m}: must be a finite number ≥ 0")));
        }
    }
    let trace = match &args.trace {
        None => None,
        Some(p) => {
            let t = TraceReader::open(p).map_err(|e| usage(format!("--trace: {e:#}")))?;
            let blocks: Vec<u32> = sal.layers.iter().map(|l| l.layer).collect();
            if t.header.layers != blocks {
                return Err(usage(format!(
                    "--trace {}: its MoE layers {:?} are not the saliency file's {:?}",
                    p.display(),
                    t.header.layers,
                    blocks
                )));
            }
            if let Some(l) = sal.layers.iter().find(|l| l.n_expert != t.header.n_expert as usize || l.n_expert_used != t.header.k as usize) {
                return Err(usage(format!(
                    "--trace {}: {} experts per layer, k = {}; the saliency file has {} experts, k = {} in layer {}",
                    p.display(),
                    t.header.n_expert,
                    t.header.k,
                    l.n_expert,
                    l.n_expert_used,
                    l.layer
                )));
            }
            if t.header_count_missing {
                eprintln!("warning: trace {}: header says 0 tokens; using the {} complete rows present", p.display(), t.n_rows);
            }
            Some(t)
        }
    };
    // refusals come before anything is written: no empty --out-dir is left behind
    let reweighted = match &args.domain_weights {
        None => None,
        Some(spec) => {
            if !methods.contains(&Method::ReapL2Sum) {
                return Err(usage("--domain-weights applies to --method reap_l2_sum, which is not among the methods".into()));
            }
            let w = domains::parse_weights(spec, &sal).map_err(usage)?;
            Some((domains::weighted(&sal, &w), w))
        }
    };

    let prior = match args.prior {
        PriorArg::Median => Prior::Median,
        PriorArg::Lcb => Prior::Lcb { z },
    };
    let params = Params { prior, shrink_m: args.shrink_m, min_count: args.min_count, groups };
    let source = Source {
        path: args.reap.display().to_string(),
        sha256: sha.clone(),
        tokens: sal.tokens,
        trace_tokens_written: sal.trace_tokens_written,
    };

    // the model the sums were measured on, so prune can refuse a map meant for another one
    let model = sal.metadata.get("model").map(|m| ModelRef { expert_count: Some(sal.layers[0].n_expert as u64), ..ModelRef::from_json(m) });

    // ---- keep sets (reap_l2_sum over the reweighted domains with --domain-weights)
    let sets: Vec<Vec<Vec<Vec<u16>>>> = methods
        .iter()
        .map(|&m| match (&reweighted, m) {
            (Some((ws, _)), Method::ReapL2Sum) => select_method(ws, m, &ks, &params),
            _ => select_method(&sal, m, &ks, &params),
        })
        .collect();
    // a model with hash-routed blocks: their stand-in order for `prune --hash-remap`; every
    // layer's where the JSON does not say which blocks (written before hash_layer_count was)
    let arch = sal.metadata.get("model").and_then(|m| m.get("architecture")).and_then(Value::as_str);
    let hash_arch = arch.is_some_and(|a| crate::analyze::prune::plan::HASH_ROUTED_ARCHS.contains(&a));
    let hash_routed = |block: u32| hash_arch && model.as_ref().and_then(|m| m.hash_routed(block)).unwrap_or(true);

    // ---- screen (one pass for all maps), before any file: a damaged trace is refused
    let screened = match (&trace, &args.trace) {
        (Some(t), Some(p)) => {
            let ne = t.header.n_expert as usize;
            let keeps: Vec<Vec<bool>> = sets
                .iter()
                .flat_map(|per_k| per_k.iter())
                .map(|layers| {
                    let mut f = vec![false; layers.len() * ne];
                    for (li, keep) in layers.iter().enumerate() {
                        for &e in keep {
                            f[li * ne + e as usize] = true;
                        }
                    }
                    f
                })
                .collect();
            Some(screen::screen(t, &keeps).map_err(|e| usage(format!("--trace {}: {e:#}", p.display())))?)
        }
        _ => None,
    };

    // ---- maps
    std::fs::create_dir_all(&args.out_dir).map_err(|e| usage(format!("--out-dir {}: {e}", args.out_dir.display())))?;
    let mut written = Vec::new();
    for (mi, &m) in methods.iter().enumerate() {
        for (ki, &k) in ks.iter().enumerate() {
            let map = KeepMap {
                method: m.name().into(),
                k,
                parameters: {
                    let mut p = method_parameters(m, &params, &sal);
                    if let (Some((_, w)), Method::ReapL2Sum) = (&reweighted, m) {
                        p["domain_weights"] = sal.domains.iter().zip(w).map(|(d, &x)| (d.name.clone(), json!(x))).collect::<serde_json::Map<_, _>>().into();
                    }
                    p
                },
                source: Some(source.clone()),
                model: model.clone(),
                layers: sal
                    .layers
                    .iter()
                    .zip(&sets[mi][ki])
                    .map(|(l, keep)| KeepLayer {
                        layer: Some(l.layer),
                        keep: keep.clone(),
                        stand_in: hash_routed(l.layer).then(|| score::stand_in_order(l, keep)),
                    })
                    .collect(),
            };
            let path = args.out_dir.join(map_file_name(m, k));
            map.write(&path)?;
            written.push(path);
        }
    }

    // ---- report
    let (text, report) = build_report(args, &sal, &source, &methods, &ks, &params, &sets, screened.as_deref(), trace.as_ref());
    let mut out = serde_json::to_string_pretty(&report)?;
    out.push('\n');
    let report_path = args.out_dir.join("select_report.json");
    atomic::write_bytes(&report_path, out.as_bytes())?;
    print_stdout(&format!(
        "{text}wrote {} keep maps and {} to {}\n",
        written.len(),
        report_path.file_name().unwrap().to_string_lossy(),
        args.out_dir.display()
    ))?;
    Ok(0)
}

/// Prints a report on stdout. A reader that has gone (`| head`) ends the printing quietly
/// instead of a panic: the files are written either way.
pub fn print_stdout(text: &str) -> Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(anyhow!("stdout: {e}")),
        _ => Ok(()),
    }
}

pub fn map_file_name(m: Method, k: usize) -> String {
    format!("keep_{}_k{k}.json", m.name())
}

/// `metadata.model.expert_group_count` and `expert_group_used_count` (1 and 1 where absent
/// or 0: no group routing).
pub fn expert_groups(sal: &Saliency) -> (usize, usize) {
    let key = |k: &str| {
        let v = sal.metadata.get("model").and_then(|m| m.get(k));
        v.and_then(|v| v.as_u64().or_else(|| v.as_str().and_then(|s| s.parse().ok()))).filter(|&n| n > 0).unwrap_or(1) as usize
    };
    let groups = key("expert_group_count");
    (groups, if groups > 1 { key("expert_group_used_count").min(groups) } else { 1 })
}

fn method_parameters(m: Method, p: &Params, sal: &Saliency) -> Value {
    let mut v = json!({"min_count": p.min_count, "tie_break": "lowest expert id", "dead_experts": "ranked after every live expert"});
    if p.groups > 1 {
        v["expert_groups"] = json!(p.groups);
        v["per_group"] = json!("each group keeps K / expert_groups: its best experts by the method");
    }
    if m.uses_prior() {
        match p.prior {
            Prior::Lcb { z } => {
                v["prior"] = json!("lcb");
                v["z"] = json!(z);
            }
            _ => {
                v["prior"] = json!("median");
                v["shrink_m"] = match p.shrink_m {
                    Some(x) => json!(x),
                    None => json!("median live count"),
                };
                v["shrink_m_per_layer"] = json!(sal.layers.iter().map(|l| score::shrink_m(l, p)).collect::<Vec<f64>>());
                v["shrink_prior_per_layer"] = json!(sal.layers.iter().map(|l| score::prior_value(l, p.prior)).collect::<Vec<_>>());
            }
        }
    }
    if m.uses_reference() {
        v["gate"] = json!("p: the router's softmax probability over all experts, before top-k normalisation");
    }
    if m == Method::ReapHybrid {
        v["combination"] = json!("mean of the reap_l2_sum and reap_shrink ranks (ties share the average rank)");
    }
    v
}

#[allow(clippy::too_many_arguments)]
fn build_report(
    args: &SelectArgs,
    sal: &Saliency,
    source: &Source,
    methods: &[Method],
    ks: &[usize],
    params: &Params,
    sets: &[Vec<Vec<Vec<u16>>>],
    screened: Option<&[Vec<screen::ScreenLayer>]>,
    trace: Option<&TraceReader>,
) -> (String, Value) {
    let mut t = String::new();
    // column widths that fit the longest method name
    let w = methods.iter().map(|m| m.name().len()).max().unwrap_or(0).max(12);
    let cw = (w + 1).max(16);
    let n_expert: Vec<usize> = sal.layers.iter().map(|l| l.n_expert).collect();
    let dead: Vec<(u32, Vec<usize>)> = sal
        .layers
        .iter()
        .map(|l| (l.layer, (0..l.n_expert).filter(|&i| l.count[i] == 0).collect::<Vec<_>>()))
        .filter(|(_, d)| !d.is_empty())
        .collect();
    let n_dead: usize = dead.iter().map(|(_, d)| d.len()).sum();
    let ne_txt = if n_expert.iter().all(|&n| n == n_expert[0]) { n_expert[0].to_string() } else { format!("{n_expert:?}") };
    let _ = writeln!(
        t,
        "select: {} (sha256 {}…): {} MoE layers, {} experts, top-{}, {} tokens",
        source.path,
        &source.sha256[..12],
        sal.layers.len(),
        ne_txt,
        sal.layers[0].n_expert_used,
        sal.tokens
    );
    let dead_txt: Vec<String> =
        dead.iter().map(|(l, d)| format!("L{l}: {}", d.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" "))).collect();
    let _ =
        writeln!(t, "dead experts (count 0): {n_dead}{}", if n_dead > 0 { format!(" ({})", dead_txt.join("; ")) } else { String::new() });
    let _ = writeln!(
        t,
        "prior for reap_shrink/reap_hybrid: {}; min-count {}",
        match params.prior {
            Prior::Lcb { z } => format!("lcb, z = {z}"),
            _ => format!(
                "median of live means, pseudo-count {}",
                params.shrink_m.map(|m| m.to_string()).unwrap_or_else(|| "= median live count".into())
            ),
        },
        params.min_count
    );
    if let Some(tr) = trace {
        let _ = writeln!(t, "trace: {} rows (substitution screen)", tr.n_rows);
    }

    let mut maps_json = Vec::new();
    for (ki, &k) in ks.iter().enumerate() {
        let _ = writeln!(t, "\nK = {k}");
        let mut hdr = format!(
            "{:<w$} {:>10} {:>14} {:>10} {:>9} {:>9} {:>9}",
            "method", "slot repl", "worst (layer)", "count kept", "l2 kept", "min count", "dead kept"
        );
        if screened.is_some() {
            hdr += &format!(" {:>12} {:>10} {:>10} {:>8}", "slots pruned", "gate lost", "prob lost", "short");
        }
        let _ = writeln!(t, "{hdr}");
        for (mi, &m) in methods.iter().enumerate() {
            let layers: Vec<LayerStats> = sal.layers.iter().zip(&sets[mi][ki]).map(|(l, keep)| layer_stats(l, keep)).collect();
            let repl: Vec<f64> = layers.iter().map(|s| s.slot_replacement()).collect();
            let mean_repl = repl.iter().sum::<f64>() / repl.len() as f64;
            let (worst_i, worst) = repl.iter().copied().enumerate().fold((0, f64::MIN), |a, (i, x)| if x > a.1 { (i, x) } else { a });
            let total: u64 = sal.layers.iter().map(|l| l.count.iter().sum::<u64>()).sum();
            let kept: u64 =
                sal.layers.iter().zip(&sets[mi][ki]).map(|(l, keep)| keep.iter().map(|&i| l.count[i as usize]).sum::<u64>()).sum();
            let count_share = if total > 0 { kept as f64 / total as f64 } else { 1.0 };
            let l2_mean = layers.iter().map(|s| s.l2_share).sum::<f64>() / layers.len() as f64;
            let min_count = layers.iter().map(|s| s.min_kept_count).min().unwrap_or(0);
            let dead_kept: usize = layers.iter().map(|s| s.dead_kept).sum();
            let mut line = format!(
                "{:<w$} {:>10} {:>14} {:>10} {:>9} {:>9} {:>9}",
                m.name(),
                pct(mean_repl),
                format!("{} (L{})", pct(worst), layers[worst_i].layer),
                pct(count_share),
                pct(l2_mean),
                min_count,
                dead_kept
            );
            let mut screen_json = Value::Null;
            if let Some(sc) = screened {
                let sl = &sc[mi * ks.len() + ki];
                let nl = sl.len() as f64;
                let slot = sl.iter().map(|s| s.slot_share_pruned()).sum::<f64>() / nl;
                let (wi, wv) =
                    sl.iter().map(|s| s.slot_share_pruned()).enumerate().fold((0, f64::MIN), |a, (i, x)| if x > a.1 { (i, x) } else { a });
                let gate = sl.iter().map(|s| s.gate_share_lost()).sum::<f64>() / nl;
                let prob = sl.iter().map(|s| s.router_prob_lost_per_token()).sum::<f64>() / nl;
                let short: u64 = sl.iter().map(|s| s.tokens_short).sum();
                line += &format!(" {:>12} {:>10} {:>10} {:>8}", pct(slot), pct(gate), format!("{prob:.4}"), short);
                screen_json = json!({
                    "slot_share_pruned_mean": slot,
                    "slot_share_pruned_worst": {"layer": sal.layers[wi].layer, "value": wv},
                    "gate_share_lost_mean": gate,
                    "router_prob_lost_per_token_mean": prob,
                    "token_layers_short": short,
                    "layers": sal.layers.iter().zip(sl).map(|(l, s)| json!({
                        "layer": l.layer,
                        "tokens": s.tokens,
                        "slots": s.slots,
                        "pruned_slots": s.pruned_slots,
                        "slot_share_pruned": s.slot_share_pruned(),
                        "tokens_with_pruned_pick": s.tokens_hit,
                        "tokens_short": s.tokens_short,
                        "gate_share_lost": s.gate_share_lost(),
                        "router_prob_lost": s.router_prob_pruned,
                        "router_prob_lost_per_token": s.router_prob_lost_per_token(),
                        "picks_not_in_candidates": s.picks_not_in_candidates,
                    })).collect::<Vec<_>>(),
                });
            }
            let _ = writeln!(t, "{line}");
            let by_domain = domains::kept(sal, &sets[mi][ki]);
            if !by_domain.is_empty() {
                let parts: Vec<String> = by_domain.iter().map(|d| format!("{} {} (worst L{} {})", d.name, pct(d.slots_kept), d.worst.0, pct(d.worst.1))).collect();
                let _ = writeln!(t, "{:<12} slots kept per domain: {}", "", parts.join(", "));
            }
            maps_json.push(json!({
                "domains": by_domain.iter().map(|d| json!({
                    "name": d.name,
                    "slots_kept": d.slots_kept,
                    "slot_replacement": 1.0 - d.slots_kept,
                    "worst_layer": {"layer": d.worst.0, "slots_kept": d.worst.1},
                })).collect::<Vec<_>>(),
                "method": m.name(),
                "k": k,
                "file": map_file_name(m, k),
                "slot_replacement_mean": mean_repl,
                "slot_replacement_worst": {"layer": layers[worst_i].layer, "value": worst},
                "count_share_kept": count_share,
                "l2_share_kept_mean": l2_mean,
                "min_kept_count": min_count,
                "dead_kept": dead_kept,
                "layers": layers.iter().map(|s| json!({
                    "layer": s.layer,
                    "count_share_kept": s.count_share,
                    "l2_share_kept": s.l2_share,
                    "slot_replacement": s.slot_replacement(),
                    "min_kept_count": s.min_kept_count,
                    "dead_kept": s.dead_kept,
                })).collect::<Vec<_>>(),
                "screen": screen_json,
            }));
        }
        if methods
            .iter()
            .zip(sets)
            .any(|(_, s)| s[ki].iter().zip(&sal.layers).any(|(keep, l)| keep.len() > l.count.iter().filter(|&&c| c > 0).count()))
        {
            let _ = writeln!(t, "note: K = {k} exceeds the live experts of some layer; dead experts fill the rest (after every live one)");
        }
    }

    // overlap between methods
    let mut overlap_json = Vec::new();
    if methods.len() > 1 {
        for (ki, &k) in ks.iter().enumerate() {
            let _ = writeln!(t, "\noverlap at K = {k}: experts kept by both, mean over layers [min]");
            let mut hdr = format!("{:<w$}", "");
            for m in methods {
                hdr += &format!(" {:>cw$}", m.name());
            }
            let _ = writeln!(t, "{hdr}");
            for (a, &ma) in methods.iter().enumerate() {
                let mut line = format!("{:<w$}", ma.name());
                for (b, &mb) in methods.iter().enumerate() {
                    let per: Vec<usize> = sets[a][ki]
                        .iter()
                        .zip(&sets[b][ki])
                        .map(|(x, y)| x.iter().filter(|e| y.binary_search(e).is_ok()).count())
                        .collect();
                    let mean = per.iter().sum::<usize>() as f64 / per.len() as f64;
                    let min = per.iter().copied().min().unwrap_or(0);
                    line += &format!(" {:>cw$}", format!("{mean:.1} [{min}]"));
                    if a < b {
                        overlap_json.push(json!({"k": k, "a": ma.name(), "b": mb.name(), "mean": mean, "min": min, "layers": per}));
                    }
                }
                let _ = writeln!(t, "{line}");
            }
        }
    }

    // nesting across K
    let mut nested_json = serde_json::Map::new();
    if ks.len() > 1 {
        let _ = writeln!(t);
        for (mi, &m) in methods.iter().enumerate() {
            match nesting_violation(&sets[mi]) {
                None => {
                    let _ = writeln!(
                        t,
                        "nested across K ({}): {} yes",
                        ks.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(" ⊂ "),
                        m.name()
                    );
                    nested_json.insert(m.name().into(), json!({"nested": true}));
                }
                Some((ki, li)) => {
                    let _ = writeln!(
                        t,
                        "nested across K: {} NO: K={} is not inside K={} in layer {}",
                        m.name(),
                        ks[ki - 1],
                        ks[ki],
                        sal.layers[li].layer
                    );
                    nested_json.insert(
                        m.name().into(),
                        json!({"nested": false, "first_violation": {"k_small": ks[ki - 1], "k_large": ks[ki], "layer": sal.layers[li].layer}}),
                    );
                }
            }
        }
    }

    if args.per_layer {
        for (ki, &k) in ks.iter().enumerate() {
            for (mi, &m) in methods.iter().enumerate() {
                let _ = writeln!(t, "\n{} K = {k}, per layer", m.name());
                let mut hdr = format!(
                    "{:>6} {:>10} {:>10} {:>9} {:>10} {:>9}",
                    "layer", "slot repl", "count kept", "l2 kept", "min count", "dead kept"
                );
                if screened.is_some() {
                    hdr += &format!(" {:>12} {:>10} {:>10} {:>8}", "slots pruned", "gate lost", "prob lost", "short");
                }
                let _ = writeln!(t, "{hdr}");
                for (li, (l, keep)) in sal.layers.iter().zip(&sets[mi][ki]).enumerate() {
                    let s = layer_stats(l, keep);
                    let mut line = format!(
                        "{:>6} {:>10} {:>10} {:>9} {:>10} {:>9}",
                        l.layer,
                        pct(s.slot_replacement()),
                        pct(s.count_share),
                        pct(s.l2_share),
                        s.min_kept_count,
                        s.dead_kept
                    );
                    if let Some(sc) = screened {
                        let x = &sc[mi * ks.len() + ki][li];
                        line += &format!(
                            " {:>12} {:>10} {:>10} {:>8}",
                            pct(x.slot_share_pruned()),
                            pct(x.gate_share_lost()),
                            format!("{:.4}", x.router_prob_lost_per_token()),
                            x.tokens_short
                        );
                    }
                    let _ = writeln!(t, "{line}");
                }
            }
        }
    }

    let report = json!({
        "format": "reap-select-report",
        "version": 1,
        "source": {"path": source.path, "sha256": source.sha256, "tokens": source.tokens, "trace_tokens_written": source.trace_tokens_written},
        "trace": args.trace.as_ref().map(|p| json!({"path": p.display().to_string(), "rows": trace.map(|t| t.n_rows)})),
        "methods": methods.iter().map(|m| m.name()).collect::<Vec<_>>(),
        "k": ks,
        "parameters": {
            "prior": match params.prior { Prior::Lcb { .. } => "lcb", _ => "median" },
            "z": match params.prior { Prior::Lcb { z } => json!(z), _ => Value::Null },
            "shrink_m": params.shrink_m,
            "min_count": params.min_count,
        },
        "layers": sal.layers.iter().map(|l| json!({
            "layer": l.layer,
            "n_expert": l.n_expert,
            "live_experts": l.count.iter().filter(|&&c| c > 0).count(),
            "dead_experts": (0..l.n_expert).filter(|&i| l.count[i] == 0).collect::<Vec<_>>(),
            "shrink_m": score::shrink_m(l, params),
            // μ of reap_shrink's median prior (null under lcb, which has none)
            "shrink_prior": score::prior_value(l, params.prior),
        })).collect::<Vec<_>>(),
        "maps": maps_json,
        "overlap": overlap_json,
        "nested": nested_json,
    });
    (t, report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::saliency::LayerSums;

    #[test]
    fn layer_stats_and_nesting() {
        let mut l = LayerSums::new(2, 4, 1);
        l.count = vec![6, 3, 1, 0];
        l.reap_l2_sum = vec![1.0, 2.0, 1.0, 0.0];
        let s = layer_stats(&l, &[1, 2]);
        assert_eq!(s, LayerStats { layer: 2, count_share: 0.4, l2_share: 0.75, min_kept_count: 1, dead_kept: 0 });
        assert!((s.slot_replacement() - 0.6).abs() < 1e-15);
        assert_eq!(layer_stats(&l, &[0, 3]).dead_kept, 1);
        let nested = vec![vec![vec![1u16]], vec![vec![1, 2]]];
        assert_eq!(nesting_violation(&nested), None);
        let not = vec![vec![vec![0u16]], vec![vec![1, 2]]];
        assert_eq!(nesting_violation(&not), Some((1, 0)));
    }
}
