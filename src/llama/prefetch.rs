//! Device-to-host copies of many tensors with one wait per device.
//!
//! At the end of an offloaded graph (patch 0002) the observer reads dozens of tensors per
//! layer. One `ggml_backend_tensor_get` each is a copy and a wait each (a round trip over RPC, a
//! stream synchronisation on CUDA). Here every tensor of a batch of reads is copied with
//! `ggml_backend_tensor_get_async` on a backend instance of ours for its device, into one
//! staging buffer per device (the device's pinned host memory where it has some, as CUDA does:
//! an asynchronous copy into pageable memory would wait anyway), then each device is waited for
//! once. [`Node::bytes`](super::Node::bytes) then finds the data staged and reads it there
//! in place (a second copy, at the exact imatrix's hundreds of MB per ubatch, cost more than
//! the sums). The scheduler waits for the device before it calls the callback, so the data the
//! copies read is complete.

use super::sys;
use anyhow::{bail, Result};
use std::cell::RefCell;
use std::collections::HashMap;

struct Device {
    dev: sys::ggml_backend_dev_t,
    backend: sys::ggml_backend_t,
    /// pinned host memory of the device (None where it has none: `fallback` is used)
    pinned: Option<(sys::ggml_backend_buffer_t, usize)>,
    fallback: Vec<u8>,
}

#[derive(Default)]
pub struct Prefetcher {
    devices: Vec<Device>,
    /// tensors copied, and waits made (one per device and batch)
    pub tensors: u64,
    pub waits: u64,
    /// time spent copying and waiting
    pub busy: std::time::Duration,
}

thread_local! {
    /// tensor → (staged bytes, length) of the batch being read; empty outside one
    static STAGED: RefCell<HashMap<usize, (*const u8, usize)>> = RefCell::new(HashMap::new());
}

/// The staged copy of `t`'s bytes, if the batch being read holds it.
pub(crate) fn staged(t: *const sys::ggml_tensor) -> Option<(*const u8, usize)> {
    STAGED.with_borrow(|m| m.get(&(t as usize)).copied())
}

const ALIGN: usize = 64;

impl Prefetcher {
    /// Copies the data of `tensors` (off-host ones; duplicates once) and waits for it, then
    /// stages it for [`staged`] until [`Prefetcher::release`].
    ///
    /// # Safety
    /// Every tensor must be live, with its data valid until `release`.
    pub unsafe fn fetch(&mut self, tensors: &[*mut sys::ggml_tensor]) -> Result<()> {
        let t0 = std::time::Instant::now();
        self.release();
        // per device: (tensor, offset in its staging, bytes)
        let mut plan: Vec<Vec<(*mut sys::ggml_tensor, usize, usize)>> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for &t in tensors {
            if t.is_null() || !seen.insert(t as usize) {
                continue;
            }
            let buf = if (*t).view_src.is_null() { (*t).buffer } else { (*(*t).view_src).buffer };
            if buf.is_null() || sys::ggml_backend_buffer_is_host(buf) {
                continue;
            }
            let n = sys::ggml_nbytes(t);
            let d = self.device_of(buf)?;
            if plan.len() <= d {
                plan.resize_with(d + 1, Vec::new);
            }
            let off = plan[d].last().map_or(0, |&(_, o, n)| (o + n).div_ceil(ALIGN) * ALIGN);
            plan[d].push((t, off, n));
        }
        let mut staged = HashMap::new();
        for (d, items) in plan.iter().enumerate().filter(|(_, v)| !v.is_empty()) {
            let total = items.last().map_or(0, |&(_, o, n)| o + n);
            let base = self.staging(d, total)?;
            let backend = self.devices[d].backend;
            for &(t, off, n) in items {
                sys::ggml_backend_tensor_get_async(backend, t, base.add(off).cast(), 0, n);
                staged.insert(t as usize, (base.add(off) as *const u8, n));
                super::tensor::DEVICE_TO_HOST_BYTES.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            }
            sys::ggml_backend_synchronize(backend);
            self.tensors += items.len() as u64;
            self.waits += 1;
        }
        STAGED.with_borrow_mut(|m| *m = staged);
        self.busy += t0.elapsed();
        Ok(())
    }

    /// Forgets the staged copies (their memory is reused by the next batch).
    pub fn release(&mut self) {
        STAGED.with_borrow_mut(|m| m.clear());
    }

    /// Our backend instance for the device of `buf`.
    unsafe fn device_of(&mut self, buf: sys::ggml_backend_buffer_t) -> Result<usize> {
        let dev = sys::ggml_backend_buft_get_device(sys::ggml_backend_buffer_get_type(buf));
        if dev.is_null() {
            bail!("a tensor's buffer type has no device");
        }
        if let Some(i) = self.devices.iter().position(|d| d.dev == dev) {
            return Ok(i);
        }
        let backend = sys::ggml_backend_dev_init(dev, std::ptr::null());
        if backend.is_null() {
            bail!("could not start a backend on a tensor's device");
        }
        self.devices.push(Device { dev, backend, pinned: None, fallback: Vec::new() });
        Ok(self.devices.len() - 1)
    }

    /// At least `n` bytes of staging for device `d`: its pinned host memory, else ours.
    unsafe fn staging(&mut self, d: usize, n: usize) -> Result<*mut u8> {
        let dev = &mut self.devices[d];
        let host = sys::ggml_backend_dev_host_buffer_type(dev.dev);
        if !host.is_null() {
            if dev.pinned.is_none_or(|(_, size)| size < n) {
                if let Some((b, _)) = dev.pinned.take() {
                    sys::ggml_backend_buffer_free(b);
                }
                // room to grow: the reads of a ubatch vary little
                let size = (n + n / 4).max(1 << 20);
                let b = sys::ggml_backend_buft_alloc_buffer(host, size);
                if b.is_null() {
                    bail!("could not allocate {size} bytes of pinned host memory for device reads");
                }
                dev.pinned = Some((b, size));
            }
            return Ok(sys::ggml_backend_buffer_get_base(dev.pinned.unwrap().0).cast());
        }
        if dev.fallback.len() < n + ALIGN {
            dev.fallback.resize(n + ALIGN, 0);
        }
        let p = dev.fallback.as_mut_ptr();
        Ok(p.add(p.align_offset(ALIGN)))
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.release();
        for d in self.devices.drain(..) {
            // SAFETY: objects created by this prefetcher, freed once.
            unsafe {
                if let Some((b, _)) = d.pinned {
                    sys::ggml_backend_buffer_free(b);
                }
                sys::ggml_backend_free(d.backend);
            }
        }
    }
}
