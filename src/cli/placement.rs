//! Where tensors live: llama.cpp's `-dev`, and by name `-ot`, `--cpu-moe`, `--n-cpu-moe`,
//! `--n-cpu-ffn`, and `--op-offload`, shared by the drop-in calibration, `eval` and
//! `trace-decode`.
//!
//! The usual way to run a MoE model larger than the GPU: `-ngl 99 --cpu-moe` (or `-ot
//! exps=CPU`) keeps the experts' weights in host memory and everything else on the GPU.
//! llama.cpp takes the first pattern that matches a tensor, so the overrides keep the order
//! they were given in across all four flags, as upstream's parser appends them.

use crate::error::UsageError;
use crate::llama::TensorOverride;
use anyhow::{bail, Result};

/// The pin's `LLM_FFN_EXPS_REGEX` and `LLM_FFN_DENSE_REGEX` (common/common.h).
const FFN_EXPS: &str = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps";
const FFN_DENSE: &str = r"\.ffn_(up|down|gate)\.";

#[derive(clap::Args, Debug, Clone, Default)]
pub struct PlacementArgs {
    /// override tensor buffer type: the first pattern (a regex searched in the tensor's name)
    /// that matches decides; repeatable [-ot]
    #[arg(long = "override-tensor", value_name = "PATTERN=TYPE,...", action = clap::ArgAction::Append)]
    pub override_tensor: Vec<String>,

    /// keep all Mixture of Experts (MoE) weights in the CPU [-cmoe]
    #[arg(long = "cpu-moe", action = clap::ArgAction::Append, num_args = 0, default_missing_value = "true", value_parser = clap::value_parser!(bool))]
    pub cpu_moe: Vec<bool>,

    /// keep the Mixture of Experts (MoE) weights of the first N layers in the CPU [-ncmoe]
    #[arg(long = "n-cpu-moe", value_name = "N", action = clap::ArgAction::Append, allow_negative_numbers = true)]
    pub n_cpu_moe: Vec<i32>,

    /// keep the dense FFN weights of the first N layers in the CPU [-ncffn]
    #[arg(long = "n-cpu-ffn", value_name = "N", action = clap::ArgAction::Append, allow_negative_numbers = true)]
    pub n_cpu_ffn: Vec<i32>,

    /// comma-separated list of devices to use for offloading (none = don't offload);
    /// `reap-imatrix --list-devices` lists them [-dev]
    #[arg(long = "device", value_name = "DEV1,DEV2,..")]
    pub device: Option<String>,

    /// whether to offload host tensor operations to device (default: true)
    #[arg(long = "op-offload", overrides_with = "no_op_offload")]
    pub op_offload: bool,

    /// run a host-resident weight's operations on the host, never copying it to the GPU
    #[arg(long = "no-op-offload", overrides_with = "op_offload")]
    pub no_op_offload: bool,

    /// the overrides of all four flags in command-line order ([`PlacementArgs::order`])
    #[arg(skip)]
    pub overrides: Vec<TensorOverride>,
}

impl PlacementArgs {
    /// Fills `overrides` from the parsed matches (clap keeps each flag's values, not how they
    /// interleave; the matches' indices do).
    pub fn order(&mut self, m: &clap::ArgMatches) -> Result<()> {
        let indices = |id: &str| m.indices_of(id).map(|i| i.collect::<Vec<_>>()).unwrap_or_default();
        let mut at: Vec<(usize, Vec<TensorOverride>)> = Vec::new();
        for (v, i) in self.override_tensor.iter().zip(indices("override_tensor")) {
            at.push((i, parse_override_tensor(v)?));
        }
        for i in indices("cpu_moe") {
            at.push((i, vec![cpu(FFN_EXPS.to_string())]));
        }
        for (regex, values, id) in [(FFN_EXPS, &self.n_cpu_moe, "n_cpu_moe"), (FFN_DENSE, &self.n_cpu_ffn, "n_cpu_ffn")] {
            for (&n, i) in values.iter().zip(indices(id)) {
                if n < 0 {
                    bail!(UsageError(format!("--{} {n}: expected a number of layers, 0 or more", id.replace('_', "-"))));
                }
                at.push((i, (0..n).map(|l| cpu(format!(r"blk\.{l}{regex}"))).collect()));
            }
        }
        at.sort_by_key(|(i, _)| *i);
        self.overrides = at.into_iter().flat_map(|(_, o)| o).collect();
        Ok(())
    }

    /// `-dev`: `Some(empty)` for `none`; the names are looked up when the model loads (after
    /// `--rpc` adds its servers' devices)
    pub fn devices(&self) -> Result<Option<Vec<String>>> {
        let Some(v) = &self.device else { return Ok(None) };
        let names: Vec<String> = v.split(',').filter(|s| !s.is_empty()).map(String::from).collect();
        if names.is_empty() {
            bail!(UsageError(format!("-dev '{v}': no devices specified")));
        }
        Ok(Some(if names == ["none"] { Vec::new() } else { names }))
    }

    pub fn op_offload(&self) -> bool {
        !self.no_op_offload
    }

    /// What the manifest and eval's base-logits sidecar record: only what differs from
    /// llama.cpp's defaults, so records made before these flags existed still match.
    pub fn settings(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut s = serde_json::Map::new();
        if !self.overrides.is_empty() {
            let list: Vec<String> = self.overrides.iter().map(|o| format!("{}={}", o.pattern, o.buffer_type)).collect();
            s.insert("tensor_overrides".into(), list.into());
        }
        if self.no_op_offload {
            s.insert("op_offload".into(), false.into());
        }
        if let Some(d) = &self.device {
            s.insert("devices".into(), d.clone().into());
        }
        s
    }
}

fn cpu(pattern: String) -> TensorOverride {
    TensorOverride { pattern, buffer_type: "CPU".into() }
}

/// `PATTERN=TYPE,PATTERN=TYPE…` as upstream splits it: at each ',' and then the first '='.
fn parse_override_tensor(value: &str) -> Result<Vec<TensorOverride>> {
    value
        .split(',')
        .map(|item| match item.split_once('=') {
            Some((pattern, buffer_type)) => Ok(TensorOverride { pattern: pattern.into(), buffer_type: buffer_type.into() }),
            None => bail!(UsageError(format!("-ot {value}: '{item}' is not <tensor name pattern>=<buffer type>"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches, Parser};

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        p: PlacementArgs,
    }

    fn order(args: &[&str]) -> Result<Vec<String>> {
        let m = Cli::command().try_get_matches_from(std::iter::once("prog").chain(args.iter().copied()))?;
        let mut c = Cli::from_arg_matches(&m)?;
        c.p.order(&m)?;
        Ok(c.p.overrides.iter().map(|o| format!("{}={}", o.pattern, o.buffer_type)).collect())
    }

    #[test]
    fn overrides_keep_the_command_line_order_across_flags() {
        let got = order(&["--override-tensor", "attn=RPC0[h:1],exps=CPU", "--n-cpu-moe", "2", "--cpu-moe", "--override-tensor=norm=CPU", "--n-cpu-ffn", "1"]).unwrap();
        assert_eq!(
            got,
            [
                "attn=RPC0[h:1]",
                "exps=CPU",
                r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU",
                r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU",
                r"\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU",
                "norm=CPU",
                r"blk\.0\.ffn_(up|down|gate)\.=CPU",
            ]
        );
        // a repeated --cpu-moe adds its pattern again, as upstream's does; the first decides
        assert_eq!(order(&["--cpu-moe", "--override-tensor", "x=CUDA0", "--cpu-moe"]).unwrap().len(), 3);
        assert_eq!(order(&["--cpu-moe", "--override-tensor", "x=CUDA0", "--cpu-moe"]).unwrap()[1], "x=CUDA0");
        assert!(order(&[]).unwrap().is_empty());
    }

    #[test]
    fn dev_names_devices_or_none() {
        let devices = |args: &[&str]| {
            let m = Cli::command().try_get_matches_from(std::iter::once("prog").chain(args.iter().copied())).unwrap();
            Cli::from_arg_matches(&m).unwrap().p.devices().map_err(|e| e.to_string())
        };
        assert_eq!(devices(&[]), Ok(None));
        assert_eq!(devices(&["--device", "none"]), Ok(Some(vec![])));
        assert_eq!(devices(&["--device", "CUDA0,RPC0"]), Ok(Some(vec!["CUDA0".to_string(), "RPC0".to_string()])));
        assert!(devices(&["--device", ","]).unwrap_err().contains("no devices specified"));
    }

    #[test]
    fn a_value_without_a_buffer_type_is_refused_by_name() {
        let e = order(&["--override-tensor", "exps=CPU,attn"]).unwrap_err().to_string();
        assert!(e.contains("-ot exps=CPU,attn: 'attn' is not <tensor name pattern>=<buffer type>"), "{e}");
        // the first '=' splits: a pattern cannot hold one, a type name may
        assert_eq!(order(&["--override-tensor", "a=b=c"]).unwrap(), ["a=b=c"]);
        let e = order(&["--n-cpu-moe", "-1"]).unwrap_err().to_string();
        assert!(e.contains("--n-cpu-moe -1: expected a number of layers, 0 or more"), "{e}");
    }
}
