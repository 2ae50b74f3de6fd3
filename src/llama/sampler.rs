//! Token sampling for generation: a llama.cpp sampler chain, greedy (argmax, as
//! `llama-simple` samples) or temperature then a seeded draw.

use super::context::Context;
use super::eval_callback::GraphObserver;
use super::sys;

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// the most probable token (llama.cpp's greedy sampler)
    Greedy,
    /// softmax of logits / temp, then one draw from a generator seeded with `seed`
    Temperature { temp: f32, seed: u32 },
}

pub struct Sampler {
    raw: *mut sys::llama_sampler,
}

impl Sampler {
    pub fn new(s: Sampling) -> Sampler {
        // SAFETY: the chain takes ownership of every sampler added to it and frees them with
        // itself (Drop); the init functions return fresh samplers.
        unsafe {
            let raw = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
            assert!(!raw.is_null(), "llama_sampler_chain_init returned null");
            match s {
                Sampling::Greedy => sys::llama_sampler_chain_add(raw, sys::llama_sampler_init_greedy()),
                Sampling::Temperature { temp, seed } => {
                    sys::llama_sampler_chain_add(raw, sys::llama_sampler_init_temp(temp));
                    sys::llama_sampler_chain_add(raw, sys::llama_sampler_init_dist(seed));
                }
            }
            Sampler { raw }
        }
    }

    /// Samples from the logits of output `idx` of the context's last decode (-1: the last
    /// output), and accepts the token into the chain's state.
    pub fn sample<O: GraphObserver>(&mut self, ctx: &Context<'_, O>, idx: i32) -> i32 {
        // SAFETY: live sampler and context; llama.cpp checks idx against the outputs it holds.
        unsafe { sys::llama_sampler_sample(self.raw, ctx.as_ptr(), idx) }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        // SAFETY: owned chain, freed once (with the samplers it holds).
        unsafe { sys::llama_sampler_free(self.raw) }
    }
}
