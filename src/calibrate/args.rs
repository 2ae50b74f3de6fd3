//! The drop-in `llama-imatrix` flags: names, spellings and defaults as upstream's
//! `llama-imatrix --help` at the pin prints them.

use clap::{Args, ValueEnum};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Gguf,
    Dat,
}

#[derive(Args, Debug, Clone)]
pub struct ImatrixArgs {
    /// model path to load
    #[arg(short = 'm', long = "model", value_name = "FNAME")]
    pub model: Option<PathBuf>,

    /// a file containing the calibration text
    #[arg(short = 'f', long = "file", value_name = "FNAME")]
    pub file: Option<PathBuf>,

    /// output file
    #[arg(short = 'o', long = "output-file", visible_alias = "output", value_name = "FNAME", default_value = "imatrix.gguf")]
    pub output_file: PathBuf,

    /// output format for imatrix file (default: gguf)
    #[arg(long = "output-format", value_name = "{gguf,dat}")]
    pub output_format: Option<OutputFormat>,

    /// size of the prompt context (0 = loaded from model)
    #[arg(short = 'c', long = "ctx-size", value_name = "N", default_value_t = 512, allow_negative_numbers = true)]
    pub ctx_size: i32,

    /// logical maximum batch size
    #[arg(short = 'b', long = "batch-size", value_name = "N", default_value_t = 2048, allow_negative_numbers = true)]
    pub batch_size: i32,

    /// physical maximum batch size [-ub]
    #[arg(long = "ubatch-size", value_name = "N", default_value_t = 512, allow_negative_numbers = true)]
    pub ubatch_size: i32,

    /// number of CPU threads to use (default: -1, all cores)
    #[arg(short = 't', long = "threads", value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    pub threads: i32,

    /// number of threads for batch processing (default: same as --threads) [-tb]
    #[arg(long = "threads-batch", value_name = "N", allow_negative_numbers = true)]
    pub threads_batch: Option<i32>,

    /// max. number of layers to store in VRAM: a number, 'auto' or 'all' (default: auto) [-ngl]
    #[arg(long = "n-gpu-layers", visible_alias = "gpu-layers", value_name = "N", default_value = "auto")]
    pub n_gpu_layers: String,

    /// set Flash Attention use ('on', 'off', or 'auto') [-fa]
    #[arg(long = "flash-attn", value_name = "on|off|auto", default_value = "auto")]
    pub flash_attn: String,

    /// how to split the model across GPUs: none, layer, row, tensor [-sm]
    #[arg(long = "split-mode", value_name = "MODE")]
    pub split_mode: Option<String>,

    /// fraction of the model to offload to each GPU, comma-separated [-ts]
    #[arg(long = "tensor-split", value_name = "N0,N1,...")]
    pub tensor_split: Option<String>,

    /// the GPU to use for the model [-mg]
    #[arg(long = "main-gpu", value_name = "INDEX", allow_negative_numbers = true)]
    pub main_gpu: Option<i32>,

    /// whether to enable weight repacking (default: enabled)
    #[arg(long = "repack", overrides_with = "no_repack")]
    pub repack: bool,

    /// turn weight repacking off [-nr]
    #[arg(long = "no-repack", overrides_with = "repack")]
    pub no_repack: bool,

    /// KV cache data type for K: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1 [-ctk]
    #[arg(long = "cache-type-k", value_name = "TYPE")]
    pub cache_type_k: Option<String>,

    /// KV cache data type for V (as -ctk) [-ctv]
    #[arg(long = "cache-type-v", value_name = "TYPE")]
    pub cache_type_v: Option<String>,

    /// offload the KV cache and KQV ops to the GPU (default) [-kvo]
    #[arg(long = "kv-offload", overrides_with = "no_kv_offload")]
    pub kv_offload: bool,

    /// keep the KV cache and KQV ops on the host [-nkvo]
    #[arg(long = "no-kv-offload", overrides_with = "kv_offload")]
    pub no_kv_offload: bool,

    #[command(flatten)]
    pub placement: crate::cli::placement::PlacementArgs,

    /// print list of available devices and exit
    #[arg(long = "list-devices")]
    pub list_devices: bool,

    /// fit unset arguments to device memory: 'off' (what reap-imatrix does); 'on' is refused,
    /// set -ngl yourself [-fit]
    #[arg(long = "fit", value_name = "on|off")]
    pub fit: Option<String>,

    /// parallel sequences: accepted as upstream's llama-imatrix accepts it, with no effect there
    /// either (the sequences per batch are -b / -c) [-np]
    #[arg(long = "parallel", value_name = "N", allow_negative_numbers = true)]
    pub parallel: Option<i32>,

    /// model loading mode: auto, none, mmap, mlock, mmap+mlock, dio [-lm]
    #[arg(long = "load-mode", value_name = "MODE", default_value = "auto")]
    pub load_mode: String,

    /// comma-separated list of RPC servers (host:port)
    #[arg(long = "rpc", value_name = "SERVERS")]
    pub rpc: Option<String>,

    /// end the run when an --rpc server moves no bytes for this many seconds while llama.cpp
    /// waits on it (stopped, hung, network down); 0 waits for ever, as upstream does
    #[arg(long = "rpc-timeout", value_name = "SECONDS", default_value_t = crate::llama::rpc_watch::DEFAULT_TIMEOUT_S)]
    pub rpc_timeout: u64,

    /// max number of chunks to process (-1 = all)
    #[arg(long = "chunks", value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    pub chunks: i32,

    /// start processing the input from chunk N
    #[arg(long = "chunk", visible_alias = "from-chunk", value_name = "N", default_value_t = 0, allow_negative_numbers = true)]
    pub chunk: i32,

    /// output the imatrix every N chunks [-ofreq]
    #[arg(long = "output-frequency", value_name = "N", default_value_t = 10, allow_negative_numbers = true)]
    pub output_frequency: i32,

    /// save an imatrix copy (<out>.at_N) every N chunks
    #[arg(long = "save-frequency", value_name = "N", default_value_t = 0, allow_negative_numbers = true)]
    pub save_frequency: i32,

    /// collect data for the output tensor
    #[arg(long = "process-output")]
    pub process_output: bool,

    /// do not compute perplexity
    #[arg(long = "no-ppl", overrides_with = "ppl")]
    pub no_ppl: bool,

    /// compute perplexity (the default)
    #[arg(long = "ppl", overrides_with = "no_ppl")]
    pub ppl: bool,

    /// parse special tokens (chat, tool, etc)
    #[arg(long = "parse-special")]
    pub parse_special: bool,

    /// input imatrix file(s), comma-separated; merged into the result
    #[arg(long = "in-file", value_name = "FNAME", action = clap::ArgAction::Append)]
    pub in_file: Vec<String>,

    /// show imatrix statistics (of the single --in-file) and exit
    #[arg(long = "show-statistics")]
    pub show_statistics: bool,

    /// REAP saliency JSON (default: beside -o, `<stem>.reap.json`)
    #[arg(long = "reap-out", value_name = "PATH", help_heading = "REAP")]
    pub reap_out: Option<PathBuf>,

    /// imatrix only: no REAP saliency, no trace
    #[arg(long = "no-reap", help_heading = "REAP")]
    pub no_reap: bool,

    /// also run the model's nextn/MTP block (GLM-4.5/4.6) as llama.cpp's MTP drafting runs
    /// it, teacher-forced, and add its imatrix entries and REAP saliency (docs/formats.md)
    #[arg(long = "nextn", help_heading = "REAP")]
    pub nextn: bool,

    /// with --nextn: the nextn/MTP block is in this file, not in -m's (DeepSeek-V4's, as
    /// convert_hf_to_gguf.py --mtp writes it: mtp-NAME.gguf)
    #[arg(long = "nextn-model", value_name = "FILE", help_heading = "REAP")]
    pub nextn_model: Option<PathBuf>,

    /// fast mode for offloaded layers: Σx² reduced on the device, only the sums copied to the
    /// host (not byte-identical to upstream; see docs/gpu.md)
    #[arg(long = "imatrix-on-device")]
    pub imatrix_on_device: bool,

    /// binary routing trace (off unless given); see docs/formats.md
    #[arg(long = "trace-out", value_name = "PATH", help_heading = "REAP")]
    pub trace_out: Option<PathBuf>,

    /// trace only the first N tokens (default: all)
    #[arg(long = "trace-tokens", value_name = "N", help_heading = "REAP")]
    pub trace_tokens: Option<u64>,

    /// router candidates kept per token and layer (default 64, at most n_expert)
    #[arg(long = "trace-top-n", value_name = "N", help_heading = "REAP")]
    pub trace_top_n: Option<usize>,

    /// which --chunks chunks of the corpus to evaluate: prefix (upstream: the first ones), even
    /// (spread over the whole corpus), seeded (drawn without replacement with --seed)
    #[arg(long = "chunk-sampling", value_name = "prefix|even|seeded", default_value = "prefix", help_heading = "Coverage")]
    pub chunk_sampling: crate::calibrate::coverage::ChunkSampling,

    /// seed of --chunk-sampling seeded (upstream's `-s`; its default -1, "random" there, is
    /// seed 0 here, so a run reproduces)
    #[arg(short = 's', long = "seed", value_name = "N", default_value = "0", allow_hyphen_values = true, value_parser = parse_seed, help_heading = "Coverage")]
    pub seed: u64,

    /// MIX.domains.tsv (from `reap-imatrix corpus`): per-domain coverage and REAP sums
    #[arg(long = "domains", value_name = "TSV", help_heading = "Coverage")]
    pub domains: Option<PathBuf>,

    /// run manifest (default: beside -o, `<stem>.manifest.json`)
    #[arg(long = "manifest-out", value_name = "PATH", help_heading = "REAP")]
    pub manifest_out: Option<PathBuf>,

    /// progress line: auto (live on a terminal, a plain line at each checkpoint otherwise), always, never
    #[arg(long = "progress", value_enum, value_name = "WHEN", default_value_t = crate::progress::Mode::Auto)]
    pub progress: crate::progress::Mode,

    /// log everything llama.cpp says
    #[arg(short = 'v', long = "verbose", visible_alias = "log-verbose")]
    pub verbose: bool,

    /// verbosity threshold [-lv]
    #[arg(long = "verbosity", visible_alias = "log-verbosity", value_name = "N", allow_negative_numbers = true)]
    pub verbosity: Option<i32>,
}

impl ImatrixArgs {
    pub fn compute_ppl(&self) -> bool {
        !self.no_ppl
    }

    /// `--trace-top-n`, or its default 64 (a model with fewer experts keeps all of them).
    pub fn trace_top_n_or_default(&self) -> usize {
        self.trace_top_n.unwrap_or(64)
    }
}

/// `dir/imatrix.gguf` → `dir/imatrix<suffix>`: the contract's default names beside `-o`.
pub fn beside_output(output: &std::path::Path, suffix: &str) -> PathBuf {
    let stem = output.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "imatrix".into());
    output.with_file_name(format!("{stem}{suffix}"))
}

/// `--seed`: a non-negative integer, or upstream's default -1, which is seed 0 here.
fn parse_seed(s: &str) -> std::result::Result<u64, String> {
    match s {
        "-1" => Ok(0),
        _ => s.parse::<u64>().map_err(|_| format!("\"{s}\" is not a seed (a non-negative integer, or -1 for the default 0)")),
    }
}
