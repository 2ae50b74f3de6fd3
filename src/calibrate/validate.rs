//! Everything about a calibration run that can be wrong before the model is loaded: the flags,
//! the model's header, the corpus, `--in-file` shapes, the `--rpc` servers, and outputs that
//! would overwrite an input. Each check fails with a [UsageError] (exit 2) naming the flag or
//! file and what is wrong, so a mistake costs a second, not a model load (docs/failures.md).
//!
//! The corpus and RPC checks are written for any tool that takes `-f` or `--rpc` (eval,
//! corpus); the model's own checks live in [crate::formats::gguf_header].

use crate::error::UsageError;
use crate::formats::gguf_header::ModelHeader;
use crate::formats::imatrix::Entry;
use anyhow::{anyhow, bail, Result};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn usage(msg: String) -> anyhow::Error {
    anyhow!(UsageError(msg))
}

/// The calibration run's checks, in order, before anything is loaded: flags, the model's
/// header, flags against the model, outputs against inputs, the corpus, the RPC servers. A
/// dense model turns REAP off here, with its one-line notice. Returns the model path, its
/// header and the corpus bytes (None in combine-only mode).
pub fn before_loading(plan: &mut super::Plan) -> Result<(PathBuf, ModelHeader, Option<Vec<u8>>)> {
    flags(&plan.args)?;
    let model = plan.args.model.clone().ok_or_else(|| usage("-m/--model is required".into()))?;
    let header = crate::formats::gguf_header::read_model("-m", &model)?;
    against_model(&plan.args, &model, &header)?;
    plan.model_shards = header.shards.iter().skip(1).cloned().collect();
    let mut inputs = vec![("-m", model.clone())];
    inputs.extend(plan.model_shards.iter().map(|p| ("-m", p.clone())));
    inputs.extend(plan.args.file.iter().map(|f| ("-f", f.clone())));
    inputs.extend(plan.in_files.iter().map(|f| ("--in-file", f.clone())));
    inputs.extend(plan.args.domains.iter().map(|f| ("--domains", f.clone())));
    inputs.extend(plan.args.nextn_model.iter().map(|f| ("--nextn-model", f.clone())));
    outputs_are_not_inputs(&plan.outputs(), &inputs)?;
    let text = match &plan.args.file {
        Some(f) => {
            let (text, read) = corpus_read("-f", f, plan.n_ctx as usize, plan.args.chunk.max(0) as usize)?;
            plan.corpus_read = Some(read);
            Some(text)
        }
        None => None,
    };
    if let Some(servers) = &plan.args.rpc {
        rpc_servers(servers)?;
    }
    // archs whose graph gives no per-expert output to take the norm of, or two alike
    if let Some(why) = no_reap(&header.arch, &model).filter(|_| plan.reap_out.is_some()) {
        if plan.args.reap_out.is_some() || plan.args.trace_out.is_some() {
            bail!(UsageError(format!("--reap-out/--trace-out: {why}")));
        }
        eprintln!("notice: {why}: imatrix only, no saliency JSON or routing trace");
        plan.reap_out = None;
    }
    if !header.is_moe() && plan.reap_out.is_some() {
        eprintln!(
            "notice: {} is a dense model ({}, no experts): imatrix only, no saliency JSON or routing trace",
            model.display(),
            header.arch
        );
        plan.reap_out = None;
        plan.args.trace_out = None;
    }
    Ok((model, header, text))
}

/// Flags whose values are wrong on their own (no file needed).
pub fn flags(a: &super::args::ImatrixArgs) -> Result<()> {
    if a.chunks == 0 {
        bail!(UsageError("--chunks 0: nothing to compute (give a positive number, or -1 for all chunks)".into()));
    }
    if a.batch_size <= 0 {
        bail!(UsageError(format!("-b {}: the batch size must be at least 1", a.batch_size)));
    }
    if a.ubatch_size <= 0 {
        bail!(UsageError(format!("-ub {}: the micro-batch size must be at least 1", a.ubatch_size)));
    }
    if let (Some(d), None) = (&a.domains, &a.file) {
        // it names byte ranges of the calibration text; combining --in-file reads none
        bail!(UsageError(format!("--domains {}: needs the calibration text it describes (-f)", d.display())));
    }
    Ok(())
}

/// The flags that depend on the model: `--trace-top-n` at most n_expert; a trace needs one k.
pub fn against_model(a: &super::args::ImatrixArgs, model: &Path, h: &ModelHeader) -> Result<()> {
    if let (Some(ks), Some(_)) = (h.varying_k(), &a.trace_out) {
        bail!(UsageError(one_k_per_trace(model, &ks)));
    }
    if a.nextn {
        match nextn_file(a, model, h)? {
            Some((p, mh)) => nextn_blocks(&p, &mh)?,
            None => nextn_blocks(model, h)?,
        };
    }
    if let Some(n) = a.trace_top_n {
        if h.is_moe() && n < h.n_expert_used as usize {
            bail!(UsageError(format!(
                "--trace-top-n {n}: fewer than the {} experts each token uses in {} (the candidates hold the selected ones)",
                h.n_expert_used,
                model.display()
            )));
        }
        if h.is_moe() && n > h.n_expert as usize {
            bail!(UsageError(format!(
                "--trace-top-n {n}: more than the {} experts per layer of {} (at most {})",
                h.n_expert,
                model.display(),
                h.n_expert
            )));
        }
    }
    Ok(())
}

/// The architectures whose nextn/MTP graph (`LLM_GRAPH_TYPE_DECODER_MTP` at the pin) `--nextn`
/// drives: its input the trunk's final hidden state and the token embedding.
pub const NEXTN_ARCHS: &[&str] = &["glm4moe", "deepseek2", "glm-dsa", "deepseek32", "qwen35moe", "qwen3next", "nemotron_h_moe", "cohere2moe", "step35", "mimo2", "hy_v3", "bailingmoe3", "deepseek4"];

/// Of those, the ones whose MTP block comes in a file of its own (`--nextn-model`):
/// DeepSeek-V4's converter at the pin leaves it out of the model and writes it with `--mtp`
/// (mtp-NAME.gguf: the block, the token embedding, the output norm and head, the block's own
/// final stream mix), and the pin's loader takes such a file without the trunk's tensors.
pub const SEPARATE_NEXTN_ARCHS: &[&str] = &["deepseek4"];

/// `--nextn`: where the blocks are. None: in -m's file; else `--nextn-model`'s path and header,
/// checked to belong to -m's model (the same arch, token embedding and head shapes, its blocks
/// right after -m's trunk).
pub fn nextn_file(a: &super::args::ImatrixArgs, model: &Path, h: &ModelHeader) -> Result<Option<(std::path::PathBuf, ModelHeader)>> {
    let Some(p) = &a.nextn_model else {
        if SEPARATE_NEXTN_ARCHS.contains(&h.arch.as_str()) && !h.tensors.keys().any(|n| n.ends_with(".nextn.eh_proj.weight")) {
            bail!(UsageError(format!(
                "--nextn: {} is {}, whose MTP block comes in a file of its own (convert_hf_to_gguf.py --mtp writes mtp-NAME.gguf): name it with --nextn-model",
                model.display(),
                h.arch
            )));
        }
        return Ok(None);
    };
    if !SEPARATE_NEXTN_ARCHS.contains(&h.arch.as_str()) {
        bail!(UsageError(format!(
            "--nextn-model {}: -m {} is {}, whose nextn/MTP block is in the model's own file at the pin (a block in a file of its own: {})",
            p.display(),
            model.display(),
            h.arch,
            SEPARATE_NEXTN_ARCHS.join(", ")
        )));
    }
    let mh = crate::formats::gguf_header::read_model("--nextn-model", p)?;
    if mh.arch != h.arch {
        bail!(UsageError(format!("--nextn-model {}: its architecture is {}, -m {}'s {}", p.display(), mh.arch, model.display(), h.arch)));
    }
    for t in ["token_embd.weight", "output.weight"] {
        if let (Some(a), Some(b)) = (h.tensors.get(t), mh.tensors.get(t)) {
            if a != b {
                bail!(UsageError(format!("--nextn-model {}: its {t} is {:?}, -m {}'s {:?}: not the same model's", p.display(), &b[..2], model.display(), &a[..2])));
            }
        }
    }
    let blocks = nextn_blocks(p, &mh)?;
    // the trunk's blocks are 0..n; the MTP graph runs block n
    let trunk = h.tensors.keys().filter_map(|n| n.strip_prefix("blk.")?.split('.').next()?.parse::<u32>().ok()).max().map_or(0, |b| b + 1);
    if blocks[0] != trunk {
        bail!(UsageError(format!(
            "--nextn-model {}: its MTP block is block {}, but -m {}'s trunk has {trunk} blocks (the block after them is {trunk}): not this model's",
            p.display(),
            blocks[0],
            model.display()
        )));
    }
    Ok(Some((p.clone(), mh)))
}

/// Of those, the ones whose files carry several MTP blocks, one graph running the block
/// `llama_set_nextn_layer_offset` picks, chained as upstream's drafter chains them
/// (Step-3.5-Flash, MiMo-V2: three). The others' models have one.
pub const CHAINED_NEXTN_ARCHS: &[&str] = &["step35", "mimo2"];

/// `--nextn`: the model's nextn blocks (those of `blk.N.nextn.eh_proj.weight`), in order, or why
/// not: one, or several consecutive ones where the arch chains them.
pub fn nextn_blocks(model: &Path, h: &ModelHeader) -> Result<Vec<u32>> {
    if !NEXTN_ARCHS.contains(&h.arch.as_str()) {
        bail!(UsageError(format!(
            "--nextn: {} is {}; the nextn/MTP pass is implemented for {} (llama.cpp's MTP graph at the pin)",
            model.display(),
            h.arch,
            NEXTN_ARCHS.join(", ")
        )));
    }
    let mut blocks: Vec<u32> = h.tensors.keys().filter_map(|n| n.strip_prefix("blk.")?.strip_suffix(".nextn.eh_proj.weight")?.parse().ok()).collect();
    blocks.sort_unstable();
    match blocks[..] {
        [] => bail!(UsageError(format!(
            "--nextn: {} has no nextn/MTP block with its own tensors (no blk.N.nextn.eh_proj.weight; converted with --no-mtp, or pruned with --drop-nextn?)",
            model.display()
        ))),
        [_] => Ok(blocks),
        _ if !CHAINED_NEXTN_ARCHS.contains(&h.arch.as_str()) => {
            bail!(UsageError(format!("--nextn: {} has {} nextn blocks {blocks:?}; llama.cpp's {} MTP graph runs one", model.display(), blocks.len(), h.arch)))
        }
        _ if blocks.windows(2).any(|w| w[1] != w[0] + 1) => {
            bail!(UsageError(format!("--nextn: {} has nextn blocks {blocks:?}, not consecutive; llama.cpp's MTP graph runs the blocks after the trunk in order", model.display())))
        }
        _ => Ok(blocks),
    }
}

/// Why the REAP sums and the routing trace of `arch` are not collected (the imatrix is), if
/// they are not:
/// - llama4: llama.cpp's graph multiplies the experts' inputs by the gate (llama-graph.cpp,
///   weight_before_ffn), so there is no unweighted expert output to take the norm of;
/// - grovemoe: each block runs two MoE passes on the same routing (its experts, then the
///   adjugate experts of their groups, `ffn_*_chexps`), and llama.cpp names both passes'
///   nodes alike (`ffn_moe_topk-N`, `ffn_moe_down-N`, …), so one layer's sums would mix them.
pub fn no_reap(arch: &str, model: &Path) -> Option<String> {
    match arch {
        "llama4" => Some(format!(
            "{} is a llama4 model: llama.cpp multiplies its experts' inputs by the router's gate, not their outputs, so REAP saliency (gate × ‖expert output‖) is not defined for it",
            model.display()
        )),
        "grovemoe" => Some(format!(
            "{} is a grovemoe model: llama.cpp runs two MoE passes in each block (the experts, then their groups' adjugate experts) whose graph nodes carry the same names, so REAP sums per expert cannot be told apart",
            model.display()
        )),
        _ => None,
    }
}

/// Why a model whose layers use different numbers of experts per token cannot be traced.
pub fn one_k_per_trace(model: &Path, ks: &[u32]) -> String {
    format!(
        "--trace-out: {} uses a different number of experts per token in different layers ({}), and a routing trace holds one k per file; the saliency JSON handles it: leave out --trace-out",
        model.display(),
        ks.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
    )
}

/// The corpus as upstream reads `-f` (bytes, one trailing newline removed), refused when it is
/// missing, empty, not UTF-8 (with the byte offset and line of the first bad byte), or too
/// short to hold two contexts even at one token per byte (a token covers at least one byte;
/// BOS adds one). The exact token count is checked again after tokenising.
pub fn corpus(flag: &str, path: &Path, n_ctx: usize, skip_chunks: usize) -> Result<Vec<u8>> {
    corpus_read(flag, path, n_ctx, skip_chunks).map(|(text, _)| text)
}

/// [corpus], and the size and sha256 of the bytes read.
pub fn corpus_read(flag: &str, path: &Path, n_ctx: usize, skip_chunks: usize) -> Result<(Vec<u8>, (u64, String))> {
    let what = |m: String| usage(format!("{flag} {}: {m}", path.display()));
    if path.is_dir() {
        return Err(what("is a folder, not a text file".into()));
    }
    let mut text = std::fs::read(path).map_err(|e| what(format!("cannot read the calibration text: {e}")))?;
    let read = (text.len() as u64, crate::formats::sha256::sha256_hex(&text));
    if text.last() == Some(&b'\n') {
        text.pop();
    }
    if text.is_empty() {
        return Err(what("the calibration text is empty".into()));
    }
    if let Err(e) = std::str::from_utf8(&text) {
        let at = e.valid_up_to();
        let line = 1 + text[..at].iter().filter(|&&b| b == b'\n').count();
        return Err(what(format!(
            "not valid UTF-8: byte offset {at} (line {line}) holds 0x{:02x}; llama.cpp's tokenizer would silently replace it with U+FFFD. Convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)",
            text[at]
        )));
    }
    let need = (skip_chunks + 2) * n_ctx;
    if text.len() + 1 < need {
        return Err(what(format!(
            "you need at least {need} tokens for a context of {n_ctx} tokens{}; the file has only {} bytes, so at most {} tokens (use a longer text or a smaller -c)",
            if skip_chunks > 0 { format!(" after skipping {skip_chunks} chunks (--chunk)") } else { String::new() },
            text.len(),
            text.len() + 1,
        )));
    }
    Ok((text, read))
}

/// Every `--in-file` entry must be a tensor of the model with the same shape: an imatrix of
/// another model is refused before anything is computed.
pub fn in_file_matches_model(in_file: &Path, entries: &std::collections::BTreeMap<String, Entry>, model: &Path, h: &ModelHeader) -> Result<()> {
    for (name, e) in entries {
        // upstream would stop on them only after the model load, naming a tensor but not the file
        if let Some(i) = e.sums.iter().position(|v| !v.is_finite()) {
            bail!(UsageError(format!(
                "--in-file {}: {name} holds a non-finite sum ({} at index {i}): a damaged imatrix",
                in_file.display(),
                e.sums[i]
            )));
        }
        if let Some(i) = e.counts.iter().position(|&c| c < 0) {
            bail!(UsageError(format!("--in-file {}: {name} holds a negative count ({} at index {i}): a damaged imatrix", in_file.display(), e.counts[i])));
        }
        let Some(ne) = h.tensors.get(name) else {
            bail!(UsageError(format!(
                "--in-file {}: it has data for {name}, which {} does not have (an imatrix of another model?)",
                in_file.display(),
                model.display()
            )));
        };
        // an imatrix entry holds ne[0] sums per matrix and one count per matrix (ne[2] experts)
        let (n_in, n_mat) = (ne[0].max(0) as usize, ne[2].max(1) as usize);
        // (a legacy .dat entry holds one count for all its matrices)
        let counts_ok = e.counts.len() == n_mat || e.counts.len() == 1;
        if e.sums.len() != n_in * n_mat || !counts_ok {
            bail!(UsageError(format!(
                "--in-file {}: {name} has {} values ({} counts), but in {} it is {:?} (expects {} values, {n_mat} counts): an imatrix of another model?",
                in_file.display(),
                e.sums.len(),
                e.counts.len(),
                model.display(),
                &ne[..3],
                n_in * n_mat
            )));
        }
    }
    Ok(())
}

/// `--rpc host:port[,…]`: each server must accept a TCP connection within a short timeout,
/// checked before the model is loaded (llama.cpp would fail only when it tries to use it).
pub fn rpc_servers(servers: &str) -> Result<()> {
    for s in servers.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let addrs: Vec<SocketAddr> = s
            .to_socket_addrs()
            .map_err(|e| usage(format!("--rpc {s}: not a reachable HOST:PORT ({e})")))?
            .collect();
        let timeout = Duration::from_secs(3);
        let mut last = None;
        if !addrs.iter().any(|a| match TcpStream::connect_timeout(a, timeout) {
            Ok(_) => true,
            Err(e) => {
                last = Some(e);
                false
            }
        }) {
            let why = last.map_or("no address".to_string(), |e| e.to_string());
            bail!(UsageError(format!("--rpc {s}: RPC server unreachable ({why}); start ggml-rpc-server there or fix the address")));
        }
    }
    Ok(())
}

/// No output may be one of the inputs: `-o model.gguf` would replace the model.
pub fn outputs_are_not_inputs(outputs: &[(&'static str, PathBuf)], inputs: &[(&'static str, PathBuf)]) -> Result<()> {
    for (oflag, o) in outputs {
        for (iflag, i) in inputs {
            if crate::formats::atomic::same_file(o, i) {
                bail!(UsageError(format!("{oflag} {} is the {iflag} input: it would be overwritten", o.display())));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("reap-validate-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn corpus_errors_say_what_and_where() {
        let err = |b: &[u8], n_ctx| format!("{:#}", corpus("-f", &tmp("c", b), n_ctx, 0).unwrap_err());
        assert!(err(b"", 4).contains("empty"));
        assert!(err(b"\n", 4).contains("empty"));
        let e = err(b"ab\ncd\xffef", 2);
        assert!(e.contains("byte offset 5 (line 2)") && e.contains("0xff"), "{e}");
        let e = err(b"abcdef", 4);
        assert!(e.contains("only 6 bytes, so at most 7 tokens") && e.contains("at least 8 tokens"), "{e}");
        assert_eq!(corpus("-f", &tmp("ok", b"abcdefg\n"), 4, 0).unwrap(), b"abcdefg");
        let e = format!("{:#}", corpus("-f", &tmp("skip", b"abcdefghij"), 4, 1).unwrap_err());
        assert!(e.contains("after skipping 1 chunks"), "{e}");
    }

    #[test]
    fn an_unreachable_rpc_server_is_named() {
        // a port that was free a moment ago: nothing listens there
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let e = format!("{:#}", rpc_servers(&format!("127.0.0.1:{port}")).unwrap_err());
        assert!(e.contains(&format!("127.0.0.1:{port}")) && e.contains("unreachable"), "{e}");
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        rpc_servers(&l.local_addr().unwrap().to_string()).unwrap();
    }

    #[test]
    fn nextn_takes_one_block_or_a_chained_archs_consecutive_ones() {
        let header = |arch: &str, blocks: &[u32]| ModelHeader {
            arch: arch.into(),
            tensors: blocks.iter().map(|b| (format!("blk.{b}.nextn.eh_proj.weight"), [1, 1, 1, 1])).collect(),
            ..Default::default()
        };
        let m = Path::new("m.gguf");
        let err = |arch: &str, blocks: &[u32]| format!("{:#}", nextn_blocks(m, &header(arch, blocks)).unwrap_err());
        assert_eq!(nextn_blocks(m, &header("glm4moe", &[92])).unwrap(), [92]);
        // in block order, not the names' (blk.10 sorts before blk.9)
        assert_eq!(nextn_blocks(m, &header("step35", &[10, 8, 9])).unwrap(), [8, 9, 10]);
        let e = err("glm4moe", &[4, 5]);
        assert!(e.contains("has 2 nextn blocks [4, 5]; llama.cpp's glm4moe MTP graph runs one"), "{e}");
        let e = err("step35", &[4, 6]);
        assert!(e.contains("nextn blocks [4, 6], not consecutive"), "{e}");
        assert!(err("step35", &[]).contains("no nextn/MTP block"));
        assert!(err("qwen3moe", &[4]).contains("is qwen3moe; the nextn/MTP pass is implemented for"));
    }
}
