//! The saliency JSON (`--reap-out`): see docs/formats.md. Typed on both sides so the writer
//! and every reader (`check`, `select`) agree on names; floats round-trip bit-exact.

use super::atomic;
use anyhow::{bail, Context as _, Result};
use serde_json::{json, Map, Value};
use std::path::Path;

pub const FORMAT: &str = "reap-saliency";
pub const VERSION: u64 = 1;

/// One MoE layer's sums, per expert.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerSums {
    pub layer: u32,
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// tokens that reached this layer's sums
    pub tokens: u64,
    pub count: Vec<u64>,
    pub prob_sum: Vec<f64>,
    pub reap_l2_sum: Vec<f64>,
    pub reap_l2_sq_sum: Vec<f64>,
    pub ean_sum: Vec<f64>,
    pub router_prob_sum: Vec<f64>,
    pub max_l2: Vec<f64>,
    /// the REAP reference's statistics; None in files written before they were collected
    pub reference: Option<ReferenceSums>,
}

/// What CerebrasResearch/reap's observer computes (CONTRACT §6), per expert: p is the router's
/// probability before top-k normalisation, f the expert's output.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReferenceSums {
    /// Σ p·‖f‖₂ over routed tokens
    pub reap_softmax_l2_sum: Vec<f64>,
    /// Σ (p·‖f‖₂)²
    pub reap_softmax_l2_sq_sum: Vec<f64>,
    /// largest element value of f over routed tokens (the "super expert" statistic); None
    /// for an expert never routed
    pub max_activation: Vec<Option<f64>>,
}

impl ReferenceSums {
    pub fn new(n_expert: usize) -> Self {
        ReferenceSums { reap_softmax_l2_sum: vec![0.0; n_expert], reap_softmax_l2_sq_sum: vec![0.0; n_expert], max_activation: vec![None; n_expert] }
    }
}

impl LayerSums {
    /// The per-expert float arrays with their JSON names (the reference's softmax-weighted
    /// sums too, where the file has them).
    pub fn float_arrays(&self) -> Vec<(&'static str, &Vec<f64>)> {
        let mut v = vec![
            ("prob_sum", &self.prob_sum),
            ("reap_l2_sum", &self.reap_l2_sum),
            ("reap_l2_sq_sum", &self.reap_l2_sq_sum),
            ("ean_sum", &self.ean_sum),
            ("router_prob_sum", &self.router_prob_sum),
            ("max_l2", &self.max_l2),
        ];
        if let Some(r) = &self.reference {
            v.push(("reap_softmax_l2_sum", &r.reap_softmax_l2_sum));
            v.push(("reap_softmax_l2_sq_sum", &r.reap_softmax_l2_sq_sum));
        }
        v
    }

    pub fn new(layer: u32, n_expert: usize, n_expert_used: usize) -> Self {
        let z = vec![0.0; n_expert];
        LayerSums {
            layer,
            n_expert,
            n_expert_used,
            tokens: 0,
            count: vec![0; n_expert],
            prob_sum: z.clone(),
            reap_l2_sum: z.clone(),
            reap_l2_sq_sum: z.clone(),
            ean_sum: z.clone(),
            router_prob_sum: z.clone(),
            max_l2: z,
            reference: Some(ReferenceSums::new(n_expert)),
        }
    }
}

/// What `metadata.routing` records about the gate weights (None where absent, as in older
/// files).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    /// the op of `ffn_moe_probs`: `SOFT_MAX` for a softmax router
    pub probs_op: Option<String>,
    /// the node the applied gates came from, e.g. `ffn_moe_weights_norm-0 (reshaped)`
    pub weights_node: Option<String>,
    pub normalised: Option<bool>,
    /// the graph's probabilities were the router's logits and p is their softmax, taken by the
    /// collector (gpt-oss's gating)
    pub probs_from_logits: Option<bool>,
}

/// Which weight the model multiplies an expert's output by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppliedGate {
    /// `ffn_moe_weights-N`: the router probability p itself
    Probability,
    /// `ffn_moe_weights_norm-N`: p / Σ over the token's picks of p; or
    /// `ffn_moe_weights_softmax-N` (gpt-oss): the softmax over the picks' logits, the same number
    Normalised,
    /// anything else (scaled, biased, another gating)
    Other,
}

impl Routing {
    pub fn softmax(&self) -> Option<bool> {
        self.probs_op.as_deref().map(|op| op == "SOFT_MAX" || self.probs_from_logits == Some(true))
    }

    /// Whether the router's probabilities are bounded by 1: softmax and sigmoid are;
    /// DeepSeek-V4's sqrt(softplus(logit)) (`probs_op` SQRT) is not. None: not recorded.
    pub fn probs_at_most_one(&self) -> Option<bool> {
        self.probs_op.as_deref().map(|op| op != "SQRT")
    }

    pub fn applied_gate(&self) -> Option<AppliedGate> {
        Some(AppliedGate::of_node(self.weights_node.as_deref()?))
    }
}

impl AppliedGate {
    /// The gate a weights node (as the graph or `metadata.routing.weights_node` names it) gives.
    pub fn of_node(node: &str) -> AppliedGate {
        // a node name, `-` and the block index, then ggml's view suffixes such as " (reshaped)"
        let name = node.split(' ').next().unwrap_or(node);
        let base = name.rsplit_once('-').map_or(name, |(b, _)| b);
        match base {
            "ffn_moe_weights" => AppliedGate::Probability,
            // exp(l_e) / Σ over the picks of exp(l_j) = p_e / Σ over the picks of p_j
            "ffn_moe_weights_norm" | "ffn_moe_weights_softmax" => AppliedGate::Normalised,
            _ => AppliedGate::Other,
        }
    }
}

/// One domain's sums for one MoE layer (`--domains`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DomainLayer {
    pub layer: u32,
    pub count: Vec<u64>,
    pub prob_sum: Vec<f64>,
    pub reap_l2_sum: Vec<f64>,
}

/// One domain's share of the run: its tokens and, per MoE layer, its part of the sums.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DomainSums {
    pub name: String,
    pub tokens: u64,
    pub layers: Vec<DomainLayer>,
}

/// The whole file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Saliency {
    pub tokens: u64,
    pub nonfinite_drops: u64,
    pub trace_tokens_written: u64,
    /// free-form run metadata (model, corpus, settings, versions)
    pub metadata: Map<String, Value>,
    pub layers: Vec<LayerSums>,
    /// which chunks of the corpus were evaluated (docs/corpus.md); None in older files
    pub coverage: Option<Value>,
    /// per-domain sums (`--domains`); empty without
    pub domains: Vec<DomainSums>,
    /// the layers that are nextn/MTP blocks (`--nextn`: their own pass, llama.cpp's MTP graph
    /// fed with the trunk's hidden states); they come last in `layers`, are not in the
    /// imatrix or the trace, and count their own `tokens`. Empty without `--nextn`.
    pub nextn_blocks: Vec<u32>,
}

impl Saliency {
    /// The trunk's layers: all but the nextn blocks (which come last), the ones the imatrix
    /// and the trace hold.
    pub fn trunk(&self) -> &[LayerSums] {
        let n = self.layers.iter().rev().take_while(|l| self.nextn_blocks.contains(&l.layer)).count();
        &self.layers[..self.layers.len() - n]
    }

    pub fn routing(&self) -> Routing {
        let r = self.metadata.get("routing");
        let str_of = |k: &str| r.and_then(|r| r.get(k)).and_then(Value::as_str).map(String::from);
        Routing {
            probs_op: str_of("probs_op"),
            weights_node: str_of("weights_node"),
            normalised: r.and_then(|r| r.get("normalised")).and_then(Value::as_bool),
            probs_from_logits: r.and_then(|r| r.get("probs_from_logits")).and_then(Value::as_bool),
        }
    }

    pub fn to_json(&self) -> Value {
        let layers: Vec<Value> = self
            .layers
            .iter()
            .map(|l| {
                let mut v = json!({
                    "layer": l.layer,
                    "n_expert": l.n_expert,
                    "n_expert_used": l.n_expert_used,
                    "tokens": l.tokens,
                    "count": l.count,
                    "prob_sum": l.prob_sum,
                    "reap_l2_sum": l.reap_l2_sum,
                    "reap_l2_sq_sum": l.reap_l2_sq_sum,
                    "ean_sum": l.ean_sum,
                    "router_prob_sum": l.router_prob_sum,
                    "max_l2": l.max_l2,
                });
                if let Some(r) = &l.reference {
                    v["reap_softmax_l2_sum"] = json!(r.reap_softmax_l2_sum);
                    v["reap_softmax_l2_sq_sum"] = json!(r.reap_softmax_l2_sq_sum);
                    // null for an expert never routed
                    v["max_activation"] = json!(r.max_activation);
                }
                v
            })
            .collect();
        let mut v = json!({
            "format": FORMAT,
            "version": VERSION,
            "tokens": self.tokens,
            "nonfinite_drops": self.nonfinite_drops,
            "trace_tokens_written": self.trace_tokens_written,
            "metadata": Value::Object(self.metadata.clone()),
            "layers": layers,
        });
        if let Some(c) = &self.coverage {
            v["coverage"] = c.clone();
        }
        if !self.nextn_blocks.is_empty() {
            v["nextn_blocks"] = json!(self.nextn_blocks);
        }
        if !self.domains.is_empty() {
            v["domains"] = self
                .domains
                .iter()
                .map(|d| {
                    json!({
                        "name": d.name,
                        "tokens": d.tokens,
                        "layers": d.layers.iter().map(|l| json!({"layer": l.layer, "count": l.count, "prob_sum": l.prob_sum, "reap_l2_sum": l.reap_l2_sum})).collect::<Vec<_>>(),
                    })
                })
                .collect();
        }
        v
    }

    /// Writes the file atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        for l in &self.layers {
            let all = [&l.prob_sum, &l.reap_l2_sum, &l.reap_l2_sq_sum, &l.ean_sum, &l.router_prob_sum, &l.max_l2];
            let reference_finite = l.reference.as_ref().map_or(true, |r| {
                r.reap_softmax_l2_sum.iter().chain(&r.reap_softmax_l2_sq_sum).chain(r.max_activation.iter().flatten()).all(|x| x.is_finite())
            });
            if all.iter().any(|v| v.iter().any(|x| !x.is_finite())) || !reference_finite {
                bail!("saliency for layer {} holds a non-finite sum; refusing to write {}", l.layer, path.display());
            }
        }
        atomic::write_json(path, &self.to_json(), "saliency")
    }

    pub fn read(path: &Path) -> Result<Saliency> {
        let v = atomic::read_json(path, "saliency file")?;
        Self::from_json(&v).with_context(|| format!("saliency file {}", path.display()))
    }

    /// The first value no run can produce: a negative or non-finite sum (JSON cannot spell NaN,
    /// but a hand-edited or foreign file can hold -1 or 1e308·10). `check` reports these as
    /// failed invariants; tools that compute from the sums (select, prune) refuse the file.
    pub fn value_problem(&self) -> Option<String> {
        let blocks: Vec<u32> = self.layers.iter().map(|l| l.layer).collect();
        if blocks.windows(2).any(|w| w[0] >= w[1]) {
            return Some(format!("layers {blocks:?} are not in block order, each once"));
        }
        if !blocks.ends_with(&self.nextn_blocks) {
            return Some(format!("\"nextn_blocks\" {:?} are not the last of the layers {blocks:?}", self.nextn_blocks));
        }
        for l in &self.layers {
            if l.n_expert_used > l.n_expert {
                return Some(format!("layer {}: n_expert_used {} is more than its n_expert {}", l.layer, l.n_expert_used, l.n_expert));
            }
            for (name, a) in l.float_arrays() {
                if let Some((e, x)) = a.iter().enumerate().find(|(_, x)| !(x.is_finite() && **x >= 0.0)) {
                    return Some(format!("layer {}: \"{name}\"[{e}] is {x}; sums are finite and non-negative", l.layer));
                }
            }
            // a sum over no tokens is 0: anything else ranks a dead expert by numbers it cannot have
            for (name, a) in [("reap_l2_sum", &l.reap_l2_sum), ("ean_sum", &l.ean_sum), ("prob_sum", &l.prob_sum)] {
                if let Some(e) = (0..l.n_expert).find(|&e| l.count[e] == 0 && a[e] != 0.0) {
                    return Some(format!("layer {}: expert {e} has count 0 but \"{name}\" {}; a sum over no tokens is 0", l.layer, a[e]));
                }
            }
        }
        None
    }

    pub fn from_json(v: &Value) -> Result<Saliency> {
        if v.get("format").and_then(Value::as_str) != Some(FORMAT) {
            bail!("\"format\" is not \"{FORMAT}\"");
        }
        let version = v.get("version").and_then(Value::as_u64).context("missing integer \"version\"")?;
        if version != VERSION {
            bail!("unsupported version {version} (this build reads {VERSION})");
        }
        let u = |k: &str| v.get(k).and_then(Value::as_u64).with_context(|| format!("missing integer \"{k}\""));
        let layers = v.get("layers").and_then(Value::as_array).context("missing array \"layers\"")?;
        let mut out = Saliency {
            tokens: u("tokens")?,
            nonfinite_drops: u("nonfinite_drops")?,
            trace_tokens_written: u("trace_tokens_written")?,
            metadata: v.get("metadata").and_then(Value::as_object).cloned().unwrap_or_default(),
            layers: Vec::with_capacity(layers.len()),
            coverage: v.get("coverage").filter(|c| c.is_object()).cloned(),
            domains: Vec::new(),
            nextn_blocks: match v.get("nextn_blocks") {
                None => Vec::new(),
                Some(b) => b
                    .as_array()
                    .and_then(|a| a.iter().map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect::<Option<Vec<u32>>>())
                    .context("\"nextn_blocks\" is not an array of block indices")?,
            },
        };
        for (i, l) in layers.iter().enumerate() {
            out.layers.push(layer_from_json(l).with_context(|| format!("layers[{i}]"))?);
        }
        if let Some(ds) = v.get("domains") {
            let ds = ds.as_array().context("\"domains\" is not an array")?;
            for (i, d) in ds.iter().enumerate() {
                out.domains.push(domain_from_json(d, &out.layers).with_context(|| format!("domains[{i}]"))?);
            }
        }
        Ok(out)
    }
}

fn domain_from_json(d: &Value, all: &[LayerSums]) -> Result<DomainSums> {
    let name = d.get("name").and_then(Value::as_str).context("missing string \"name\"")?.to_string();
    let tokens = d.get("tokens").and_then(Value::as_u64).context("missing integer \"tokens\"")?;
    let ls = d.get("layers").and_then(Value::as_array).context("missing array \"layers\"")?;
    if ls.len() != all.len() {
        bail!("domain {name} has {} layers, the run has {}", ls.len(), all.len());
    }
    let mut layers = Vec::with_capacity(ls.len());
    for (l, a) in ls.iter().zip(all) {
        let n = a.n_expert;
        let arr = |k: &str| -> Result<&Vec<Value>> {
            let v = l.get(k).and_then(Value::as_array).with_context(|| format!("domain {name}: missing array \"{k}\""))?;
            if v.len() != n {
                bail!("domain {name}, layer {}: \"{k}\" has {} values, n_expert is {n}", a.layer, v.len());
            }
            Ok(v)
        };
        let floats = |k: &str| -> Result<Vec<f64>> { arr(k)?.iter().map(|x| x.as_f64().with_context(|| format!("\"{k}\" holds a non-number"))).collect() };
        layers.push(DomainLayer {
            layer: l.get("layer").and_then(Value::as_u64).context("missing integer \"layer\"")? as u32,
            count: arr("count")?.iter().map(|x| x.as_u64().context("\"count\" holds a non-integer")).collect::<Result<_>>()?,
            prob_sum: floats("prob_sum")?,
            reap_l2_sum: floats("reap_l2_sum")?,
        });
    }
    Ok(DomainSums { name, tokens, layers })
}

fn layer_from_json(l: &Value) -> Result<LayerSums> {
    let u = |k: &str| l.get(k).and_then(Value::as_u64).with_context(|| format!("missing integer \"{k}\""));
    let n_expert = u("n_expert")? as usize;
    let floats = |k: &str| -> Result<Vec<f64>> {
        let a = l.get(k).and_then(Value::as_array).with_context(|| format!("missing array \"{k}\""))?;
        if a.len() != n_expert {
            bail!("\"{k}\" has {} values, n_expert is {n_expert}", a.len());
        }
        a.iter().map(|x| x.as_f64().with_context(|| format!("\"{k}\" holds a non-number"))).collect()
    };
    let opt_floats = |k: &str| if l.get(k).is_some() { floats(k) } else { Ok(vec![0.0; n_expert]) };
    // the counts first: they are what every other array is checked against
    let count = {
        let a = l.get("count").and_then(Value::as_array).context("missing array \"count\"")?;
        if a.len() != n_expert {
            bail!("\"count\" has {} values, n_expert is {n_expert}", a.len());
        }
        a.iter().map(|x| x.as_u64().with_context(|| format!("\"count\" holds {x}, not a non-negative integer"))).collect::<Result<Vec<u64>>>()?
    };
    // the reference's statistics come as a group; files from before them have none of the keys
    let reference = if l.get("reap_softmax_l2_sum").is_some() {
        let a = l.get("max_activation").and_then(Value::as_array).context("missing array \"max_activation\"")?;
        if a.len() != n_expert {
            bail!("\"max_activation\" has {} values, n_expert is {n_expert}", a.len());
        }
        let max_activation = a
            .iter()
            .map(|x| if x.is_null() { Ok(None) } else { x.as_f64().map(Some).context("\"max_activation\" holds something other than a number or null") })
            .collect::<Result<Vec<Option<f64>>>>()?;
        Some(ReferenceSums { reap_softmax_l2_sum: floats("reap_softmax_l2_sum")?, reap_softmax_l2_sq_sum: floats("reap_softmax_l2_sq_sum")?, max_activation })
    } else {
        None
    };
    Ok(LayerSums {
        layer: u("layer")? as u32,
        n_expert,
        n_expert_used: u("n_expert_used")? as usize,
        tokens: l.get("tokens").and_then(Value::as_u64).unwrap_or(0),
        count,
        prob_sum: floats("prob_sum")?,
        reap_l2_sum: floats("reap_l2_sum")?,
        reap_l2_sq_sum: floats("reap_l2_sq_sum")?,
        ean_sum: floats("ean_sum")?,
        router_prob_sum: opt_floats("router_prob_sum")?,
        max_l2: opt_floats("max_l2")?,
        reference,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_bit_exact() {
        let mut l = LayerSums::new(3, 4, 2);
        l.count = vec![5, 0, 7, 2];
        l.reap_l2_sum = vec![0.1 + 0.2, 0.0, 1e-300, 123456789.123456789];
        l.reap_l2_sq_sum = vec![f64::MIN_POSITIVE, 0.0, 5e-324, 1.0 / 3.0];
        let r = l.reference.as_mut().unwrap();
        r.reap_softmax_l2_sum = vec![0.1 + 0.7, 0.0, 2e-300, 1.0 / 7.0];
        r.max_activation = vec![Some(-0.5), None, Some(1e-45), Some(3.25)];
        let d = DomainSums { name: "ja".into(), tokens: 3, layers: vec![DomainLayer { layer: 3, count: vec![1, 0, 2, 0], prob_sum: vec![0.1, 0.0, 1.0 / 3.0, 0.0], reap_l2_sum: vec![0.2, 0.0, 0.7, 0.0] }] };
        let s = Saliency { tokens: 7, nonfinite_drops: 1, trace_tokens_written: 0, metadata: Map::new(), layers: vec![l], coverage: Some(json!({"chunk_indices": [1, 4]})), domains: vec![d], nextn_blocks: vec![3] };
        let text = serde_json::to_string(&s.to_json()).unwrap();
        let back = Saliency::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back, s);
        for (a, b) in back.layers[0].reap_l2_sq_sum.iter().zip(&s.layers[0].reap_l2_sq_sum) {
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }

    #[test]
    fn files_from_before_the_reference_statistics_still_read() {
        let mut l = LayerSums::new(0, 2, 1);
        l.count = vec![1, 0];
        let mut v = Saliency { layers: vec![l], ..Default::default() }.to_json();
        assert_eq!(v["layers"][0]["max_activation"], json!([null, null]));
        for k in ["reap_softmax_l2_sum", "reap_softmax_l2_sq_sum", "max_activation"] {
            v["layers"][0].as_object_mut().unwrap().remove(k);
        }
        let old = Saliency::from_json(&v).unwrap();
        assert_eq!(old.layers[0].reference, None);
        // and they are written back without the keys (absent, not zero)
        assert!(old.to_json()["layers"][0].get("reap_softmax_l2_sum").is_none());
        // a partial group is an error that names the key
        v["layers"][0]["reap_softmax_l2_sum"] = json!([0.0, 0.0]);
        let e = Saliency::from_json(&v).unwrap_err();
        assert!(format!("{e:#}").contains("max_activation"), "{e:#}");
    }

    #[test]
    fn the_applied_gate_is_named_by_its_node() {
        let gate = |n: &str| Routing { weights_node: Some(n.into()), ..Default::default() }.applied_gate();
        assert_eq!(gate("ffn_moe_weights-3"), Some(AppliedGate::Probability));
        assert_eq!(gate("ffn_moe_weights_norm-0 (reshaped)"), Some(AppliedGate::Normalised));
        assert_eq!(gate("ffn_moe_weights_softmax-0"), Some(AppliedGate::Normalised));
        assert_eq!(gate("ffn_moe_weights_scaled-0"), Some(AppliedGate::Other));
        assert_eq!(Routing::default().applied_gate(), None);
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let e = Saliency::from_json(&json!({"format": "other"})).unwrap_err();
        assert!(format!("{e:#}").contains("format"));
        let mut v = Saliency { layers: vec![LayerSums::new(0, 2, 1)], ..Default::default() }.to_json();
        v["layers"][0]["count"] = json!([1, 2, 3]);
        let e = Saliency::from_json(&v).unwrap_err();
        assert!(format!("{e:#}").contains("\"count\" has 3 values"), "{e:#}");
    }
}
