//! `reap-imatrix corpus`: a calibration text assembled from JSONL sources, with per-source
//! shares of a token budget counted by the target model's own tokenizer (see docs/corpus.md).
//!
//! Steps: read every source and `--eval` file; render chat documents with the GGUF's chat
//! template; decide every document's fate (eval overlap, exact or near duplicate: `dedupe`);
//! count each remaining document's tokens; check every source can fill its target; order the
//! documents by the weighted round-robin (`mix`), cutting documents that are too long (keeping
//! their end); write the text; tokenise the written text whole, as calibration will, and count
//! each document's tokens from the token byte offsets: the counts in the domains file and the
//! report are those of the final text, not estimates.

pub mod dedupe;
pub mod mix;
pub mod par;
pub mod sources;

use crate::calibrate::args::beside_output;
use crate::error::UsageError;
use crate::formats::domains::{Domains, Range};
use crate::llama::{chat, Model, ModelParams, Vocab};
use anyhow::{bail, Context as _, Result};
use serde_json::json;
use sources::{Body, SourceSpec};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What separates documents in the mix (and ends the last one, as a single newline).
pub const SEPARATOR: &str = "\n\n";

#[derive(clap::Args, Debug, Clone)]
pub struct CorpusArgs {
    /// model whose tokenizer counts the tokens and whose chat template renders `messages`
    #[arg(short = 'm', long = "model", value_name = "MODEL.gguf")]
    pub model: PathBuf,
    /// a JSONL source: NAME=FILE.jsonl[:SHARE] (repeatable; SHARE is a fraction of --tokens,
    /// default an equal part of what the given shares leave)
    #[arg(long = "source", value_name = "NAME=FILE[:SHARE]", required = true)]
    pub source: Vec<String>,
    /// token budget of the mix
    #[arg(long = "tokens", value_name = "N")]
    pub tokens: u64,
    /// the mix (plain text); MIX.domains.tsv and MIX.report.json are written beside it
    #[arg(short = 'o', long = "output", value_name = "MIX.txt")]
    pub output: PathBuf,
    /// evaluation documents (JSONL): calibration documents overlapping any of them are left out
    #[arg(long = "eval", value_name = "FILE.jsonl")]
    pub eval: Vec<PathBuf>,
    /// seed of the document order within each source
    #[arg(long = "seed", value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// cut longer documents to their last N tokens
    #[arg(long = "max-doc-tokens", value_name = "N")]
    pub max_doc_tokens: Option<u64>,
    /// fail, instead of dropping them, when documents overlap the --eval set
    #[arg(long = "strict")]
    pub strict: bool,
}

/// Output paths: MIX.txt → MIX.domains.tsv, MIX.report.json.
pub fn domains_path(mix: &Path) -> PathBuf {
    beside_output(mix, ".domains.tsv")
}
pub fn report_path(mix: &Path) -> PathBuf {
    beside_output(mix, ".report.json")
}

/// One source's documents after rendering.
struct Source {
    spec: SourceSpec,
    share: f64,
    /// (line, rendered text) per document, in file order
    docs: Vec<(usize, String)>,
}

/// Per-source figures for the report.
#[derive(Default, Clone)]
struct Stats {
    tokens_target: u64,
    /// tokens of the counted documents (each at most --max-doc-tokens); all of the source's
    /// when `all_counted`, else at least the target
    available: u64,
    counted: u64,
    all_counted: bool,
    documents: u64,
    truncated: u64,
    duplicates: u64,
    eval_overlaps: u64,
    tokens: u64,
}

pub fn run(args: &CorpusArgs) -> Result<i32> {
    let t0 = Instant::now();
    let specs: Vec<SourceSpec> = args.source.iter().map(|s| SourceSpec::parse(s).map_err(UsageError)).collect::<Result<_, _>>()?;
    for (i, s) in specs.iter().enumerate() {
        if specs[..i].iter().any(|o| o.name == s.name) {
            bail!(UsageError(format!("--source {}: the name is given twice", s.name)));
        }
    }
    let shares = sources::resolve_shares(&specs).map_err(UsageError)?;
    if args.tokens == 0 {
        bail!(UsageError("--tokens must be at least 1".into()));
    }
    if args.max_doc_tokens == Some(0) {
        bail!(UsageError("--max-doc-tokens must be at least 1".into()));
    }
    let targets: Vec<u64> = shares.iter().map(|&sh| (sh * args.tokens as f64).round() as u64).collect();
    // a target of 0 would leave the source out of the mix without a word
    if let Some(s) = targets.iter().position(|&t| t == 0) {
        bail!(UsageError(format!(
            "--source {}: share {} of --tokens {} is a target of 0 tokens, so the source would be left out: raise --tokens or the share",
            specs[s].name, shares[s], args.tokens
        )));
    }
    let share_sum: f64 = shares.iter().sum();
    let (dom_path, rep_path) = (domains_path(&args.output), report_path(&args.output));
    let inputs: Vec<(String, &Path)> = std::iter::once(("-m".to_string(), args.model.as_path()))
        .chain(specs.iter().map(|s| (format!("--source {}", s.name), s.path.as_path())))
        .chain(args.eval.iter().map(|p| ("--eval".to_string(), p.as_path())))
        .collect();
    for p in [&args.output, &dom_path, &rep_path] {
        if let Some((flag, _)) = inputs.iter().find(|(_, i)| crate::formats::atomic::same_file(p, i)) {
            bail!(UsageError(format!("-o {}: writes {}, which is the {flag} input: it would be overwritten", args.output.display(), p.display())));
        }
        crate::formats::atomic::check_writable(p).map_err(|e| UsageError(format!("-o {e}")))?;
    }
    // a missing, foreign or unknown model is a usage error naming -m, before llama.cpp sees it
    crate::formats::gguf_header::read_model("-m", &args.model)?;
    let model = Model::load(&args.model, &ModelParams { vocab_only: true, ..Default::default() })?;
    let template = model.chat_template();
    let vocab = model.vocab();

    // read and render everything first: bad input fails before any work
    let mut srcs = Vec::with_capacity(specs.len());
    for (spec, share) in specs.into_iter().zip(shares) {
        let docs = sources::read_jsonl(&spec.path)?;
        let what = format!("source {} ({})", spec.name, spec.path.display());
        let mut docs = render_all(docs, template.as_deref(), &what, &args.model)?;
        // empty once trimmed: skipped, so neither a duplicate of another empty one nor an
        // "overlap" with an empty --eval document
        docs.retain(|(_, t)| !t.trim().is_empty());
        srcs.push(Source { spec, share, docs });
    }
    let mut eval_docs = Vec::new();
    for p in &args.eval {
        let docs = sources::read_jsonl(p)?;
        let rendered = render_all(docs, template.as_deref(), &format!("--eval {}", p.display()), &args.model)?;
        eval_docs.extend(rendered.into_iter().filter(|(_, t)| !t.trim().is_empty()).map(|(line, t)| (format!("{}:{line}", p.display()), t)));
    }
    let t_read = t0.elapsed();

    // every document of every source, in command-line then file order
    let all: Vec<(usize, usize)> = srcs.iter().enumerate().flat_map(|(s, src)| (0..src.docs.len()).map(move |d| (s, d))).collect();
    let eval = dedupe::EvalIndex::new(par::map(&eval_docs, |(_, t)| dedupe::prepare(t)));
    let prepared = par::map(&all, |&(s, d)| eval.prepare(&srcs[s].docs[d].1));
    let verdicts = dedupe::dedupe(&prepared, &eval);
    drop(prepared);
    let t_dedupe = t0.elapsed();

    let mut stats = vec![Stats::default(); srcs.len()];
    let mut overlaps: Vec<String> = Vec::new();
    let mut kept: Vec<Vec<usize>> = vec![Vec::new(); srcs.len()];
    for (&(s, d), v) in all.iter().zip(&verdicts) {
        match v {
            dedupe::Verdict::Keep => kept[s].push(d),
            dedupe::Verdict::Duplicate(_) => stats[s].duplicates += 1,
            dedupe::Verdict::EvalOverlap(e) => {
                stats[s].eval_overlaps += 1;
                if overlaps.len() < 10 {
                    overlaps.push(format!("{}:{} overlaps {}", srcs[s].spec.path.display(), srcs[s].docs[d].0, eval_docs[*e].0));
                }
            }
        }
    }
    let n_overlaps: u64 = stats.iter().map(|s| s.eval_overlaps).sum();
    if args.strict && n_overlaps > 0 {
        bail!(UsageError(format!("--strict: {n_overlaps} document(s) overlap the --eval set; nothing written. First ones:\n  {}", overlaps.join("\n  "))));
    }

    // seeded order within each source, then token counts of every kept document
    for (s, k) in kept.iter_mut().enumerate() {
        let perm = crate::fixture::rng::Rng::stream(args.seed, &format!("corpus/{}", srcs[s].spec.name)).permutation(k.len());
        *k = perm.iter().map(|&i| k[i as usize]).collect();
    }
    // token counts, per source in that order, only as far as its target needs: the plan takes
    // each source's documents in queue order and stops at the target, so the documents after
    // that are never read (counting everything was most of the command's time)
    let bar = crate::progress::start(0, crate::progress::Unit::Documents).label("corpus: counting tokens");
    let mut queues: Vec<Vec<u64>> = vec![Vec::new(); srcs.len()];
    let mut counted_bytes = vec![0u64; srcs.len()];
    loop {
        let mut batch: Vec<(usize, usize)> = Vec::new();
        for s in 0..srcs.len() {
            let have = mix::available(&queues[s], args.max_doc_tokens);
            let next = queues[s].len();
            if have >= targets[s] || next == kept[s].len() {
                continue;
            }
            let bytes_of = |i: usize| srcs[s].docs[kept[s][i]].1.len() as u64;
            let n = count_batch(targets[s] - have, counted_bytes[s], queues[s].iter().sum(), args.max_doc_tokens, (next..kept[s].len()).map(bytes_of));
            batch.extend((next..next + n).map(|i| (s, i)));
        }
        if batch.is_empty() {
            break;
        }
        let counts = par::map(&batch, |&(s, i)| {
            let c = count_tokens(vocab, &srcs[s].docs[kept[s][i]].1);
            crate::progress::add(1);
            c
        });
        for (&(s, i), c) in batch.iter().zip(counts) {
            queues[s].push(c?);
            counted_bytes[s] += srcs[s].docs[kept[s][i]].1.len() as u64;
        }
    }
    bar.finish();
    let t_count = t0.elapsed();

    let mut short = Vec::new();
    for s in 0..srcs.len() {
        stats[s].tokens_target = targets[s];
        stats[s].available = mix::available(&queues[s], args.max_doc_tokens);
        stats[s].counted = queues[s].len() as u64;
        stats[s].all_counted = queues[s].len() == kept[s].len();
        if stats[s].available < targets[s] {
            short.push(s);
        }
    }
    if !short.is_empty() {
        let list: Vec<String> = srcs
            .iter()
            .enumerate()
            .map(|(s, src)| {
                format!(
                    "  {}: target {} tokens, available {} ({} documents after {} duplicates and {} eval overlaps dropped){}",
                    src.spec.name,
                    targets[s],
                    if stats[s].all_counted { stats[s].available.to_string() } else { format!(">={}", stats[s].available) },
                    kept[s].len(),
                    stats[s].duplicates,
                    stats[s].eval_overlaps,
                    if short.contains(&s) { "  <- too few" } else { "" }
                )
            })
            .collect();
        bail!(UsageError(format!("--tokens {}: the sources do not hold enough tokens; nothing written\n{}", args.tokens, list.join("\n"))));
    }

    // the text, document by document
    let plan = mix::plan(&queues, &targets, args.max_doc_tokens);
    let mut text = String::new();
    let mut ranges: Vec<Range> = Vec::with_capacity(plan.len());
    for (i, t) in plan.iter().enumerate() {
        let doc = &srcs[t.source].docs[kept[t.source][t.doc]].1;
        let body = doc.trim();
        let body = match t.keep {
            Some(k) => {
                stats[t.source].truncated += 1;
                keep_end(vocab, body, k)?
            }
            None => body,
        };
        if body.is_empty() {
            continue;
        }
        let start = text.len() as u64;
        text.push_str(body);
        text.push_str(if i + 1 == plan.len() { "\n" } else { SEPARATOR });
        ranges.push(Range { start, end: text.len() as u64, domain: srcs[t.source].spec.name.clone(), tokens: None, line: ranges.len() + 2 });
        stats[t.source].documents += 1;
    }
    if text.ends_with(SEPARATOR) {
        text.pop(); // the last document was empty after cutting: end with one newline
        ranges.last_mut().unwrap().end -= 1;
    }

    // exact counts: the text as calibration reads it (one trailing newline removed), whole
    let calib = text.strip_suffix('\n').unwrap_or(&text).as_bytes();
    let tokens = vocab.tokenize(calib, true, true)?;
    let offsets = vocab.token_offsets(calib, &tokens)?;
    let mut domains = Domains { ranges };
    let per_range = domains.tokens_per_range(&offsets);
    for (r, n) in domains.ranges.iter_mut().zip(per_range) {
        r.tokens = Some(n);
    }
    for r in &domains.ranges {
        let s = srcs.iter().position(|s| s.spec.name == r.domain).unwrap();
        stats[s].tokens += r.tokens.unwrap();
    }
    let t_mix = t0.elapsed();

    let total = tokens.len() as u64;
    let report = json!({
        "tokens_target": args.tokens,
        "tokens": total,
        "seed": args.seed,
        "max_doc_tokens": args.max_doc_tokens,
        "model": args.model.to_string_lossy(),
        "chat_template": template.is_some(),
        "eval_documents": eval_docs.len(),
        "dedupe": {"shingle_units": dedupe::SHINGLE, "jaccard": dedupe::JACCARD, "eval_overlap": dedupe::EVAL_OVERLAP,
                   "minhash_bands": dedupe::BANDS, "minhash_rows": dedupe::ROWS},
        "sources": srcs.iter().zip(&stats).map(|(src, st)| json!({
            "name": src.spec.name,
            "file": src.spec.path.to_string_lossy(),
            "share_target": src.share,
            "tokens_target": st.tokens_target,
            "tokens": st.tokens,
            "share": if total > 0 { st.tokens as f64 / total as f64 } else { 0.0 },
            "documents": st.documents,
            "truncated": st.truncated,
            "duplicates_dropped": st.duplicates,
            "eval_overlaps_dropped": st.eval_overlaps,
            "documents_read": src.docs.len(),
            // known only where every document was counted (a source short of its target);
            // counting stops once the target is covered
            "tokens_available": if st.all_counted { serde_json::json!(st.available) } else { serde_json::Value::Null },
            "documents_counted": st.counted,
        })).collect::<Vec<_>>(),
    });
    // the three files are replaced together: a failed write leaves the previous set whole
    let report_text = serde_json::to_string_pretty(&report)? + "\n";
    let tsv = domains.to_tsv();
    let contents = [text.as_bytes(), tsv.as_bytes(), report_text.as_bytes()];
    crate::formats::atomic::replace_together(&[&args.output, &dom_path, &rep_path], |i, tmp| {
        std::fs::write(tmp, contents[i]).with_context(|| format!("writing {}", tmp.display()))
    })?;

    print_table(&srcs, &stats, total, args.tokens);
    if share_sum < 1.0 - 1e-9 {
        // every share given and below 1 in all: the mix is planned at that part of --tokens
        let shown = (share_sum * 1e9).round() / 1e9;
        eprintln!(
            "note: the --source shares add up to {shown}, so the mix has {total} tokens, about {shown} × --tokens {}: for K chunks of C tokens ask for --tokens a little more than K × C / {shown}",
            args.tokens
        );
    } else if total < args.tokens {
        // a calibration of K chunks of C tokens needs K·C (llama-imatrix: at least 2·C)
        eprintln!(
            "note: the mix has {total} tokens, {} below --tokens {} (documents are planned by their own counts; tokens merge where they are joined, and calibration strips the final newline): for K chunks of C tokens ask for a little more than K × C",
            args.tokens - total,
            args.tokens
        );
    }
    eprintln!(
        "corpus: {} documents read, {} bytes of mix, {total} tokens; read {:.2} s, dedupe {:.2} s, count {:.2} s, mix {:.2} s",
        all.len(),
        text.len(),
        t_read.as_secs_f64(),
        (t_dedupe - t_read).as_secs_f64(),
        (t_count - t_dedupe).as_secs_f64(),
        (t_mix - t_count).as_secs_f64()
    );
    eprintln!("wrote {}, {}, {}", args.output.display(), dom_path.display(), rep_path.display());
    Ok(0)
}


/// Renders every document to text; a chat document needs the model's chat template.
fn render_all(docs: Vec<sources::Doc>, template: Option<&str>, what: &str, model: &Path) -> Result<Vec<(usize, String)>> {
    docs.into_iter()
        .map(|d| {
            let text = match d.body {
                Body::Text(t) => t,
                Body::Messages(m) => {
                    let Some(t) = template else {
                        bail!(UsageError(format!(
                            "{what}, line {}: a chat document (\"messages\"), but {} has no chat template (tokenizer.chat_template)",
                            d.line,
                            model.display()
                        )));
                    };
                    chat::apply_template(t, &m, false).with_context(|| format!("{what}, line {}", d.line))?
                }
            };
            Ok((d.line, text))
        })
        .collect()
}

/// How many more documents of a source to count: enough that their bytes, at the bytes per
/// token seen so far in this source (4 before any is counted), cover `need` tokens with a 20%
/// margin, and at least 32; a document gives at most `max_doc_tokens`. Counting a little too
/// much costs little; counting too little costs one more round.
fn count_batch(need: u64, counted_bytes: u64, counted_tokens: u64, max_doc_tokens: Option<u64>, bytes: impl Iterator<Item = u64>) -> usize {
    let bytes_per_token = if counted_tokens > 0 { counted_bytes as f64 / counted_tokens as f64 } else { 4.0 };
    let want = need as f64 * 1.2;
    let (mut n, mut est) = (0usize, 0.0f64);
    for b in bytes {
        if est >= want && n >= 32 {
            break;
        }
        let t = b as f64 / bytes_per_token.max(0.5);
        est += max_doc_tokens.map_or(t, |m| t.min(m as f64));
        n += 1;
    }
    n
}

/// A document's tokens in the mix: its trimmed text and the separator after it, with special
/// tokens parsed (as `--parse-special` calibration reads them), nothing added. The document is
/// tokenised as it stands in the mix, after the separator that ends the one before it: alone,
/// it would start a text, where a SentencePiece vocab adds a space that becomes a token of its
/// own before what cannot merge with it (CJK, digits, punctuation), about a token per document
/// that the mix does not have.
fn count_tokens(vocab: Vocab<'_>, doc: &str) -> Result<u64> {
    let body = doc.trim();
    if body.is_empty() {
        return Ok(0);
    }
    let text = in_mix(body);
    let toks = vocab.tokenize(text.as_bytes(), false, true)?;
    let sep = vocab.tokenize(SEPARATOR.as_bytes(), false, true)?;
    if toks.starts_with(&sep) {
        // the separator's own tokens spell it: the rest start in the document
        return Ok((toks.len() - sep.len()) as u64);
    }
    // a token across the join: count those starting in the document, as the domains file does
    let offs = vocab.token_offsets(text.as_bytes(), &toks)?;
    Ok(offs.iter().filter(|&&o| o >= SEPARATOR.len() as u64).count() as u64)
}

/// `doc` as it stands in the mix: after a separator, followed by one.
fn in_mix(doc: &str) -> String {
    let mut s = String::with_capacity(doc.len() + 2 * SEPARATOR.len());
    s.push_str(SEPARATOR);
    s.push_str(doc);
    s.push_str(SEPARATOR);
    s
}

/// The end of `doc` that tokenises (with the separator) to at most `keep` tokens: the cut falls
/// on a token boundary that is also a character boundary, moved forward until the kept part
/// re-tokenises within `keep`.
fn keep_end<'a>(vocab: Vocab<'_>, doc: &'a str, keep: u64) -> Result<&'a str> {
    // tokenised as in the mix (see count_tokens); offsets are then of the document plus `sep`
    let full = in_mix(doc);
    let sep = SEPARATOR.len();
    let toks = vocab.tokenize(full.as_bytes(), false, true)?;
    let offs = vocab.token_offsets(full.as_bytes(), &toks)?;
    let own = offs.iter().position(|&o| o as usize >= sep).unwrap_or(toks.len());
    let mut first = own.max(toks.len().saturating_sub(keep as usize));
    while first < toks.len() {
        let at = offs[first] as usize - sep;
        if at >= doc.len() {
            return Ok("");
        }
        if doc.is_char_boundary(at) {
            let rest = doc[at..].trim_start();
            if count_tokens(vocab, rest)? <= keep {
                return Ok(rest);
            }
        }
        first += 1;
    }
    Ok("")
}

fn print_table(srcs: &[Source], stats: &[Stats], total: u64, target: u64) {
    println!("{:<12} {:>7} {:>10} {:>10} {:>7} {:>6} {:>6} {:>6} {:>6} {:>10}", "source", "target", "tokens_tgt", "tokens", "share", "docs", "trunc", "dups", "eval", "available");
    for (src, st) in srcs.iter().zip(stats) {
        println!(
            "{:<12} {:>7.4} {:>10} {:>10} {:>7.4} {:>6} {:>6} {:>6} {:>6} {:>10}",
            src.spec.name,
            src.share,
            st.tokens_target,
            st.tokens,
            if total > 0 { st.tokens as f64 / total as f64 } else { 0.0 },
            st.documents,
            st.truncated,
            st.duplicates,
            st.eval_overlaps,
            // counting stopped at the target: the source holds at least this much
            if st.all_counted { st.available.to_string() } else { format!(">={}", st.available) }
        );
    }
    println!("{:<12} {:>7} {:>10} {:>10}", "total", "", target, total);
}

#[cfg(test)]
mod tests {
    use super::count_batch;

    #[test]
    fn a_batch_covers_the_need_with_a_margin_at_the_bytes_per_token_seen() {
        // 4 bytes per token assumed before any count: 100 tokens need 120 × 4 bytes, at least 32 documents
        assert_eq!(count_batch(100, 0, 0, None, std::iter::repeat(40).take(1000)), 32);
        assert_eq!(count_batch(1000, 0, 0, None, std::iter::repeat(40).take(1000)), 120);
        // 2 bytes per token seen: each 40-byte document counts as 20 tokens
        assert_eq!(count_batch(1000, 2000, 1000, None, std::iter::repeat(40).take(1000)), 60);
        // --max-doc-tokens caps what a document gives
        assert_eq!(count_batch(1000, 2000, 1000, Some(10), std::iter::repeat(40).take(1000)), 120);
        // never more than there is
        assert_eq!(count_batch(1_000_000, 0, 0, None, std::iter::repeat(40).take(7)), 7);
    }
}
