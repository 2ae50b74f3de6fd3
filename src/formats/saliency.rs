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
}

impl LayerSums {
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
}

impl Saliency {
    pub fn to_json(&self) -> Value {
        let layers: Vec<Value> = self
            .layers
            .iter()
            .map(|l| {
                json!({
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
                })
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
            if all.iter().any(|v| v.iter().any(|x| !x.is_finite())) {
                bail!("saliency for layer {} holds a non-finite sum; refusing to write {}", l.layer, path.display());
            }
        }
        atomic::write_json(path, &self.to_json(), "saliency")
    }

    pub fn read(path: &Path) -> Result<Saliency> {
        let v = atomic::read_json(path, "saliency file")?;
        Self::from_json(&v).with_context(|| format!("saliency file {}", path.display()))
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
    let count = {
        let a = l.get("count").and_then(Value::as_array).context("missing array \"count\"")?;
        if a.len() != n_expert {
            bail!("\"count\" has {} values, n_expert is {n_expert}", a.len());
        }
        a.iter().map(|x| x.as_u64().context("\"count\" holds a non-integer")).collect::<Result<Vec<u64>>>()?
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
        let d = DomainSums { name: "ja".into(), tokens: 3, layers: vec![DomainLayer { layer: 3, count: vec![1, 0, 2, 0], prob_sum: vec![0.1, 0.0, 1.0 / 3.0, 0.0], reap_l2_sum: vec![0.2, 0.0, 0.7, 0.0] }] };
        let s = Saliency { tokens: 7, nonfinite_drops: 1, trace_tokens_written: 0, metadata: Map::new(), layers: vec![l], coverage: Some(json!({"chunk_indices": [1, 4]})), domains: vec![d] };
        let text = serde_json::to_string(&s.to_json()).unwrap();
        let back = Saliency::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back, s);
        for (a, b) in back.layers[0].reap_l2_sq_sum.iter().zip(&s.layers[0].reap_l2_sq_sum) {
            assert_eq!(a.to_bits(), b.to_bits());
        }
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
