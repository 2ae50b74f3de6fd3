//! A batch of tokens for `llama_process` (the extended batch API used at the pin).

use super::sys;

pub struct Batch {
    raw: *mut sys::llama_batch_ext,
    len: usize,
}

impl Batch {
    pub(crate) fn new(ctx: *mut sys::llama_context) -> Batch {
        // SAFETY: sized by the context; freed in Drop.
        let raw = unsafe { sys::llama_batch_ext_init(ctx) };
        assert!(!raw.is_null(), "llama_batch_ext_init returned null");
        Batch { raw, len: 0 }
    }

    pub fn clear(&mut self) {
        unsafe { sys::llama_batch_ext_clear(self.raw) };
        self.len = 0;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds one token at `pos` of sequence `seq`; `output` requests its logits.
    pub fn add(&mut self, token: i32, pos: i32, seq: i32, output: bool) {
        // SAFETY: a live batch; the error codes are checked.
        unsafe {
            let idx = sys::llama_batch_ext_add_token(self.raw, seq, token);
            assert!(idx >= 0, "batch add failed ({idx}): batch full or invalid token {token}");
            // text tokens use pos[0] only, but the API reads a full M-RoPE section array
            let p = [pos, 0, 0, 0];
            sys::llama_batch_ext_set_pos(self.raw, idx, p.as_ptr());
            sys::llama_batch_ext_set_output_logits(self.raw, idx, output);
        }
        self.len += 1;
    }

    /// Adds one token with a hidden state row `h` (an MTP context's input: the trunk's final
    /// hidden state of the token before; llama.cpp takes it through the token's embedding slot
    /// and copies it).
    pub fn add_with_state(&mut self, token: i32, pos: i32, seq: i32, output: bool, h: &[f32]) {
        self.add(token, pos, seq, output);
        let idx = self.len as i32 - 1;
        let e = sys::llama_embd { data: h.as_ptr(), n_rows: 1, n_embd: h.len() };
        // SAFETY: a live batch; `h` is read (copied) during the call.
        let ok = unsafe { sys::llama_batch_ext_set_embd_token(self.raw, idx, e) };
        assert!(ok, "batch: the hidden state of row {idx} ({} values) was refused", h.len());
    }

    pub(crate) fn as_ptr(&mut self) -> *mut sys::llama_batch_ext {
        self.raw
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        unsafe { sys::llama_batch_ext_free(self.raw) }
    }
}
