//! The eval callback with a real model: a panic inside the observer stops the graph and is
//! re-raised by `decode` after llama.cpp returns, instead of unwinding through C.

use super::util::fixture;
use reap_imatrix::llama::{Context, ContextParams, GraphObserver, Model, ModelParams, Node};

struct PanicAfter {
    observed: usize,
    limit: usize,
}

impl GraphObserver for PanicAfter {
    fn wants(&mut self, node: Node<'_>) -> bool {
        node.name().starts_with("ffn_moe_topk")
    }
    fn observe(&mut self, node: Node<'_>) -> bool {
        self.observed += 1;
        if self.observed > self.limit {
            panic!("boom at {}", node.name());
        }
        true
    }
}

fn params() -> ContextParams {
    ContextParams { n_ctx: 64, n_batch: 64, n_ubatch: 64, n_seq_max: 1, n_threads: 2, n_threads_batch: 2, flash_attn: -1, ..Default::default() }
}

#[test]
fn observer_panic_is_reraised_after_decode() {
    let model = Model::load(&fixture("qwen3moe"), &ModelParams::default()).unwrap();
    let mut ctx = Context::new(&model, &params(), PanicAfter { observed: 0, limit: 1 }).unwrap();
    let mut batch = ctx.batch();
    for i in 0..32 {
        batch.add(100 + i, i, 0, true);
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ctx.decode(&mut batch)));
    let payload = r.expect_err("the observer's panic must surface from decode");
    let msg = payload.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.starts_with("boom at ffn_moe_topk-"), "{msg}");
    // the graph stopped at the panic: the second layer's node was the last one observed
    assert_eq!(ctx.observer().observed, 2);
}

#[test]
fn a_plain_observer_sees_every_moe_layer_once_per_ubatch() {
    let model = Model::load(&fixture("qwen3moe"), &ModelParams::default()).unwrap();
    let mut ctx = Context::new(&model, &params(), PanicAfter { observed: 0, limit: usize::MAX }).unwrap();
    let mut batch = ctx.batch();
    for i in 0..32 {
        batch.add(100 + i, i, 0, true);
    }
    ctx.decode(&mut batch).unwrap();
    assert_eq!(ctx.observer().observed, model.n_layer() as usize);
    assert_eq!(ctx.logits_ith(31).len(), model.vocab().n_tokens() as usize);
}
