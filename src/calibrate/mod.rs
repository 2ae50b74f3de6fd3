//! The calibration run, as upstream's `llama-imatrix` drives it (`compute_imatrix` at the
//! pin): tokenise, cut into chunks, feed `n_seq` chunks per batch, clear the KV cache per
//! chunk, put BOS first when the vocab adds it, request every output, and print perplexity
//! over the second half of each chunk.

pub mod args;
pub mod coverage;
pub mod metadata;
pub mod nextn;
pub mod observer;
pub mod perplexity;
pub mod show_statistics;
pub mod validate;
pub mod writer;

use crate::calibrate::args::{beside_output, ImatrixArgs, OutputFormat};
use crate::collect::trace_rows::{BatchLayout, SeqSpan, TraceRows};
use crate::formats::trace::{TraceHeader, FLAG_NORMALISED};
use crate::formats::manifest::{FileRecord, Interruption};
use crate::progress;
use observer::{Checkpoint, ReapState};
use serde_json::{json, Value};
use crate::error::UsageError;
use crate::collect::imatrix::{Imatrix, ImatrixCollector, ImatrixConfig, SaveRequest};
use crate::formats::imatrix as imatrix_file;
use crate::llama::{self, Context, ContextParams, Model, ModelParams};
use anyhow::{bail, Context as _, Result};
use observer::CalibrationObserver;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use writer::{ImatrixFormat, Job, Writer};

/// Everything the run needs, resolved from the flags the way upstream resolves them.
pub struct Plan {
    pub args: ImatrixArgs,
    /// tokens per chunk (-c)
    pub n_ctx: i32,
    /// sequences per batch: max(1, b / c)
    pub n_seq: i32,
    /// KV size: n_seq · n_ctx
    pub n_kv: i32,
    /// min(b, n_kv)
    pub n_batch: i32,
    pub format: ImatrixFormat,
    pub in_files: Vec<PathBuf>,
    pub prompt_file: String,
    /// the saliency JSON; None with --no-reap
    pub reap_out: Option<PathBuf>,
    /// -o is a device written in place (`/dev/null`): nothing is written beside it by default
    pub output_in_place: bool,
    /// -f's size and sha256, of the bytes the run read (set when it reads them): the manifest's
    /// record, not a hash of whatever the file holds when the run ends
    pub corpus_read: Option<(u64, String)>,
    /// a split model's shards after the first (-m), recorded in the manifest
    pub model_shards: Vec<PathBuf>,
}

impl Plan {
    pub fn from_args(mut args: ImatrixArgs) -> Result<Plan> {
        // the block's own file says what to do with it
        args.nextn |= args.nextn_model.is_some();
        let n_ctx = args.ctx_size;
        if n_ctx <= 0 {
            bail!(UsageError("imatrix tool requires '--ctx-size' > 0".into()));
        }
        if args.output_frequency <= 0 {
            bail!(UsageError(format!("--output-frequency must be > 0 (got {})", args.output_frequency)));
        }
        let n_seq = (args.batch_size / n_ctx).max(1);
        // llama-context.cpp refuses more after the model load (LLAMA_MAX_SEQ in llama-cparams.h)
        const MAX_SEQ: i32 = 256;
        if n_seq > MAX_SEQ {
            bail!(UsageError(format!(
                "-b {} holds {n_seq} chunks of -c {n_ctx}, and llama.cpp takes at most {MAX_SEQ} sequences per batch: use a smaller -b or a larger -c",
                args.batch_size
            )));
        }
        let n_kv = n_seq * n_ctx;
        let n_batch = args.batch_size.min(n_kv);
        let format = match args.output_format {
            Some(OutputFormat::Dat) => ImatrixFormat::Dat,
            _ => ImatrixFormat::Gguf,
        };
        if args.output_format.is_none() && args.output_file.extension().is_none_or(|e| e != "gguf") {
            eprintln!("warning: saving imatrix using GGUF format with a different suffix than .gguf");
            eprintln!("warning: if you want the previous imatrix format, use --output-format dat");
        }
        // as upstream at the pin: `--in-file` takes a comma-separated list, and a repeated flag
        // adds its files too (upstream's handler appends, whatever its warning says)
        let mut in_files = Vec::new();
        for list in &args.in_file {
            for item in list.split(',').filter(|s| !s.is_empty()) {
                let p = PathBuf::from(item);
                std::fs::File::open(&p).map_err(|e| UsageError(format!("--in-file {item}: {e}")))?;
                in_files.push(p);
            }
        }
        let prompt_file = args.file.as_ref().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        if args.no_reap && (args.trace_out.is_some() || args.reap_out.is_some()) {
            bail!(UsageError("--no-reap cannot be combined with --reap-out or --trace-out".into()));
        }
        // `-o /dev/null` discards the imatrix; files "beside" it would land in /dev
        let output_in_place = crate::formats::atomic::in_place(&args.output_file);
        let reap_out = match (&args.reap_out, output_in_place) {
            _ if args.no_reap => None,
            (Some(p), _) => Some(p.clone()),
            (None, false) => Some(beside_output(&args.output_file, ".reap.json")),
            (None, true) if args.trace_out.is_some() => bail!(UsageError(format!(
                "-o {} is not a regular file, so the saliency JSON has no default place beside it: give --reap-out (--trace-out needs it)",
                args.output_file.display()
            ))),
            (None, true) => None,
        };
        if output_in_place {
            if args.save_frequency > 0 {
                bail!(UsageError(format!(
                    "--save-frequency {} writes copies beside -o ({}.at_N), and {} is not a regular file",
                    args.save_frequency,
                    args.output_file.display(),
                    args.output_file.display()
                )));
            }
            let unnamed: Vec<&str> = [(reap_out.is_none() && !args.no_reap, "--reap-out"), (args.manifest_out.is_none(), "--manifest-out")].into_iter().filter(|x| x.0).map(|x| x.1).collect();
            if !unnamed.is_empty() {
                eprintln!(
                    "note: -o {} is not a regular file (written in place): nothing is written beside it; name {} to keep {}",
                    args.output_file.display(),
                    unnamed.join(" and "),
                    if unnamed.len() == 2 { "the saliency JSON and the manifest" } else if unnamed[0] == "--reap-out" { "the saliency JSON" } else { "the manifest" }
                );
            }
        }
        if args.trace_tokens == Some(0) && args.trace_out.is_some() {
            bail!(UsageError("--trace-tokens 0 traces nothing: give N ≥ 1, or leave out --trace-out".into()));
        }
        if args.trace_top_n == Some(0) {
            bail!(UsageError("--trace-top-n must be at least 1".into()));
        }
        Ok(Plan { n_ctx, n_seq, n_kv, n_batch, format, in_files, prompt_file, reap_out, output_in_place, corpus_read: None, model_shards: Vec::new(), args })
    }

    /// Every file the run will write, with the flag that names it.
    pub fn outputs(&self) -> Vec<(&'static str, PathBuf)> {
        let mut v = vec![("-o", self.args.output_file.clone())];
        if let Some(p) = &self.reap_out {
            v.push(("--reap-out", p.clone()));
        }
        if let Some(p) = &self.args.trace_out {
            v.push(("--trace-out", p.clone()));
        }
        if let Some(p) = self.manifest_path() {
            v.push(("--manifest-out", p));
        }
        v
    }

    /// None when -o is a device and no --manifest-out is given
    pub fn manifest_path(&self) -> Option<PathBuf> {
        self.args.manifest_out.clone().or_else(|| (!self.output_in_place).then(|| beside_output(&self.args.output_file, ".manifest.json")))
    }

    /// Before anything is loaded or computed: every output can be written, and no two outputs
    /// are the same file.
    pub fn check_outputs(&self) -> Result<()> {
        let outs = self.outputs();
        for (i, (flag, p)) in outs.iter().enumerate() {
            if let Some((other, _)) = outs[..i].iter().find(|(_, q)| crate::formats::atomic::same_file(p, q)) {
                bail!(UsageError(format!("{flag} and {other} name the same file {}", p.display())));
            }
            crate::formats::atomic::check_writable(p).map_err(|e| UsageError(format!("{flag} {e}")))?;
        }
        Ok(())
    }

    /// Tokens per chunk as the imatrix file records it: n_ctx / n_parallel.
    pub fn chunk_size(&self) -> i32 {
        self.n_kv / self.n_seq
    }

    fn collector(&self) -> ImatrixCollector {
        ImatrixCollector::new(
            ImatrixConfig {
                chunk_size: self.chunk_size(),
                out_freq: self.args.output_frequency,
                save_freq: self.args.save_frequency,
                process_output: self.args.process_output,
                small_by_rows: false,
            },
            Imatrix::default(),
        )
    }

    fn job(&self, req: SaveRequest) -> Job {
        let path = match req.at {
            Some(n) => {
                let mut s = self.args.output_file.clone().into_os_string();
                s.push(format!(".at_{n}"));
                PathBuf::from(s)
            }
            None => self.args.output_file.clone(),
        };
        Job::Imatrix {
            path,
            state: Box::new(req.state),
            format: self.format,
            prompt_file: self.prompt_file.clone(),
            chunk_size: self.chunk_size(),
            progress_at: None,
        }
    }
}

/// The drop-in mode: `reap-imatrix -m MODEL -f TEXT [...]`. `argv` (after the program name,
/// as given) goes into the run manifest.
pub fn run(args: ImatrixArgs, argv: &[String]) -> Result<()> {
    llama::log::set_verbosity(if args.verbose { 2 } else { args.verbosity.unwrap_or(0) });
    progress::configure(args.progress);
    if args.show_statistics {
        return show_statistics::show(&args);
    }
    let mut plan = Plan::from_args(args)?;
    plan.check_outputs()?;
    // every check that needs no model load comes first (docs/failures.md)
    let (model_path, header, text) = validate::before_loading(&mut plan)?;
    let mut collector = plan.collector();
    for f in &plan.in_files {
        eprintln!("loading imatrix from '{}'", f.display());
        let loaded = imatrix_file::load(f).map_err(|e| UsageError(format!("--in-file: {e:#}")))?;
        validate::in_file_matches_model(f, &loaded.entries, &model_path, &header)?;
        collector.merge(&loaded).map_err(|e| anyhow::anyhow!("--in-file {}: {e}", f.display()))?;
    }
    let (Some(text_path), Some(text)) = (plan.args.file.clone(), text) else {
        eprintln!("No prompt provided; combining precomputed matrices only.");
        if plan.in_files.is_empty() {
            bail!(UsageError("No prompt provided and no precomputed matrices (--in-file) to combine.".into()));
        }
        eprintln!("saving {} to '{}'", if plan.in_files.len() > 1 { "combined imatrix" } else { "imatrix" }, plan.args.output_file.display());
        let w = Writer::spawn();
        w.send(plan.job(SaveRequest { at: None, state: collector.state }));
        w.finish()?;
        let cwd = std::env::current_dir()?;
        let mut model = vec![FileRecord::of("model", &model_path, &cwd)?];
        for p in &plan.model_shards {
            model.push(FileRecord::of("model_shard", p, &cwd)?);
        }
        return write_manifest(&plan, argv, model, &[], None, None);
    };
    // bad ranges fail before the model is loaded; they refer to the file's bytes
    let domains = match &plan.args.domains {
        Some(p) => {
            let file_len = std::fs::metadata(&text_path).map(|m| m.len()).unwrap_or(text.len() as u64);
            Some(crate::formats::domains::Domains::read(p, file_len)?)
        }
        None => None,
    };
    if domains.is_some() && plan.reap_out.is_none() {
        eprintln!("note: --domains with --no-reap: per-domain coverage is printed, no per-domain sums are collected");
    }
    let model_size = std::fs::metadata(&model_path).map(|m| m.len()).unwrap_or(0);
    // hashing a large model takes a while: once per file version (cached), beside the compute;
    // a split model's further shards too (hundreds of GB: minutes, not at the run's end)
    let model_sha = {
        let p = model_path.clone();
        let shards = plan.model_shards.clone();
        std::thread::spawn(move || {
            let first = metadata::cached_sha256_file(&p).ok();
            let rest: Vec<Option<(u64, String)>> = shards.iter().map(|s| Some((std::fs::metadata(s).ok()?.len(), metadata::cached_sha256_file(s).ok()?))).collect();
            (first, rest)
        })
    };
    // every flag is read before the model loads: a typo costs a second, not the load
    let mut params = model_params(&plan.args)?;
    let ctx_params = context_params(&plan)?;
    // --nextn-model: the block's own file (DeepSeek-V4's), loaded beside the trunk
    let nextn_file = if plan.args.nextn { validate::nextn_file(&plan.args, &model_path, &header)? } else { None };
    // hashed beside the compute too (an MTP file is gigabytes)
    let nextn_sha = nextn_file.as_ref().map(|(p, _)| {
        let p = p.clone();
        std::thread::spawn(move || Some((std::fs::metadata(&p).ok()?.len(), metadata::cached_sha256_file(&p).ok()?)))
    });
    let nextn_blocks = if plan.args.nextn {
        let (p, h) = nextn_file.as_ref().map_or((&model_path, &header), |(p, h)| (p, h));
        let b = validate::nextn_blocks(p, h)?;
        params.load_mtp = nextn_file.is_none();
        let own_head = b.iter().any(|b| h.tensors.contains_key(&format!("blk.{b}.nextn.shared_head_head.weight")));
        // a block without a router is dense (MiMo-V2's): imatrix entries, no REAP sums
        let moe: Vec<bool> = b.iter().map(|b| h.tensors.contains_key(&format!("blk.{b}.ffn_gate_inp.weight"))).collect();
        Some((b, moe, own_head))
    } else {
        None
    };
    let model = Model::load(&model_path, &params)?;
    let nextn_model = match &nextn_file {
        Some((p, _)) => Some(Model::load(p, &ModelParams { load_mtp: true, ..params.clone() }).map_err(|e| anyhow::anyhow!("--nextn-model {}: {e:#}", p.display()))?),
        None => None,
    };
    let block_model = nextn_model.as_ref().unwrap_or(&model);
    if let Some((b, _, _)) = &nextn_blocks {
        // the MTP graph runs block n_layer + offset (llama_model_n_layer: the trunk's count):
        // the blocks with tensors must be those
        let want: Vec<u32> = (0..block_model.n_layer_nextn().max(0) as u32).map(|i| block_model.n_layer() as u32 + i).collect();
        let p = nextn_file.as_ref().map_or(&model_path, |(p, _)| p);
        if *b != want {
            bail!("--nextn: {} has nextn tensors in blocks {b:?}, but llama.cpp loaded the nextn blocks {want:?} (nextn_predict_layers {})", p.display(), block_model.n_layer_nextn());
        }
        if block_model.n_embd_out() != model.n_embd_out() {
            bail!("--nextn-model {}: its blocks read hidden states {} wide, -m {}'s trunk gives {}", p.display(), block_model.n_embd_out(), model_path.display(), model.n_embd_out());
        }
    }
    let reap = plan.reap_out.as_ref().map(|_| {
        let trace = plan.args.trace_out.as_ref().map(|_| TraceRows::new(plan.args.trace_top_n_or_default(), plan.args.trace_tokens.unwrap_or(u64::MAX)));
        ReapState::new(trace)
    });
    let offloaded = crate::llama::expert_stats::wanted(&params);
    let device_stats = reap.is_some() && offloaded;
    crate::llama::expert_stats::set(device_stats);
    // --no-reap without --imatrix-on-device keeps upstream's graph (and its splits) for parity
    let defer = crate::llama::expert_stats::keep_wanted(offloaded, reap.is_some() || plan.args.imatrix_on_device);
    crate::llama::expert_stats::set_keep(defer);
    let router_on_device = device_stats && crate::llama::expert_stats::router_wanted(defer);
    let trace_top_n = reap.as_ref().and_then(|r| r.trace.as_ref()).map(|t| t.top_n);
    let router_candidates = if router_on_device { crate::llama::expert_stats::router_candidates(trace_top_n, model.n_expert()) } else { 0 };
    crate::llama::expert_stats::set_router_candidates(router_candidates);
    // offloaded, the host's cores wait while the callback runs: the exact imatrix's sums of a
    // large input are made on as many threads as the prompt's (-tb, -t's by default;
    // REAP_COLLECT_THREADS sets it, 1: the callback's thread alone). On the CPU, ggml's own
    // threads are about then (measured: the callback a tenth slower on 2 cores)
    let (_, prompt_threads) = thread_counts(plan.args.threads, plan.args.threads_batch);
    let threads = std::env::var("REAP_COLLECT_THREADS").ok().and_then(|v| v.parse::<i32>().ok()).filter(|&t| t > 0).unwrap_or(prompt_threads);
    if offloaded && threads > 1 {
        collector.pool = Some(crate::collect::pool::Pool::new(threads as usize));
    }
    // a trace's rows are encoded on the prompt's threads where offloaded (a fast device could
    // outrun one); REAP_WRITER_THREADS sets it
    let writer_threads = std::env::var("REAP_WRITER_THREADS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&t| t > 0);
    let traced = offloaded && plan.args.trace_out.is_some();
    let writer_threads = writer_threads.unwrap_or(if traced { prompt_threads.max(1) as usize } else { 1 });
    let mut observer = CalibrationObserver::new(collector, reap);
    observer.expert_stats_on_device = device_stats;
    observer.defer = defer;
    observer.router_on_device = router_on_device;
    observer.router_candidates = router_candidates;
    if crate::llama::expert_stats::prefetch_wanted(defer) {
        observer.prefetch = Some(crate::llama::prefetch::Prefetcher::new());
    }
    if plan.args.imatrix_on_device {
        observer.reducer = Some(crate::llama::reduce::DeviceReducer::default());
        observer.overlap = crate::llama::expert_stats::overlap_wanted(defer);
        observer.reap_by_layer = std::env::var("REAP_PARALLEL_LAYERS").map_or(true, |v| v != "0");
    }
    observer.capture_hidden = nextn_blocks.is_some();
    if header.arch == "deepseek4" {
        // the MTP block reads the trunk's hyper-connection streams as they leave the last
        // block (llama.cpp's h_nextn there), not the normed final state
        observer.hidden_node = format!("l_last-{}", model.n_layer() - 1);
    }
    let mut ctx = Context::new(&model, &ctx_params, observer)?;
    let mut nextn = nextn_blocks.map(|(b, moe, own_head)| nextn::NextnPass::new(block_model, &ctx_params, b, moe, own_head, ctx.observer())).transpose()?;
    if plan.n_kv > model.n_ctx_train() {
        eprintln!("warning: model was trained on only {} context tokens ({} specified)", model.n_ctx_train(), plan.n_kv);
    }
    let mut out = Outputs {
        plan: &plan,
        writer: Writer::spawn_with(writer_threads),
        trace_started: false,
        trace_published: false,
        outputs_replaced: false,
        model_block: metadata::model_block(&model, &model_path, model_size, None, &[]),
        corpus_block: json!({
            "path": plan.prompt_file,
            // of the bytes the run read (the file may change while it runs)
            "bytes": plan.corpus_read.as_ref().map_or(text.len() as u64, |(n, _)| *n),
            "sha256": plan.corpus_read.as_ref().map(|(_, h)| h.clone()).or_else(|| metadata::sha256_file(&text_path).ok()),
            "parse_special": plan.args.parse_special,
        }),
        chunks_done: 0,
        at_files: Vec::new(),
        chunk_base: ctx.observer().imatrix.state.last_chunk,
        coverage: None,
    };
    // from here a first SIGINT/SIGTERM stops the run between ubatches, with its outputs written
    let _graceful = crate::interrupt::graceful();
    let outcome = compute(&plan, &mut ctx, nextn.as_mut(), &text, domains.as_ref(), &mut out);
    // queued checkpoints are consistent states: they go to disk whatever happened
    out.flush(&mut ctx);
    let interrupted = match outcome {
        Ok(i) => i,
        Err(e) => {
            let w = out.writer.finish();
            if e.is::<writer::WriteFailed>() {
                return Err(w.err().unwrap_or(e).context("the run stopped; earlier checkpoints are left as they were"));
            }
            return Err(e.context(match w {
                Ok(_) if out.outputs_replaced => format!("the last checkpoint {} is left as it was", plan.args.output_file.display()),
                Ok(_) => format!("nothing was written before (no checkpoint yet; {} was not touched)", plan.args.output_file.display()),
                Err(we) => format!("and writing the last checkpoint failed too: {we:#}"),
            }));
        }
    };
    if let Some((sig, i)) = interrupted.as_ref().filter(|(_, i)| i.tokens == 0) {
        out.writer.finish()?;
        bail!(stopped_by(*sig, i, None));
    }
    let state = ctx.observer().imatrix.state.clone();
    if !out.outputs_replaced {
        out.remove_stale_manifest();
    }
    out.writer.send(plan.job(SaveRequest { at: None, state }));
    out.publish_trace();
    let (sha, shard_hashes) = model_sha.join().unwrap_or_default();
    // every shard hashed: the JSON names them all (a keep map then ties prune to each)
    let hashed: Vec<(PathBuf, u64, String)> = plan.model_shards.iter().zip(&shard_hashes).filter_map(|(p, h)| h.clone().map(|(size, sha)| (p.clone(), size, sha))).collect();
    let listed = if hashed.len() == plan.model_shards.len() { &hashed[..] } else { &[] };
    out.model_block = metadata::model_block(&model, &model_path, model_size, sha.as_deref(), listed);
    let nextn_hashed = nextn_sha.and_then(|t| t.join().ok().flatten());
    if let (Some((p, _)), Some((size, sha))) = (&nextn_file, &nextn_hashed) {
        // a keep map carries it, and prune checks the MTP file against it
        out.model_block["nextn_model"] = json!({"path": p.to_string_lossy(), "size": size, "sha256": sha});
    }
    if let Some(reap_out) = &plan.reap_out {
        match ctx.observer().saliency() {
            Some(s) if !s.layers.is_empty() => {
                if s.tokens == 0 || s.layers.iter().all(|l| l.count.iter().all(|&c| c == 0)) {
                    bail!("REAP collection saw no routed tokens; {} was not written", reap_out.display());
                }
                let s = out.with_metadata(&ctx, s);
                out.writer.send(Job::Saliency { path: reap_out.clone(), saliency: Box::new(s) });
            }
            _ => eprintln!("notice: {} is a dense model (no MoE layers): imatrix only, no saliency JSON", model_path.display()),
        }
    }
    let written = out.writer.finish().context("writing the final outputs failed; earlier checkpoints are left as they were")?;
    let mut extra = Vec::new();
    if let Some(p) = plan.reap_out.as_ref().filter(|p| p.is_file()) {
        extra.push(("reap", p.clone()));
    }
    if let Some(p) = &plan.args.trace_out {
        extra.push(("trace", p.clone()));
    }
    extra.extend(out.at_files.iter().map(|p| ("imatrix_at", p.clone())));
    let cwd = std::env::current_dir()?;
    let mut model_records = vec![match &sha {
        Some(h) => FileRecord { role: "model".into(), path: model_path.clone(), size: model_size, sha256: h.clone() },
        None => FileRecord::of("model", &model_path, &cwd)?,
    }];
    for (p, hashed) in plan.model_shards.iter().zip(shard_hashes.into_iter().chain(std::iter::repeat(None))) {
        model_records.push(match hashed {
            Some((size, sha256)) => FileRecord { role: "model_shard".into(), path: p.clone(), size, sha256 },
            None => FileRecord::of("model_shard", p, &cwd)?,
        });
    }
    if let Some((p, _)) = &nextn_file {
        model_records.push(match &nextn_hashed {
            Some((size, sha256)) => FileRecord { role: "nextn_model".into(), path: p.clone(), size: *size, sha256: sha256.clone() },
            None => FileRecord::of("nextn_model", p, &cwd)?,
        });
    }
    write_manifest(&plan, argv, model_records, &extra, interrupted.as_ref().map(|(_, i)| i), out.coverage.clone())?;
    if interrupted.is_none() {
        llama::abort::outputs_complete();
    }
    let prefetched = ctx.observer().prefetch.as_ref().map_or(String::new(), |p| format!(" ({} tensors copied in {} copies in {} batches, {} waits, {:.3} s starting the copies and waiting)", p.tensors, p.copies, p.batches, p.waits, p.busy.as_secs_f64()));
    eprintln!(
        "collection: {:.3} s inside the eval callback over {} chunks; {} matmuls collected from the input of the one before (no callback of their own); {} nodes read at the end of their graph{prefetched}",
        ctx.observer().busy.as_secs_f64(),
        out.chunks_done,
        ctx.observer().shared_inputs,
        ctx.observer().deferred_reads
    );
    if let Some(r) = &ctx.observer().reducer {
        let o = ctx.observer();
        let by_layer = if o.reap_by_layer_reads > 0 { format!(" ({} with REAP's layers summed on {} threads)", o.reap_by_layer_reads, o.imatrix.pool.as_ref().map_or(1, |p| p.threads())) } else { String::new() };
        let overlapped = if o.overlapped_reads > 0 { format!(", {} of them while REAP's reads were copied and summed{by_layer}", o.overlapped_reads) } else { String::new() };
        eprintln!(
            "collection: --imatrix-on-device copied {} bytes of sums in {} drains ({:.3} s copying and adding them); {} reduction graphs run ({} operations){overlapped}",
            r.bytes_out,
            o.drains,
            o.drain_busy.as_secs_f64(),
            r.graphs_run,
            r.ops_run
        );
    }
    let copied = crate::llama::tensor::DEVICE_TO_HOST_BYTES.load(std::sync::atomic::Ordering::Relaxed);
    if copied > 0 {
        let tokens = (out.chunks_done as u64 * plan.n_ctx as u64).max(1);
        let obs = ctx.observer();
        // what REAP read (nothing with --no-reap)
        let reap = if obs.reap.is_none() {
            String::new()
        } else {
            let stats = if obs.expert_stats_on_device { "on the device" } else { "from the host copies" };
            format!("; expert statistics read {stats}; router {}", obs.router_summary())
        };
        eprintln!("collection: {:.1} MiB copied from device buffers ({} bytes per token{reap})", copied as f64 / (1u64 << 20) as f64, copied / tokens);
    }
    if plan.args.trace_out.is_some() {
        eprintln!(
            "collection: trace rows ordered and encoded on {} writer thread{} in {:.3} s; the compute waited {:.3} s for the writer's queue",
            written.threads,
            if written.threads == 1 { "" } else { "s" },
            written.encoding.as_secs_f64(),
            written.blocked.as_secs_f64()
        );
    }
    eprintln!("imatrix written to {}", plan.args.output_file.display());
    if let (Some(p), Some(s)) = (&plan.reap_out, ctx.observer().saliency().filter(|s| !s.layers.is_empty())) {
        eprintln!("REAP saliency written to {} ({} MoE layers, {} tokens)", p.display(), s.layers.len(), s.tokens);
    }
    if let Some(t) = &plan.args.trace_out {
        eprintln!("routing trace written to {} ({} rows)", t.display(), ctx.observer().reap.as_ref().and_then(|r| r.trace.as_ref()).map_or(0, |t| t.rows));
    }
    if let Some((sig, i)) = interrupted {
        bail!(stopped_by(sig, &i, Some(plan.manifest_path().as_deref())));
    }
    Ok(())
}

/// The error of a run a signal stopped; `written`: None when nothing was written, else the
/// manifest that records the outputs (None inside: no manifest, -o being a device).
fn stopped_by(signal: i32, i: &Interruption, written: Option<Option<&Path>>) -> crate::error::Interrupted {
    let message = match written {
        None => format!("interrupted by {} before chunk {} was evaluated: nothing new was written", i.signal, i.chunk),
        Some(m) => format!(
            "interrupted by {} during chunk {}: the outputs hold the {} tokens evaluated ({} whole chunks){}",
            i.signal,
            i.chunk,
            i.tokens,
            i.chunks_done,
            m.map_or(String::new(), |m| format!("; {} records the interruption", m.display()))
        ),
    };
    crate::error::Interrupted { signal, message }
}

/// Everything that leaves the compute thread: checkpoints, the saliency JSON, trace rows.
struct Outputs<'p> {
    plan: &'p Plan,
    writer: Writer,
    trace_started: bool,
    /// the trace has its name (Job::TracePublish sent)
    trace_published: bool,
    /// a checkpoint was sent: the previous run's files are being replaced
    outputs_replaced: bool,
    model_block: Value,
    corpus_block: Value,
    chunks_done: usize,
    /// `.at_N` copies sent to the writer
    at_files: Vec<PathBuf>,
    /// the imatrix's chunk count before this run (merged --in-file): checkpoints count from it
    chunk_base: i32,
    /// which chunks are evaluated (set before the first one)
    coverage: Option<Value>,
}

impl Outputs<'_> {
    fn run_block(&self) -> Value {
        let a = &self.plan.args;
        let mut run = json!({
            // effective sizes, as llama.cpp uses them (the ubatch never exceeds the batch)
            "ctx": self.plan.n_ctx, "batch": self.plan.n_batch, "ubatch": a.ubatch_size.min(self.plan.n_batch as _), "n_seq": self.plan.n_seq,
            "chunks": a.chunks, "chunks_done": self.chunks_done, "from_chunk": a.chunk,
            "output_frequency": a.output_frequency, "threads": a.threads, "n_gpu_layers": a.n_gpu_layers,
            "trace_top_n": a.trace_top_n_or_default(), "trace_tokens": a.trace_tokens,
            "chunk_sampling": a.chunk_sampling.name(), "seed": a.seed,
            "domains": a.domains.as_ref().map(|p| p.to_string_lossy().into_owned()),
        });
        run.as_object_mut().expect("an object").extend(a.placement.settings());
        run
    }

    fn with_metadata(&self, ctx: &Context<'_, CalibrationObserver>, mut s: crate::formats::saliency::Saliency) -> crate::formats::saliency::Saliency {
        let wn = ctx.observer().reap.as_ref().and_then(|r| r.weights_node.clone());
        let gating = ctx.observer().reap.as_ref().and_then(|r| r.gating_op.clone());
        let from_logits = ctx.observer().reap.as_ref().is_some_and(|r| r.probs_from_logits);
        let routing = json!({
            // the op of ffn_moe_probs: SOFT_MAX for softmax gating, UNARY for sigmoid, …
            "probs_op": gating,
            // MUL_MAT/ADD: the graph's probs are the logits (gpt-oss); p is their softmax, taken here
            "probs_from_logits": from_logits,
            "weights_node": wn,
            "normalised": wn.as_deref().is_some_and(is_normalised_node),
            "layers": s.layers.iter().map(|l| json!({"layer": l.layer, "n_expert": l.n_expert, "n_expert_used": l.n_expert_used})).collect::<Vec<_>>(),
        });
        s.metadata = metadata::assemble(self.model_block.clone(), self.corpus_block.clone(), self.run_block(), routing);
        s.coverage = self.coverage.clone();
        s
    }

    /// Hands everything the observer queued to the writer: trace rows first, so that (the
    /// writer being FIFO) every row a checkpoint's JSON counts is on disk before that JSON.
    fn flush(&mut self, ctx: &mut Context<'_, CalibrationObserver>) {
        self.flush_trace(ctx);
        let checkpoints: Vec<Checkpoint> = ctx.observer_mut().checkpoints.drain(..).collect();
        for c in checkpoints {
            let rolling_at = c.imatrix.at.is_none().then(|| (c.imatrix.state.last_chunk - self.chunk_base).max(0) as u64);
            let mut job = self.plan.job(c.imatrix);
            if let Job::Imatrix { progress_at, .. } = &mut job {
                *progress_at = rolling_at;
            }
            if let (Job::Imatrix { path, .. }, true) = (&job, c.reap.is_none()) {
                if !self.at_files.contains(path) && path != &self.plan.args.output_file {
                    self.at_files.push(path.clone());
                }
            }
            if !self.outputs_replaced {
                self.outputs_replaced = true;
                self.remove_stale_manifest();
            }
            self.writer.send(job);
            // before the JSON: a JSON on disk always has its trace rows on disk
            self.publish_trace();
            if let (Some(path), Some(s)) = (&self.plan.reap_out, c.reap) {
                if !s.layers.is_empty() {
                    let s = self.with_metadata(ctx, s);
                    self.writer.send(Job::Saliency { path: path.clone(), saliency: Box::new(s) });
                }
            }
        }
    }

    /// The previous run's manifest vouches for the files this run now replaces: it goes before
    /// the first of them does (this run's own is written at the end).
    fn remove_stale_manifest(&self) {
        if let Some(m) = self.plan.manifest_path().map(|m| crate::formats::atomic::resolve(&m)).filter(|m| m.is_file()) {
            let _ = std::fs::remove_file(m);
        }
    }

    /// The trace takes its name with the imatrix and JSON it belongs with (once).
    fn publish_trace(&mut self) {
        if self.trace_started && !self.trace_published {
            self.trace_published = true;
            self.writer.send(Job::TracePublish);
        }
    }

    fn flush_trace(&mut self, ctx: &mut Context<'_, CalibrationObserver>) {
        let Some(trace_path) = self.plan.args.trace_out.clone() else { return };
        let obs = ctx.observer_mut();
        let Some(r) = obs.reap.as_mut() else { return };
        let Some(t) = r.trace.as_mut() else { return };
        if t.pending_rows == 0 {
            return;
        }
        if !self.trace_started {
            let first = &r.sums.layers[0];
            let header = TraceHeader {
                layers: r.sums.layers.iter().map(|l| l.layer).collect(),
                n_expert: first.n_expert as u32,
                k: first.n_expert_used as u32,
                top_n: t.top_n as u32,
                n_tokens: 0,
                flags: if r.weights_node.as_deref().is_some_and(is_normalised_node) { FLAG_NORMALISED } else { 0 },
            };
            self.writer.send(Job::TraceCreate { path: trace_path, header });
            self.trace_started = true;
        }
        t.spare.extend(self.writer.spare_routing());
        let ubatches = std::mem::take(&mut t.pending);
        let n = std::mem::take(&mut t.pending_rows);
        r.rows_handed += n;
        self.writer.send(Job::TraceUbatches { ubatches, n });
    }
}

pub use crate::formats::domains::NO_DOMAIN;

/// Whether the gate weights the graph applies sum to 1 over the top-k.
pub fn is_normalised_node(name: &str) -> bool {
    crate::formats::saliency::AppliedGate::of_node(name) == crate::formats::saliency::AppliedGate::Normalised
}

/// The model's parameters from the drop-in flags: `-ngl`, `-lm`, `--rpc` (shared with eval and
/// trace-decode), and `-sm`, `-mg`, `-ts`, `-nr` as upstream's tools read them; sets the
/// watchdog's `--rpc-timeout` for the process.
pub fn model_params(args: &ImatrixArgs) -> Result<ModelParams> {
    llama::rpc_watch::set_timeout(args.rpc_timeout);
    let mut p = model_params_of(&args.n_gpu_layers, &args.load_mode, args.rpc.clone())?;
    if let Some(m) = &args.split_mode {
        p.split_mode = match m.as_str() {
            "none" => llama::sys::LLAMA_SPLIT_MODE_NONE,
            "layer" => llama::sys::LLAMA_SPLIT_MODE_LAYER,
            "row" => llama::sys::LLAMA_SPLIT_MODE_ROW,
            "tensor" => llama::sys::LLAMA_SPLIT_MODE_TENSOR,
            m => bail!(UsageError(format!("-sm {m}: expected none, layer, row or tensor"))),
        };
    }
    if let Some(g) = args.main_gpu {
        p.main_gpu = g;
    }
    if let Some(ts) = &args.tensor_split {
        // as upstream: values separated by ',' or '/'
        p.tensor_split = ts
            .split([',', '/'])
            .filter(|s| !s.is_empty())
            .map(|s| s.trim().parse::<f32>().ok().filter(|x| x.is_finite() && *x >= 0.0))
            .collect::<Option<Vec<f32>>>()
            .ok_or_else(|| UsageError(format!("-ts {ts}: expected non-negative numbers separated by ',' or '/'")))?;
        // SAFETY: a plain query.
        let max = unsafe { llama::sys::llama_max_devices() };
        if p.tensor_split.len() > max {
            bail!(UsageError(format!("-ts {ts}: {} values, this build supports at most {max} devices", p.tensor_split.len())));
        }
    }
    if args.no_repack {
        p.use_extra_bufts = false;
    }
    p.tensor_overrides = args.placement.overrides.clone();
    p.devices = args.placement.devices()?;
    match args.fit.as_deref() {
        None | Some("off" | "false" | "0" | "disabled") => {}
        Some("on" | "true" | "1" | "enabled") => bail!(UsageError(
            "-fit on: reap-imatrix does not fit arguments to device memory; set -ngl (and -c) yourself, or -fit off".into()
        )),
        Some(v) => bail!(UsageError(format!("-fit {v}: expected on or off"))),
    }
    Ok(p)
}

/// `-ctk`/`-ctv`: the KV cache types upstream's tools accept (`kv_cache_types` in the pin's
/// common/arg.cpp), by ggml's type names.
fn kv_cache_type(flag: &str, name: &str) -> Result<llama::sys::ggml_type> {
    use llama::sys::*;
    let allowed = [GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1];
    // SAFETY: ggml_type_name returns a static C string for every type.
    let type_name = |t| unsafe { std::ffi::CStr::from_ptr(ggml_type_name(t)) }.to_string_lossy().into_owned();
    allowed.into_iter().find(|&t| type_name(t) == name).ok_or_else(|| {
        let names: Vec<String> = allowed.into_iter().map(type_name).collect();
        anyhow::anyhow!(UsageError(format!("{flag} {name}: unsupported cache type (one of {})", names.join(", "))))
    })
}

/// `-ngl`, `-lm` and `--rpc` as upstream's tools read them (shared with `eval`).
pub fn model_params_of(n_gpu_layers: &str, load_mode: &str, rpc: Option<String>) -> Result<ModelParams> {
    let n_gpu_layers = match n_gpu_layers {
        "auto" => -1,
        "all" => -2,
        n => n.parse().map_err(|_| UsageError(format!("-ngl: expected a number, 'auto' or 'all', got '{n}'")))?,
    };
    let load_mode = match load_mode {
        "auto" => llama::sys::LLAMA_LOAD_MODE_AUTO,
        "none" => llama::sys::LLAMA_LOAD_MODE_NONE,
        "mmap" => llama::sys::LLAMA_LOAD_MODE_MMAP,
        "mlock" => llama::sys::LLAMA_LOAD_MODE_MLOCK,
        "mmap+mlock" => llama::sys::LLAMA_LOAD_MODE_MMAP_MLOCK,
        "dio" => llama::sys::LLAMA_LOAD_MODE_DIRECT_IO,
        m => bail!(UsageError(format!("-lm: unknown load mode '{m}'"))),
    };
    Ok(ModelParams { n_gpu_layers, load_mode, rpc_servers: rpc, ..Default::default() })
}

/// `-t`/`-tb` as upstream reads them: ≤ 0 means every core.
pub fn thread_counts(threads: i32, threads_batch: Option<i32>) -> (i32, i32) {
    let hw = std::thread::available_parallelism().map(|n| n.get() as i32).unwrap_or(4);
    let threads = if threads <= 0 { hw } else { threads };
    let threads_batch = match threads_batch {
        None => threads,
        Some(t) if t <= 0 => hw,
        Some(t) => t,
    };
    (threads, threads_batch)
}

/// `-fa on|off|auto` → `llama_flash_attn_type`.
pub fn flash_attn_type(v: &str) -> Result<i32> {
    Ok(match v {
        "on" | "enabled" | "1" | "true" => llama::sys::LLAMA_FLASH_ATTN_TYPE_ENABLED,
        "off" | "disabled" | "0" | "false" => llama::sys::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        "auto" | "-1" => llama::sys::LLAMA_FLASH_ATTN_TYPE_AUTO,
        v => bail!(UsageError(format!("unknown value for --flash-attn: '{v}'"))),
    })
}

fn context_params(plan: &Plan) -> Result<ContextParams> {
    let (threads, threads_batch) = thread_counts(plan.args.threads, plan.args.threads_batch);
    let flash_attn = flash_attn_type(&plan.args.flash_attn)?;
    let kv_type = |flag: &str, t: &Option<String>| t.as_deref().map(|t| kv_cache_type(flag, t)).transpose();
    Ok(ContextParams {
        n_ctx: plan.n_kv as u32,
        n_batch: plan.n_batch as u32,
        n_ubatch: plan.args.ubatch_size as u32,
        n_seq_max: plan.n_seq as u32,
        n_threads: threads,
        n_threads_batch: threads_batch,
        flash_attn,
        type_k: kv_type("-ctk", &plan.args.cache_type_k)?,
        type_v: kv_type("-ctv", &plan.args.cache_type_v)?,
        offload_kqv: !plan.args.no_kv_offload,
        op_offload: plan.args.placement.op_offload(),
        mtp: false,
    })
}

/// The chunk loop. Returns the signal and where it stopped the run, when one did.
fn compute(plan: &Plan, ctx: &mut Context<'_, CalibrationObserver>, mut nextn: Option<&mut nextn::NextnPass<'_>>, text: &[u8], domains: Option<&crate::formats::domains::Domains>, outputs: &mut Outputs) -> Result<Option<(i32, Interruption)>> {
    let model = ctx.model();
    let vocab = model.vocab();
    let add_bos = vocab.add_bos();
    if vocab.add_eos() {
        bail!("the model's vocab adds EOS to every text; llama-imatrix refuses such models too");
    }
    let n_ctx = plan.n_ctx as usize;
    let t0 = Instant::now();
    eprintln!("compute_imatrix: tokenizing the input ..");
    let mut tokens = vocab.tokenize(text, true, plan.args.parse_special)?;
    eprintln!("compute_imatrix: tokenization took {:.3} ms", t0.elapsed().as_secs_f64() * 1e3);
    // with --domains: every token's domain, from the byte its token starts at
    let (domain_names, mut token_domain) = match domains {
        Some(d) => {
            let offsets = vocab.token_offsets(text, &tokens).context("--domains: mapping tokens to byte offsets")?;
            if let Some((i, stated, counted)) = d.first_count_mismatch(&offsets) {
                let r = &d.ranges[i];
                eprintln!(
                    "warning: --domains {}:{}: range [{}, {}) ({}) says {stated} tokens, this text has {counted} there: a domains file of another mix, or a run without --parse-special (corpus counts special tokens parsed); tokens are attributed by byte range all the same",
                    plan.args.domains.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                    r.line,
                    r.start,
                    r.end,
                    r.domain
                );
            }
            let mut names = d.names();
            let none = names.len() as u16;
            let ids: Vec<u16> = d.domain_of_offsets(&offsets).into_iter().map(|x| x.unwrap_or(none)).collect();
            if ids.contains(&none) {
                names.push(NO_DOMAIN.to_string());
            }
            (names, ids)
        }
        None => (Vec::new(), Vec::new()),
    };
    let i_chunk = plan.args.chunk.max(0) as usize;
    if i_chunk > 0 {
        if (i_chunk + 2) * n_ctx >= tokens.len() {
            bail!(UsageError(format!("there will be not enough tokens left after removing {i_chunk} chunks")));
        }
        eprintln!("compute_imatrix: removing initial {i_chunk} chunks ({} tokens)", i_chunk * n_ctx);
        tokens.drain(..i_chunk * n_ctx);
        if !token_domain.is_empty() {
            token_domain.drain(..i_chunk * n_ctx);
        }
    }
    if tokens.len() < 2 * n_ctx {
        bail!(UsageError(format!(
            "you need at least {} tokens for a context of {n_ctx} tokens; the data file you provided tokenizes to only {} tokens",
            2 * n_ctx,
            tokens.len()
        )));
    }
    let n_chunk_max = tokens.len() / n_ctx;
    let n_chunk = if plan.args.chunks < 0 { n_chunk_max } else { (plan.args.chunks as usize).min(n_chunk_max) };
    let chunk_ids = coverage::chunk_indices(plan.args.chunk_sampling, n_chunk_max, n_chunk, plan.args.seed);
    let cov = coverage::Coverage {
        sampling: plan.args.chunk_sampling,
        seed: plan.args.seed,
        n_ctx,
        corpus_tokens: tokens.len() as u64,
        chunks_total: n_chunk_max,
        domains: domain_names
            .iter()
            .enumerate()
            .map(|(d, name)| {
                let of = |ts: &[u16]| ts.iter().filter(|&&x| x as usize == d).count() as u64;
                let evaluated = chunk_ids.iter().map(|&c| of(&token_domain[c * n_ctx..(c + 1) * n_ctx])).sum();
                (name.clone(), of(&token_domain), evaluated)
            })
            .collect(),
        chunk_indices: chunk_ids.clone(),
    };
    for line in cov.describe() {
        eprintln!("{line}");
    }
    outputs.coverage = Some(cov.to_json());
    if !domain_names.is_empty() {
        if let Some(r) = ctx.observer_mut().reap.as_mut() {
            r.sums.domains = Some(crate::collect::reap::DomainSplit::new(domain_names.clone()));
        }
    }
    let n_vocab = vocab.n_tokens() as usize;
    let n_batch = plan.n_batch as usize;
    let n_seq = plan.n_seq as usize;
    let num_batches = n_ctx.div_ceil(n_batch);
    let compute_ppl = plan.args.compute_ppl();
    eprintln!("compute_imatrix: computing over {n_chunk} chunks, n_ctx={n_ctx}, batch_size={n_batch}, n_seq={n_seq}");

    let mut ppl = perplexity::Accumulator::default();
    let mut logits: Vec<f32> = Vec::new();
    let mut batch = ctx.batch();
    let bar = progress::start(n_chunk as u64, progress::Unit::Chunks { tokens: n_ctx as u64 }).checkpoints();
    // upstream's per-chunk perplexities grow one line on stdout: no live line over it
    let bar = if compute_ppl { bar.quiet_on_terminal() } else { bar };
    let mut out = std::io::stdout().lock();
    let mut span = DecodeSpan::default();
    let mut i = 0;
    while i < n_chunk {
        let n_seq_batch = n_seq.min(n_chunk - i);
        // the corpus chunks of this batch's sequences (consecutive under prefix sampling)
        let seq_chunks = &chunk_ids[i..i + n_seq_batch];
        let t_start = Instant::now();
        ctx.observer_mut().chunk = i as i32 + 1;
        ctx.clear_memory();
        if let Some(n) = nextn.as_deref_mut() {
            n.start_chunk(i as i32 + 1);
        }
        for j in 0..num_batches {
            let batch_size = (n_ctx - j * n_batch).min(n_batch);
            batch.clear();
            let mut fed: Vec<i32> = Vec::with_capacity(n_seq_batch * batch_size);
            for seq in 0..n_seq_batch {
                let seq_start = seq_chunks[seq] * n_ctx + j * n_batch;
                for k in 0..batch_size {
                    // BOS replaces the first token of each chunk when the vocab adds BOS
                    let tok = if add_bos && j == 0 && k == 0 { vocab.bos() } else { tokens[seq_start + k] };
                    batch.add(tok, (j * n_batch + k) as i32, seq as i32, true);
                    fed.push(tok);
                }
            }
            if let Some(r) = ctx.observer_mut().reap.as_mut() {
                let dom = |chunk: u32, pos: u32| token_domain.get(chunk as usize * n_ctx + pos as usize).copied();
                r.batch = batch_rows(seq_chunks, j * n_batch, batch_size, plan.args.ubatch_size.min(plan.n_batch) as usize, &fed, dom);
            }
            // Without perplexity or --process-output nobody reads the logits. When this decode
            // is one ubatch and the last of its chunk (the KV cache is cleared next, so the
            // positions llama.cpp drops on a stopped graph are never read), stop the graph after
            // the final norm and skip the output projection. Every collected tensor comes
            // before it, so the files are unchanged.
            let one_ubatch = n_seq_batch * batch_size <= (plan.args.ubatch_size as usize).min(n_batch);
            let stop = !compute_ppl && !plan.args.process_output && one_ubatch && j + 1 == num_batches;
            ctx.observer_mut().stop_before_logits = stop;
            ctx.observer_mut().stopped_before_logits = false;
            ctx.observer_mut().hidden.clear();
            let r = ctx.decode_or_stop(&mut batch);
            ctx.observer_mut().finish_ubatch();
            // with --nextn, the checkpoints of this batch wait for the block's pass (below)
            if nextn.is_none() || ctx.observer().interrupted {
                outputs.flush(ctx);
            }
            if let Some(e) = outputs.writer.failure() {
                return Err(e.into());
            }
            if let Some(f) = ctx.observer_mut().failure.take() {
                bail!("{f}");
            }
            if ctx.observer().interrupted {
                // the ubatches before the signal are whole: their device sums belong in the outputs
                if !ctx.observer_mut().flush_device_imatrix() {
                    bail!("{}", ctx.observer_mut().failure.take().unwrap_or_default());
                }
                outputs.flush(ctx);
                bar.abandon("interrupted");
                if compute_ppl {
                    writeln!(out)?;
                }
                let signal = crate::interrupt::requested().unwrap_or(libc::SIGINT);
                let at = Interruption {
                    signal: crate::interrupt::name(signal),
                    chunk: i as u64 + 1,
                    chunks_done: i as u64,
                    tokens: ctx.observer().tokens_begun,
                };
                return Ok(Some((signal, at)));
            }
            let completed = r.context("failed to eval")?;
            if !completed && !ctx.observer().stopped_before_logits {
                bail!("failed to eval: the graph was stopped");
            }
            if let Some(n) = nextn.as_deref_mut() {
                let hidden = std::mem::take(&mut ctx.observer_mut().hidden);
                n.run(&fed, n_seq_batch, batch_size, j * n_batch, &hidden, ctx.observer_mut())?;
                ctx.observer_mut().hidden = hidden;
                outputs.flush(ctx);
                if let Some(e) = outputs.writer.failure() {
                    return Err(e.into());
                }
            }
            span.note();
            if compute_ppl && num_batches > 1 {
                logits.extend_from_slice(ctx.logits(batch_size));
            }
        }
        // --imatrix-on-device: the sums accumulated on the device enter the imatrix (and its
        // checkpoint rule) where that rule writes a checkpoint for this chunk, and at the end,
        // not after every chunk: each time copies and adds every weight's sums, tens of MB on
        // a large model, which at -c 512 can cost more than the chunk's forward pass
        let last = i + n_seq_batch >= n_chunk;
        if (last || ctx.observer().device_imatrix_due()) && !ctx.observer_mut().flush_device_imatrix() {
            bail!("{}", ctx.observer_mut().failure.take().unwrap_or_default());
        }
        outputs.flush(ctx);
        if let Some(e) = outputs.writer.failure() {
            return Err(e.into());
        }
        if i == 0 {
            ctx.synchronize();
            let t_total = t_start.elapsed().as_secs_f32();
            let mut total_seconds = (t_total * n_chunk as f32 / n_seq as f32) as i32;
            let mut eta = String::new();
            if total_seconds >= 3600 {
                eta += &format!("{} hours ", total_seconds / 3600);
                total_seconds %= 3600;
            }
            progress::eprintln(&format!("compute_imatrix: {t_total:.2} seconds per pass - ETA {eta}{:.2} minutes", total_seconds as f64 / 60.0));
        }
        if compute_ppl {
            let first = n_ctx / 2;
            for seq in 0..n_seq_batch {
                let all: &[f32] = if num_batches > 1 { &logits } else { &ctx.logits((seq + 1) * n_ctx)[seq * n_ctx * n_vocab..] };
                let toks = &tokens[seq_chunks[seq] * n_ctx + first..];
                ppl.add_chunk(&all[first * n_vocab..], toks, n_ctx - 1 - first, n_vocab);
                write!(out, "[{}]{:.4},", i + seq + 1, ppl.ppl())?;
            }
            out.flush()?;
            logits.clear();
        }
        i += n_seq;
        outputs.chunks_done = i.min(n_chunk);
        bar.set(outputs.chunks_done as u64);
    }
    // the last checkpoint, when it is written, belongs on the line
    outputs.writer.sync();
    bar.finish();
    writeln!(out)?;
    span.report();
    if compute_ppl {
        match ppl.final_estimate() {
            Some((p, err)) => writeln!(out, "Final estimate: PPL = {p:.4} +/- {err:.5}")?,
            None => writeln!(out, "Unexpected negative standard deviation of log(prob)")?,
        }
    }
    Ok(None)
}

/// The decode loop timed from inside: when each decode returned. scripts/gpu-check compares
/// runs by it (upstream's tools timed the same way by scripts/decode-span.c, whose line this
/// is): the time of each decode after the first, the work between decodes included, without
/// what a process pays once (the backend's start, the model's upload, the first decode's first
/// touches, the files written at the end).
#[derive(Default)]
struct DecodeSpan {
    decodes: u64,
    first_end: Option<Instant>,
    last_end: Option<Instant>,
}

impl DecodeSpan {
    fn note(&mut self) {
        let t = Instant::now();
        self.decodes += 1;
        self.first_end.get_or_insert(t);
        self.last_end = Some(t);
    }

    fn report(&self) {
        if let (Some(a), Some(b)) = (self.first_end, self.last_end) {
            eprintln!("decode-span: {} decodes, {:.6} s from the end of the first to the end of the last", self.decodes, (b - a).as_secs_f64());
        }
    }
}

/// The rows of every ubatch of one batch: one sequence per corpus chunk in `chunks`, each
/// `len` tokens from position `pos0`; `fed` is what the batch holds, sequence after sequence;
/// `domain(chunk, pos)` the domain of a row (None without `--domains`). A row's `chunk` is the
/// index of its chunk in the tokenised corpus (after `--chunk`), so a sampled run's trace rows
/// say where in the corpus they come from.
fn batch_rows(chunks: &[usize], pos0: usize, len: usize, n_ubatch: usize, fed: &[i32], domain: impl Fn(u32, u32) -> Option<u16>) -> observer::BatchRows {
    let layout = BatchLayout {
        seqs: chunks.iter().enumerate().map(|(s, &c)| SeqSpan { chunk: c as u32, pos0: pos0 as u32, tok0: s * len, len }).collect(),
        n_ubatch,
    };
    let ubatches: Vec<Vec<(u32, u32, i32)>> = layout
        .ubatches()
        .into_iter()
        .map(|u| {
            u.into_iter()
                .map(|(s, o)| {
                    let sp = layout.seqs[s];
                    (sp.chunk, sp.pos0 + o as u32, fed[sp.tok0 + o])
                })
                .collect()
        })
        .collect();
    let domains = ubatches.iter().map(|u| u.iter().filter_map(|&(c, p, _)| domain(c, p)).collect()).collect();
    observer::BatchRows { ubatches, domains, current: None }
}

/// Records what was run, on what, and what came out (see formats::manifest).
/// `model`: the model's record, then a split model's further shards'.
fn write_manifest(plan: &Plan, argv: &[String], model: Vec<FileRecord>, outputs: &[(&str, PathBuf)], interrupted: Option<&Interruption>, coverage: Option<Value>) -> Result<()> {
    use crate::formats::manifest::Manifest;
    let cwd = std::env::current_dir().context("reading the working folder")?;
    let mut inputs = model;
    if let Some(f) = &plan.args.file {
        inputs.push(match &plan.corpus_read {
            Some((size, sha256)) => FileRecord { role: "corpus".into(), path: f.clone(), size: *size, sha256: sha256.clone() },
            None => FileRecord::of("corpus", f, &cwd)?,
        });
    }
    if let Some(f) = &plan.args.domains {
        inputs.push(FileRecord::of("domains", f, &cwd)?);
    }
    for f in &plan.in_files {
        inputs.push(FileRecord::of("in_file", f, &cwd)?);
    }
    let Some(manifest_path) = plan.manifest_path() else { return Ok(()) };
    // a device written in place (-o /dev/null) keeps nothing to record or compare
    let mut outs = Vec::new();
    for (role, p) in std::iter::once(&("imatrix", plan.args.output_file.clone())).chain(outputs) {
        if !crate::formats::atomic::in_place(p) {
            outs.push(FileRecord::of(role, p, &cwd)?);
        }
    }
    let m = Manifest {
        tool_version: env!("CARGO_PKG_VERSION").into(),
        llama_cpp_commit: llama::PIN_COMMIT.into(),
        patches_sha256: llama::PATCHES_SHA256.into(),
        cwd,
        argv: argv.to_vec(),
        inputs,
        outputs: outs,
        platform: Some(crate::formats::manifest::Platform::current()),
        interrupted: interrupted.cloned(),
        coverage,
    };
    m.write(&manifest_path)
}
