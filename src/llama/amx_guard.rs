//! A guard against a wrong product of the pin's AMX kernels. On a CPU with AMX the CPU
//! backend's extra buffer type "AMX" holds f16 and some quantized weights (unless
//! `--no-repack`), and its matmul (`ggml-cpu/amx/mmq.cpp`, `ggml_backend_amx_mul_mat`) takes
//! the input's rows as `dst->ne[1]` only: an input of 3 or 4 dimensions gets its first 2-D
//! slice multiplied and the rest of the output left as it was. Its `supports_op` does not
//! check for that, so the result is wrong without a word. Graphs that multiply a weight by a
//! 3-D input exist: the gated delta net blocks of qwen35moe/qwen3next project
//! `[value_dim, n_seq_tokens, n_seqs]` through `ssm_out`, 3-D once a ubatch holds two
//! sequences (llama-imatrix's and llama-perplexity's default, `-b` over `-c`). Seen
//! 2026-12-03 on the qwen35moe fixture: upstream's llama-perplexity gives PPL 68158 with two
//! sequences per batch and 20896 with one, and 20896 both ways with `-nr`.
//!
//! So the callback, asked about a matmul node, refuses one whose weight is in an AMX buffer
//! and whose input has more than one 2-D slice: it asks for the node, and when ggml hands it
//! over computed, stops the graph before any node reads it; the decode returns the refusal
//! as its error, so nothing of that ubatch reaches a file.

use super::sys;
use super::tensor::Node;
use std::ffi::CStr;

/// Why the graph must stop at `node` (before anything reads it), if it is such a matmul.
pub(crate) fn refuse(node: Node<'_>) -> Option<String> {
    let t = node.info();
    if t.op != sys::GGML_OP_MUL_MAT {
        return None;
    }
    let (w, x) = (node.src(0)?, node.src(1)?);
    let xi = x.info();
    if xi.ne[2] * xi.ne[3] <= 1 || w.buffer_type_name()? != "AMX" {
        return None;
    }
    Some(message(w.name(), xi.ne))
}

fn message(weight: &str, ne: [i64; 4]) -> String {
    let shape = ne.iter().map(|n| n.to_string()).collect::<Vec<_>>().join("×");
    format!(
        "{weight} sits in ggml's AMX buffer and is multiplied by a {shape} input; at the pinned llama.cpp the AMX \
         kernel multiplies only a 2-D input's worth of it and leaves the rest of the product wrong (upstream's tools \
         give such results silently). Run with --no-repack (-nr), which keeps the weights out of the AMX buffer, or \
         with one sequence per batch (-b equal to -c)"
    )
}

impl Node<'_> {
    /// The name of the buffer type holding the tensor's data (`CPU`, `AMX`, `CUDA0`, `RPC…`).
    pub(crate) fn buffer_type_name(&self) -> Option<&str> {
        let b = self.raw_buffer();
        if b.is_null() {
            return None;
        }
        // SAFETY: a live tensor's buffer; its type's name is a static string.
        unsafe { CStr::from_ptr(sys::ggml_backend_buft_name(sys::ggml_backend_buffer_get_type(b))) }.to_str().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_weight_the_shape_and_the_ways_around() {
        let m = message("blk.0.ssm_out.weight", [64, 128, 2, 1]);
        assert!(m.starts_with("blk.0.ssm_out.weight sits in ggml's AMX buffer"), "{m}");
        assert!(m.contains("64×128×2×1") && m.contains("--no-repack (-nr)") && m.contains("-b equal to -c"), "{m}");
    }
}
