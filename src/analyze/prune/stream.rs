//! Writes a pruned GGUF from the source, tensor by tensor.
//!
//! Memory stays flat whatever the model size. Each run of bytes (a whole tensor, or one kept
//! expert's slice) is copied by the kernel with `copy_file_range(2)`, page cache to page
//! cache, without mapping it into this process (measured on the 460 MiB bench model: the
//! mapped copy took 3× `cp`). Where the file systems do not allow that, data goes from the
//! memory map to `write(2)` in windows of [`WINDOW`] bytes, each window's pages dropped from
//! the mapping (`MADV_DONTNEED`) once written, so the resident set never holds more than a
//! window of the model (the page cache keeps what it likes; that is not this process's memory).

use super::plan::Step;
use crate::formats::gguf::pad;
use anyhow::{Context as _, Result};
use memmap2::{Mmap, UncheckedAdvice};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::fd::AsRawFd;
use std::path::Path;

/// Bytes copied between two drops of mapped pages.
const WINDOW: usize = 16 << 20;

/// Writes `header` (which already holds the output tensor infos and the padding to the data
/// section), then each step's data (from its shard of `srcs`): whole, or the kept experts'
/// runs in ascending id order, or the step's own bytes, each tensor padded to `alignment`. `offsets` are the output
/// offsets the header promised; they are checked as the file is written. Returns the bytes
/// written.
pub fn write(path: &Path, srcs: &[(&Mmap, &File)], header: &[u8], steps: &[Step], offsets: &[u64], keep: &[Vec<u16>], alignment: u64) -> Result<u64> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    // REAP_PRUNE_COPY=map forces the mapped copy (the fallback; tested against the kernel copy)
    let mut kernel_copy = std::env::var("REAP_PRUNE_COPY").map_or(true, |v| v != "map");
    for (src, _) in srcs {
        let _ = src.advise(memmap2::Advice::Sequential);
    }
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
        let (src, src_file) = srcs[step.shard];
        let n = match step.slice {
            _ if step.data.is_some() => {
                let d = step.data.as_deref().unwrap();
                w.write_all(d).with_context(err)?;
                crate::progress::add(d.len() as u64);
                d.len() as u64
            }
            None => {
                copy(src, src_file, &mut kernel_copy, start, step.src.nbytes() as usize, &mut w).with_context(err)?;
                step.src.nbytes()
            }
            Some((slot, per)) => {
                for &e in &keep[slot] {
                    copy(src, src_file, &mut kernel_copy, start + e as usize * per as usize, per as usize, &mut w).with_context(err)?;
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

/// Copies `len` bytes of the source from `start` to the end of `w`: by `copy_file_range(2)`
/// while `kernel_copy` holds (cleared for good when the kernel refuses it for these files),
/// else from the map.
fn copy(src: &Mmap, src_file: &File, kernel_copy: &mut bool, start: usize, len: usize, w: &mut BufWriter<File>) -> std::io::Result<()> {
    let mut at = start;
    let end = start + len;
    if *kernel_copy {
        w.flush()?;
        let (fd_in, fd_out) = (src_file.as_raw_fd(), w.get_ref().as_raw_fd());
        while at < end {
            let mut off_in = at as libc::loff_t;
            // SAFETY: plain syscall on two open descriptors; the output offset is the file's own,
            // which the flushed writer left at the end of what it wrote.
            let r = unsafe { libc::copy_file_range(fd_in, &mut off_in, fd_out, std::ptr::null_mut(), (end - at).min(WINDOW), 0) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EXDEV | libc::ENOSYS | libc::EINVAL | libc::EOPNOTSUPP | libc::EPERM) => {
                        *kernel_copy = false;
                        break;
                    }
                    _ => return Err(e),
                }
            }
            if r == 0 {
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the source ended early"));
            }
            crate::progress::add(r as u64);
            at += r as usize;
        }
    }
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
