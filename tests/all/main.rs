//! All integration tests, in one binary (one link, shared fixtures).

mod build_steps;
mod decode;
mod drop_in;
mod fixture;
mod manifest;
mod replay;
mod select;
mod reap;
mod trampoline;
mod util;
