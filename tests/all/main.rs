//! All integration tests, in one binary (one link, shared fixtures).

mod build_steps;
mod drop_in;
mod eval;
mod fixture;
mod manifest;
mod replay;
mod select;
mod reap;
mod trampoline;
mod util;
