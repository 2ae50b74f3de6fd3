//! Replay tests: hand-checked cases per policy, closed forms, and an independent naive
//! simulator (eager decay of every expert, linear scans, brute-force next use) that every
//! fast policy must match exactly.

use super::engine::NONE;
use super::*;
use super::keep::picks_off_candidates;
use crate::formats::trace::{RowData, TraceFile, TraceHeader, FLAG_NORMALISED};

/// One token: per layer the picks and the candidates (ids, probs), best first.
#[derive(Clone)]
struct Tok {
    sel: Vec<Vec<u16>>,
    cand: Vec<Vec<u16>>,
    prob: Vec<Vec<f32>>,
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("reap-replay-unit-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn write_trace(name: &str, n_expert: u32, k: u32, top_n: u32, toks: &[Tok]) -> PathBuf {
    let nl = toks[0].sel.len();
    let h = TraceHeader { layers: (0..nl as u32).collect(), n_expert, k, top_n, n_tokens: 0, flags: FLAG_NORMALISED };
    let p = tmp(name);
    let layout = h.layout();
    let mut f = TraceFile::create(&p, h).unwrap();
    let mut buf = Vec::new();
    for (t, x) in toks.iter().enumerate() {
        let sel: Vec<u16> = x.sel.concat();
        let w: Vec<f32> = vec![1.0 / k as f32; sel.len()];
        let cand: Vec<u16> = x.cand.concat();
        let prob: Vec<f32> = x.prob.concat();
        assert_eq!(sel.len(), nl * k as usize);
        assert_eq!(cand.len(), nl * top_n as usize);
        layout.encode(
            &RowData { chunk: 0, pos: t as u32, token: 0, phase: 0, sel_weight: &w, cand_prob: &prob, sel_id: &sel, cand_id: &cand },
            &mut buf,
        );
    }
    f.append(&buf, toks.len() as u64).unwrap();
    f.publish().unwrap();
    p
}

/// One layer, k = 1, top-N 1: the candidate is the pick, with probability `p`.
fn single(seq: &[u16], probs: Option<&[f32]>) -> Vec<Tok> {
    seq.iter()
        .enumerate()
        .map(|(i, &e)| Tok { sel: vec![vec![e]], cand: vec![vec![e]], prob: vec![vec![probs.map_or(1.0, |p| p[i])]] })
        .collect()
}

fn misses(path: &Path, policy: Policy, cap: usize, decay: f64) -> (u64, u64) {
    let tr = TraceReader::open(path).unwrap();
    let caps = vec![vec![cap; tr.header.n_layers()]];
    let (o, f) = simulate(&tr, 0..tr.n_rows, None, &[policy], &caps, decay, 48, 1.0).unwrap();
    assert_eq!(f.forced.iter().sum::<u64>(), 0);
    (o[0].hits.iter().sum(), o[0].misses.iter().sum())
}

#[test]
fn cyclic_pattern_lru_misses_everything_and_belady_has_its_closed_form() {
    for c in [1usize, 2, 3, 7] {
        let t_len = 50 * (c + 1) + 3;
        let seq: Vec<u16> = (0..t_len).map(|t| (t % (c + 1)) as u16).collect();
        let p = write_trace(&format!("cyc{c}"), c as u32 + 1, 1, 1, &single(&seq, None));
        assert_eq!(misses(&p, Policy::Lru, c, 0.99), (0, t_len as u64), "LRU, C = {c}");
        // MIN: C cold misses, then one miss every C accesses
        let belady = c + (t_len - c).div_ceil(c);
        assert_eq!(misses(&p, Policy::Belady, c, 0.99).1, belady as u64, "Belady, C = {c}");
    }
}

#[test]
fn hand_checked_cases() {
    // LRU, C = 2: 0m 1m 0h 2m(evict 1) 1m(evict 0) 0m(evict 2)
    let p = write_trace("lru", 4, 1, 1, &single(&[0, 1, 0, 2, 1, 0], None));
    assert_eq!(misses(&p, Policy::Lru, 2, 0.99), (1, 5));
    // LFU, same: t3 evicts 1 (1 use vs 0's 2); t4: 1 now has 2 uses, 2 has 1 → evict 2; t5 hit
    assert_eq!(misses(&p, Policy::Lfu, 2, 0.99), (2, 4));

    // EMA, C = 2, picks 0 0 0 1 2 0. d = 0.9: at t4 s0 = 2.195, s1 = 0.9 → evict 1; t5 hits.
    // d = 0.5: at t4 s0 = 0.4375 < s1 = 0.5 → evict 0; t5 misses. LRU evicts 0 too.
    let p = write_trace("ema", 4, 1, 1, &single(&[0, 0, 0, 1, 2, 0], None));
    assert_eq!(misses(&p, Policy::Ema, 2, 0.9), (3, 3));
    assert_eq!(misses(&p, Policy::Ema, 2, 0.5), (2, 4));
    assert_eq!(misses(&p, Policy::Lru, 2, 0.9), (2, 4));

    // inverse-router-ema, C = 2, d = 0.9, picks 0 1 2 0 with router p .9 .1 .5 .9:
    // t2: s0 = .9·.81 = .729, s1 = .1·.9 = .09 → evict 1; t3 hits. Plain ema evicts 0 (0.81 < 0.9).
    let p = write_trace("ir", 4, 1, 1, &single(&[0, 1, 2, 0], Some(&[0.9, 0.1, 0.5, 0.9])));
    assert_eq!(misses(&p, Policy::InverseRouterEma, 2, 0.9), (1, 3));
    assert_eq!(misses(&p, Policy::Ema, 2, 0.9), (0, 4));

    // near-pick-ema, C = 2, d = 0.5, w = 1, picks 0 1 0 2 1 with runners-up 1 2 1 1 0 (equal p,
    // credit 1): at t3 s0 = .625, s1 = 1.875 → evict 0 and t4 hits; plain ema evicts 1 (.25 < .625).
    let toks: Vec<Tok> = [(0u16, 1u16), (1, 2), (0, 1), (2, 1), (1, 0)]
        .iter()
        .map(|&(e, r)| Tok { sel: vec![vec![e]], cand: vec![vec![e, r]], prob: vec![vec![0.4, 0.4]] })
        .collect();
    let p = write_trace("np", 4, 1, 2, &toks);
    assert_eq!(misses(&p, Policy::NearPickEma, 2, 0.5), (2, 3));
    assert_eq!(misses(&p, Policy::Ema, 2, 0.5), (1, 4));

    // Belady, C = 2, picks 0 1 2 0 1 3 0: t2 evicts 1 (next 4 vs 0's 3); t4 evicts 2 (never);
    // t5 evicts 1 (never) → misses at t0 t1 t2 t4 t5. LRU misses all 7.
    let p = write_trace("bel", 4, 1, 1, &single(&[0, 1, 2, 0, 1, 3, 0], None));
    assert_eq!(misses(&p, Policy::Belady, 2, 0.99), (2, 5));
    assert_eq!(misses(&p, Policy::Lru, 2, 0.99), (0, 7));
}

#[test]
fn a_token_never_evicts_its_own_picks() {
    // k = 2, C = 2: token 1 picks (2, 0); 0 is resident and must stay, so 1 is evicted
    let toks: Vec<Tok> =
        [[0u16, 1], [2, 0]].iter().map(|s| Tok { sel: vec![s.to_vec()], cand: vec![s.to_vec()], prob: vec![vec![0.5, 0.5]] }).collect();
    let p = write_trace("pin", 4, 2, 2, &toks);
    for pol in [Policy::Lru, Policy::Lfu, Policy::Ema, Policy::NearPickEma, Policy::InverseRouterEma, Policy::Belady] {
        assert_eq!(misses(&p, pol, 2, 0.9), (1, 3), "{pol:?}");
    }
}

#[test]
fn keep_map_reroutes_and_counts_forced_misses() {
    // k = 2, top-N 3; the map keeps {0, 3}: token 0 (cands 0 1 2) keeps only 0 → 1 forced miss;
    // token 1 (cands 1 3 0) → picks 3, 0; token 2 (cands 1 2 0) → 0 + 1 forced.
    let toks: Vec<Tok> = [[0u16, 1, 2], [1, 3, 0], [1, 2, 0]]
        .iter()
        .map(|c| Tok { sel: vec![c[..2].to_vec()], cand: vec![c.to_vec()], prob: vec![vec![0.5, 0.3, 0.2]] })
        .collect();
    let p = write_trace("keep", 4, 2, 3, &toks);
    let tr = TraceReader::open(&p).unwrap();
    let keep = vec![true, false, false, true];
    let (o, f) = simulate(&tr, 0..3, Some(Keep::from(&keep[..])), &[Policy::Lru, Policy::Belady], &[vec![2]], 0.99, 48, 1.0).unwrap();
    assert_eq!(f.forced, vec![2]);
    assert_eq!(f.tokens_short, vec![2]);
    for x in &o {
        // fetched: 0 (miss), 3 (miss), 0 (hit), 0 (hit)
        assert_eq!((x.hits[0], x.misses[0]), (2, 2), "{}", x.policy);
    }
}

#[test]
fn token_ranges_replay_only_those_rows() {
    let p = write_trace("range", 4, 1, 1, &single(&[0, 1, 2, 3, 0, 1, 2, 3], None));
    let tr = TraceReader::open(&p).unwrap();
    let (o, _) = simulate(&tr, 4..8, None, &[Policy::Lru], &[vec![4]], 0.99, 48, 1.0).unwrap();
    assert_eq!((o[0].hits[0], o[0].misses[0]), (0, 4));
    let (o, _) = simulate(&tr, 0..8, None, &[Policy::Lru], &[vec![4]], 0.99, 48, 1.0).unwrap();
    assert_eq!((o[0].hits[0], o[0].misses[0]), (4, 4));
    assert_eq!(parse_range("2..5", 8).unwrap(), 2..5);
    assert_eq!(parse_range("3..", 8).unwrap(), 3..8);
    assert_eq!(parse_range("..2", 8).unwrap(), 0..2);
    assert!(parse_range("5..9", 8).is_err());
    assert!(parse_range("5..5", 8).is_err());
    assert!(parse_range("x", 8).is_err());
}

// ---------------------------------------------------------------- the naive reference

/// Everything one naive simulation needs.
struct Naive<'a> {
    policy: Policy,
    decay: f64,
    near_n: usize,
    near_w: f64,
    keep: Option<&'a [bool]>,
}

fn naive_route(tr: &TraceReader, t: u64, li: usize, keep: Option<&[bool]>) -> Vec<u16> {
    let row = tr.row(t);
    let (ne, k) = (tr.header.n_expert as usize, tr.header.k as usize);
    match keep {
        None => row.sel_ids(li).to_vec(),
        Some(f) => row.cand_ids(li).iter().copied().filter(|&e| f[li * ne + e as usize]).take(k).collect(),
    }
}

/// (hits, misses) per layer, the documented semantics implemented the slow, obvious way.
fn naive(tr: &TraceReader, rows: Range<u64>, cap: usize, n: &Naive) -> (Vec<u64>, Vec<u64>) {
    let h = &tr.header;
    let (nl, ne, k) = (h.n_layers(), h.n_expert as usize, h.k as usize);
    let mut hits = vec![0u64; nl];
    let mut misses = vec![0u64; nl];
    // routed picks of every replayed token, for Belady's brute-force next use
    let routed: Vec<Vec<Vec<u16>>> = rows.clone().map(|t| (0..nl).map(|li| naive_route(tr, t, li, n.keep)).collect()).collect();
    let mut score = vec![vec![0f64; ne]; nl];
    let mut freq = vec![vec![0u64; ne]; nl];
    let mut last = vec![vec![0u64; ne]; nl];
    let mut resident: Vec<Vec<usize>> = vec![Vec::new(); nl];
    for (ti, t) in rows.clone().enumerate() {
        let row = tr.row(t);
        for li in 0..nl {
            let picks = &routed[ti][li];
            let (cid, cp) = (row.cand_ids(li), row.cand_probs(li));
            let prob = |e: u16| cid.iter().position(|&c| c == e).map(|r| cp[r]);
            // eager decay of every expert, then this token's credits
            for s in score[li].iter_mut() {
                *s *= n.decay;
            }
            for (j, &e) in picks.iter().enumerate() {
                let e = e as usize;
                freq[li][e] += 1;
                last[li][e] = ti as u64 * k as u64 + j as u64 + 1;
                score[li][e] += match n.policy {
                    Policy::InverseRouterEma => {
                        let p = prob(e as u16).unwrap_or(*cp.last().unwrap()) as f64;
                        if p > 0.0 {
                            p
                        } else {
                            0.0
                        }
                    }
                    _ => 1.0,
                };
            }
            if n.policy == Policy::NearPickEma {
                let p_min = picks.iter().filter_map(|&e| prob(e)).map(|p| p as f64).fold(f64::INFINITY, f64::min);
                for r in 0..n.near_n.min(cid.len()) {
                    let e = cid[r];
                    if picks.contains(&e) || n.keep.is_some_and(|f| !f[li * ne + e as usize]) {
                        continue;
                    }
                    // w · min(1, p / p_min), rounded as the fast path computes it
                    let c = if p_min > 0.0 && p_min.is_finite() { (cp[r] as f64 * (n.near_w / p_min)).min(n.near_w) } else { n.near_w };
                    if c > 0.0 {
                        score[li][e as usize] += c;
                    }
                }
            }
            let next_use =
                |e: usize| -> u64 { (ti + 1..routed.len()).find(|&u| routed[u][li].contains(&(e as u16))).map_or(u64::MAX, |u| u as u64) };
            for &e in picks {
                let e = e as usize;
                if resident[li].contains(&e) {
                    hits[li] += 1;
                    continue;
                }
                misses[li] += 1;
                if resident[li].len() == cap {
                    let cands: Vec<usize> = resident[li].iter().copied().filter(|r| !picks.contains(&(*r as u16))).collect();
                    let victim = match n.policy {
                        Policy::Lru => *cands.iter().min_by_key(|&&r| last[li][r]).unwrap(),
                        Policy::Lfu => *cands.iter().min_by_key(|&&r| (freq[li][r], last[li][r])).unwrap(),
                        Policy::Belady => *cands.iter().min_by_key(|&&r| (u64::MAX - next_use(r), r)).unwrap(),
                        _ => *cands
                            .iter()
                            .min_by(|&&a, &&b| score[li][a].partial_cmp(&score[li][b]).unwrap().then(last[li][a].cmp(&last[li][b])))
                            .unwrap(),
                    };
                    resident[li].retain(|&r| r != victim);
                }
                resident[li].push(e);
            }
        }
    }
    (hits, misses)
}

const ALL: [Policy; 6] = [Policy::Lru, Policy::Lfu, Policy::Ema, Policy::NearPickEma, Policy::InverseRouterEma, Policy::Belady];

fn compare_with_naive(tr: &TraceReader, rows: Range<u64>, keep: Option<&[bool]>, caps: &[usize], decay: f64) {
    let nl = tr.header.n_layers();
    let cap_l: Vec<Vec<usize>> = caps.iter().map(|&c| vec![c; nl]).collect();
    let (out, _) = simulate(tr, rows.clone(), keep.map(Keep::from), &ALL, &cap_l, decay, 4, 0.7).unwrap();
    for o in &out {
        let policy = *ALL.iter().find(|p| p.name() == o.policy).unwrap();
        let n = Naive { policy, decay, near_n: 4, near_w: 0.7, keep };
        let (h, m) = naive(tr, rows.clone(), caps[o.capacity], &n);
        assert_eq!((&o.hits, &o.misses), (&h, &m), "{} C={} d={decay} keep={}", o.policy, caps[o.capacity], keep.is_some());
    }
}

#[test]
fn every_policy_matches_the_naive_reference_and_lazy_decay_matches_eager_exactly() {
    let p = tmp("synthetic.trace");
    synthetic::write(&p, &synthetic::Spec { tokens: 3000, layers: 2, experts: 12, k: 2, top_n: 6, seed: 7 }).unwrap();
    let tr = TraceReader::open(&p).unwrap();
    for decay in [0.5, 0.9, 0.99] {
        compare_with_naive(&tr, 0..3000, None, &[2, 3, 5, 12], decay);
    }
    // the trace makes the caches work: at C = 3 every policy misses well beyond the cold
    // misses, and Belady least
    let (out, _) = simulate(&tr, 0..3000, None, &ALL, &[vec![3, 3]], 0.9, 4, 0.7).unwrap();
    let total = |p: &str| out.iter().find(|o| o.policy == p).map(|o| o.misses.iter().sum::<u64>()).unwrap();
    for p in ALL {
        assert!(total(p.name()) > 1000, "{}: {}", p.name(), total(p.name()));
        assert!(total(p.name()) >= total("belady"));
    }
    assert!(total("lru") > total("belady"));
    // the rescale path was taken for 0.5 (d^-t > 1e100 after 333 tokens) and 0.9 (after 2186)
    let shape = Shape { n_layers: 2, n_expert: 12, k: 2 };
    for (decay, want) in [(0.5, 9u64), (0.9, 1), (0.99, 0)] {
        let mut e = ema::Ema::new(shape, &[vec![3, 3]], decay, ema::Credit::Pick);
        {
            let mut fam: Vec<Box<dyn Family + '_>> = vec![Box::new(&mut e)];
            engine::run(&tr, 0..3000, shape, None, &mut fam).unwrap();
        }
        let n_rescale = (3000.0 * (1.0 / decay).log10() / 100.0f64).floor() as u64;
        assert_eq!(n_rescale, want);
        assert_eq!(e.rescales, want, "d = {decay}");
    }
    // with a keep map (some tokens short of survivors) and on a row range
    let mut keep = vec![false; 2 * 12];
    for (i, f) in keep.iter_mut().enumerate() {
        *f = (i * 7) % 3 != 0;
    }
    compare_with_naive(&tr, 500..2500, Some(&keep), &[2, 4], 0.9);
    let sparse: Vec<bool> = (0..24).map(|i| i % 4 == 0).collect();
    let (_, f) = simulate(&tr, 0..3000, Some(Keep::from(&sparse[..])), &[Policy::Lru], &[vec![2, 2]], 0.9, 4, 1.0).unwrap();
    assert!(f.forced.iter().sum::<u64>() > 0, "the sparse map leaves some tokens short");
    compare_with_naive(&tr, 0..3000, Some(&sparse), &[2, 3], 0.5);
}

#[test]
fn ranks_are_none_for_picks_outside_the_candidates() {
    // a pick that is not among the candidates (selection bias) gets the last candidate's p
    let toks = vec![Tok { sel: vec![vec![3]], cand: vec![vec![0, 1]], prob: vec![vec![0.6, 0.2]] }];
    let p = write_trace("bias", 4, 1, 2, &toks);
    let tr = TraceReader::open(&p).unwrap();
    let shape = Shape { n_layers: 1, n_expert: 4, k: 1 };
    let mut r = engine::Router::new(shape, None, true);
    let row = tr.row(0);
    let x = r.route(&row, 0);
    assert_eq!((x.picks, x.ranks), (&[3u16][..], &[NONE][..]));
}

/// One token's router: logits N(0, 2²), p their softmax (or, elementwise, uniform in [0, 1)),
/// and Σ over the kept experts of exp(logit) (the pruned softmax's denominator).
fn random_router(rng: &mut crate::fixture::rng::Rng, ne: usize, softmax: bool, keep: &[bool]) -> (Vec<f64>, Vec<f32>, f64) {
    let logits: Vec<f64> = (0..ne).map(|_| rng.normal() * 2.0).collect();
    let p: Vec<f32> = if softmax {
        let z: f64 = logits.iter().map(|l| l.exp()).sum();
        logits.iter().map(|l| (l.exp() / z) as f32).collect()
    } else {
        (0..ne).map(|_| rng.uniform() as f32).collect()
    };
    let z_kept = (0..ne).filter(|&e| keep[e]).map(|e| logits[e].exp()).sum();
    (logits, p, z_kept)
}

/// Re-routing under a selection bias, against brute force. Random probabilities and biases
/// for every expert, with exact ties planted (two kept experts of one bias and equal p in a
/// quarter of the tokens). A named pick must be in the pruned model's top k of p' + b however
/// ties fall (fewer than k other kept experts score as much); from a trace listing every
/// expert every such expert is named; from a top-N trace exactly those a brute force over
/// what the trace shows can be sure of (an unlisted expert scores at most the last
/// candidate's p plus its bias). Elementwise gates (p' = p) at top-16, 8 and 5 of 16; a softmax
/// (p' renormalised over the kept experts, from the logits in f64) at top-16.
#[test]
fn biased_rerouting_names_exactly_the_certain_picks() {
    use crate::fixture::rng::Rng;
    let (ne, k) = (16usize, 3usize);
    let mut rng = Rng::stream(7, "biased-reroute");
    let keep: Vec<bool> = (0..ne).map(|e| e % 3 != 1).collect();
    let mut bias: Vec<f32> = (0..ne).map(|_| (rng.normal() * 0.15) as f32).collect();
    bias[5] = bias[2]; // both kept: ties where their p are equal
    let (mut partly, mut tied_out) = (0, 0);
    for (top_n, softmax) in [(ne, false), (8, false), (5, false), (ne, true)] {
        let (mut toks, mut truth) = (Vec::new(), Vec::new());
        for t in 0..400 {
            let (logits, mut p, z_kept) = random_router(&mut rng, ne, softmax, &keep);
            if !softmax && t % 4 == 0 {
                p[5] = p[2];
            }
            // the pruned model's scores, with full knowledge
            let score: Vec<f64> = (0..ne)
                .map(|e| if softmax { logits[e].exp() / z_kept + bias[e] as f64 } else { (p[e] + bias[e]) as f64 })
                .collect();
            let certain: Vec<u16> = (0..ne as u16)
                .filter(|&e| keep[e as usize])
                .filter(|&e| (0..ne).filter(|&f| f != e as usize && keep[f] && score[f] >= score[e as usize]).count() < k)
                .collect();
            let mut by_p: Vec<u16> = (0..ne as u16).collect();
            by_p.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
            let cand = by_p[..top_n].to_vec();
            let prob = cand.iter().map(|&e| p[e as usize]).collect();
            truth.push((certain, score, p.clone(), by_p.clone()));
            toks.push(Tok { sel: vec![by_p[..k].to_vec()], cand: vec![cand], prob: vec![prob] });
        }
        let path = write_trace(&format!("biased-{top_n}-{softmax}"), ne as u32, k as u32, top_n as u32, &toks);
        let tr = TraceReader::open(&path).unwrap();
        let shape = Shape { n_layers: 1, n_expert: ne, k };
        let mut r = engine::Router::new(shape, Some(Keep { flags: &keep, bias: Some(&bias), renormalise: softmax, groups: None, fixed: None, remap: None }), true);
        for (t, (certain, score, p, by_p)) in truth.iter().enumerate() {
            let row = tr.row(t as u64);
            let x = r.route(&row, 0);
            let n = x.picks.len();
            assert_eq!(x.forced, k - n);
            for (&e, &rk) in x.picks.iter().zip(x.ranks) {
                assert!(certain.contains(&e), "top-{top_n} softmax {softmax} token {t}: {e} named, not certain ({certain:?})");
                assert_eq!(toks[t].cand[0][rk as usize], e, "rank of pick {e}");
            }
            if top_n == ne {
                if softmax {
                    // f32 p / S against f64: leave out near-ties at the boundary
                    let mut sc: Vec<f64> = (0..ne).filter(|&e| keep[e]).map(|e| score[e]).collect();
                    sc.sort_by(|a, b| b.total_cmp(a));
                    if sc[k - 1] - sc[k] < 1e-5 {
                        continue;
                    }
                }
                assert_eq!(n, certain.len(), "top-{top_n} softmax {softmax} token {t}: {:?} named, {certain:?} certain", x.picks);
                tied_out += (n < k) as u32;
                continue;
            }
            // brute force over what the trace shows
            let p_last = p[by_p[top_n - 1] as usize];
            let listed: Vec<u16> = by_p[..top_n].iter().copied().filter(|&e| keep[e as usize]).collect();
            let s = |e: u16| p[e as usize] + bias[e as usize];
            let sure = listed
                .iter()
                .filter(|&&e| {
                    let others = listed.iter().filter(|&&f| f != e && s(f) >= s(e)).count();
                    let unlisted = by_p[top_n..].iter().filter(|&&u| keep[u as usize] && p_last + bias[u as usize] >= s(e)).count();
                    others + unlisted < k
                })
                .count();
            assert_eq!(n, sure, "top-{top_n} token {t}: named picks");
            partly += (0 < n && n < k) as u32;
        }
    }
    // the cases the rules are for did occur: partly decidable tokens, and exact ties at the
    // boundary with every expert listed
    assert!(partly > 0 && tied_out > 0, "{partly} {tied_out}");
}

/// The no-`--model` warning's count: a pick below the first k candidates counts, one tied with
/// the k-th candidate does not (an exact tie falls either way), one not listed at all counts.
/// Rows outside the replayed ones are looked at when those show nothing.
#[test]
fn picks_below_the_first_candidates_are_counted_but_ties_are_not() {
    let tok = |sel: Vec<u16>, cand: Vec<u16>, prob: Vec<f32>| Tok { sel: vec![sel], cand: vec![cand], prob: vec![prob] };
    let toks = vec![
        tok(vec![0, 1], vec![0, 1, 2], vec![0.5, 0.3, 0.2]), // the first two
        tok(vec![0, 2], vec![0, 1, 2], vec![0.5, 0.3, 0.3]), // 2 ties with the 2nd candidate
        tok(vec![0, 2], vec![0, 1, 2], vec![0.5, 0.3, 0.2]), // 2 is below: a bias
        tok(vec![0, 3], vec![0, 1, 2], vec![0.5, 0.3, 0.2]), // 3 is not listed
    ];
    let p = write_trace("off-candidates", 4, 2, 3, &toks);
    let tr = TraceReader::open(&p).unwrap();
    assert_eq!(picks_off_candidates(&tr, &Rows::Range(1..4)), (2, "3 replayed rows".to_string()));
    // none in rows 0..2, so the trace's first rows are read too: 2 there
    assert_eq!(picks_off_candidates(&tr, &Rows::Range(0..2)).0, 2);
    // a trace of the first two rows only: the tie is no sign of a bias
    let p = write_trace("off-candidates-tie", 4, 2, 3, &toks[..2]);
    let tr = TraceReader::open(&p).unwrap();
    assert_eq!(picks_off_candidates(&tr, &Rows::Range(0..2)), (0, "the trace's first 2 rows (none among the replayed rows)".to_string()));
}

/// Group-limited re-routing against llama.cpp's algorithm written out plainly: 16 experts in 4
/// groups, 2 used, k = 3, three kept per group; random sigmoid-like p and biases, with and
/// without the bias, and a softmax router with a bias. Every named pick is the truth's, and
/// all k are named except at exact ties (planted: equal p for two experts of one bias).
#[test]
fn grouped_rerouting_follows_the_chosen_groups() {
    use crate::fixture::rng::Rng;
    let (ne, k, g, used) = (16usize, 3usize, 4usize, 2usize);
    let mut rng = Rng::stream(11, "grouped-reroute");
    let keep: Vec<bool> = (0..ne).map(|e| e % 4 != 3).collect();
    let mut bias: Vec<f32> = (0..ne).map(|_| (rng.normal() * 0.1) as f32).collect();
    bias[1] = bias[0];
    for (with_bias, softmax) in [(false, false), (true, false), (true, true)] {
        let (mut toks, mut truth) = (Vec::new(), Vec::new());
        for t in 0..300 {
            let (logits, mut p, z_kept) = random_router(&mut rng, ne, softmax, &keep);
            if !softmax && t % 5 == 0 {
                p[1] = p[0];
            }
            // the pruned model: its own softmax over the kept logits, or p
            let s = |e: usize| -> f64 {
                let pp = if softmax { logits[e].exp() / z_kept } else { p[e] as f64 };
                pp + if with_bias { bias[e] as f64 } else { 0.0 }
            };
            let per = ne / g;
            let mut gs: Vec<(f64, usize)> = (0..g)
                .map(|gi| {
                    let mut v: Vec<f64> = (gi * per..(gi + 1) * per).filter(|&e| keep[e]).map(s).collect();
                    v.sort_by(|a, b| b.total_cmp(a));
                    (v[0] + v[1], gi)
                })
                .collect();
            gs.sort_by(|a, b| b.0.total_cmp(&a.0));
            let mut pool: Vec<usize> = gs[..used].iter().flat_map(|&(_, gi)| (gi * per..(gi + 1) * per).filter(|&e| keep[e])).collect();
            pool.sort_by(|&a, &b| s(b).total_cmp(&s(a)));
            let boundary_tie = (s(pool[k - 1]) - s(pool[k])).abs() < 1e-6 || (gs[used - 1].0 - gs[used].0).abs() < 1e-6;
            let mut want: Vec<u16> = pool[..k].iter().map(|&e| e as u16).collect();
            want.sort_unstable();
            truth.push((want, boundary_tie));
            let mut by_p: Vec<u16> = (0..ne as u16).collect();
            by_p.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
            let prob = by_p.iter().map(|&e| p[e as usize]).collect();
            toks.push(Tok { sel: vec![by_p[..k].to_vec()], cand: vec![by_p.clone()], prob: vec![prob] });
        }
        let path = write_trace(&format!("grouped-{with_bias}-{softmax}"), ne as u32, k as u32, ne as u32, &toks);
        let tr = TraceReader::open(&path).unwrap();
        let shape = Shape { n_layers: 1, n_expert: ne, k };
        let keep_arg = Keep { flags: &keep, bias: with_bias.then_some(&bias[..]), renormalise: softmax, groups: Some((g, used)), fixed: None, remap: None };
        let mut r = engine::Router::new(shape, Some(keep_arg), true);
        let mut full = 0;
        for (t, (want, tie)) in truth.iter().enumerate() {
            let row = tr.row(t as u64);
            let x = r.route(&row, 0);
            assert_eq!(x.forced, k - x.picks.len());
            for (&e, &rk) in x.picks.iter().zip(x.ranks) {
                assert!(want.contains(&e), "bias {with_bias} softmax {softmax} token {t}: {e} named, truth {want:?}");
                assert_eq!(toks[t].cand[0][rk as usize], e);
            }
            if !tie {
                let mut got = x.picks.to_vec();
                got.sort_unstable();
                assert_eq!(&got, want, "bias {with_bias} softmax {softmax} token {t}");
                full += 1;
            }
        }
        assert!(full > 250, "{full}");
        // the groups matter: ignoring them re-routes some tokens differently
        let mut r = engine::Router::new(shape, Some(Keep { groups: None, ..keep_arg }), false);
        let differ = truth.iter().enumerate().filter(|(t, (want, _))| {
            let row = tr.row(*t as u64);
            let mut got = r.route(&row, 0).picks.to_vec();
            got.sort_unstable();
            &got != want
        });
        assert!(differ.count() > 30, "bias {with_bias} softmax {softmax}");
    }
}
