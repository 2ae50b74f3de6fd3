//! Where the model runs: the flags `eval` and `trace-decode` share with llama.cpp's tools
//! (the drop-in calibration has the same ones in its upstream-shaped parser).

use crate::calibrate::{flash_attn_type, model_params_of};
use crate::llama::ModelParams;
use anyhow::Result;

#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Layers to offload: a number, 'auto' or 'all' [-ngl]
    #[arg(long = "n-gpu-layers", visible_alias = "gpu-layers", value_name = "N", default_value = "auto")]
    pub n_gpu_layers: String,
    /// Comma-separated RPC servers (HOST:PORT) to offload to, with -ngl
    #[arg(long = "rpc", value_name = "SERVERS")]
    pub rpc: Option<String>,
    /// End the run when an --rpc server moves no bytes for this many seconds while llama.cpp
    /// waits on it (stopped, hung, network down); 0 waits for ever, as upstream does
    #[arg(long = "rpc-timeout", value_name = "SECONDS", default_value_t = crate::llama::rpc_watch::DEFAULT_TIMEOUT_S)]
    pub rpc_timeout: u64,
    /// Flash attention: on, off, auto [-fa]
    #[arg(long = "flash-attn", value_name = "on|off|auto", default_value = "auto")]
    pub flash_attn: String,
    /// Model loading mode: auto, none, mmap, mlock, mmap+mlock, dio [-lm]
    #[arg(long = "load-mode", value_name = "MODE", default_value = "auto")]
    pub load_mode: String,
    /// Keep the weights out of the CPU backend's extra buffer types (AMX, repacked layouts),
    /// as llama.cpp's tools do with it; on a CPU with AMX some models need it [-nr]
    #[arg(long = "no-repack")]
    pub no_repack: bool,
    #[command(flatten)]
    pub placement: super::placement::PlacementArgs,
}

impl DeviceArgs {
    /// Checks the flags and that every `--rpc` server answers, before any model is loaded.
    pub fn validate(&self) -> Result<(ModelParams, i32)> {
        if let Some(servers) = &self.rpc {
            crate::calibrate::validate::rpc_servers(servers)?;
        }
        crate::llama::rpc_watch::set_timeout(self.rpc_timeout);
        let mut p = model_params_of(&self.n_gpu_layers, &self.load_mode, self.rpc.clone())?;
        p.use_extra_bufts = !self.no_repack;
        p.tensor_overrides = self.placement.overrides.clone();
        p.devices = self.placement.devices()?;
        Ok((p, flash_attn_type(&self.flash_attn)?))
    }
}
