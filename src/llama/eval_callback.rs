//! The eval-callback trampoline: llama.cpp calls it for every graph node, first to ask
//! whether we want the node (`ask = true`), then, if we did, with its computed data.
//!
//! The observer's state is owned by the context and borrowed only during `decode`. A panic
//! inside the observer is caught at the FFI boundary (unwinding into C is undefined), stored,
//! turned into "stop the graph", and re-raised by the context after the C call returns.

use super::tensor::Node;
use super::sys;
use std::any::Any;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What the compute loop plugs into the graph.
pub trait GraphObserver {
    /// Whether we want this node's data. Called before the node is computed.
    fn wants(&mut self, node: Node<'_>) -> bool;
    /// The node's data, after it was computed. Return `false` to stop the graph.
    fn observe(&mut self, node: Node<'_>) -> bool;
}

/// An observer that wants nothing: a plain forward pass.
pub struct NoObserver;

impl GraphObserver for NoObserver {
    fn wants(&mut self, _: Node<'_>) -> bool {
        false
    }
    fn observe(&mut self, _: Node<'_>) -> bool {
        true
    }
}

pub(crate) struct CallbackState<O> {
    pub observer: O,
    pub panic: Option<Box<dyn Any + Send>>,
}

impl<O: GraphObserver> CallbackState<O> {
    /// The decision, as plain Rust: what the trampoline returns to C for one call.
    pub fn dispatch(&mut self, node: Option<Node<'_>>, ask: bool) -> bool {
        if self.panic.is_some() {
            return false; // already failing: want nothing, stop everything
        }
        let Some(node) = node else { return !ask };
        let obs = &mut self.observer;
        match catch_unwind(AssertUnwindSafe(|| if ask { obs.wants(node) } else { obs.observe(node) })) {
            Ok(v) => v,
            Err(p) => {
                self.panic = Some(p);
                false
            }
        }
    }
}

/// # Safety
/// `user_data` is the `CallbackState<O>` the context registered, alive for the context's life.
pub(crate) unsafe extern "C" fn trampoline<O: GraphObserver>(
    t: *mut sys::ggml_tensor,
    ask: bool,
    user_data: *mut c_void,
) -> bool {
    let state = unsafe { &mut *(user_data as *mut CallbackState<O>) };
    let node = unsafe { Node::from_raw(t) };
    state.dispatch(node, ask)
}
