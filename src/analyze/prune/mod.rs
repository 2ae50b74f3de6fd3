//! `reap-imatrix prune`: a keep map applied to a GGUF model (and its imatrix), giving a model
//! with K experts per MoE layer that stock llama.cpp loads. See docs/prune.md.
//!
//! Everything is checked before the first byte is written (the map against the model, the
//! imatrix against both, the output paths); then the model is streamed from a memory map to a
//! temporary file beside the output and renamed into place, and the imatrix the same way.

pub mod plan;
pub mod split;
pub mod stream;

use crate::analyze::select::keep_map::KeepMap;
use crate::error::UsageError;
use crate::formats::atomic;
use crate::formats::gguf::{encode_header, Header, TensorInfo};
use anyhow::{anyhow, Context as _, Result};
use memmap2::Mmap;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
#[command(after_help = "Keeps, in every MoE layer, the experts the keep map lists (ascending id order); every other key and \
tensor is copied unchanged. Nothing is written when an input is refused. See docs/prune.md.")]
pub struct PruneArgs {
    /// Model to prune (GGUF)
    #[arg(short = 'm', long = "model", value_name = "MODEL.gguf")]
    pub model: PathBuf,
    /// Keep map (from `select`): which experts each MoE layer keeps
    #[arg(long = "keep-map", value_name = "MAP.json")]
    pub keep_map: PathBuf,
    /// Pruned model to write
    #[arg(short = 'o', long = "output", visible_alias = "out", value_name = "OUT.gguf")]
    pub out: PathBuf,
    /// Imatrix of the model (GGUF) to slice the same way
    #[arg(long, value_name = "IN.gguf", requires = "imatrix_out")]
    pub imatrix: Option<PathBuf>,
    /// Where to write the sliced imatrix
    #[arg(long = "imatrix-out", value_name = "OUT.imatrix.gguf", requires = "imatrix")]
    pub imatrix_out: Option<PathBuf>,
    /// Replace existing output files
    #[arg(long)]
    pub force: bool,
    /// Check the model, the map, the imatrix and the outputs as a run would, and write nothing
    #[arg(long = "dry-run")]
    pub dry_run: bool,
    /// Leave the model's nextn/MTP blocks out (GLM-4.5/4.6, DeepSeek-V3: `nextn_predict_layers`):
    /// calibration never runs them, so select's maps have no entry for them. The output is the
    /// model without them, as convert_hf_to_gguf.py --no-mtp writes it (block_count of the
    /// trunk, no nextn_predict_layers, per-layer arrays cut to the trunk); speculative decoding
    /// then needs a separate MTP GGUF
    #[arg(long = "drop-nextn")]
    pub drop_nextn: bool,
    /// In a hash-routed block (DeepSeek-V4's first blocks: `ffn_gate_tid2eid` names each token's
    /// experts), send each table entry that names a dropped expert to the first kept expert of
    /// the map's `stand_in` list (select writes it: the smallest mean REAP contribution first)
    /// that the token's row does not name yet. This changes how those tokens route; without it
    /// such a map is refused
    #[arg(long = "hash-remap")]
    pub hash_remap: bool,
    /// Write the model as shards of at most N tensors, OUT-00001-of-0000K.gguf … (the files
    /// `llama-gguf-split --split --split-max-tensors N` would make of OUT.gguf)
    #[arg(long = "split-max-tensors", value_name = "N", conflicts_with = "split_max_size")]
    pub split_max_tensors: Option<usize>,
    /// Write the model as shards of at most N megabytes (M) or gigabytes (G) of tensor data
    /// (10^6, 10^9 bytes; as `llama-gguf-split --split --split-max-size` cuts)
    #[arg(long = "split-max-size", value_name = "N(M|G)")]
    pub split_max_size: Option<String>,
}

/// What to prune: the library entry point's input (`eval --keep-map` prunes through it).
#[derive(Clone, Debug)]
pub struct PruneOptions {
    pub model: PathBuf,
    pub keep_map: PathBuf,
    pub out: PathBuf,
    /// (imatrix of `model`, where to write the sliced one)
    pub imatrix: Option<(PathBuf, PathBuf)>,
    /// replace existing outputs
    pub force: bool,
    /// every check, nothing written (`bytes_out` 0)
    pub dry_run: bool,
    /// leave the nextn/MTP blocks out (`--drop-nextn`)
    pub drop_nextn: bool,
    /// send hash-table entries of dropped experts to kept ones by the map's stand_in (`--hash-remap`)
    pub hash_remap: bool,
    /// write shards (`--split-max-tensors`, `--split-max-size`) instead of `out` itself
    pub split: Option<split::SplitRule>,
}

/// What was written.
#[derive(Clone, Debug, PartialEq)]
pub struct PruneReport {
    pub arch: String,
    /// the model's expert count before pruning
    pub n_expert: u64,
    /// experts kept per MoE layer
    pub k: usize,
    /// the MoE layers (block indices), in keep-map order
    pub moe_layers: Vec<u32>,
    pub tensors: usize,
    /// tensors sliced along their expert axis
    pub tensors_sliced: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// per-expert imatrix entries sliced (`in_sum2` and `counts` each count), with --imatrix
    pub imatrix_entries_sliced: Option<usize>,
    /// nextn/MTP blocks left out (`--drop-nextn`), and the model tensors they held
    pub nextn_dropped: Vec<u32>,
    pub tensors_dropped: usize,
    /// blocks the map holds for the other file of a model whose MTP block is in a file of its
    /// own (`--nextn-model`): the MTP block, pruning the trunk; the trunk's, pruning the MTP file
    pub other_file_blocks: Vec<u32>,
    /// the file holds a nextn/MTP block alone (DeepSeek-V4's `mtp-NAME.gguf`)
    pub mtp_file: bool,
    /// hash-routed blocks whose table named dropped experts, sent elsewhere (`--hash-remap`):
    /// (block, entries, tokens)
    pub hash_remapped: Vec<(u32, usize, usize)>,
    /// hash-routed blocks (tables of expert ids) in the file
    pub hash_blocks: Vec<u32>,
    /// the shards written (or, with `dry_run`, to be written) in place of `out`; empty without
    /// a split rule
    pub shards: Vec<PathBuf>,
}

fn usage(msg: String) -> anyhow::Error {
    anyhow!(UsageError(msg))
}

pub fn run(args: &PruneArgs) -> Result<i32> {
    let split = match (args.split_max_tensors, &args.split_max_size) {
        (Some(0), _) => return Err(usage("--split-max-tensors 0: at least 1".into())),
        (Some(n), _) => Some(split::SplitRule::Tensors(n)),
        (None, Some(s)) => Some(split::SplitRule::Bytes(split::parse_size(s).map_err(usage)?)),
        (None, None) => None,
    };
    let opts = PruneOptions {
        split,
        model: args.model.clone(),
        keep_map: args.keep_map.clone(),
        out: args.out.clone(),
        imatrix: args.imatrix.clone().zip(args.imatrix_out.clone()),
        force: args.force,
        dry_run: args.dry_run,
        drop_nextn: args.drop_nextn,
        hash_remap: args.hash_remap,
    };
    let t0 = std::time::Instant::now();
    let r = prune_model(&opts)?;
    if args.hash_remap && r.hash_blocks.is_empty() {
        eprintln!("prune: note: --hash-remap: {} has no hash-routed block (no blk.N.ffn_gate_tid2eid); the flag changes nothing", args.model.display());
    }
    let mut shape = format!("{} MoE layers, {} → {} experts", r.moe_layers.len(), r.n_expert, r.k);
    if !r.nextn_dropped.is_empty() {
        shape += &format!("; nextn block {:?} left out ({} tensors)", r.nextn_dropped, r.tensors_dropped);
    }
    if r.mtp_file {
        shape += &format!("; the MTP block alone (the map's entries for the trunk's blocks {:?} are the trunk file's)", r.other_file_blocks);
    } else if !r.other_file_blocks.is_empty() {
        shape += &format!("; the map's entry for block {:?} is the MTP file's: prune that with -m MTP-FILE and this map", r.other_file_blocks);
    }
    for (block, entries, tokens) in &r.hash_remapped {
        shape += &format!("; block {block} routes by token id: {entries} table entries of {tokens} tokens sent to kept experts (--hash-remap)");
    }
    if args.dry_run {
        println!(
            "prune: --dry-run: {} ({}) fits the map: {shape}, {} of {} tensors to slice{}; nothing written",
            args.model.display(),
            r.arch,
            r.tensors_sliced,
            r.tensors,
            match r.shards.len() {
                0 => String::new(),
                n => format!(", in {n} shards from {}", r.shards[0].display()),
            }
        );
        return Ok(0);
    }
    let written = match &r.shards[..] {
        [] => args.out.display().to_string(),
        [first, .., last] => format!("{} … {} ({} shards)", first.display(), last.display(), r.shards.len()),
        [one] => format!("{} (1 shard)", one.display()),
    };
    println!(
        "prune: {written} ({}): {shape}; {} of {} tensors sliced; {:.1} MiB → {:.1} MiB in {:.2} s",
        r.arch,
        r.tensors_sliced,
        r.tensors,
        r.bytes_in as f64 / (1 << 20) as f64,
        r.bytes_out as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    if let (Some(n), Some(p)) = (r.imatrix_entries_sliced, &args.imatrix_out) {
        println!("prune: {}: {n} per-expert imatrix entries sliced", p.display());
    }
    Ok(0)
}

/// A source file and its parsed header.
struct Source {
    file: std::fs::File,
    map: Mmap,
    header: Header,
}

/// A split model (`llama-gguf-split`): the shards after the first, found as llama.cpp finds
/// them, and each tensor's place, in the order of the first shard's header with the others'
/// tensors appended (the order `llama-gguf-split --merge` writes them in).
struct Shards {
    more: Vec<(PathBuf, Source)>,
    /// per tensor of the merged header: (shard, absolute offset of its data in that shard)
    places: Vec<(usize, u64)>,
}

/// The shards of `first` where it is the first of a split model, its header extended by the
/// other shards' tensors; None for a single file (or a merged one: `split.count` 0).
fn open_shards(first: &mut Source, model: &Path) -> Result<Option<Shards>> {
    let (h, b) = (&first.header, &first.map[..]);
    let Some(count) = h.uint(b, "split.count").filter(|&n| n > 1) else { return Ok(None) };
    let no = h.uint(b, "split.no").unwrap_or(0);
    let bad = |e: String| usage(format!("-m {}: {e}", model.display()));
    if no != 0 {
        return Err(bad(format!("shard {} of {count} of a split model: give the first shard, which holds the model's keys", no + 1)));
    }
    let paths = crate::formats::gguf_header::split_paths(model, no, count).map_err(bad)?;
    let mut places: Vec<(usize, u64)> = first.header.tensors.iter().map(|t| (0, first.header.data_start + t.offset)).collect();
    let mut more = Vec::new();
    for (i, p) in paths.into_iter().enumerate().skip(1) {
        let s = open_gguf(&p, "-m (a shard)")?;
        if s.header.uint(&s.map, "split.count") != Some(count) || s.header.uint(&s.map, "split.no") != Some(i as u64) {
            return Err(usage(format!("-m (a shard) {}: not shard {} of the {count}-file split model {}", p.display(), i + 1, model.display())));
        }
        places.extend(s.header.tensors.iter().map(|t| (i, s.header.data_start + t.offset)));
        first.header.tensors.extend(s.header.tensors.iter().cloned());
        more.push((p, s));
    }
    let total = first.header.tensors.len() as u64;
    if let Some(n) = first.header.uint(&first.map, "split.tensors.count").filter(|&n| n != total) {
        return Err(bad(format!("split.tensors.count says {n} tensors, the {count} shards hold {total}")));
    }
    Ok(Some(Shards { more, places }))
}

fn open_gguf(path: &Path, what: &str) -> Result<Source> {
    let file = std::fs::File::open(path).map_err(|e| usage(format!("{what} {}: {e}", path.display())))?;
    // SAFETY: read-only map; a file changed underneath would give wrong bytes, not unsafety in
    // practice (the same assumption llama.cpp's own mmap loading makes).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| usage(format!("{what} {}: cannot map: {e}", path.display())))?;
    let header = Header::parse(&map).map_err(|e| usage(format!("{what} {}: {e}", path.display())))?;
    Ok(Source { file, map, header })
}

/// Refuses an output that is one of the inputs (or the other output), an existing output
/// without `force`, and an output folder that cannot be written.
fn check_outputs(opts: &PruneOptions) -> Result<()> {
    let mut inputs: Vec<(&str, &Path)> = vec![("-m", &opts.model), ("--keep-map", &opts.keep_map)];
    let mut outputs: Vec<(&str, &Path)> = vec![("-o", &opts.out)];
    if let Some((i, o)) = &opts.imatrix {
        inputs.push(("--imatrix", i));
        outputs.push(("--imatrix-out", o));
    }
    for (oi, (of, o)) in outputs.iter().enumerate() {
        for (f, i) in inputs.iter().chain(&outputs[..oi]) {
            if atomic::same_file(o, i) {
                let what = if oi > 0 && outputs[..oi].iter().any(|(g, _)| g == f) { "two outputs must be two files" } else { "an output must not overwrite an input" };
                return Err(usage(format!("{of} {}: the same file as {f} ({what})", o.display())));
            }
        }
        // split, -o names the shards' prefix: each shard is checked once their count is known
        if oi == 0 && opts.split.is_some() {
            continue;
        }
        if o.exists() && !opts.force {
            return Err(usage(format!("{of} {}: already exists (pass --force to replace it)", o.display())));
        }
        atomic::check_writable(o).map_err(|e| usage(format!("{of} {e}")))?;
    }
    Ok(())
}

/// The map's kept ids per MoE layer, checked against the model.
fn check_map(map: &KeepMap, path: &Path, blocks: &[u32], n_expert: u64, n_used: u64) -> Result<Vec<Vec<u16>>> {
    let p = path.display();
    if let Some(n) = map.model.as_ref().and_then(|m| m.expert_count) {
        if n != n_expert {
            return Err(usage(format!("--keep-map {p}: made for a model with {n} experts per layer; the model has {n_expert}")));
        }
    }
    if map.layers.len() != blocks.len() {
        return Err(usage(format!(
            "--keep-map {p}: {} layers, but the model has {} MoE layers (blocks {blocks:?}): a map for another model?",
            map.layers.len(),
            blocks.len()
        )));
    }
    let named: Vec<u32> = map.layers.iter().filter_map(|l| l.layer).collect();
    if !named.is_empty() && named != blocks {
        return Err(usage(format!("--keep-map {p}: its layers {named:?} are not the model's MoE layers {blocks:?}")));
    }
    let k = map.layers[0].keep.len();
    for (l, &b) in map.layers.iter().zip(blocks) {
        if l.keep.len() != k {
            return Err(usage(format!(
                "--keep-map {p}: layer {b} keeps {} experts, layer {} keeps {k}; llama.cpp loads only the same number of experts in every layer",
                l.keep.len(),
                blocks[0]
            )));
        }
        if let Some(&e) = l.keep.iter().find(|&&e| e as u64 >= n_expert) {
            return Err(usage(format!(
                "--keep-map {p}: layer {b}: expert id {e} is out of range (the model has {n_expert} experts, 0–{})",
                n_expert - 1
            )));
        }
    }
    if map.k != 0 && map.k != k {
        return Err(usage(format!("--keep-map {p}: says \"k\": {}, but its layers keep {k} experts", map.k)));
    }
    if (k as u64) < n_used.max(1) {
        return Err(usage(format!(
            "--keep-map {p}: keeps {k} experts per layer, fewer than the {n_used} each token uses (expert_used_count)"
        )));
    }
    Ok(map.layers.iter().map(|l| l.keep.clone()).collect())
}

/// The pairs that change when the last `n_nextn` blocks go, as the converter's `--no-mtp`
/// writes the model (every loader takes that layout; a trunk-only file that keeps
/// `nextn_predict_layers` loads only where the arch's loader makes the nextn tensors optional):
/// `block_count` of the trunk, no `nextn_predict_layers`, and each `<arch>.*` array of one
/// value per block cut to the trunk's. (key, new pair bytes, or None to remove it).
fn no_mtp_kvs(h: &Header, b: &[u8], arch: &str, n_nextn: u64) -> Result<Vec<(String, Option<Vec<u8>>)>, String> {
    let count_key = format!("{arch}.block_count");
    let total = h.uint(b, &count_key).ok_or_else(|| format!("no {count_key}"))?;
    let trunk = total - n_nextn;
    let mut out = vec![
        (count_key.clone(), Some(Header::encode_uint(h.kv(&count_key).unwrap(), trunk)?)),
        (format!("{arch}.nextn_predict_layers"), None),
    ];
    for kv in h.kvs.iter().filter(|kv| kv.key.starts_with(&format!("{arch}."))) {
        if h.array_len(b, &kv.key) == Some(total) {
            out.push((kv.key.clone(), Some(Header::encode_array_prefix(kv, b, trunk)?)));
        }
    }
    Ok(out)
}

/// A model that routes within `groups` groups of consecutive experts (DeepSeek-V3): llama.cpp
/// splits the pruned layer's experts into `groups` equal runs again, so every group must keep
/// the same number (then each kept expert stays in its group), at least the two it scores a
/// group by, and the `groups_used` best groups must still hold the experts a token uses.
/// (Also `replay --keep-map` of a group-routed model: the same rule.)
pub(crate) fn check_groups(keep: &[Vec<u16>], blocks: &[u32], path: &Path, n_expert: u64, groups: u64, groups_used: u64, n_used: u64) -> Result<()> {
    let per_group = n_expert / groups;
    let k = keep[0].len() as u64;
    for (ids, b) in keep.iter().zip(blocks) {
        let mut counts = vec![0u64; groups as usize];
        for &e in ids {
            counts[(e as u64 / per_group) as usize] += 1;
        }
        if counts.iter().any(|&c| c != k / groups) || k % groups != 0 {
            return Err(usage(format!(
                "--keep-map {}: layer {b} keeps {counts:?} experts of its {groups} expert groups; the model routes within the groups, so every group must keep as many (select does this from the saliency JSON's expert_group_count)",
                path.display()
            )));
        }
    }
    if k / groups < 2 || (k / groups) * groups_used < n_used {
        return Err(usage(format!(
            "--keep-map {}: {} experts per group: llama.cpp scores a group by its best 2 and takes the {n_used} experts a token uses from {groups_used} groups",
            path.display(),
            k / groups
        )));
    }
    Ok(())
}

/// Why a hash-routed block (DeepSeek-V4's first blocks pick each token's experts from a table
/// by its token id) cannot lose the experts the keep map drops: no router score chooses another
/// expert for the tokens the table sends there, and llama.cpp holds one expert count for every
/// block, so a table that names all experts leaves nothing to prune.
fn dropped_ids_message(map: &Path, tensor: &str, block: u32, n_expert: u64, k: usize, d: &plan::DroppedIds) -> String {
    let (token, slot, expert) = d.first;
    let shown: Vec<String> = d.experts.iter().take(8).map(u32::to_string).collect();
    let more = if d.experts.len() > 8 { format!(", … ({} in all)", d.experts.len()) } else { String::new() };
    let all = if d.named as u64 == n_expert {
        format!(
            " It names all {n_expert}: llama.cpp reads one expert_count for every block, so this model's experts cannot be pruned without changing how block {block} routes"
        )
    } else {
        format!(" A map that keeps all {} experts it names in block {block} (K ≥ {}) prunes it", d.named, d.named)
    };
    let all = format!(
        "{all}. Or pass --hash-remap: each such entry then names the first kept expert of the map's stand_in list that the token's \
         row lacks (those tokens route differently; docs/prune.md)"
    );
    format!(
        "--keep-map {}: block {block} routes by token id ({tensor} names each token's experts; DeepSeek-V4's hash routing), and the map drops \
         experts it names: {}{more}, in {} entries of {} tokens (first: token {token}, slot {slot}, expert {expert}). Keeping {k} of {n_expert}, \
         those tokens would have no expert to go to.{all}",
        map.display(),
        shown.join(", "),
        d.entries,
        d.tokens
    )
}

/// Prunes `opts.model` by `opts.keep_map` into `opts.out` (and the imatrix, if given).
/// Bad inputs are `UsageError`s, raised before anything is written.
pub fn prune_model(opts: &PruneOptions) -> Result<PruneReport> {
    let model_arg = opts.model.display();
    check_outputs(opts)?;
    let map = KeepMap::read(&opts.keep_map).map_err(|e| usage(format!("--keep-map: {e:#}")))?;
    let mut src = open_gguf(&opts.model, "-m")?;
    let shards = open_shards(&mut src, &opts.model)?;
    if let Some(s) = &shards {
        if let Some((p, _)) = s.more.iter().find(|(p, _)| atomic::same_file(p, &opts.out)) {
            return Err(usage(format!("-o {}: is the model's shard {}", opts.out.display(), p.display())));
        }
    }
    let (h, b) = (&src.header, &src.map[..]);
    let arch = h.string(b, "general.architecture").ok_or_else(|| usage(format!("-m {model_arg}: no general.architecture")))?;
    let count_key = format!("{arch}.expert_count");
    let n_expert = h
        .uint(b, &count_key)
        .filter(|&n| n > 0)
        .ok_or_else(|| usage(format!("-m {model_arg}: no {count_key}: not a mixture-of-experts model")))?;
    // per layer on some models (an array): the largest is what every kept set must hold
    let n_used = h.uints(b, &format!("{arch}.expert_used_count")).and_then(|v| v.into_iter().max()).unwrap_or(0);
    let groups = h.uint(b, &format!("{arch}.expert_group_count")).unwrap_or(0);
    let groups_used = h.uint(b, &format!("{arch}.expert_group_used_count")).unwrap_or(groups);
    let grouped = groups > 1 && groups_used < groups;
    if grouped && n_expert % groups != 0 {
        return Err(usage(format!("-m {model_arg}: {n_expert} experts do not split into {groups} expert groups")));
    }
    let nextn = plan::nextn_blocks(h, b, &arch);
    let dropped: Vec<u32> = if opts.drop_nextn { nextn.clone() } else { Vec::new() };
    if opts.drop_nextn && nextn.is_empty() {
        return Err(usage(format!("--drop-nextn: -m {model_arg} has no nextn/MTP block (no {arch}.nextn_predict_layers)")));
    }
    let all_moe = plan::moe_blocks(h);
    // DeepSeek-V4's MTP block comes in a file of its own (convert_hf_to_gguf.py --mtp): the map
    // of a run with --nextn-model covers the trunk and that block, and each file takes its part
    let mtp_only = !nextn.is_empty() && all_moe.iter().all(|b| nextn.contains(b));
    let recorded_mtp = map.model.as_ref().and_then(|m| m.nextn_model.clone());
    let named: Vec<u32> = map.layers.iter().filter_map(|l| l.layer).collect();
    let foreign: Vec<u32> = if mtp_only {
        if named.len() != map.layers.len() {
            return Err(usage(format!(
                "-m {model_arg} holds the nextn/MTP block {nextn:?} alone (a file of its own, as DeepSeek-V4's): --keep-map {} must name its layers (select's maps do)",
                opts.keep_map.display()
            )));
        }
        if let Some(b) = nextn.iter().find(|b| !named.contains(b)) {
            return Err(usage(format!(
                "--keep-map {}: no entry for block {b}, the nextn/MTP block -m {model_arg} holds: calibrate with --nextn-model {model_arg} and select again, or add {{\"layer\": {b}, \"keep\": [...]}} to the map",
                opts.keep_map.display()
            )));
        }
        named.iter().copied().filter(|l| !all_moe.contains(l) && *l < nextn[0]).collect()
    } else if recorded_mtp.is_some() {
        let n_blocks = h.tensors.iter().filter_map(|t| plan::block_of(&t.name)).max().map_or(0, |b| b + 1);
        named.iter().copied().filter(|&l| l >= n_blocks).collect()
    } else {
        Vec::new()
    };
    let kept_tensor = |name: &str| plan::block_of(name).is_none_or(|n| !dropped.contains(&n) && !foreign.contains(&n));
    let blocks: Vec<u32> = all_moe.iter().copied().filter(|b| !dropped.contains(b)).collect();
    if blocks.is_empty() {
        return Err(usage(format!("-m {model_arg}: no MoE layer (no blk.N.ffn_gate_inp.weight)")));
    }
    // a map from select covers the trunk only: the nextn blocks are never run
    let nextn_moe: Vec<u32> = blocks.iter().copied().filter(|b| nextn.contains(b)).collect();
    let mut map_blocks: Vec<u32> = map.layers.iter().filter_map(|l| l.layer).collect();
    map_blocks.sort_unstable();
    let trunk: Vec<u32> = blocks.iter().copied().filter(|b| !nextn.contains(b)).collect();
    if !nextn_moe.is_empty() && map.layers.len() == trunk.len() && (map_blocks.is_empty() || map_blocks == trunk) {
        return Err(usage(format!(
            "--keep-map {}: no entry for the model's nextn/MTP block {nextn_moe:?} (a plain calibration never runs it, so select's maps cover \
             the trunk {trunk:?} only): pass --drop-nextn to leave the block out (the model as convert_hf_to_gguf.py --no-mtp writes it), add \
             {{\"layer\": {}, \"keep\": [...]}} to the map to prune its experts too, or calibrate with --nextn ({}) and select again",
            opts.keep_map.display(),
            nextn_moe[0],
            crate::calibrate::validate::NEXTN_ARCHS.join(", ")
        )));
    }
    let mut map = map;
    // with --drop-nextn, a hand-made entry for a dropped block goes with it: named, or (a map
    // of plain lists, one per MoE block in order) the trailing entries; the other file's
    // entries are that file's
    map.layers.retain(|l| l.layer.is_none_or(|n| !dropped.contains(&n) && !foreign.contains(&n)));
    if opts.drop_nextn && map.layers.iter().all(|l| l.layer.is_none()) && map.layers.len() == all_moe.len() {
        map.layers.truncate(blocks.len());
    }
    let keep = check_map(&map, &opts.keep_map, &blocks, n_expert, n_used)?;
    let k = keep[0].len();
    if grouped {
        check_groups(&keep, &blocks, &opts.keep_map, n_expert, groups, groups_used, n_used)?;
    }
    // the file the map was made with: the model, or (an MTP file) the block's own file
    let (want_sha, made_for) = match (&recorded_mtp, mtp_only) {
        (Some((p, sha)), true) => (sha.clone(), p.clone()),
        _ if mtp_only => (None, String::new()),
        _ => map.model.as_ref().map_or((None, String::new()), |m| (m.sha256.clone(), m.path.clone())),
    };
    if let Some(want) = &want_sha {
        let got = crate::formats::sha256::cached_sha256_file(&opts.model).with_context(|| format!("hashing {model_arg}"))?;
        if !got.eq_ignore_ascii_case(want) {
            return Err(usage(format!(
                "--keep-map {}: made for the {} with sha256 {want} ({made_for}); -m {model_arg} has sha256 {got}",
                opts.keep_map.display(),
                if mtp_only { "MTP file" } else { "model" }
            )));
        }
    }
    // a split model's further shards, where the map records them (the trunk's)
    if let Some(m) = map.model.as_ref().filter(|m| !m.shards.is_empty() && !mtp_only) {
        let ours: Vec<&Path> = shards.as_ref().map_or_else(Vec::new, |s| s.more.iter().map(|(p, _)| p.as_path()).collect());
        if ours.len() != m.shards.len() {
            return Err(usage(format!(
                "--keep-map {}: made for a model in {} files ({} and {} more shards); -m {model_arg} is {} file(s)",
                opts.keep_map.display(),
                m.shards.len() + 1,
                m.path,
                m.shards.len(),
                ours.len() + 1
            )));
        }
        for (p, (recorded, want)) in ours.iter().zip(&m.shards) {
            let got = crate::formats::sha256::cached_sha256_file(p).with_context(|| format!("hashing {}", p.display()))?;
            if !got.eq_ignore_ascii_case(want) {
                return Err(usage(format!(
                    "--keep-map {}: made for the model whose shard {recorded} has sha256 {want}; {} has sha256 {got}",
                    opts.keep_map.display(),
                    p.display()
                )));
            }
        }
    }
    let per_expert = |name: &str| if kept_tensor(name) { plan::model_per_expert(name) } else { Ok(None) };
    let mut steps = plan::plan(h, per_expert, &blocks, k, n_expert).map_err(|e| usage(format!("-m {model_arg}: {e}")))?;
    if let Some(s) = &shards {
        // one step per tensor, in the merged header's order
        for (step, &(shard, start)) in steps.iter_mut().zip(&s.places) {
            (step.shard, step.src_start) = (shard, start);
        }
    }
    let tensors_dropped = steps.len();
    steps.retain(|s| kept_tensor(&s.src.name));
    let tensors_dropped = tensors_dropped - steps.len();
    let (mut hash_remapped, mut hash_blocks) = (Vec::new(), Vec::new());
    for step in steps.iter_mut() {
        let Some(block) = plan::expert_id_table(&step.src.name) else { continue };
        hash_blocks.push(block);
        let bytes = if step.shard == 0 { &src.map } else { &shards.as_ref().unwrap().more[step.shard - 1].1.map };
        let at = step.src_start as usize;
        let data = bytes.get(at..at + step.src.nbytes() as usize).ok_or_else(|| usage(format!("-m {model_arg}: tensor {}: its data runs past the end of the file", step.src.name)))?;
        let Some(slot) = blocks.iter().position(|&b| b == block) else {
            return Err(usage(format!("-m {model_arg}: tensor {}: a table of expert ids in block {block}, which has no router (blk.{block}.ffn_gate_inp.weight)", step.src.name)));
        };
        let order = map.layers[slot].stand_ins();
        let (data, moved) = plan::remap_expert_ids(&step.src, data, &keep[slot], n_expert, order.as_ref().ok().copied().filter(|_| opts.hash_remap))
            .map_err(|e| match e {
                Err(broken) => usage(format!("-m {model_arg}: {broken}")),
                Ok(d) if opts.hash_remap => usage(format!(
                    "--keep-map {}: block {block} routes by token id ({}) and the map drops {} of the experts it names, but there is no \
                     stand-in order for block {block}: {}",
                    opts.keep_map.display(),
                    step.src.name,
                    d.experts.len(),
                    order.as_ref().err().map_or("", |s| s.as_str())
                )),
                Ok(d) => usage(dropped_ids_message(&opts.keep_map, &step.src.name, block, n_expert, k, &d)),
            })?;
        step.data = Some(data);
        hash_remapped.extend(moved.map(|d| (block, d.entries, d.tokens)));
    }
    let count_kv = h.kv(&count_key).unwrap();
    let new_count = Header::encode_uint(count_kv, k as u64).map_err(|e| usage(format!("-m {model_arg}: {e}")))?;
    let mut replaced: Vec<(String, Option<Vec<u8>>)> = vec![(count_key.clone(), Some(new_count))];
    if shards.is_some() {
        // one file now, with the first shard's keys: split.count 0, as llama-gguf-split --merge
        // writes it (so llama.cpp reads it as one file, and a merge-then-prune gives these bytes)
        let kv = h.kv("split.count").unwrap();
        replaced.push(("split.count".into(), Some(Header::encode_uint(kv, 0).map_err(|e| usage(format!("-m {model_arg}: {e}")))?)));
    }
    if opts.drop_nextn {
        replaced.extend(no_mtp_kvs(h, b, &arch, nextn.len() as u64).map_err(|e| usage(format!("-m {model_arg}: --drop-nextn: {e}")))?);
    }
    let named_kvs: Vec<(&str, &[u8])> = h
        .kvs
        .iter()
        .filter_map(|kv| match replaced.iter().find(|(key, _)| *key == kv.key) {
            Some((_, new)) => new.as_deref().map(|n| (kv.key.as_str(), n)),
            None => Some((kv.key.as_str(), &b[kv.raw.clone()])),
        })
        .collect();
    let kvs: Vec<&[u8]> = named_kvs.iter().map(|(_, v)| *v).collect();

    // the imatrix: parsed and planned before anything is written
    let imatrix = match &opts.imatrix {
        None => None,
        Some((path, out)) => {
            let im = open_gguf(path, "--imatrix").map_err(|e| {
                let legacy = std::fs::read(path).map(|b| !b.starts_with(b"GGUF")).unwrap_or(false);
                if legacy {
                    usage(format!(
                        "--imatrix {}: not a GGUF imatrix (the legacy .dat format is not sliced; convert it with `llama-imatrix -m MODEL --in-file OLD.dat -o NEW.gguf`)",
                        path.display()
                    ))
                } else {
                    e
                }
            })?;
            if im.header.string(&im.map, "general.type").as_deref() != Some("imatrix") {
                return Err(usage(format!("--imatrix {}: not an imatrix (general.type is not \"imatrix\")", path.display())));
            }
            let per_expert = |name: &str| if kept_tensor(name) { plan::imatrix_per_expert(name) } else { Ok(None) };
            let mut steps = plan::plan(&im.header, per_expert, &blocks, k, n_expert)
                .map_err(|e| usage(format!("--imatrix {}: {e} (an imatrix of another model?)", path.display())))?;
            steps.retain(|s| kept_tensor(&s.src.name));
            plan::imatrix_fits(&im.header, h, &kept_tensor).map_err(|e| usage(format!("--imatrix {}: {e} (an imatrix of another model?)", path.display())))?;
            Some((im, steps, out))
        }
    };

    let split_plan = match opts.split {
        None => None,
        Some(rule) => Some(plan_shards(opts, rule, &steps, &src, shards.as_ref())?),
    };
    let imatrix_entries_sliced = imatrix.as_ref().map(|(_, steps, _)| steps.iter().filter(|s| s.slice.is_some()).count());
    let report = |bytes_out| PruneReport {
        arch: arch.clone(),
        n_expert,
        k,
        moe_layers: blocks.clone(),
        tensors: steps.len(),
        tensors_sliced: steps.iter().filter(|s| s.slice.is_some()).count(),
        bytes_in: src.map.len() as u64 + shards.as_ref().map_or(0, |s| s.more.iter().map(|(_, m)| m.map.len() as u64).sum()),
        bytes_out,
        imatrix_entries_sliced,
        nextn_dropped: dropped.clone(),
        tensors_dropped,
        other_file_blocks: foreign.clone(),
        mtp_file: mtp_only,
        hash_remapped: hash_remapped.clone(),
        hash_blocks: hash_blocks.clone(),
        shards: split_plan.as_ref().map_or_else(Vec::new, |(_, paths)| paths.clone()),
    };
    if opts.dry_run {
        return Ok(report(0));
    }
    // the model and its imatrix are replaced together: a failed imatrix write must not leave
    // a new model beside an old imatrix of the same name (which would quantize without a word)
    let mut targets: Vec<&Path> = match &split_plan {
        Some((_, paths)) => paths.iter().map(|p| p.as_path()).collect(),
        None => vec![&opts.out],
    };
    let n_model = targets.len();
    targets.extend(imatrix.as_ref().map(|(_, _, out)| out.as_path()));
    let mut bytes_out = 0;
    let more = shards.as_ref().map_or(&[][..], |s| &s.more[..]);
    atomic::replace_together(&targets, |i, tmp| {
        if let (true, Some((of, _))) = (i < n_model, &split_plan) {
            // shard i: its tensors, the first shard's keys or none, the split keys
            let mine: Vec<plan::Step> = steps.iter().zip(of).filter(|(_, &s)| s == i).map(|(st, _)| st.clone()).collect();
            let shard_kvs = split::shard_kvs(&named_kvs, i, n_model, steps.len());
            let refs: Vec<&[u8]> = shard_kvs.iter().map(|v| v.as_slice()).collect();
            bytes_out += write_gguf(tmp, &src, more, &refs, &mine, &keep).with_context(|| format!("writing {}", targets[i].display()))?;
        } else if i == 0 {
            bytes_out = write_gguf(tmp, &src, more, &kvs, &steps, &keep).with_context(|| format!("writing {}", opts.out.display()))?;
        } else if let Some((im, steps, out)) = &imatrix {
            let kvs: Vec<&[u8]> = im.header.kvs.iter().map(|kv| &im.map[kv.raw.clone()]).collect();
            write_gguf(tmp, im, &[], &kvs, steps, &keep).with_context(|| format!("writing {}", out.display()))?;
        }
        Ok(())
    })?;
    Ok(report(bytes_out))
}

/// `--split-max-tensors`, `--split-max-size`: each output tensor's shard, and the shards'
/// paths, each checked as `-o` is (not an input, not existing without `--force`, writable).
fn plan_shards(opts: &PruneOptions, rule: split::SplitRule, steps: &[plan::Step], src: &Source, shards: Option<&Shards>) -> Result<(Vec<usize>, Vec<PathBuf>)> {
    if src.header.alignment != 32 {
        return Err(usage(format!("-m {}: general.alignment {}: llama-gguf-split lays shards out at 32 bytes", opts.model.display(), src.header.alignment)));
    }
    let sizes: Vec<u64> = steps.iter().map(|s| s.out.nbytes()).collect();
    let of = split::assign(rule, &sizes).map_err(usage)?;
    let n = of.last().map_or(1, |&s| s + 1);
    if n > u16::MAX as usize {
        return Err(usage(format!("-o {}: {n} shards; split.count holds at most {}", opts.out.display(), u16::MAX)));
    }
    let paths: Vec<PathBuf> = (0..n).map(|i| split::shard_path(&opts.out, i, n)).collect();
    let mut inputs: Vec<(&str, &Path)> = vec![("-m", &opts.model), ("--keep-map", &opts.keep_map)];
    inputs.extend(shards.iter().flat_map(|s| s.more.iter().map(|(p, _)| ("-m (a shard)", p.as_path()))));
    if let Some((i, o)) = &opts.imatrix {
        inputs.push(("--imatrix", i));
        inputs.push(("--imatrix-out", o));
    }
    for p in &paths {
        if let Some((f, i)) = inputs.iter().find(|(_, i)| atomic::same_file(p, i)) {
            return Err(usage(format!("-o: the shard {} is the same file as {f} {}", p.display(), i.display())));
        }
        if p.exists() && !opts.force {
            return Err(usage(format!("-o: the shard {} already exists (pass --force to replace it)", p.display())));
        }
        atomic::check_writable(p).map_err(|e| usage(format!("-o {e}")))?;
    }
    Ok((of, paths))
}

/// Writes `src` (and a split model's further shards `more`) with the pairs `kvs` and the
/// planned tensors to `tmp` (renamed by the caller).
fn write_gguf(tmp: &Path, src: &Source, more: &[(PathBuf, Source)], kvs: &[&[u8]], steps: &[plan::Step], keep: &[Vec<u16>]) -> Result<u64> {
    let infos: Vec<TensorInfo> = steps.iter().map(|s| s.out.clone()).collect();
    let (header, offsets) = encode_header(src.header.version, kvs, &infos, src.header.alignment);
    let srcs: Vec<(&Mmap, &std::fs::File)> = std::iter::once(src).chain(more.iter().map(|(_, s)| s)).map(|s| (&s.map, &s.file)).collect();
    stream::write(tmp, &srcs, &header, steps, &offsets, keep, src.header.alignment)
}
