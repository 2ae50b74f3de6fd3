//! Device-to-host copies of many tensors, started together, read as they arrive.
//!
//! At the end of an offloaded graph (patch 0002) the observer reads dozens of tensors per
//! layer. One `ggml_backend_tensor_get` each is a copy and a wait each (a round trip over RPC, a
//! stream synchronisation on CUDA). Here every tensor of a batch of reads is copied with
//! `ggml_backend_tensor_get_async` on a backend instance of ours for its device, into one
//! staging buffer per device (the device's pinned host memory where it has some, as CUDA does:
//! an asynchronous copy into pageable memory would wait anyway), an event recorded after each
//! copy, so that a read waits only for the copies up to its own while the later ones go on:
//! the host's sums over the first tensors overlap the copies of the rest (a device without
//! events, or `REAP_STREAM=0`: each device is waited for once, before the reads).
//! [`Node::bytes`](super::Node::bytes) then finds the data staged and reads it there in place
//! (a second copy, at the exact imatrix's hundreds of MB per ubatch, cost more than the sums).
//! The scheduler waits for the device before it calls the callback, so the data the copies
//! read is complete.

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
    /// events recorded after each copy of a batch, reused
    events: Vec<sys::ggml_backend_event_t>,
    /// the device has no events: its batches are waited for whole
    no_events: bool,
}

#[derive(Default)]
pub struct Prefetcher {
    devices: Vec<Device>,
    /// tensors copied, batches of copies (one per device and batch of reads), and waits made
    /// (with events, one wherever a read found its copy not known done; else one per batch)
    pub tensors: u64,
    pub batches: u64,
    pub waits: u64,
    /// time spent starting the copies and waiting for them
    pub busy: std::time::Duration,
    /// wait for each device's whole batch before the reads (`REAP_STREAM=0`), not copy by copy
    pub whole: bool,
}

/// One device's copies in the batch being read.
struct Stream {
    backend: sys::ggml_backend_t,
    /// the event recorded after each copy, in copy order (empty: the batch was waited for)
    events: Vec<sys::ggml_backend_event_t>,
    /// copies known done: those before this index
    done: usize,
}

#[derive(Default)]
struct Staged {
    /// tensor → (staged bytes, length, device, place in the device's copy order)
    tensors: HashMap<usize, (*const u8, usize, usize, usize)>,
    streams: Vec<Stream>,
    waits: u64,
    waited: std::time::Duration,
}

thread_local! {
    /// the batch being read; empty outside one
    static STAGED: RefCell<Staged> = RefCell::new(Staged::default());
}

/// The staged copy of `t`'s bytes, if the batch being read holds it, once it has arrived:
/// copies on one device complete in order, so the event after this one's covers every earlier
/// one, and a read waits only for the copies up to its own while later ones go on.
pub(crate) fn staged(t: *const sys::ggml_tensor) -> Option<(*const u8, usize)> {
    STAGED.with_borrow_mut(|b| {
        let &(p, n, d, seq) = b.tensors.get(&(t as usize))?;
        let s = &mut b.streams[d];
        if seq >= s.done {
            let t0 = std::time::Instant::now();
            // SAFETY: an event of ours, recorded after this copy on the device's backend.
            unsafe { sys::ggml_backend_event_synchronize(s.events[seq]) };
            s.done = seq + 1;
            b.waits += 1;
            b.waited += t0.elapsed();
        }
        Some((p, n))
    })
}

const ALIGN: usize = 64;

impl Prefetcher {
    /// Reads wait copy by copy where the device has events, unless `REAP_STREAM=0`.
    pub fn new() -> Self {
        let mut p = Prefetcher::default();
        p.whole = std::env::var("REAP_STREAM").is_ok_and(|v| v == "0");
        p
    }

    /// Starts copying the data of `tensors` (off-host ones; duplicates once), in their order,
    /// and stages it for [`staged`] until [`Prefetcher::release`]: a read waits for its own
    /// copy (the device's event after it) while the later ones go on, so the host's work on
    /// the first tensors overlaps the copies of the rest (`whole`, or a device without
    /// events: each device's batch is waited for here).
    ///
    /// # Safety
    /// Every tensor must be live, with its data valid until `release`.
    pub unsafe fn fetch(&mut self, tensors: &[*mut sys::ggml_tensor]) -> Result<()> {
        self.release();
        let t0 = std::time::Instant::now();
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
        let mut b = Staged::default();
        for (d, items) in plan.iter().enumerate() {
            let backend = self.devices[d].backend;
            let events = if self.whole || items.is_empty() { None } else { self.events(d, items.len()) };
            b.streams.push(Stream { backend, events: events.unwrap_or_default(), done: 0 });
            if items.is_empty() {
                continue;
            }
            let total = items.last().map_or(0, |&(_, o, n)| o + n);
            let base = match self.staging(d, total) {
                Ok(p) => p,
                Err(e) => {
                    // the copies already started must end before their tensors can go
                    STAGED.with_borrow_mut(|m| *m = b);
                    self.release();
                    return Err(e);
                }
            };
            for (i, &(t, off, n)) in items.iter().enumerate() {
                sys::ggml_backend_tensor_get_async(backend, t, base.add(off).cast(), 0, n);
                if let Some(&e) = b.streams[d].events.get(i) {
                    sys::ggml_backend_event_record(e, backend);
                }
                b.tensors.insert(t as usize, (base.add(off) as *const u8, n, d, i));
                super::tensor::DEVICE_TO_HOST_BYTES.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            }
            if b.streams[d].events.is_empty() {
                sys::ggml_backend_synchronize(backend);
                b.streams[d].done = items.len();
                self.waits += 1;
            }
            self.tensors += items.len() as u64;
            self.batches += 1;
        }
        STAGED.with_borrow_mut(|m| *m = b);
        self.busy += t0.elapsed();
        Ok(())
    }

    /// At least `n` events of device `d`, created on first need; None where it has none.
    unsafe fn events(&mut self, d: usize, n: usize) -> Option<Vec<sys::ggml_backend_event_t>> {
        let dev = &mut self.devices[d];
        while !dev.no_events && dev.events.len() < n {
            let e = sys::ggml_backend_event_new(dev.dev);
            if e.is_null() {
                dev.no_events = true;
            } else {
                dev.events.push(e);
            }
        }
        (!dev.no_events).then(|| dev.events[..n].to_vec())
    }

    /// Waits for every copy still under way and forgets the staged copies (their memory is
    /// reused by the next batch).
    pub fn release(&mut self) {
        let b = STAGED.with_borrow_mut(std::mem::take);
        let t0 = std::time::Instant::now();
        for s in b.streams.iter().filter(|s| s.done < s.events.len()) {
            // SAFETY: our backend instance, whose copies read tensors still live.
            unsafe { sys::ggml_backend_synchronize(s.backend) };
            self.waits += 1;
        }
        self.waits += b.waits;
        self.busy += b.waited + t0.elapsed();
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
        self.devices.push(Device { dev, backend, pinned: None, fallback: Vec::new(), events: Vec::new(), no_events: false });
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
                for e in d.events {
                    sys::ggml_backend_event_free(e);
                }
                sys::ggml_backend_free(d.backend);
            }
        }
    }
}
