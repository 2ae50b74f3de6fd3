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
    /// The observer stopped the graph during this decode. ggml's scheduler (at the pin) ends
    /// only the current split when the callback says stop, and computes the splits after it,
    /// and the ubatches after that, asking the callback again: with layers off-host a graph has
    /// several splits. So from the stop to the end of the decode nothing more is wanted, and
    /// the decode counts as stopped whatever llama.cpp returns.
    pub stopped: bool,
    /// Check every matmul against the AMX kernel's blind spot (`amx_guard`): set where a
    /// model of the process has weights in the extra buffer types.
    pub guard_amx: bool,
    /// Why the graph was stopped before a node that would compute wrong values; the context
    /// returns it as the decode's error.
    pub refusal: Option<String>,
}

impl<O> CallbackState<O> {
    pub fn new(observer: O) -> Self {
        CallbackState { observer, panic: None, stopped: false, guard_amx: super::abort::extra_bufts(), refusal: None }
    }
}

impl<O: GraphObserver> CallbackState<O> {
    /// The decision, as plain Rust: what the trampoline returns to C for one call.
    pub fn dispatch(&mut self, node: Option<Node<'_>>, ask: bool) -> bool {
        if self.panic.is_some() || self.stopped {
            return false; // failing or stopped: want nothing, stop everything
        }
        let Some(node) = node else { return !ask };
        if self.refusal.is_some() {
            // the node refused when asked, computed now: stop before anything reads it
            self.stopped = true;
            return false;
        }
        if ask && self.guard_amx {
            if let Some(why) = super::amx_guard::refuse(node) {
                // wanted, so that ggml stops at it (an unwanted node is only skipped)
                self.refusal = Some(why);
                return true;
            }
        }
        let obs = &mut self.observer;
        match catch_unwind(AssertUnwindSafe(|| if ask { obs.wants(node) } else { obs.observe(node) })) {
            Ok(true) => true,
            Ok(false) => {
                self.stopped = !ask;
                false
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A ggml context with one small tensor, for calling the trampoline without a model.
    struct OneTensor {
        ctx: *mut sys::ggml_context,
        t: *mut sys::ggml_tensor,
    }

    impl OneTensor {
        fn new(name: &str) -> Self {
            unsafe {
                let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: 1 << 16, mem_buffer: std::ptr::null_mut(), no_alloc: false });
                let t = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, 4, 2);
                let n = std::ffi::CString::new(name).unwrap();
                sys::ggml_set_name(t, n.as_ptr());
                OneTensor { ctx, t }
            }
        }
    }

    impl Drop for OneTensor {
        fn drop(&mut self) {
            unsafe { sys::ggml_free(self.ctx) }
        }
    }

    #[derive(Default)]
    struct Recorder {
        asked: Vec<String>,
        seen: Vec<String>,
        panic_on_observe: bool,
    }

    impl GraphObserver for Recorder {
        fn wants(&mut self, node: Node<'_>) -> bool {
            self.asked.push(node.name().to_string());
            node.name().starts_with("want")
        }
        fn observe(&mut self, node: Node<'_>) -> bool {
            if self.panic_on_observe {
                panic!("observer failed on {}", node.name());
            }
            self.seen.push(node.name().to_string());
            !node.name().contains("stop")
        }
    }

    fn call(state: &mut CallbackState<Recorder>, t: &OneTensor, ask: bool) -> bool {
        unsafe { trampoline::<Recorder>(t.t, ask, state as *mut CallbackState<Recorder> as *mut c_void) }
    }

    #[test]
    fn asks_and_observes_through_the_trampoline() {
        let mut st = CallbackState::new(Recorder::default());
        let (a, b) = (OneTensor::new("want_me"), OneTensor::new("skip_me"));
        assert!(call(&mut st, &a, true));
        assert!(!call(&mut st, &b, true));
        assert!(call(&mut st, &a, false));
        assert_eq!(st.observer.asked, ["want_me", "skip_me"]);
        assert_eq!(st.observer.seen, ["want_me"]);
        assert!(st.panic.is_none());
    }

    #[test]
    fn after_a_stop_nothing_more_is_wanted_until_the_next_decode() {
        let mut st = CallbackState::new(Recorder::default());
        let (stop, a) = (OneTensor::new("want_stop"), OneTensor::new("want_me"));
        assert!(call(&mut st, &stop, true));
        assert!(!call(&mut st, &stop, false), "the observer's stop reaches ggml");
        assert!(st.stopped);
        // ggml goes on with the next split: asked again, we want nothing
        assert!(!call(&mut st, &a, true));
        assert_eq!(st.observer.asked, ["want_stop"]);
        assert_eq!(st.observer.seen, ["want_stop"]);
        st.stopped = false; // what the next decode does
        assert!(call(&mut st, &a, true));
    }

    #[test]
    fn a_panic_is_caught_stops_the_graph_and_is_kept_for_the_caller() {
        let mut st = CallbackState::new(Recorder { panic_on_observe: true, ..Default::default() });
        let a = OneTensor::new("want_me");
        assert!(!call(&mut st, &a, false), "a panicking observer must stop the graph");
        let p = st.panic.take().expect("panic stored");
        assert_eq!(p.downcast_ref::<String>().map(String::as_str), Some("observer failed on want_me"));
    }

    #[test]
    fn after_a_panic_nothing_more_is_wanted_or_observed() {
        let mut st = CallbackState::new(Recorder::default());
        st.panic = Some(Box::new("earlier"));
        let a = OneTensor::new("want_me");
        assert!(!call(&mut st, &a, true));
        assert!(!call(&mut st, &a, false));
        assert!(st.observer.asked.is_empty() && st.observer.seen.is_empty());
    }

    #[test]
    fn a_null_node_is_not_wanted_and_does_not_stop_the_graph() {
        let mut st = CallbackState::new(Recorder::default());
        let p = &mut st as *mut CallbackState<Recorder> as *mut c_void;
        assert!(!unsafe { trampoline::<Recorder>(std::ptr::null_mut(), true, p) });
        assert!(unsafe { trampoline::<Recorder>(std::ptr::null_mut(), false, p) });
    }
}
