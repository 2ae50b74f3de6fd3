//! The weighted round-robin that orders documents into the mix.
//!
//! Each source `s` has a target of `T_s` tokens and a queue of documents (already deduplicated,
//! in seeded order) with their token counts. At every step the source *furthest below its target
//! share* gives the next document: the one with the smallest `achieved_s / T_s` among sources
//! still below target (ties: the source given first). So after any prefix every source holds
//! about its share of what has been written, and a calibration run that reads only the first
//! chunks still sees every domain. A document longer than `--max-doc-tokens` is cut to that many
//! tokens, keeping its end; the document that would carry a source past its target is cut to
//! the remainder the same way, and the source is then complete.

/// One step of the plan: source `source` contributes its document `doc` (index into its queue),
/// cut to its last `keep` tokens when `keep` is Some.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Take {
    pub source: usize,
    pub doc: usize,
    pub keep: Option<u64>,
}

/// Plans the mix: `queues[s]` holds the token counts of source `s`'s documents in the order they
/// may be taken; `targets[s]` its token target. Every target must be reachable (checked by the
/// caller against [`available`]).
pub fn plan(queues: &[Vec<u64>], targets: &[u64], max_doc_tokens: Option<u64>) -> Vec<Take> {
    let n = queues.len();
    let mut achieved = vec![0u64; n];
    let mut next = vec![0usize; n];
    let mut done: Vec<bool> = (0..n).map(|s| targets[s] == 0 || queues[s].is_empty()).collect();
    let mut out = Vec::new();
    loop {
        // smallest achieved/target, compared exactly as achieved_a·T_b < achieved_b·T_a
        let pick = (0..n).filter(|&s| !done[s]).min_by(|&a, &b| {
            let l = achieved[a] as u128 * targets[b] as u128;
            let r = achieved[b] as u128 * targets[a] as u128;
            l.cmp(&r).then(a.cmp(&b))
        });
        let Some(s) = pick else { break };
        let full = queues[s][next[s]];
        let mut len = max_doc_tokens.map_or(full, |m| full.min(m));
        let need = targets[s] - achieved[s];
        if len >= need {
            len = need;
            done[s] = true;
        }
        out.push(Take { source: s, doc: next[s], keep: (len < full).then_some(len) });
        achieved[s] += len;
        next[s] += 1;
        if next[s] == queues[s].len() {
            done[s] = true;
        }
    }
    out
}

/// Tokens a source can give: its documents, each at most `max_doc_tokens`.
pub fn available(queue: &[u64], max_doc_tokens: Option<u64>) -> u64 {
    queue.iter().map(|&t| max_doc_tokens.map_or(t, |m| t.min(m))).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every prefix of the plan is within one document of each source's share.
    #[test]
    fn every_prefix_is_mixed() {
        let queues = vec![vec![10; 100], vec![25; 100], vec![7; 300]];
        let targets = [500, 300, 200];
        let p = plan(&queues, &targets, None);
        let mut got = [0u64; 3];
        for t in &p {
            got[t.source] += t.keep.unwrap_or(queues[t.source][t.doc]);
            let total: u64 = got.iter().sum();
            for s in 0..3 {
                let want = total as f64 * targets[s] as f64 / 1000.0;
                assert!((got[s] as f64 - want).abs() <= 25.0, "source {s} at {total}: {} vs {want}", got[s]);
            }
        }
        assert_eq!(got, targets);
    }

    #[test]
    fn long_documents_keep_their_end_and_the_last_is_cut_to_fit() {
        let p = plan(&[vec![100, 30, 30]], &[70], Some(50));
        assert_eq!(p, [Take { source: 0, doc: 0, keep: Some(50) }, Take { source: 0, doc: 1, keep: Some(20) }]);
        assert_eq!(available(&[100, 30, 30], Some(50)), 110);
    }

    #[test]
    fn the_source_furthest_below_its_share_goes_first_ties_to_the_first() {
        let p = plan(&[vec![10, 10], vec![10, 10]], &[20, 20], None);
        let order: Vec<usize> = p.iter().map(|t| t.source).collect();
        assert_eq!(order, [0, 1, 0, 1]);
    }
}
