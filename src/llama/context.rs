//! An inference context with our graph observer plugged into its eval callback.

use super::batch::Batch;
use super::eval_callback::{trampoline, CallbackState, GraphObserver};
use super::model::Model;
use super::{log, sys};
use anyhow::{bail, Context as _, Result};
use std::ffi::{c_void, CString};

/// The context settings the compute loop controls (everything else: llama.cpp defaults).
#[derive(Clone, Debug)]
pub struct ContextParams {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_ubatch: u32,
    pub n_seq_max: u32,
    pub n_threads: i32,
    pub n_threads_batch: i32,
    /// -1 auto, 0 off, 1 on (`llama_flash_attn_type`)
    pub flash_attn: i32,
    /// KV cache types (-ctk, -ctv); None: llama.cpp's default (f16)
    pub type_k: Option<sys::ggml_type>,
    pub type_v: Option<sys::ggml_type>,
    /// offload the KQV ops and the KV cache to the GPU (-kvo / -nkvo; default on)
    pub offload_kqv: bool,
    /// run a host-resident weight's op on the GPU when the batch is large enough, copying the
    /// weight there (--op-offload / --no-op-offload; default on)
    pub op_offload: bool,
    /// a context that runs the model's nextn/MTP block (`LLAMA_CONTEXT_TYPE_MTP`): each token
    /// comes with the trunk's hidden state, as llama.cpp's MTP drafting feeds it
    pub mtp: bool,
}

impl Default for ContextParams {
    fn default() -> Self {
        ContextParams { n_ctx: 0, n_batch: 0, n_ubatch: 0, n_seq_max: 1, n_threads: 1, n_threads_batch: 1, flash_attn: -1, type_k: None, type_v: None, offload_kqv: true, op_offload: true, mtp: false }
    }
}

pub struct Context<'m, O: GraphObserver> {
    raw: *mut sys::llama_context,
    state: *mut CallbackState<O>,
    model: &'m Model,
}

impl<'m, O: GraphObserver> Context<'m, O> {
    pub fn new(model: &'m Model, p: &ContextParams, observer: O) -> Result<Self> {
        let state = Box::into_raw(Box::new(CallbackState::new(observer)));
        // SAFETY: default params are plain data.
        let mut cp = unsafe { sys::llama_context_default_params() };
        cp.n_ctx = p.n_ctx;
        cp.n_batch = p.n_batch;
        cp.n_ubatch = p.n_ubatch;
        cp.n_seq_max = p.n_seq_max;
        cp.n_threads = p.n_threads;
        cp.n_threads_batch = p.n_threads_batch;
        cp.flash_attn_type = p.flash_attn;
        if let Some(t) = p.type_k {
            cp.type_k = t;
        }
        if let Some(t) = p.type_v {
            cp.type_v = t;
        }
        cp.offload_kqv = p.offload_kqv;
        cp.op_offload = p.op_offload;
        if p.mtp {
            cp.ctx_type = sys::LLAMA_CONTEXT_TYPE_MTP;
        }
        cp.cb_eval = Some(trampoline::<O>);
        cp.cb_eval_user_data = state as *mut c_void;
        log::take_recent_errors();
        // SAFETY: a live model; the callback state outlives the context (freed after it in Drop).
        let raw = unsafe { sys::llama_init_from_model(model.as_ptr(), cp) };
        if raw.is_null() {
            // SAFETY: reclaim the box we leaked above; the C side never saw a context.
            drop(unsafe { Box::from_raw(state) });
            bail!("llama.cpp could not create a context:\n  {}", log::take_recent_errors().join("\n  "));
        }
        Ok(Context { raw, state, model })
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::llama_context {
        self.raw
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    pub fn batch(&self) -> Batch {
        Batch::new(self.raw)
    }

    /// Runs the batch through the graph; the observer sees every node it asks for. A panic in
    /// the observer stops the graph and is re-raised here.
    pub fn decode(&mut self, batch: &mut Batch) -> Result<()> {
        if !self.decode_or_stop(batch)? {
            bail!("llama_process: the graph was stopped by the eval callback");
        }
        Ok(())
    }

    /// As `decode`, but a graph the observer stopped (by returning false) is not an error:
    /// returns Ok(false). llama.cpp then drops that ubatch's positions from the KV cache.
    pub fn decode_or_stop(&mut self, batch: &mut Batch) -> Result<bool> {
        self.state_mut().stopped = false;
        // SAFETY: live context and batch; the observer is reached only through the callback.
        let rc = unsafe { sys::llama_process(self.raw, sys::LLAMA_PROCESS_TYPE_DECODE, batch.as_ptr()) };
        if let Some(p) = self.state_mut().panic.take() {
            std::panic::resume_unwind(p);
        }
        if let Some(why) = self.state_mut().refusal.take() {
            return Err(crate::error::UsageError(why).into());
        }
        match rc {
            0 | 2 if self.state_mut().stopped => Ok(false),
            0 => Ok(true),
            2 => Ok(false),
            _ => bail!("llama_process failed with code {rc}: {}", log::take_recent_errors().join("; ")),
        }
    }

    pub fn observer(&self) -> &O {
        // SAFETY: no decode is running while we hold &self.
        unsafe { &(*self.state).observer }
    }

    pub fn observer_mut(&mut self) -> &mut O {
        &mut self.state_mut().observer
    }

    fn state_mut(&mut self) -> &mut CallbackState<O> {
        // SAFETY: exclusive access through &mut self; the callback runs only inside decode.
        unsafe { &mut *self.state }
    }

    pub fn clear_memory(&mut self) {
        unsafe { sys::llama_memory_clear(sys::llama_get_memory(self.raw), true) }
    }

    /// Drops positions `p0..` of sequence `seq` from the KV cache; the freed cells are reused
    /// first (the cache's head moves back), so a batch decoded again lands in the same cells.
    pub fn seq_rm_from(&mut self, seq: i32, p0: i32) -> bool {
        unsafe { sys::llama_memory_seq_rm(sys::llama_get_memory(self.raw), seq, p0, -1) }
    }

    /// Which of the model's nextn/MTP blocks an MTP context's graph runs (il = trunk + offset),
    /// as llama.cpp's drafter chains Step-3.5's three heads.
    pub fn set_nextn_layer_offset(&mut self, offset: i32) {
        unsafe { set_nextn_layer_offset(self.raw, offset) }
    }

    pub fn synchronize(&mut self) {
        unsafe { sys::llama_synchronize(self.raw) }
    }

    /// Logits of the batch's i-th output row, `n_vocab` long.
    pub fn logits_ith(&self, i: i32) -> &[f32] {
        let n = self.model.vocab().n_tokens() as usize;
        // SAFETY: valid for outputs of the last decode; length n_vocab.
        unsafe {
            let p = sys::llama_get_logits_ith(self.raw, i);
            assert!(!p.is_null(), "no logits for output {i}");
            std::slice::from_raw_parts(p, n)
        }
    }

    /// All output logits of the last decode, row-major `[n_outputs][n_vocab]`.
    pub fn logits(&self, n_outputs: usize) -> &[f32] {
        let n = self.model.vocab().n_tokens() as usize;
        // SAFETY: llama_get_logits points at n_outputs × n_vocab floats after a decode.
        unsafe { std::slice::from_raw_parts(sys::llama_get_logits(self.raw), n_outputs * n) }
    }

    pub fn n_ctx(&self) -> u32 {
        unsafe { sys::llama_n_ctx(self.raw) }
    }

    pub fn into_observer(self) -> O {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: free the context first (it holds the callback pointer), then take the state.
        unsafe {
            sys::llama_free(this.raw);
            Box::from_raw(this.state).observer
        }
    }
}

impl<O: GraphObserver> Drop for Context<'_, O> {
    fn drop(&mut self) {
        // SAFETY: context first, since it holds a pointer to the state.
        unsafe {
            sys::llama_free(self.raw);
            drop(Box::from_raw(self.state));
        }
    }
}

/// Registers `--rpc` servers (comma-separated HOST:PORT) as devices, as upstream's tools do.
pub(crate) fn add_rpc_devices(servers: &str) -> Result<()> {
    let list: Vec<&str> = servers.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if list.is_empty() {
        bail!("--rpc: no RPC servers specified");
    }
    let name = CString::new("RPC").unwrap();
    let sym = CString::new("ggml_backend_rpc_add_server").unwrap();
    // SAFETY: registry lookups; a null result is checked before use.
    unsafe {
        let reg = sys::ggml_backend_reg_by_name(name.as_ptr());
        if reg.is_null() {
            bail!("--rpc: this build has no RPC backend (build with the `rpc` feature)");
        }
        let f = sys::ggml_backend_reg_get_proc_address(reg, sym.as_ptr());
        if f.is_null() {
            bail!("--rpc: the RPC backend has no ggml_backend_rpc_add_server");
        }
        let add: unsafe extern "C" fn(*const std::ffi::c_char) -> sys::ggml_backend_reg_t = std::mem::transmute(f);
        // a process loads several models (eval: the base, then each model): each server is
        // registered once, or its device would appear twice
        static ADDED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
        let mut added = ADDED.lock().unwrap_or_else(|e| e.into_inner());
        for s in list {
            if added.iter().any(|a| a == s) {
                continue;
            }
            let ep = CString::new(s).context("--rpc: server name contains a NUL byte")?;
            let r = add(ep.as_ptr());
            if r.is_null() {
                bail!("--rpc: could not connect to RPC server {s}");
            }
            sys::ggml_backend_register(r);
            added.push(s.to_string());
            super::abort::note_rpc_server(s);
            super::rpc_watch::start();
        }
    }
    Ok(())
}

extern "C" {
    // Declared in the pin's src/llama-ext.h, a C++ header (outside llama.h's extern "C", so
    // bindgen cannot read it and the symbol is C++-mangled): the Itanium ABI's name for
    // `void llama_set_nextn_layer_offset(llama_context *, int32_t)`, as gcc and clang emit it.
    #[link_name = "_Z28llama_set_nextn_layer_offsetP13llama_contexti"]
    fn set_nextn_layer_offset(ctx: *mut sys::llama_context, offset: i32);
}
