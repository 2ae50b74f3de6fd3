//! A loaded model and its vocabulary.

use super::placement::{self, TensorOverride};
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
    /// load the vocabulary and metadata only, no tensors (`corpus` needs only the tokenizer)
    pub vocab_only: bool,
    /// `llama_split_mode` (-sm)
    pub split_mode: sys::llama_split_mode,
    /// -mg
    pub main_gpu: i32,
    /// -ts: proportions per device (empty: llama.cpp's default)
    pub tensor_split: Vec<f32>,
    /// weight repacking into extra buffer types (--repack / -nr)
    pub use_extra_bufts: bool,
    /// load the nextn/MTP blocks' own tensors (`--nextn`; llama.cpp skips them by default)
    pub load_mtp: bool,
    /// where tensors go by name (`-ot`, `--cpu-moe`, `--n-cpu-moe`), in command-line order:
    /// llama.cpp takes the first pattern that matches
    pub tensor_overrides: Vec<TensorOverride>,
    /// `-dev`: the devices to offload to, by name (`CUDA0`, `RPC0`); `Some(empty)`: none (every
    /// layer on the host); `None`: every device there is
    pub devices: Option<Vec<String>>,
}

impl Default for ModelParams {
    fn default() -> Self {
        // SAFETY: default params are plain data.
        let d = unsafe { sys::llama_model_default_params() };
        ModelParams {
            n_gpu_layers: -1,
            load_mode: sys::LLAMA_LOAD_MODE_AUTO,
            rpc_servers: None,
            vocab_only: false,
            split_mode: d.split_mode,
            main_gpu: d.main_gpu,
            tensor_split: Vec::new(),
            use_extra_bufts: d.use_extra_bufts,
            load_mtp: d.load_mtp,
            tensor_overrides: Vec::new(),
            devices: None,
        }
    }
}

pub struct Model {
    raw: *mut sys::llama_model,
}

// SAFETY: a loaded llama_model is read-only after loading and safe to share between threads.
unsafe impl Send for Model {}
unsafe impl Sync for Model {}

impl Model {
    /// Loads only the vocabulary (no weights): for tokenizing with a model's tokenizer.
    pub fn load_vocab(path: &Path) -> Result<Model> {
        Self::load(path, &ModelParams { vocab_only: true, ..Default::default() })
    }

    pub fn load(path: &Path, params: &ModelParams) -> Result<Model> {
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
        mp.vocab_only = params.vocab_only;
        mp.split_mode = params.split_mode;
        mp.main_gpu = params.main_gpu;
        mp.use_extra_bufts = params.use_extra_bufts;
        if params.use_extra_bufts && !params.vocab_only {
            super::abort::note_extra_bufts();
        }
        mp.load_mtp = params.load_mtp;
        // llama.cpp reads llama_max_devices() floats; the array lives until the load returns
        // SAFETY: a plain query.
        let mut split = vec![0f32; unsafe { sys::llama_max_devices() }];
        if !params.tensor_split.is_empty() {
            if params.tensor_split.len() > split.len() {
                bail!("-ts: {} values, this build of llama.cpp supports at most {} devices", params.tensor_split.len(), split.len());
            }
            split[..params.tensor_split.len()].copy_from_slice(&params.tensor_split);
            mp.tensor_split = split.as_ptr();
        }
        // -dev: null-terminated, alive until the load returns
        let mut devices = match &params.devices {
            Some(names) => placement::offload_devices(names)?,
            None => Vec::new(),
        };
        if params.devices.is_some() && !params.vocab_only {
            devices.push(std::ptr::null_mut());
            mp.devices = devices.as_mut_ptr();
        }
        // the patterns and the array live until the load returns; null-terminated
        let overrides = placement::buffer_overrides(&params.tensor_overrides)?;
        let mut override_array: Vec<sys::llama_model_tensor_buft_override> =
            overrides.iter().map(|(p, b)| sys::llama_model_tensor_buft_override { pattern: p.as_ptr(), buft: *b }).collect();
        if !override_array.is_empty() && !params.vocab_only {
            override_array.push(sys::llama_model_tensor_buft_override { pattern: std::ptr::null(), buft: std::ptr::null_mut() });
            mp.tensor_buft_overrides = override_array.as_ptr();
        }
        log::take_recent_errors();
        // SAFETY: valid C string and params; null is checked.
        let raw = unsafe { sys::llama_model_load_from_file(c_path.as_ptr(), mp) };
        if raw.is_null() {
            let mut why = log::take_recent_errors().join("\n  ");
            // the loader compiles each pattern with std::regex, whose error names none
            if why.contains("regular expression") && !params.tensor_overrides.is_empty() {
                let patterns: Vec<&str> = params.tensor_overrides.iter().map(|o| o.pattern.as_str()).collect();
                why += &format!("\n  (a pattern of -ot is not a valid ECMAScript regex: {})", patterns.join("  "));
                bail!(crate::error::UsageError(format!("model file {}: llama.cpp could not load it\n  {why}", path.display())));
            }
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

    /// nextn/MTP blocks after the trunk (`<arch>.nextn_predict_layers`; 0 for most models).
    pub fn n_layer_nextn(&self) -> i32 {
        unsafe { sys::llama_model_n_layer_nextn(self.raw) }
    }

    pub fn n_embd(&self) -> i32 {
        unsafe { sys::llama_model_n_embd(self.raw) }
    }

    /// The width of a token's final hidden state (an MTP block's input): n_embd, but for
    /// DeepSeek-V4 its hyper-connection streams (n_embd × their count).
    pub fn n_embd_out(&self) -> i32 {
        unsafe { sys::llama_model_n_embd_out(self.raw) }
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

    /// Experts per MoE layer (`<arch>.expert_count`), if the model says.
    pub fn n_expert(&self) -> Option<usize> {
        let arch = self.meta_str("general.architecture")?;
        self.meta_str(&format!("{arch}.expert_count"))?.parse().ok()
    }

    /// The chat template stored in the GGUF (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<String> {
        // SAFETY: returns a pointer into the model's metadata (lives as long as the model) or null.
        let p = unsafe { sys::llama_model_chat_template(self.raw, std::ptr::null()) };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null, NUL-terminated.
        Some(unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

impl Model {
    /// Renders `messages` with the model's own chat template (see `chat::apply_template`),
    /// ending with the assistant's turn opened when `add_assistant`. Errors when the model has
    /// no template or llama.cpp does not recognise it.
    pub fn apply_chat_template(&self, messages: &[super::chat::Message], add_assistant: bool) -> Result<String> {
        let Some(tmpl) = self.chat_template() else { bail!("the model has no chat template (tokenizer.chat_template)") };
        super::chat::apply_template(&tmpl, messages, add_assistant)
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

// SAFETY: the vocab is read-only after loading; llama_tokenize and llama_token_to_piece keep
// their state per call (llama.cpp's server tokenizes from several threads the same way).
unsafe impl Send for Vocab<'_> {}
unsafe impl Sync for Vocab<'_> {}

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

    /// End of generation (EOS, EOT, …).
    pub fn is_eog(&self, token: i32) -> bool {
        unsafe { sys::llama_vocab_is_eog(self.raw, token) }
    }

    /// The token's text, special tokens rendered (as `llama-simple` prints them).
    pub fn piece(&self, token: i32) -> Vec<u8> {
        let mut buf = vec![0u8; 128];
        // SAFETY: buffer and its length are passed together; a negative result is the size needed.
        let call = |buf: &mut Vec<u8>| unsafe { sys::llama_token_to_piece(self.raw, token, buf.as_mut_ptr().cast(), buf.len() as i32, 0, true) };
        let mut n = call(&mut buf);
        if n < 0 {
            buf.resize((-n) as usize, 0);
            n = call(&mut buf);
        }
        buf.truncate(n.max(0) as usize);
        buf
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

    /// The bytes of one token as the tokenizer spells it; special tokens (`<|im_start|>`) as
    /// their text (`special` = true), as `--parse-special` reads them back.
    pub fn token_to_piece(&self, token: i32, buf: &mut Vec<u8>) -> Result<()> {
        buf.resize(buf.capacity().max(64), 0);
        loop {
            // SAFETY: buffer and its length are passed together; a negative result is the size needed.
            let n = unsafe { sys::llama_token_to_piece(self.raw, token, buf.as_mut_ptr().cast(), buf.len() as i32, 0, true) };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(());
            }
            buf.resize((-n) as usize, 0);
        }
    }

    pub fn is_control(&self, token: i32) -> bool {
        unsafe { sys::llama_vocab_is_control(self.raw, token) }
    }

    /// A token the tokenizer cuts out of the text as a fragment of its own (control,
    /// user-defined and unknown tokens: `cache_special_tokens` in the pin's llama-vocab.cpp).
    pub fn is_special_fragment(&self, token: i32) -> bool {
        // SAFETY: a valid vocab; llama_vocab_get_attr reads the token's attributes.
        let attr = unsafe { sys::llama_vocab_get_attr(self.raw, token) };
        attr & (sys::LLAMA_TOKEN_ATTR_CONTROL | sys::LLAMA_TOKEN_ATTR_USER_DEFINED | sys::LLAMA_TOKEN_ATTR_UNKNOWN) != 0
    }
}

impl Vocab<'_> {
    /// The byte offset in `text` at which each of `tokens` (the result of tokenising `text`)
    /// starts: the token pieces are laid over the text one after the other and each must match
    /// the bytes it lands on, so the mapping is proven, not estimated. Two tokens have no bytes
    /// of their own: an added BOS first (offset 0), and the space a SentencePiece vocab puts
    /// before the text and after each special token (the first piece of such a fragment then
    /// matches without its space). Anything else that
    /// does not match is an error (a vocab whose pieces do not spell the text back).
    pub fn token_offsets(&self, text: &[u8], tokens: &[i32]) -> Result<Vec<u64>> {
        let mut piece = Vec::with_capacity(64);
        // a SentencePiece-style vocab puts a space before every text fragment that starts the
        // text or follows a special token (`</s> words` → `</s>`, `▁▁words`); whether this one
        // does is read off a probe rather than its settings
        let probe = self.tokenize(b"a", false, false)?;
        let space_prefix = match probe.first() {
            Some(&t) => {
                self.token_to_piece(t, &mut piece)?;
                piece.first() == Some(&b' ')
            }
            None => false,
        };
        let mut offsets = Vec::with_capacity(tokens.len());
        let mut at = 0usize;
        let mut fragment_start = true;
        for (i, &tok) in tokens.iter().enumerate() {
            self.token_to_piece(tok, &mut piece)?;
            let rest = &text[at..];
            offsets.push(at as u64);
            let special = self.is_special_fragment(tok);
            // the first piece of a fragment carries the added space: it is not in the text
            let body = if space_prefix && fragment_start && !special && piece.first() == Some(&b' ') { &piece[1..] } else { &piece[..] };
            if rest.starts_with(body) {
                at += body.len();
            } else if i == 0 && tok == self.bos() {
                // added BOS: zero width
            } else {
                bail!(
                    "token {i} (id {tok}, {:?}) does not spell the text at byte {at}: cannot map tokens to byte offsets for this vocab",
                    String::from_utf8_lossy(&piece)
                );
            }
            fragment_start = special;
        }
        if at != text.len() {
            bail!("the tokens spell {at} of the text's {} bytes: cannot map tokens to byte offsets for this vocab", text.len());
        }
        Ok(offsets)
    }
}
