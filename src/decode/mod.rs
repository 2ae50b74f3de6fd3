//! `reap-imatrix trace-decode`: routing traces of generation, as inference sees it.
//!
//! For each prompt: clear the KV cache, evaluate the prompt (every prompt token requests its
//! output, so that every layer routes every token: with only the last output, llama.cpp drops
//! the other rows before the last layer's FFN), then sample up to `--n-predict` tokens one at a
//! time, feeding each back, until an end-of-generation token. The loop is `llama-simple`'s
//! (examples/simple at the pin): greedy by default, the prompt tokenised with the vocab's
//! specials added and special tokens parsed, the last generated token not fed. Each evaluated
//! token is one trace row (phase prefill for the prompt, decode for a fed generated token), read
//! through the calibration observer with the imatrix switched off.

pub mod prompts;

use crate::calibrate::observer::{BatchRows, CalibrationObserver, ReapState};
use crate::calibrate::writer::{Job, Writer};
use crate::collect::imatrix::{Imatrix, ImatrixCollector, ImatrixConfig};
use crate::collect::trace_rows::{BatchLayout, SeqSpan, TraceRows};
use crate::error::UsageError;
use crate::formats::trace::{FLAG_DECODE, PHASE_DECODE, PHASE_PREFILL};
use crate::llama::{self, Context, ContextParams, Model, Sampler, Sampling};
use anyhow::{bail, Context as _, Result};
use prompts::PromptBody;
use serde_json::json;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
#[command(after_help = "Prompts: a .jsonl file holds one {\"text\": …} or {\"messages\": [{\"role\", \"content\"}…]} per line \
(chat rendered with the model's template); any other file is plain text with prompts separated by a line '---'.\n\
stdout: one JSON line per prompt (sequence, line, prompt_tokens, generated token ids, stop, text).")]
pub struct TraceDecodeArgs {
    /// The model (GGUF)
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub model: PathBuf,
    /// Prompts: plain text separated by '---' lines, or .jsonl with "text" or "messages"
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: PathBuf,
    /// Tokens to generate per prompt (at most; generation stops at an end-of-generation token)
    #[arg(short = 'n', long = "n-predict", value_name = "N", default_value_t = 128)]
    pub n_predict: usize,
    /// Sampling temperature; 0 (the default): greedy
    #[arg(long = "temp", value_name = "T", default_value_t = 0.0)]
    pub temp: f32,
    /// Seed of the sampling draw (with --temp)
    #[arg(long = "seed", value_name = "S", default_value_t = 1)]
    pub seed: u32,
    /// KV cache size; 0 (the default): the longest prompt plus n-predict − 1
    #[arg(short = 'c', long = "ctx-size", value_name = "N", default_value_t = 0)]
    pub ctx_size: u32,
    /// Most prompt tokens per decode call
    #[arg(short = 'b', long = "batch-size", value_name = "N", default_value_t = 512)]
    pub batch_size: u32,
    /// Physical batch size [-ub]
    #[arg(long = "ubatch-size", value_name = "N", default_value_t = 512)]
    pub ubatch_size: u32,
    /// CPU threads (-1: all cores)
    #[arg(short = 't', long = "threads", value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    pub threads: i32,
    #[command(flatten)]
    pub device: crate::cli::device::DeviceArgs,
    /// The routing trace to write
    #[arg(long = "trace-out", value_name = "FILE", required_unless_present = "no_trace")]
    pub trace_out: Option<PathBuf>,
    /// Router candidates kept per token and layer (at most n_expert)
    #[arg(long = "trace-top-n", value_name = "N", default_value_t = 64)]
    pub trace_top_n: usize,
    /// (benchmark helper) run the same loop without reading the graph, writing no trace
    #[arg(long = "no-trace")]
    pub no_trace: bool,
}

/// A prompt, tokenised.
struct Sequence {
    line: usize,
    tokens: Vec<i32>,
}

/// Time spent evaluating, per phase.
#[derive(Default)]
struct Timing {
    prefill: Duration,
    prefill_tokens: u64,
    decode: Duration,
    decode_tokens: u64,
}

pub fn run(args: &TraceDecodeArgs) -> Result<i32> {
    llama::log::set_verbosity(0);
    if args.trace_top_n == 0 {
        bail!(UsageError("--trace-top-n must be at least 1".into()));
    }
    if !(args.temp.is_finite() && args.temp >= 0.0) {
        bail!(UsageError(format!("--temp {}: must be a number ≥ 0", args.temp)));
    }
    if args.batch_size == 0 || args.ubatch_size == 0 {
        bail!(UsageError("--batch-size and --ubatch-size must be at least 1".into()));
    }
    if args.temp > 0.0 && args.seed == u32::MAX {
        // LLAMA_DEFAULT_SEED: llama.cpp's sampler draws a random seed for it
        bail!(UsageError(format!("--seed {}: llama.cpp takes this value as 'a random seed', so the run would not reproduce; give another", u32::MAX)));
    }
    let prompts = prompts::read(&args.file)?;
    if let Some(p) = &args.trace_out {
        for (flag, input) in [("-m", &args.model), ("-f", &args.file)] {
            if crate::formats::atomic::same_file(p, input) {
                bail!(UsageError(format!("--trace-out {} is the {flag} input: it would be overwritten", p.display())));
            }
        }
        crate::formats::atomic::check_writable(p).map_err(|e| UsageError(format!("--trace-out {e}")))?;
    }
    let header = crate::formats::gguf_header::read_model("-m", &args.model)?;
    if let Some(why) = crate::calibrate::validate::no_reap(&header.arch, &args.model).filter(|_| !args.no_trace) {
        bail!(UsageError(format!("{why}; its routing cannot be traced here")));
    }
    if let Some(ks) = header.varying_k().filter(|_| !args.no_trace) {
        bail!(UsageError(crate::calibrate::validate::one_k_per_trace(&args.model, &ks)));
    }
    if header.is_moe() && !args.no_trace && args.trace_top_n < header.n_expert_used as usize {
        bail!(UsageError(format!(
            "--trace-top-n {}: fewer than the {} experts each token uses (the candidates hold the selected ones)",
            args.trace_top_n, header.n_expert_used
        )));
    }
    let (model_params, flash_attn) = args.device.validate()?;
    let model = Model::load(&args.model, &model_params)?;
    let seqs = tokenize(args, &model, &prompts)?;
    let need = seqs.iter().map(|s| s.tokens.len() + args.n_predict.saturating_sub(1)).max().unwrap_or(1);
    let n_ctx = if args.ctx_size == 0 { need as u32 } else { args.ctx_size };
    if let Some(s) = seqs.iter().find(|s| s.tokens.len() + args.n_predict.saturating_sub(1) > n_ctx as usize) {
        bail!(UsageError(format!(
            "{}:{}: the prompt ({} tokens) and {} generated tokens need a context of {}; -c is {n_ctx}",
            args.file.display(),
            s.line,
            s.tokens.len(),
            args.n_predict,
            s.tokens.len() + args.n_predict.saturating_sub(1)
        )));
    }
    if n_ctx as i32 > model.n_ctx_train() {
        eprintln!("warning: model was trained on only {} context tokens ({n_ctx} specified)", model.n_ctx_train());
    }
    let n_batch = args.batch_size.min(n_ctx);
    let n_ubatch = args.ubatch_size.min(n_batch);
    let hw = std::thread::available_parallelism().map(|n| n.get() as i32).unwrap_or(4);
    let threads = if args.threads <= 0 { hw } else { args.threads };
    let ctx_params = ContextParams {
        n_ctx,
        n_batch,
        n_ubatch,
        n_seq_max: 1,
        n_threads: threads,
        n_threads_batch: threads,
        flash_attn,
        op_offload: args.device.placement.op_offload(),
        ..Default::default()
    };
    let reap = (!args.no_trace).then(|| ReapState::new(Some(TraceRows::new(args.trace_top_n, u64::MAX))));
    // the imatrix collector is required by the observer but switched off: routing only
    let imatrix = ImatrixCollector::new(ImatrixConfig { chunk_size: n_ctx as i32, out_freq: i32::MAX, save_freq: 0, process_output: false, small_by_rows: false }, Imatrix::default());
    let device_stats = reap.is_some() && crate::llama::expert_stats::wanted(&model_params);
    crate::llama::expert_stats::set(device_stats);
    let defer = crate::llama::expert_stats::keep_wanted(device_stats, true);
    crate::llama::expert_stats::set_keep(defer);
    let router_on_device = device_stats && crate::llama::expert_stats::router_wanted(defer);
    let router_candidates = if router_on_device { crate::llama::expert_stats::router_candidates(Some(args.trace_top_n), model.n_expert()) } else { 0 };
    crate::llama::expert_stats::set_router_candidates(router_candidates);
    let mut observer = CalibrationObserver::new(imatrix, reap);
    observer.collect_imatrix = false;
    observer.expert_stats_on_device = device_stats;
    observer.defer = defer;
    observer.router_on_device = router_on_device;
    observer.router_candidates = router_candidates;
    if crate::llama::expert_stats::prefetch_wanted(defer) {
        observer.prefetch = Some(crate::llama::prefetch::Prefetcher::new());
    }
    let mut ctx = Context::new(&model, &ctx_params, observer)?;
    let sampling = if args.temp > 0.0 { Sampling::Temperature { temp: args.temp, seed: args.seed } } else { Sampling::Greedy };
    let mut out = TraceOut { path: args.trace_out.clone().filter(|_| !args.no_trace), writer: Writer::spawn(), started: false };
    let mut timing = Timing::default();
    let mut stdout = std::io::stdout().lock();
    let vocab = model.vocab();
    for (s, seq) in seqs.iter().enumerate() {
        ctx.clear_memory();
        // seeded afresh per prompt: a prompt's generation does not depend on the ones before it
        let mut sampler = Sampler::new(sampling);
        let t0 = Instant::now();
        for (j, part) in seq.tokens.chunks(n_batch as usize).enumerate() {
            let pos0 = j * n_batch as usize;
            let last = pos0 + part.len() == seq.tokens.len();
            eval(&mut ctx, s, pos0, part, n_ubatch as usize, PHASE_PREFILL, last)?;
        }
        timing.prefill += t0.elapsed();
        timing.prefill_tokens += seq.tokens.len() as u64;
        let mut generated = Vec::new();
        let mut stop = "length";
        let t1 = Instant::now();
        while generated.len() < args.n_predict {
            let tok = sampler.sample(&ctx, -1);
            if vocab.is_eog(tok) {
                stop = "eog";
                break;
            }
            generated.push(tok);
            if generated.len() == args.n_predict {
                break; // as llama-simple: the last token is sampled, not fed
            }
            eval(&mut ctx, s, seq.tokens.len() + generated.len() - 1, &[tok], 1, PHASE_DECODE, true)?;
            timing.decode_tokens += 1;
            if ctx.observer().reap.as_ref().and_then(|r| r.trace.as_ref()).is_some_and(|t| t.pending_rows >= 4096) {
                out.flush(&mut ctx);
            }
            // a failed trace write stops the run now, not after every prompt
            if let Some(e) = out.writer.failure() {
                return Err(anyhow::Error::from(e).context("writing the trace"));
            }
        }
        timing.decode += t1.elapsed();
        out.flush(&mut ctx);
        if let Some(e) = out.writer.failure() {
            return Err(anyhow::Error::from(e).context("writing the trace"));
        }
        let text: Vec<u8> = generated.iter().flat_map(|&t| vocab.piece(t)).collect();
        let line = json!({
            "sequence": s, "line": seq.line, "prompt_tokens": seq.tokens.len(), "generated": generated,
            "stop": stop, "text": String::from_utf8_lossy(&text),
        });
        writeln!(stdout, "{line}")?;
    }
    out.writer.finish().context("writing the trace")?;
    report(&ctx, &timing, args, seqs.len());
    Ok(0)
}

/// Evaluates `tokens` of sequence `seq` from position `pos0`, as one batch; `want_last`
/// requests the logits of the last token (the prompt requests all its rows, see the module doc).
fn eval(ctx: &mut Context<'_, CalibrationObserver>, seq: usize, pos0: usize, tokens: &[i32], n_ubatch: usize, phase: u32, want_last: bool) -> Result<()> {
    let mut batch = ctx.batch();
    for (i, &t) in tokens.iter().enumerate() {
        let output = phase == PHASE_PREFILL || (want_last && i + 1 == tokens.len());
        batch.add(t, (pos0 + i) as i32, 0, output);
    }
    if let Some(r) = ctx.observer_mut().reap.as_mut() {
        let layout = BatchLayout { seqs: vec![SeqSpan { chunk: seq as u32, pos0: pos0 as u32, tok0: 0, len: tokens.len() }], n_ubatch };
        let ubatches = layout.ubatches().into_iter().map(|u| u.into_iter().map(|(_, o)| (seq as u32, (pos0 + o) as u32, tokens[o])).collect()).collect();
        r.batch = BatchRows { ubatches, domains: Vec::new(), current: None };
        if let Some(t) = r.trace.as_mut() {
            t.phase = phase;
        }
    }
    let drops = |ctx: &Context<'_, CalibrationObserver>| ctx.observer().reap.as_ref().map_or(0, |r| r.sums.nonfinite_drops);
    let before = drops(ctx);
    let res = ctx.decode(&mut batch);
    ctx.observer_mut().finish_ubatch();
    if let Some(f) = ctx.observer_mut().failure.take() {
        bail!("{f} (sequence {seq}, position {pos0})");
    }
    // rows of NaN gates and junk ids would fail `check`; calibration stops on such input too
    if drops(ctx) > before {
        bail!(
            "non-finite values (NaN or Inf) in the MoE routing of sequence {seq}, positions {pos0}..{}: the model computes them for \
             this input; the trace keeps the rows already written",
            pos0 + tokens.len()
        );
    }
    res
}

/// The prompts as token lists: chat rendered with the model's template, then tokenised as
/// llama-simple does (the vocab's BOS added when it adds one, special tokens parsed).
fn tokenize(args: &TraceDecodeArgs, model: &Model, prompts: &[prompts::Prompt]) -> Result<Vec<Sequence>> {
    let vocab = model.vocab();
    let at = |line: usize| format!("{}:{line}", args.file.display());
    prompts
        .iter()
        .map(|p| {
            let text = match &p.body {
                PromptBody::Text(t) => t.clone(),
                PromptBody::Chat(m) => {
                    if model.chat_template().is_none() {
                        bail!(UsageError(format!(
                            "{}: a chat prompt (\"messages\") needs the model's chat template, and {} has no tokenizer.chat_template",
                            at(p.line),
                            args.model.display()
                        )));
                    }
                    model.apply_chat_template(m, true).map_err(|e| UsageError(format!("{}: {e:#}", at(p.line))))?
                }
            };
            let tokens = vocab.tokenize(text.as_bytes(), true, true)?;
            if tokens.is_empty() {
                bail!(UsageError(format!("{}: the prompt tokenises to nothing", at(p.line))));
            }
            Ok(Sequence { line: p.line, tokens })
        })
        .collect()
}

/// The trace file, started when the first rows (and so the model's MoE layout) are known.
struct TraceOut {
    path: Option<PathBuf>,
    writer: Writer,
    started: bool,
}

impl TraceOut {
    fn flush(&mut self, ctx: &mut Context<'_, CalibrationObserver>) {
        let Some(path) = &self.path else { return };
        let Some(r) = ctx.observer_mut().reap.as_mut() else { return };
        if r.trace.as_ref().is_none_or(|t| t.pending_rows == 0) {
            return;
        }
        if !self.started {
            let Some(mut header) = r.trace_header() else { return };
            header.flags |= FLAG_DECODE;
            self.writer.send(Job::TraceCreate { path: path.clone(), header });
            self.started = true;
        }
        let t = r.trace.as_mut().unwrap();
        t.spare.extend(self.writer.spare_routing());
        let ubatches = std::mem::take(&mut t.pending);
        let n = std::mem::take(&mut t.pending_rows);
        r.rows_handed += n;
        self.writer.send(Job::TraceUbatches { ubatches, n });
        // the previous trace stays until this one holds rows (then every step is on disk)
        self.writer.send(Job::TracePublish);
    }
}

fn report(ctx: &Context<'_, CalibrationObserver>, t: &Timing, args: &TraceDecodeArgs, n_seq: usize) {
    let ms = |d: Duration, n: u64| if n > 0 { d.as_secs_f64() * 1e3 / n as f64 } else { 0.0 };
    eprintln!(
        "trace-decode: {n_seq} prompts; prefill {} tokens in {:.3} s ({:.3} ms/token); generation {} fed tokens in {:.3} s ({:.3} ms/token); {:.3} s inside the eval callback",
        t.prefill_tokens,
        t.prefill.as_secs_f64(),
        ms(t.prefill, t.prefill_tokens),
        t.decode_tokens,
        t.decode.as_secs_f64(),
        ms(t.decode, t.decode_tokens),
        ctx.observer().busy.as_secs_f64()
    );
    let copied = crate::llama::tensor::DEVICE_TO_HOST_BYTES.load(std::sync::atomic::Ordering::Relaxed);
    if copied > 0 {
        eprintln!("trace-decode: {:.1} MiB copied from device buffers; router {}", copied as f64 / (1u64 << 20) as f64, ctx.observer().router_summary());
    }
    if let (Some(p), Some(r)) = (&args.trace_out, ctx.observer().reap.as_ref()) {
        if r.sums.layers.is_empty() {
            eprintln!("notice: {} has no MoE layers: no trace written", args.model.display());
        } else {
            eprintln!("routing trace written to {} ({} rows: {} prefill, {} decode)", p.display(), r.rows_handed, t.prefill_tokens, t.decode_tokens);
        }
    }
}

