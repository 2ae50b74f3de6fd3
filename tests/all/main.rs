//! All integration tests, in one binary (one link, shared fixtures).

mod bad_input;
mod build_steps;
mod corpus;
mod coverage;
mod decode;
mod drop_in;
mod eval;
mod export;
mod faults;
mod fixture;
mod interrupt;
mod manifest;
mod nextn;
mod progress;
mod prune;
mod replay;
mod select;
mod split;
mod reap;
mod trampoline;
mod util;
