//! A loaded model and its vocabulary.

use super::{init_backend, log, sys};
use anyhow::{bail, Context as _, Result};
use std::ffi::CString;
use std::path::Path;

/// What `llama_model_load_from_file` is told.
#[derive(Clone, Debug)]
pub struct ModelParams {
    /// layers to offload (-ngl); negative: all
    pub n_gpu_layers: i32,
    /// `llama_load_mode` (-lm): -1 auto, 0 none, 1 mmap, …
    pub load_mode: i32,
    /// `--rpc` servers, comma-separated as upstream takes them
    pub rpc_servers: Option<String>,
}

impl Default for ModelParams {
    fn default() -> Self {
        ModelParams { n_gpu_layers: -1, load_mode: sys::LLAMA_LOAD_MODE_AUTO, rpc_servers: None }
    }
}

pub struct Model {
    raw: *mut sys::llama_model,
}

// SAFETY: a loaded llama_model is read-only after loading and safe to share between threads.
unsafe impl Send for Model {}
unsafe impl Sync for Model {}

impl Model {
    pub fn load(path: &Path, params: &ModelParams) -> Result<Model> {
        Self::load_with(path, params, false)
    }

    /// Loads only the vocabulary (no weights): for tokenizing with a model's tokenizer.
    pub fn load_vocab(path: &Path) -> Result<Model> {
        Self::load_with(path, &ModelParams::default(), true)
    }

    fn load_with(path: &Path, params: &ModelParams, vocab_only: bool) -> Result<Model> {
        init_backend();
        let meta = std::fs::metadata(path).with_context(|| format!("model file {}", path.display()))?;
        if !meta.is_file() {
            bail!("model file {}: not a regular file", path.display());
        }
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .with_context(|| format!("model path {} contains a NUL byte", path.display()))?;
        if let Some(servers) = &params.rpc_servers {
            super::context::add_rpc_devices(servers)?;
        }
        // SAFETY: default params are plain data.
        let mut mp = unsafe { sys::llama_model_default_params() };
        mp.n_gpu_layers = params.n_gpu_layers;
        mp.load_mode = params.load_mode;
        mp.vocab_only = vocab_only;
        log::take_recent_errors();
        // SAFETY: valid C string and params; null is checked.
        let raw = unsafe { sys::llama_model_load_from_file(c_path.as_ptr(), mp) };
        if raw.is_null() {
            let why = log::take_recent_errors().join("\n  ");
            bail!("model file {}: llama.cpp could not load it\n  {why}", path.display());
        }
        Ok(Model { raw })
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::llama_model {
        self.raw
    }

    pub fn vocab(&self) -> Vocab<'_> {
        // SAFETY: the vocab lives as long as the model.
        Vocab { raw: unsafe { sys::llama_model_get_vocab(self.raw) }, _model: self }
    }

    pub fn n_ctx_train(&self) -> i32 {
        unsafe { sys::llama_model_n_ctx_train(self.raw) }
    }

    pub fn n_layer(&self) -> i32 {
        unsafe { sys::llama_model_n_layer(self.raw) }
    }

    pub fn n_embd(&self) -> i32 {
        unsafe { sys::llama_model_n_embd(self.raw) }
    }

    /// A string from the model's GGUF metadata (e.g. `general.architecture`).
    pub fn meta_str(&self, key: &str) -> Option<String> {
        let key = CString::new(key).ok()?;
        let mut buf = vec![0u8; 512];
        // SAFETY: buffer and its length are passed together; returns -1 when missing.
        let n = unsafe { sys::llama_model_meta_val_str(self.raw, key.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return None;
        }
        buf.truncate((n as usize).min(buf.len() - 1));
        String::from_utf8(buf).ok()
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: owned pointer, freed once.
        unsafe { sys::llama_model_free(self.raw) }
    }
}

/// The tokenizer of a loaded model.
#[derive(Clone, Copy)]
pub struct Vocab<'m> {
    raw: *const sys::llama_vocab,
    _model: &'m Model,
}

impl Vocab<'_> {
    pub fn n_tokens(&self) -> i32 {
        unsafe { sys::llama_vocab_n_tokens(self.raw) }
    }
    pub fn bos(&self) -> i32 {
        unsafe { sys::llama_vocab_bos(self.raw) }
    }
    pub fn add_bos(&self) -> bool {
        unsafe { sys::llama_vocab_get_add_bos(self.raw) }
    }
    pub fn add_eos(&self) -> bool {
        unsafe { sys::llama_vocab_get_add_eos(self.raw) }
    }

    /// Tokenises `text` as upstream's `common_tokenize` does.
    pub fn tokenize(&self, text: &[u8], add_special: bool, parse_special: bool) -> Result<Vec<i32>> {
        let len = i32::try_from(text.len()).context("text too long to tokenize in one call (over 2 GiB)")?;
        // upper bound as upstream: one token per byte plus specials
        let mut out = vec![0i32; text.len() + 2 * add_special as usize];
        let call = |out: &mut Vec<i32>| unsafe {
            sys::llama_tokenize(self.raw, text.as_ptr().cast(), len, out.as_mut_ptr(), out.len() as i32, add_special, parse_special)
        };
        let mut n = call(&mut out);
        if n < 0 {
            out.resize((-n) as usize, 0);
            n = call(&mut out);
        }
        if n < 0 {
            bail!("tokenization failed ({n})");
        }
        out.truncate(n as usize);
        Ok(out)
    }
}
