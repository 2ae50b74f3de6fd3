//! Which tensors of a GGUF hold one slice per expert, and what each becomes after pruning.
//! Pure functions over a parsed header: no file access.
//!
//! The expert axis is the outermost declared dimension (`ne[2]` of a `[n_in, n_out, n_expert]`
//! weight, `ne[1]` of a `[n, n_expert]` bias or router, `ne[0]` of a `[n_expert]` scale or
//! selection bias), named by the tensor's role, never guessed from sizes: an expert FFN width
//! equal to the expert count is a legal model. Because the expert axis is outermost, each
//! expert's data is one contiguous run of `nbytes / n_expert` bytes made of whole rows, so a
//! quantized block never straddles two experts.

use crate::formats::gguf::{Header, TensorInfo};

/// Per-expert tensors of a model, by the part of the name after `blk.N.`: the expert FFN
/// weights (split and fused) with any suffix (`weight`, `bias`, `scale`, `input_scale`) and
/// the selection biases. The router is per expert by its suffix ([ROUTER_PER_EXPERT]).
pub const MODEL_PER_EXPERT: &[&str] = &["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps", "exp_probs_b", "exp_probs_b_vl"];

/// The router `blk.N.ffn_gate_inp.*`: its weight (a row per expert) and bias are per expert.
const ROUTER: &str = "ffn_gate_inp";
const ROUTER_PER_EXPERT: &[&str] = &["weight", "bias"];
/// ...and Gemma 4's `ffn_gate_inp.scale` is not: it scales the router's input, one value per
/// input column (`[n_embd]`, `src/models/gemma4.cpp` at the pin), and is copied.
const ROUTER_PER_COLUMN: &[&str] = &["scale"];

/// Tables of expert ids (`[n_expert_used, n_vocab]` I32): DeepSeek-V4's hash-routed blocks pick
/// each token's experts by its id from `blk.N.ffn_gate_tid2eid.weight`, not by the router's
/// scores. Pruning renumbers the ids ([remap_expert_ids]).
const EXPERT_ID_TABLES: &[&str] = &["ffn_gate_tid2eid"];

/// Architectures whose blocks may route by such a table (select writes their maps' `stand_in`).
pub const HASH_ROUTED_ARCHS: &[&str] = &["deepseek4"];

/// Names that end like a per-expert tensor but hold one vector for the whole layer.
const NOT_PER_EXPERT: &[&str] = &["ffn_norm_exps"];

/// Per-expert entries of an imatrix: `<weight>.in_sum2` `[n_in, n_expert]` and `<weight>.counts`
/// `[1, n_expert]` of the expert FFN weights (the router's entry is per input column, not per
/// expert, and is copied).
pub const IMATRIX_PER_EXPERT: &[&str] = &["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"];

/// `blk.N.<base>.<rest>` → (N, base, rest); `blk.N.<base>` → (N, base, ""): hy_v3's loader
/// names its selection bias `blk.N.exp_probs_b`, without a suffix.
fn split_block(name: &str) -> Option<(u32, &str, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (n, rest) = rest.split_once('.')?;
    let (base, rest) = rest.split_once('.').unwrap_or((rest, ""));
    Some((n.parse().ok()?, base, rest))
}

/// The block a tensor belongs to (`blk.N.…`), if any.
pub fn block_of(name: &str) -> Option<u32> {
    name.strip_prefix("blk.")?.split_once('.')?.0.parse().ok()
}

/// The nextn/MTP blocks of a model: the last `{arch}.nextn_predict_layers` of `block_count`.
pub fn nextn_blocks(h: &Header, bytes: &[u8], arch: &str) -> Vec<u32> {
    let n = h.uint(bytes, &format!("{arch}.nextn_predict_layers")).unwrap_or(0);
    let total = h.uint(bytes, &format!("{arch}.block_count")).unwrap_or(0);
    (total.saturating_sub(n)..total).map(|b| b as u32).collect()
}

/// The block of a model tensor that holds one slice per expert. An unknown `*_exps` tensor is
/// an error: copying it whole would leave a model llama.cpp cannot load, or loads wrongly.
pub fn model_per_expert(name: &str) -> Result<Option<u32>, String> {
    let Some((n, base, rest)) = split_block(name) else { return Ok(None) };
    if MODEL_PER_EXPERT.contains(&base) {
        return Ok(Some(n));
    }
    if base == ROUTER {
        return match rest {
            _ if ROUTER_PER_EXPERT.contains(&rest) => Ok(Some(n)),
            _ if ROUTER_PER_COLUMN.contains(&rest) => Ok(None),
            _ => Err(format!("tensor {name}: a router tensor prune does not know how to slice (per expert: .weight, .bias; per input column: .scale)")),
        };
    }
    if base.ends_with("_chexps") {
        // GroveMoE's adjugate experts: llama.cpp picks one by expert id / the group size
        // (`n_group_experts`), so renumbering the kept experts would hand tokens another group's
        return Err(format!("tensor {name}: GroveMoE's adjugate experts, picked by expert id / group size; pruning renumbers the experts and would break that mapping"));
    }
    if base.ends_with("_exps") && !NOT_PER_EXPERT.contains(&base) {
        return Err(format!("tensor {name}: a per-expert tensor prune does not know how to slice"));
    }
    Ok(None)
}

/// The block of a model tensor that is a table of expert ids ([EXPERT_ID_TABLES]).
pub fn expert_id_table(name: &str) -> Option<u32> {
    let (n, base, rest) = split_block(name)?;
    (EXPERT_ID_TABLES.contains(&base) && rest == "weight").then_some(n)
}

/// Why a table of expert ids cannot be pruned as the keep map asks: the table names experts
/// the map drops.
#[derive(Clone, Debug, PartialEq)]
pub struct DroppedIds {
    /// the distinct experts the table names (of the model's n_expert)
    pub named: usize,
    /// the entries (token × slot) that name a dropped expert, and the tokens with one
    pub entries: usize,
    pub tokens: usize,
    /// the dropped experts the table names, ascending
    pub experts: Vec<u32>,
    /// the first such entry: (token id, slot, expert)
    pub first: (usize, usize, u32),
}

/// `--hash-remap`'s rule for one token's row of a hash-routed block: each entry naming a
/// dropped expert (not `kept`), slot by slot, becomes the first expert of `stand_in` (the kept
/// experts in the keep map's stand-in order) that the row does not name yet. `replay
/// --hash-remap` routes by the same rule as `prune --hash-remap` writes the table. Returns the
/// entries changed.
pub fn hash_remap_row(row: &mut [u16], kept: impl Fn(u16) -> bool, stand_in: &[u16]) -> usize {
    let mut changed = 0;
    for slot in 0..row.len() {
        if kept(row[slot]) {
            continue;
        }
        // stand_in holds K ≥ the row's width kept experts, so one is free whenever K ≥ k
        if let Some(&e) = stand_in.iter().find(|e| !row.contains(e)) {
            row[slot] = e;
            changed += 1;
        }
    }
    changed
}

/// An expert-id table (`data`: `ne[0]` I32 ids per token, tokens along `ne[1]`) with each id
/// renumbered to its position among the kept experts (`keep`, ascending), as the sliced
/// expert tensors number them. An id outside `0..n_expert` is a broken model (Err(Err)).
/// Ids of dropped experts leave the token without an expert to go to (Err(Ok)), unless
/// `remap` gives the kept experts in stand-in order (`prune --hash-remap`): then each such entry,
/// slot by slot, names the first of them its token's row does not name yet (so a row never
/// names an expert twice), and the Ok's second part says what was sent elsewhere.
pub fn remap_expert_ids(
    t: &TensorInfo,
    data: &[u8],
    keep: &[u16],
    n_expert: u64,
    remap: Option<&[u16]>,
) -> Result<(Vec<u8>, Option<DroppedIds>), Result<DroppedIds, String>> {
    if t.ggml_type != crate::llama::sys::GGML_TYPE_I32 {
        return Err(Err(format!("tensor {}: a table of expert ids of type {} (the pin's loader reads I32)", t.name, t.ggml_type)));
    }
    let width = t.ne.first().copied().unwrap_or(1).max(1) as usize;
    if data.len() as u64 != t.nbytes() {
        return Err(Err(format!("tensor {}: {} bytes of data for shape {:?}", t.name, data.len(), t.ne)));
    }
    let mut new_id = vec![-1i32; n_expert as usize];
    for (i, &e) in keep.iter().enumerate() {
        new_id[e as usize] = i as i32;
    }
    let mut ids: Vec<i32> = data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
    let mut named = vec![false; n_expert as usize];
    let (mut entries, mut tokens, mut experts, mut first) = (0, 0, Vec::new(), None);
    for (tok, row) in ids.chunks_mut(width).enumerate() {
        let mut token_has = false;
        for (slot, &id) in row.iter().enumerate() {
            if id < 0 || id as u64 >= n_expert {
                return Err(Err(format!("tensor {}: token {tok} names expert {id}, outside 0..{n_expert}", t.name)));
            }
            named[id as usize] = true;
            if new_id[id as usize] >= 0 {
                continue;
            }
            entries += 1;
            token_has = true;
            experts.push(id as u32);
            first.get_or_insert((tok, slot, id as u32));
        }
        tokens += usize::from(token_has);
        if let (true, Some(order)) = (token_has, remap) {
            let mut r: Vec<u16> = row.iter().map(|&e| e as u16).collect();
            hash_remap_row(&mut r, |e| new_id[e as usize] >= 0, order);
            row.iter_mut().zip(r).for_each(|(x, e)| *x = e as i32);
        }
    }
    let dropped = first.map(|first| {
        experts.sort_unstable();
        experts.dedup();
        DroppedIds { named: named.iter().filter(|&&n| n).count(), entries, tokens, experts, first }
    });
    if let (Some(d), None) = (&dropped, remap) {
        return Err(Ok(d.clone()));
    }
    let out = ids.iter().flat_map(|&id| new_id[id as usize].to_le_bytes()).collect();
    Ok((out, dropped))
}

/// The block of an imatrix entry that holds one slice per expert.
pub fn imatrix_per_expert(name: &str) -> Result<Option<u32>, String> {
    let Some((n, base, rest)) = split_block(name) else { return Ok(None) };
    let entry = rest.ends_with(".in_sum2") || rest.ends_with(".counts");
    Ok((entry && IMATRIX_PER_EXPERT.contains(&base)).then_some(n))
}

/// Whether an imatrix was collected on this model: each `<weight>.in_sum2` names a tensor of
/// the model and holds `ne[0] × ne[2]` sums, as `llama-quantize` requires of the pruned pair
/// (its only check). A per-expert entry, which prune slices, must be `[ne[0], ne[2]]`: one
/// matrix of sums per expert. Others need not be: upstream stores a 3-D weight that is not
/// per expert (deepseek2's per-head `attn_k_b` [16, 32, 4]) as `[64, 1]`, one count in all.
/// Entries `kept` refuses (a dropped nextn block's, the other file's) are not checked.
pub fn imatrix_fits(im: &Header, model: &Header, kept: &dyn Fn(&str) -> bool) -> Result<(), String> {
    for t in &im.tensors {
        let Some(weight) = t.name.strip_suffix(".in_sum2") else { continue };
        if !kept(weight) {
            continue;
        }
        let m = model.tensors.iter().find(|m| m.name == weight).ok_or_else(|| format!("entry {}: the model has no tensor {weight}", t.name))?;
        let want = (m.ne[0], m.ne.get(2).copied().unwrap_or(1));
        let got = (t.ne[0], t.ne.get(1).copied().unwrap_or(1));
        let per_expert = imatrix_per_expert(&t.name)?.is_some();
        if (per_expert && got != want) || got.0 * got.1 != want.0 * want.1 {
            return Err(format!(
                "entry {}: sums for {} columns × {} matrices, but the model's {weight} has shape {:?} ({} × {})",
                t.name, got.0, got.1, m.ne, want.0, want.1
            ));
        }
    }
    Ok(())
}

/// Blocks with a router (`blk.N.ffn_gate_inp.weight`): the MoE layers, ascending.
pub fn moe_blocks(h: &Header) -> Vec<u32> {
    let mut v: Vec<u32> = h
        .tensors
        .iter()
        .filter_map(|t| split_block(&t.name).filter(|(_, base, rest)| *base == "ffn_gate_inp" && *rest == "weight").map(|(n, _, _)| n))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// One tensor of the output.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// the source tensor, its offset made absolute (file offset in its shard)
    pub src_start: u64,
    /// the shard of a split model holding it (0: the first, or the only file)
    pub shard: usize,
    pub src: TensorInfo,
    /// the output tensor's info (offset filled in by the header encoder)
    pub out: TensorInfo,
    /// per-expert: (index of the MoE layer in the keep map, bytes per expert)
    pub slice: Option<(usize, u64)>,
    /// the output data, where it is not a copy of the source's (a renumbered expert-id table)
    pub data: Option<Vec<u8>>,
}

/// The output tensors, in source order. `per_expert` names the per-expert tensors' blocks;
/// `blocks` are the MoE layers in keep-map order; every per-expert tensor must have
/// `n_expert` along its outermost dimension.
pub fn plan(
    h: &Header,
    per_expert: impl Fn(&str) -> Result<Option<u32>, String>,
    blocks: &[u32],
    k: usize,
    n_expert: u64,
) -> Result<Vec<Step>, String> {
    let mut steps = Vec::with_capacity(h.tensors.len());
    for t in &h.tensors {
        let src_start = h.data_start + t.offset;
        let Some(block) = per_expert(&t.name)? else {
            steps.push(Step { src_start, shard: 0, src: t.clone(), out: t.clone(), slice: None, data: None });
            continue;
        };
        let slot = blocks
            .iter()
            .position(|&b| b == block)
            .ok_or_else(|| format!("tensor {}: per-expert, but block {block} has no router (blk.{block}.ffn_gate_inp.weight)", t.name))?;
        let axis = t.ne.len() - 1;
        if t.ne[axis] != n_expert {
            return Err(format!(
                "tensor {}: shape {:?} has {} along its expert axis (ne[{axis}], the outermost), not the model's expert_count {n_expert}",
                t.name, t.ne, t.ne[axis]
            ));
        }
        let nbytes = t.nbytes();
        if nbytes % n_expert != 0 {
            return Err(format!("tensor {}: {nbytes} bytes do not split into {n_expert} experts", t.name));
        }
        let mut out = t.clone();
        out.ne[axis] = k as u64;
        steps.push(Step { src_start, shard: 0, src: t.clone(), out, slice: Some((slot, nbytes / n_expert)), data: None });
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::gguf::encode_header;
    use crate::llama::sys;

    fn info(name: &str, ne: &[u64], ty: u32) -> TensorInfo {
        TensorInfo { name: name.into(), ne: ne.to_vec(), ggml_type: ty, offset: 0 }
    }

    /// Biases, scales, the router's bias and a selection bias are sliced along their outermost
    /// axis like the weights; a 2-D bias whose width equals the expert count is still sliced
    /// along ne[1]; shared-expert tensors are copied.
    #[test]
    fn every_per_expert_shape_is_sliced_along_its_outermost_axis() {
        let (f32_, q8) = (sys::GGML_TYPE_F32, sys::GGML_TYPE_Q8_0);
        let tensors = vec![
            info("blk.1.ffn_gate_inp.weight", &[64, 8], f32_),
            info("blk.1.ffn_gate_inp.bias", &[8], f32_),
            info("blk.1.exp_probs_b.bias", &[8], f32_),
            info("blk.1.ffn_gate_exps.weight", &[64, 8, 8], q8),
            info("blk.1.ffn_gate_exps.bias", &[8, 8], f32_),
            info("blk.1.ffn_down_exps.scale", &[8], f32_),
            info("blk.1.ffn_down_shexp.weight", &[8, 64], f32_),
            // Gemma 4's router input scale: one per input column, not per expert
            info("blk.1.ffn_gate_inp.scale", &[64], f32_),
        ];
        let (head, _) = encode_header(3, &[], &tensors, 32);
        let size: u64 = tensors.iter().map(|t| crate::formats::gguf::pad(t.nbytes(), 32)).sum();
        let mut file = head;
        file.resize(file.len() + size as usize, 0);
        let h = Header::parse(&file).unwrap();
        assert_eq!(moe_blocks(&h), vec![1]);
        let steps = plan(&h, model_per_expert, &[1], 3, 8).unwrap();
        let got: Vec<(Vec<u64>, Option<(usize, u64)>)> = steps.iter().map(|s| (s.out.ne.clone(), s.slice)).collect();
        assert_eq!(
            got,
            vec![
                (vec![64, 3], Some((0, 64 * 4))),
                (vec![3], Some((0, 4))),
                (vec![3], Some((0, 4))),
                (vec![64, 8, 3], Some((0, 8 * 2 * 34))),
                (vec![8, 3], Some((0, 8 * 4))),
                (vec![3], Some((0, 4))),
                (vec![8, 64], None),
                (vec![64], None),
            ]
        );
        // a per-expert tensor with another expert count, or in a block without a router
        let e = plan(&h, model_per_expert, &[1], 3, 16).unwrap_err();
        assert!(e.contains("not the model's expert_count 16"), "{e}");
        let e = plan(&h, model_per_expert, &[2], 3, 8).unwrap_err();
        assert!(e.contains("block 1 has no router"), "{e}");
    }

    #[test]
    fn an_imatrix_must_name_the_models_tensors_with_their_widths() {
        let f32_ = sys::GGML_TYPE_F32;
        let header = |tensors: &[TensorInfo]| {
            let (head, _) = encode_header(3, &[], tensors, 32);
            let size: u64 = tensors.iter().map(|t| crate::formats::gguf::pad(t.nbytes(), 32)).sum();
            let mut file = head;
            file.resize(file.len() + size as usize, 0);
            file
        };
        let model = header(&[info("blk.0.ffn_down_exps.weight", &[16, 64, 8], f32_), info("blk.0.attn_q.weight", &[64, 64], f32_)]);
        let model = Header::parse(&model).unwrap();
        let im = |down: &[u64], q: &[u64]| header(&[info("blk.0.ffn_down_exps.weight.in_sum2", down, f32_), info("blk.0.attn_q.weight.in_sum2", q, f32_)]);
        assert_eq!(imatrix_fits(&Header::parse(&im(&[16, 8], &[64, 1])).unwrap(), &model, &|_| true), Ok(()));
        let e = imatrix_fits(&Header::parse(&im(&[32, 8], &[64, 1])).unwrap(), &model, &|_| true).unwrap_err();
        assert!(e.contains("blk.0.ffn_down_exps.weight.in_sum2: sums for 32 columns × 8 matrices") && e.contains("(16 × 8)"), "{e}");
        let e = imatrix_fits(&Header::parse(&im(&[16, 8], &[128, 1])).unwrap(), &model, &|_| true).unwrap_err();
        assert!(e.contains("attn_q.weight.in_sum2: sums for 128 columns"), "{e}");
        let other = header(&[info("blk.9.attn_q.weight.in_sum2", &[64, 1], f32_)]);
        let e = imatrix_fits(&Header::parse(&other).unwrap(), &model, &|_| true).unwrap_err();
        assert!(e.contains("the model has no tensor blk.9.attn_q.weight"), "{e}");
        // an entry of a block the file does not hold by design (the MTP file's) is not its to fit
        assert_eq!(imatrix_fits(&Header::parse(&other).unwrap(), &model, &|n| !n.starts_with("blk.9.")), Ok(()));
        // a 3-D weight that is not per expert (deepseek2's per-head attn_k_b [16, 32, 4]):
        // upstream writes its 16 × 4 sums as [64, 1], which llama-quantize takes (it checks the
        // size only); per expert, [128, 1] of the same size is refused (prune slices by matrix)
        let mla = Header::parse(&header(&[info("blk.0.attn_k_b.weight", &[16, 32, 4], f32_), info("blk.0.ffn_down_exps.weight", &[16, 64, 8], f32_)])).unwrap();
        let im = |kb: &[u64], down: &[u64]| Header::parse(&header(&[info("blk.0.attn_k_b.weight.in_sum2", kb, f32_), info("blk.0.ffn_down_exps.weight.in_sum2", down, f32_)])).unwrap();
        assert_eq!(imatrix_fits(&im(&[64, 1], &[16, 8]), &mla, &|_| true), Ok(()));
        assert_eq!(imatrix_fits(&im(&[16, 4], &[16, 8]), &mla, &|_| true), Ok(()));
        let e = imatrix_fits(&im(&[48, 1], &[16, 8]), &mla, &|_| true).unwrap_err();
        assert!(e.contains("attn_k_b.weight.in_sum2: sums for 48 columns × 1 matrices") && e.contains("(16 × 4)"), "{e}");
        let e = imatrix_fits(&im(&[64, 1], &[128, 1]), &mla, &|_| true).unwrap_err();
        assert!(e.contains("ffn_down_exps.weight.in_sum2: sums for 128 columns × 1 matrices"), "{e}");
    }

    fn table(ids: &[[i32; 2]]) -> (TensorInfo, Vec<u8>) {
        let data: Vec<u8> = ids.iter().flatten().flat_map(|i| i.to_le_bytes()).collect();
        (info("blk.0.ffn_gate_tid2eid.weight", &[2, ids.len() as u64], sys::GGML_TYPE_I32), data)
    }

    /// Each id becomes the kept expert's position in the ascending keep list (written out by
    /// hand here); an id of a dropped expert is reported with what it affects.
    #[test]
    fn expert_id_tables_are_renumbered_or_refused() {
        let keep = [1u16, 3, 4, 6];
        let (t, d) = table(&[[1, 3], [4, 6], [6, 1]]);
        let i32s = |b: &[u8]| -> Vec<i32> { b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect() };
        let (out, none) = remap_expert_ids(&t, &d, &keep, 8, None).unwrap();
        assert_eq!((i32s(&out), none), (vec![0, 1, 2, 3, 3, 0], None));
        let (t, d) = table(&[[1, 2], [0, 3], [4, 6], [2, 2]]);
        let e = remap_expert_ids(&t, &d, &keep, 8, None).unwrap_err().unwrap();
        assert_eq!(e, DroppedIds { named: 6, entries: 4, tokens: 3, experts: vec![0, 2], first: (0, 1, 2) });
        // --hash-remap, stand-ins 4, 1, 6, 3: a dropped entry takes the first the row lacks (by hand:
        // [1,2]→[1,4], [0,3]→[4,3], [2,2]→[4,1], [0,4]→[1,4]), then ids are renumbered
        let (t, d) = table(&[[1, 2], [0, 3], [4, 6], [2, 2], [0, 4]]);
        let (out, moved) = remap_expert_ids(&t, &d, &keep, 8, Some(&[4, 1, 6, 3])).unwrap();
        assert_eq!(i32s(&out), vec![0, 2, 2, 1, 2, 3, 2, 0, 0, 2]);
        assert_eq!(moved, Some(DroppedIds { named: 6, entries: 5, tokens: 4, experts: vec![0, 2], first: (0, 1, 2) }));
        let (t, d) = table(&[[1, 8]]);
        assert!(remap_expert_ids(&t, &d, &keep, 8, None).unwrap_err().unwrap_err().contains("token 0 names expert 8, outside 0..8"));
        let (t, d) = table(&[[1, -1]]);
        assert!(remap_expert_ids(&t, &d, &keep, 8, None).unwrap_err().unwrap_err().contains("names expert -1"));
        let (mut t, d) = table(&[[1, 3]]);
        t.ggml_type = sys::GGML_TYPE_F32;
        assert!(remap_expert_ids(&t, &d, &keep, 8, None).unwrap_err().unwrap_err().contains("I32"));
    }

    #[test]
    fn per_expert_names_are_recognised_by_role() {
        assert_eq!(model_per_expert("blk.3.ffn_down_exps.weight"), Ok(Some(3)));
        assert_eq!(model_per_expert("blk.3.ffn_gate_up_exps.weight"), Ok(Some(3)));
        assert_eq!(model_per_expert("blk.0.ffn_up_exps.bias"), Ok(Some(0)));
        assert_eq!(model_per_expert("blk.0.ffn_up_exps.scale"), Ok(Some(0)));
        assert_eq!(model_per_expert("blk.12.ffn_gate_inp.weight"), Ok(Some(12)));
        assert_eq!(model_per_expert("blk.12.ffn_gate_inp.bias"), Ok(Some(12)));
        assert_eq!(model_per_expert("blk.1.exp_probs_b.bias"), Ok(Some(1)));
        // hy_v3's, without a suffix
        assert_eq!(model_per_expert("blk.2.exp_probs_b"), Ok(Some(2)));
        assert_eq!(model_per_expert("blk.2.ffn_norm"), Ok(None));
        // shared experts, their gate and layer-wide norms are not per expert
        assert_eq!(model_per_expert("blk.1.ffn_gate_inp_shexp.weight"), Ok(None));
        assert_eq!(model_per_expert("blk.1.ffn_down_shexp.weight"), Ok(None));
        assert_eq!(model_per_expert("blk.1.ffn_norm_exps.weight"), Ok(None));
        assert_eq!(model_per_expert("token_embd.weight"), Ok(None));
        assert!(model_per_expert("blk.1.ffn_other_exps.weight").is_err());
        assert!(model_per_expert("blk.1.ffn_gate_chexps.weight").unwrap_err().contains("GroveMoE"));
        // Gemma 4's router input scale is per input column; an unknown router tensor is refused
        assert_eq!(model_per_expert("blk.1.ffn_gate_inp.scale"), Ok(None));
        assert!(model_per_expert("blk.1.ffn_gate_inp.other").unwrap_err().contains("router tensor"));
        // DeepSeek-V4's expert-id table is renumbered, not sliced
        assert_eq!(model_per_expert("blk.0.ffn_gate_tid2eid.weight"), Ok(None));
        assert_eq!(expert_id_table("blk.0.ffn_gate_tid2eid.weight"), Some(0));
        assert_eq!(expert_id_table("blk.0.ffn_gate_inp.weight"), None);
        assert_eq!(imatrix_per_expert("blk.2.ffn_down_exps.weight.in_sum2"), Ok(Some(2)));
        assert_eq!(imatrix_per_expert("blk.2.ffn_gate_exps.weight.counts"), Ok(Some(2)));
        assert_eq!(imatrix_per_expert("blk.2.ffn_gate_inp.weight.in_sum2"), Ok(None));
        assert_eq!(imatrix_per_expert("blk.2.ffn_down_shexp.weight.counts"), Ok(None));
    }
}
