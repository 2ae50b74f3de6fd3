//! Writes a pruned GGUF from a memory map of the source, tensor by tensor.
//!
//! Memory stays flat whatever the model size: data goes from the map straight to `write(2)`
//! in windows of [`WINDOW`] bytes, and each window's pages are dropped from the mapping
//! (`MADV_DONTNEED`) once written, so the resident set never holds more than a window of the
//! model (the kernel's page cache keeps what it likes; that is not this process's memory).

use super::plan::Step;
use crate::formats::gguf::pad;
use anyhow::{Context as _, Result};
use memmap2::{Mmap, UncheckedAdvice};
use std::io::Write;
use std::path::Path;

/// Bytes copied between two drops of mapped pages.
const WINDOW: usize = 16 << 20;

/// Writes `header` (which already holds the output tensor infos and the padding to the data
/// section), then each step's data: whole, or the kept experts' runs in ascending id order,
/// each tensor padded to `alignment`. `offsets` are the output offsets the header promised;
/// they are checked as the file is written. Returns the bytes written.
pub fn write(path: &Path, src: &Mmap, header: &[u8], steps: &[Step], offsets: &[u64], keep: &[Vec<u16>], alignment: u64) -> Result<u64> {
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let _ = src.advise(memmap2::Advice::Sequential);
    let err = || format!("writing {}", path.display());
    // bytes copied, on the progress line once the copy runs longer than about two seconds
    let total = header.len() as u64 + steps.iter().map(|s| pad(s.out.nbytes(), alignment)).sum::<u64>();
    let bar = crate::progress::start(total, crate::progress::Unit::Bytes).label("prune");
    w.write_all(header).with_context(err)?;
    crate::progress::add(header.len() as u64);
    let mut written = header.len() as u64;
    let zeros = vec![0u8; alignment as usize];
    for (step, &offset) in steps.iter().zip(offsets) {
        anyhow::ensure!(written == header.len() as u64 + offset, "internal error: {} would land at {written}", step.out.name);
        let start = step.src_start as usize;
        let n = match step.slice {
            None => {
                copy(src, start, step.src.nbytes() as usize, &mut w).with_context(err)?;
                step.src.nbytes()
            }
            Some((slot, per)) => {
                for &e in &keep[slot] {
                    copy(src, start + e as usize * per as usize, per as usize, &mut w).with_context(err)?;
                }
                per * keep[slot].len() as u64
            }
        };
        debug_assert_eq!(n, step.out.nbytes());
        let padded = pad(n, alignment);
        w.write_all(&zeros[..(padded - n) as usize]).with_context(err)?;
        crate::progress::add(padded - n);
        written += padded;
    }
    w.flush().with_context(err)?;
    bar.finish();
    Ok(written)
}

/// Copies `len` bytes of the map from `start`, a window at a time, dropping each window's
/// pages from the mapping once written.
fn copy(src: &Mmap, start: usize, len: usize, w: &mut impl Write) -> std::io::Result<()> {
    let mut at = start;
    let end = start + len;
    while at < end {
        let next = end.min(at + WINDOW);
        w.write_all(&src[at..next])?;
        crate::progress::add((next - at) as u64);
        // SAFETY: the map is read-only and private to this process; dropping its pages only
        // makes a later read fault them in again from the file. No slice of the dropped range
        // outlives this call.
        unsafe {
            let _ = src.unchecked_advise_range(UncheckedAdvice::DontNeed, at, next - at);
        }
        at = next;
    }
    Ok(())
}
