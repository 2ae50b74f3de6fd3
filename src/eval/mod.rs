//! `reap-imatrix eval`: how far each model's next-token distributions are from a base model's,
//! with the statistics of `llama-perplexity --kl-divergence` (see `stats`), over the same
//! chunks (see `forward`). The base runs once and its log-probabilities go to a file in
//! upstream's `--kl-divergence-base` format (see `cache`); then each model, one at a time, is
//! run and compared row by row against that file. N models cost N + 1 forward passes.
//! Defined precisely in docs/eval.md.

pub mod cache;
pub mod forward;
pub mod in_sample;
pub mod prune;
pub mod report;
pub mod stats;

use crate::calibrate::thread_counts;
use crate::error::UsageError;
use crate::formats::atomic;
use crate::formats::base_logits::{self, Header};
use crate::llama::eval_callback::NoObserver;
use crate::llama::{self, Context, ContextParams, Model, ModelParams};
use anyhow::{anyhow, bail, Context as _, Result};
use forward::Layout;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args, Debug)]
#[command(after_help = "Prints llama-perplexity --kl-divergence's statistics per model, then a table sorted by mean KLD.\n\
Single-dash spellings -ngl, -ub, -fa, -lm, -nr are accepted. See docs/eval.md.")]
pub struct EvalArgs {
    /// The reference model (its log-probs are the "base")
    #[arg(long, value_name = "MODEL.gguf")]
    pub base: PathBuf,
    /// Models to compare with the base, comma-separated
    #[arg(long = "model", short = 'm', value_name = "A.gguf[,B.gguf…]", value_delimiter = ',', required_unless_present = "keep_maps", conflicts_with = "keep_maps")]
    pub models: Vec<PathBuf>,
    /// Keep maps (from `select`): each is pruned from --base into the scratch folder, then evaluated
    #[arg(long = "keep-map", value_name = "MAP.json[,MAP2.json…]", value_delimiter = ',')]
    pub keep_maps: Vec<PathBuf>,
    /// With --keep-map: prune with `--drop-nextn` (leave a nextn/MTP block out; see `prune --help`)
    #[arg(long = "drop-nextn", requires = "keep_maps")]
    pub drop_nextn: bool,
    /// With --keep-map: prune with `--hash-remap` (DeepSeek-V4's hash-routed blocks; see `prune --help`)
    #[arg(long = "hash-remap", requires = "keep_maps")]
    pub hash_remap: bool,
    /// The evaluation text (as llama-perplexity -f reads it)
    #[arg(short = 'f', long = "file", value_name = "TEXT")]
    pub file: PathBuf,
    /// The text the models were calibrated on: eval counts the scored tokens it holds
    /// (in-sample). Keep maps name theirs through their saliency JSON; this overrides it
    #[arg(long = "calibration-text", value_name = "TEXT")]
    pub calibration_text: Option<PathBuf>,
    /// Tokens per chunk; the second half of each chunk is scored
    #[arg(short = 'c', long = "ctx-size", value_name = "N", default_value_t = 512)]
    pub ctx_size: i32,
    /// Chunks to evaluate (-1 = all the text holds)
    #[arg(long = "chunks", value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    pub chunks: i32,
    /// Logical batch size; max(1, b/c) chunks share a batch, as in llama-perplexity
    #[arg(short = 'b', long = "batch-size", value_name = "N", default_value_t = 2048)]
    pub batch_size: i32,
    /// Physical batch size [-ub]
    #[arg(long = "ubatch-size", value_name = "N", default_value_t = 512)]
    pub ubatch_size: i32,
    /// CPU threads (-1 = all cores)
    #[arg(short = 't', long = "threads", value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    pub threads: i32,
    #[command(flatten)]
    pub device: crate::cli::device::DeviceArgs,
    /// The base's log-probs (llama-perplexity --kl-divergence-base format): written when missing, reused when it matches
    #[arg(long = "base-logits", value_name = "FILE")]
    pub base_logits: Option<PathBuf>,
    /// Results as JSON (rewritten after each model)
    #[arg(long = "json", value_name = "OUT")]
    pub json: Option<PathBuf>,
    /// Folder for pruned models and the temporary base log-probs [default: the system temp folder]
    #[arg(long = "scratch", value_name = "DIR")]
    pub scratch: Option<PathBuf>,
    /// Log everything llama.cpp says
    #[arg(short = 'v', long = "verbose")]
    pub verbose: bool,
}

/// What is evaluated: a model file, or a keep map pruned from the base first.
#[derive(Clone, Debug)]
pub enum Candidate {
    Model(PathBuf),
    KeepMap(PathBuf),
}

impl Candidate {
    pub fn path(&self) -> &Path {
        match self {
            Candidate::Model(p) | Candidate::KeepMap(p) => p,
        }
    }
    /// The short name in the table: the file name without its extension.
    pub fn label(&self) -> String {
        let p = self.path();
        p.file_stem().unwrap_or(p.as_os_str()).to_string_lossy().into_owned()
    }
}

/// One evaluated model.
pub struct Outcome {
    pub candidate: Candidate,
    pub summary: stats::Summary,
    pub seconds: f64,
    /// how many scored tokens the calibration saw (`in_sample::to_json`), or why that is not known
    pub in_sample: Option<serde_json::Value>,
}

/// The folder for this run's temporary files, removed when the run ends (also on error, and
/// on a signal: see `interrupt`).
/// A `--scratch DIR` that did not exist is made, and removed again with the folder in it.
struct Scratch(PathBuf, Option<PathBuf>, #[allow(dead_code)] Vec<crate::interrupt::RemoveOnSignal>);

impl Scratch {
    fn new(parent: Option<&Path>) -> Result<Scratch> {
        let parent = parent.map(Path::to_path_buf).unwrap_or_else(std::env::temp_dir);
        let made = (!parent.exists()).then(|| parent.clone());
        let dir = parent.join(format!("reap-eval-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| UsageError(format!("--scratch {}: {e}", parent.display())))?;
        // folders are removed after files, in the order registered: the inner one first
        let on_signal = std::iter::once(&dir).chain(made.as_ref()).map(|d| crate::interrupt::remove_on_signal(d)).collect();
        Ok(Scratch(dir, made, on_signal))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        if let Some(made) = &self.1 {
            let _ = std::fs::remove_dir(made);
        }
    }
}

/// Settings resolved once, shared by every pass.
struct Setup {
    layout: Layout,
    model_params: ModelParams,
    ctx_params: ContextParams,
}

impl Setup {
    fn context<'m>(&self, model: &'m Model) -> Result<Context<'m, NoObserver>> {
        Context::new(model, &self.ctx_params, NoObserver)
    }
}

fn usage(m: String) -> anyhow::Error {
    anyhow!(UsageError(m))
}

/// Every input exists and every output can be written, before anything is loaded.
/// The flags of prune's that `--keep-map` passes on.
fn prune_flags(args: &EvalArgs) -> Vec<&'static str> {
    [(args.drop_nextn, "--drop-nextn"), (args.hash_remap, "--hash-remap")].into_iter().filter(|x| x.0).map(|x| x.1).collect()
}

fn check_files(args: &EvalArgs, candidates: &[Candidate]) -> Result<()> {
    let must_exist = |flag: &str, p: &Path| -> Result<()> {
        if !p.is_file() {
            bail!(usage(format!("{flag} {}: no such file", p.display())));
        }
        Ok(())
    };
    must_exist("--base", &args.base)?;
    must_exist("-f", &args.file)?;
    if let Some(p) = &args.calibration_text {
        must_exist("--calibration-text", p)?;
    }
    for c in candidates {
        match c {
            Candidate::Model(p) => must_exist("--model", p)?,
            Candidate::KeepMap(p) => {
                must_exist("--keep-map", p)?;
                crate::analyze::select::keep_map::KeepMap::read(p).map_err(|e| usage(format!("--keep-map {}: {e:#}", p.display())))?;
            }
        }
    }
    let inputs: Vec<&Path> = [args.base.as_path(), args.file.as_path()].into_iter().chain(candidates.iter().map(Candidate::path)).collect();
    if let (Some(j), Some(b)) = (&args.json, &args.base_logits) {
        if atomic::same_file(j, b) {
            bail!(usage(format!("--json {} is also --base-logits: the results would replace the base log-probs", j.display())));
        }
    }
    for (flag, out) in [("--json", &args.json), ("--base-logits", &args.base_logits)] {
        let Some(out) = out else { continue };
        if inputs.iter().any(|i| atomic::same_file(i, out)) {
            bail!(usage(format!("{flag} {} is also an input", out.display())));
        }
        if flag == "--json" || !out.exists() {
            atomic::check_writable(out).map_err(|e| usage(format!("{flag} {e}")))?;
        }
    }
    Ok(())
}

pub fn run(args: &EvalArgs) -> Result<i32> {
    llama::log::set_verbosity(if args.verbose { 2 } else { 0 });
    let candidates: Vec<Candidate> = if args.keep_maps.is_empty() {
        args.models.iter().cloned().map(Candidate::Model).collect()
    } else {
        args.keep_maps.iter().cloned().map(Candidate::KeepMap).collect()
    };
    if candidates.is_empty() {
        bail!(usage("give --model or --keep-map".into()));
    }
    if args.ctx_size < 4 {
        bail!(usage(format!("-c {}: the context must be at least 4 tokens", args.ctx_size)));
    }
    if args.batch_size <= 0 || args.ubatch_size <= 0 {
        bail!(usage("-b and -ub must be positive".into()));
    }
    check_files(args, &candidates)?;
    // every model's header now, so a truncated or foreign file fails in a second
    crate::formats::gguf_header::read_model("--base", &args.base)?;
    for c in &candidates {
        if let Candidate::Model(p) = c {
            crate::formats::gguf_header::read_model("--model", p)?;
        }
    }
    let (threads, threads_batch) = thread_counts(args.threads, None);
    let (model_params, flash_attn) = args.device.validate()?;

    // the tokens, by the base's vocabulary (loaded without its weights)
    let n_ctx = args.ctx_size as usize;
    let text = crate::calibrate::validate::corpus("-f", &args.file, n_ctx, 0)?;
    let vocab_model = Model::load_vocab(&args.base)?;
    let (tokens, n_vocab) = {
        let v = vocab_model.vocab();
        if v.add_eos() {
            bail!(usage(format!("--base {}: its vocab adds EOS to every text; llama-perplexity refuses such models too", args.base.display())));
        }
        (v.tokenize(&text, true, false)?, v.n_tokens())
    };
    for c in &candidates {
        if let Candidate::Model(p) = c {
            let n = Model::load_vocab(p)?.vocab().n_tokens();
            if n != n_vocab {
                bail!(usage(format!("--model {}: vocabulary of {n} tokens, the base's has {n_vocab}", p.display())));
            }
        }
    }
    if tokens.len() < 2 * n_ctx {
        bail!(usage(format!(
            "-f {}: you need at least {} tokens to evaluate with a context of {n_ctx}; the text tokenizes to only {}",
            args.file.display(),
            2 * n_ctx,
            tokens.len()
        )));
    }
    let n_chunk_max = tokens.len() / n_ctx;
    let n_chunk = if args.chunks < 0 { n_chunk_max } else { (args.chunks as usize).min(n_chunk_max) };
    let scored = n_chunk * base_logits::scored_per_chunk(n_ctx);
    if scored < 100 {
        bail!(usage(format!(
            "{n_chunk} chunks of {n_ctx} score only {scored} tokens; llama-perplexity's statistics need at least 100 (more text, --chunks or -c)"
        )));
    }
    let in_sample = in_sample_checks(args, &candidates, &vocab_model, &tokens, n_ctx, n_chunk)?;
    drop(vocab_model);
    let layout = Layout::new(n_ctx, args.batch_size as usize, n_chunk);
    let setup = Setup {
        layout,
        model_params,
        ctx_params: ContextParams {
            n_ctx: layout.n_kv() as u32,
            n_batch: layout.n_batch as u32,
            n_ubatch: args.ubatch_size as u32,
            n_seq_max: layout.n_seq as u32,
            n_threads: threads,
            n_threads_batch: threads_batch,
            flash_attn,
            op_offload: args.device.placement.op_offload(),
            ..Default::default()
        },
    };
    let header = Header { n_ctx: n_ctx as u32, n_vocab, n_chunk: n_chunk as i32, tokens: tokens[..n_chunk * n_ctx].to_vec() };
    eprintln!(
        "eval: {n_chunk} chunks of {n_ctx} tokens, {scored} scored; {} chunk(s) per batch of {}; {} model(s)",
        layout.n_seq,
        layout.n_batch,
        candidates.len()
    );

    let scratch = Scratch::new(args.scratch.as_deref())?;
    let maps: Vec<&Path> = args.keep_maps.iter().map(PathBuf::as_path).collect();
    prune::check_maps(&scratch.0, &args.base, &maps, &prune_flags(args))?;
    let base_file = args.base_logits.clone().unwrap_or_else(|| scratch.0.join("base.logits"));
    // in the scratch folder (no --base-logits) the base file goes with it, on a signal too
    let _base_on_signal = args.base_logits.is_none().then(|| crate::interrupt::remove_on_signal(&base_file));
    let mut settings = json!({
        "batch": layout.n_batch, "ubatch": args.ubatch_size, "flash_attn": args.device.flash_attn, "n_gpu_layers": args.device.n_gpu_layers,
    });
    // where the weights ran changes the logits' last bits too
    settings.as_object_mut().expect("an object").extend(args.device.placement.settings());
    let base_sha = || crate::formats::sha256::cached_sha256_file(&args.base).with_context(|| format!("hashing {}", args.base.display()));
    let mut forward_passes = 0;
    let reused = match cache::decide(&base_file, &header, base_sha, &settings)? {
        cache::Decision::Reuse(notes) => {
            notes.iter().for_each(|n| eprintln!("{n}"));
            true
        }
        cache::Decision::Compute => {
            let t = Instant::now();
            let (sha, nll) = compute_base(&args.base, &setup, &header, &base_file)?;
            forward_passes += 1;
            let (p, err) = nll.final_estimate().unwrap_or((nll.ppl(), f64::NAN));
            eprintln!("base: {} in {:.1} s; PPL = {p:.4} +/- {err:.5} (unquantized)", args.base.display(), t.elapsed().as_secs_f64());
            if args.base_logits.is_some() {
                let prov = cache::Provenance {
                    base_path: args.base.display().to_string(),
                    base_sha256: base_sha()?,
                    text_path: args.file.display().to_string(),
                    text_sha256: crate::formats::sha256::sha256_file(&args.file)?,
                    settings: settings.clone(),
                };
                cache::write_sidecar(&base_file, &header, &sha, &prov)?;
                eprintln!("base log-probs written to {} (and {})", base_file.display(), cache::sidecar_path(&base_file).display());
            }
            false
        }
    };

    let mut outcomes: Vec<Outcome> = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        let t = Instant::now();
        let (path, pruned) = match c {
            Candidate::Model(p) => (p.clone(), None),
            Candidate::KeepMap(m) => {
                let out = prune::prune_into(&scratch.0, &args.base, m, i, &prune_flags(args))?;
                (out.clone(), Some((crate::interrupt::remove_on_signal(&out), out)))
            }
        };
        eprintln!("\nmodel {}/{}: {}", i + 1, candidates.len(), path.display());
        let summary = compare(&path, &setup, &base_file)?;
        forward_passes += 1;
        if let Some((_on_signal, p)) = pruned {
            let _ = std::fs::remove_file(p);
        }
        println!("\n### {} ({})", c.label(), c.path().display());
        print!("{}", summary.upstream_text());
        outcomes.push(Outcome { candidate: c.clone(), summary, seconds: t.elapsed().as_secs_f64(), in_sample: in_sample[i].clone() });
        if let Some(j) = &args.json {
            // the path only when it outlives the run (--base-logits)
            let base = json!({"path": args.base_logits, "reused": reused});
            atomic::write_json(j, &report::to_json(&args.base, &outcomes, base, forward_passes, &prune_flags(args)), "eval results")?;
        }
    }
    println!();
    print!("{}", report::table(&outcomes));
    eprintln!("eval: {forward_passes} forward pass(es) for {} model(s){}", outcomes.len(), if reused { ", base log-probs reused" } else { "" });
    if let Some(j) = &args.json {
        eprintln!("results written to {}", j.display());
    }
    Ok(0)
}

/// Per candidate: how many of the scored tokens its calibration saw (see `in_sample`), said
/// on stderr once per calibration text; None for a model file without `--calibration-text`.
fn in_sample_checks(args: &EvalArgs, candidates: &[Candidate], vocab_model: &Model, tokens: &[i32], n_ctx: usize, n_chunk: usize) -> Result<Vec<Option<serde_json::Value>>> {
    use in_sample::Calibration;
    let given = match &args.calibration_text {
        Some(p) => Some(Calibration {
            text: p.clone(),
            sha256: crate::formats::sha256::sha256_file(p).map_err(|e| usage(format!("--calibration-text {}: {e}", p.display())))?,
            parse_special: false,
            chunks: None,
            via: "--calibration-text".into(),
        }),
        None => None,
    };
    let cals: Vec<Option<std::result::Result<Calibration, String>>> = candidates
        .iter()
        .map(|c| match (&given, c) {
            (Some(g), _) => Some(Ok(g.clone())),
            (None, Candidate::KeepMap(p)) => Some(in_sample::of_keep_map(p)),
            (None, Candidate::Model(_)) => None,
        })
        .collect();
    let mut out = vec![None; candidates.len()];
    let mut done: Vec<Calibration> = Vec::new();
    for (i, cal) in cals.iter().enumerate() {
        match cal {
            None => {}
            Some(Err(why)) => {
                eprintln!("eval: cannot tell whether {}'s calibration saw this text: {why} (--calibration-text names it)", candidates[i].label());
                out[i] = Some(json!({"unknown": why}));
            }
            Some(Ok(cal)) if !done.contains(cal) => {
                let t = Instant::now();
                let (seen, note) = in_sample::seen(&vocab_model.vocab(), cal).map_err(|e| usage(format!("{e:#}")))?;
                eprintln!("eval: {} read for the in-sample count: {} windows of {} tokens in {:.1} s", cal.text.display(), seen.len(), in_sample::WINDOW, t.elapsed().as_secs_f64());
                if let Some(n) = note {
                    eprintln!("eval: note: {n}");
                }
                let (scored, hit) = in_sample::count(tokens, n_ctx, n_chunk, &seen);
                let same: Vec<usize> = (0..candidates.len()).filter(|&j| matches!(&cals[j], Some(Ok(c)) if c == cal)).collect();
                let who = if same.len() == candidates.len() { "the models were".to_string() } else { format!("{} was", same.iter().map(|&j| candidates[j].label()).collect::<Vec<_>>().join(", ")) };
                let whence = match cal.chunks {
                    Some(_) => format!("the chunks of {} the run evaluated, per {}", cal.text.display(), cal.via),
                    None => format!("{}, {}", cal.text.display(), cal.via),
                };
                if hit > 0 {
                    eprintln!(
                        "eval: {hit} of {scored} scored tokens ({:.1}%) are text {who} calibrated on ({whence}): there the KL divergence understates what \
                         pruning costs on unseen text; evaluate on text the calibration did not see (corpus --eval keeps one apart)",
                        100.0 * hit as f64 / scored as f64
                    );
                } else {
                    eprintln!("eval: none of the {scored} scored tokens is text {who} calibrated on ({whence})");
                }
                for j in same {
                    out[j] = Some(in_sample::to_json(cal, scored, hit));
                }
                done.push(cal.clone());
            }
            Some(Ok(_)) => {}
        }
    }
    Ok(out)
}

/// The base pass: writes `file` (atomically) and returns its sha256 and the unquantized PPL.
fn compute_base(base: &Path, setup: &Setup, header: &Header, file: &Path) -> Result<(String, crate::calibrate::perplexity::Accumulator)> {
    let model = Model::load(base, &setup.model_params)?;
    let n_vocab = header.n_vocab as usize;
    let mut ctx = setup.context(&model)?;
    let row = base_logits::row_len(n_vocab);
    let mut nll = crate::calibrate::perplexity::Accumulator::default();
    let mut sha = String::new();
    atomic::replace_with(file, |tmp| {
        let f = std::fs::File::create(tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = base_logits::Writer::new(f, header)?;
        let mut rows = vec![0u16; base_logits::scored_per_chunk(header.n_ctx as usize) * row];
        let threads = setup.ctx_params.n_threads as usize;
        forward::run_chunks(&mut ctx, setup.layout, &header.tokens, |chunk, logits, targets| {
            // rows are independent: encoded on every thread
            let nlls = each_row(&mut rows, row, threads, |i, r| {
                base_logits::encode_row(&logits[i * n_vocab..(i + 1) * n_vocab], targets[i] as usize, r)
            });
            nlls.iter().for_each(|&v| nll.add_value(v as f64));
            w.write_rows(&rows).with_context(|| format!("writing {}", tmp.display()))?;
            // upstream's running perplexity, [chunk]PPL,
            crate::progress::eprint(&format!("[{}]{:.4},{}", chunk + 1, nll.ppl(), if chunk + 1 == header.n_chunk as usize { "\n" } else { "" }));
            Ok(())
        })?;
        sha = w.finish().with_context(|| format!("writing {}", tmp.display()))?;
        Ok(())
    })
    .with_context(|| format!("base pass over {}", base.display()))?;
    Ok((sha, nll))
}

/// One model against the base file.
fn compare(path: &Path, setup: &Setup, base_file: &Path) -> Result<stats::Summary> {
    let mut reader = base_logits::Reader::open(base_file)?;
    let header = reader.header.clone();
    let model = Model::load(path, &setup.model_params)?;
    let n_vocab = model.vocab().n_tokens();
    if n_vocab != header.n_vocab {
        bail!(usage(format!("model {}: vocabulary of {n_vocab} tokens, the base's has {}", path.display(), header.n_vocab)));
    }
    let n_vocab = n_vocab as usize;
    let mut ctx = setup.context(&model)?;
    let row = base_logits::row_len(n_vocab);
    let mut acc = stats::Accumulator::default();
    let mut rows = Vec::new();
    let threads = setup.ctx_params.n_threads as usize;
    forward::run_chunks(&mut ctx, setup.layout, &header.tokens, |chunk, logits, targets| {
        reader.next_chunk(&mut rows)?;
        // tokens are scored on every thread, then added in token order (reproducible sums)
        let terms = each_row(&mut rows, row, threads, |i, r| stats::token_terms(&logits[i * n_vocab..(i + 1) * n_vocab], r, targets[i] as usize));
        terms.iter().for_each(|t| acc.add_terms(t));
        if chunk == 0 {
            crate::progress::eprintln(stats::CHUNK_HEADER);
        }
        crate::progress::eprintln(&acc.sums.chunk_line(chunk + 1));
        Ok(())
    })
    .with_context(|| format!("model {}", path.display()))?;
    acc.summary().ok_or_else(|| anyhow!("fewer than 100 scored tokens"))
}

/// `f(i, row i)` for every row of `rows` (`row` slots each), on up to `threads` threads over
/// contiguous ranges; the results in row order.
fn each_row<T: Send>(rows: &mut [u16], row: usize, threads: usize, f: impl Fn(usize, &mut [u16]) -> T + Sync) -> Vec<T> {
    let per = (rows.len() / row).div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let f = &f;
        let jobs: Vec<_> = rows
            .chunks_mut(per * row)
            .enumerate()
            .map(|(k, part)| s.spawn(move || part.chunks_mut(row).enumerate().map(|(i, r)| f(k * per + i, r)).collect::<Vec<T>>()))
            .collect();
        jobs.into_iter().flat_map(|j| j.join().expect("a scoring thread panicked")).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_folder_eval_made_goes_with_it_and_one_that_was_there_stays() {
        let base = std::env::temp_dir().join(format!("reap-scratch-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let made = base.join("new");
        let s = Scratch::new(Some(&made)).unwrap();
        assert!(s.0.is_dir());
        drop(s);
        assert!(!made.exists(), "the --scratch folder eval made was left");
        std::fs::create_dir_all(&made).unwrap();
        drop(Scratch::new(Some(&made)).unwrap());
        assert!(made.is_dir() && std::fs::read_dir(&made).unwrap().count() == 0, "a folder that was there must stay, emptied of ours");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
