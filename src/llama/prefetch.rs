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
//!
//! Tensors that lie close together in one device buffer are copied as one span (a tensor of our
//! own over those bytes, [`coalesce`]): the graph allocator places a layer's small kept nodes
//! near each other, and a copy has a fixed cost (a call and an event on CUDA, a round trip
//! over RPC). Measured over RPC on a 16-layer fixture with `--imatrix-on-device` and a trace:
//! 112 tensors per ubatch in 17 spans of adjacent tensors. `REAP_COALESCE=0` copies each alone.

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
    /// copies made (spans of nearby tensors copied as one: see [`coalesce`])
    pub copies: u64,
    /// copy each tensor alone (`REAP_COALESCE=0`)
    pub one_by_one: bool,
    /// a context of our own for the tensors that span several (no data of its own)
    spans: Option<SpanContext>,
}

/// A ggml context holding the metadata of the span tensors of a batch, remade where more are
/// needed.
struct SpanContext {
    ctx: *mut sys::ggml_context,
    capacity: usize,
}

/// Tensors closer than this in a buffer are copied as one span (the bytes between come along):
/// the allocator's alignment padding, not a tensor left on the device between two read ones.
const SPAN_GAP: usize = 512;
/// A span grows to at most this (a larger tensor is copied alone): large reads keep one copy
/// and event each, so the host's work on the first overlaps the copies of the rest.
const SPAN_MAX: usize = 4 << 20;

/// One copy of a batch: `[start, end)` of buffer `buf`'s device addresses, the tensors in it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Span {
    pub buf: usize,
    pub start: usize,
    pub end: usize,
    /// (index of the tensor in read order, its address)
    pub members: Vec<(usize, usize)>,
}

/// Groups tensors `(buffer, address, bytes)`, given in read order, into spans: those of one
/// buffer in address order, each joining the span before where it starts within [`SPAN_GAP`]
/// of its end and the span stays within [`SPAN_MAX`] (overlapping views join theirs). The spans
/// come in the order of their first tensor in read order, so early reads wait for early copies.
pub(crate) fn coalesce(items: &[(usize, usize, usize)]) -> Vec<Span> {
    let mut by_addr: Vec<usize> = (0..items.len()).collect();
    by_addr.sort_by_key(|&i| (items[i].0, items[i].1, i));
    let mut spans: Vec<Span> = Vec::new();
    for i in by_addr {
        let (buf, a, n) = items[i];
        match spans.last_mut() {
            Some(s) if s.buf == buf && a <= s.end + SPAN_GAP && s.end.max(a + n) - s.start <= SPAN_MAX => {
                s.end = s.end.max(a + n);
                s.members.push((i, a));
            }
            _ => spans.push(Span { buf, start: a, end: a + n, members: vec![(i, a)] }),
        }
    }
    spans.sort_by_key(|s| s.members.iter().map(|m| m.0).min());
    spans
}

/// Places spans one after another in a staging area whose start is [`ALIGN`]ed, each at an
/// offset congruent to its device address modulo [`ALIGN`]: every tensor in it is then staged
/// as aligned as it lies on the device (a span may start at a view or a tensor packed at any
/// address, and the readers need f32 and i32 data on 4-byte boundaries). Returns the spans with
/// their offsets, and the bytes they take.
pub(crate) fn place(spans: Vec<Span>) -> (Vec<(Span, usize)>, usize) {
    let mut off = 0usize;
    let placed = spans
        .into_iter()
        .map(|s| {
            let at = off.div_ceil(ALIGN) * ALIGN + s.start % ALIGN;
            off = at + s.end - s.start;
            (s, at)
        })
        .collect();
    (placed, off)
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
        p.one_by_one = std::env::var("REAP_COALESCE").is_ok_and(|v| v == "0");
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
        // per device: (tensor, its buffer, bytes), in read order
        let mut plan: Vec<Vec<(*mut sys::ggml_tensor, sys::ggml_backend_buffer_t, usize)>> = Vec::new();
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
            plan[d].push((t, buf, n));
        }
        // per device: the copies (spans of tensors, or one each), their places in its staging
        let mut copies = Vec::with_capacity(plan.len());
        let mut spanning = 0;
        for items in &plan {
            let spans = if self.one_by_one {
                items.iter().enumerate().map(|(i, &(t, buf, n))| Span { buf: buf as usize, start: (*t).data as usize, end: (*t).data as usize + n, members: vec![(i, (*t).data as usize)] }).collect()
            } else {
                coalesce(&items.iter().map(|&(t, buf, n)| (buf as usize, (*t).data as usize, n)).collect::<Vec<_>>())
            };
            let (placed, total) = place(spans);
            spanning += placed.iter().filter(|(s, _)| s.members.len() > 1).count();
            copies.push((placed, total));
        }
        let spans_ctx = self.span_context(spanning)?;
        let mut b = Staged::default();
        for (d, (items, (placed, total))) in plan.iter().zip(&copies).enumerate() {
            let backend = self.devices[d].backend;
            let events = if self.whole || placed.is_empty() { None } else { self.events(d, placed.len()) };
            b.streams.push(Stream { backend, events: events.unwrap_or_default(), done: 0 });
            if placed.is_empty() {
                continue;
            }
            let base = match self.staging(d, *total) {
                Ok(p) => p,
                Err(e) => {
                    // the copies already started must end before their tensors can go
                    STAGED.with_borrow_mut(|m| *m = b);
                    self.release();
                    return Err(e);
                }
            };
            for (c, (span, off)) in placed.iter().enumerate() {
                let len = span.end - span.start;
                let whole = match &span.members[..] {
                    &[(i, _)] => Some(items[i].0),
                    _ => None,
                };
                // one tensor: itself; several: a tensor of ours over their bytes
                let t = whole.unwrap_or_else(|| {
                    let t = sys::ggml_new_tensor_1d(spans_ctx, sys::GGML_TYPE_I8, len as i64);
                    (*t).buffer = span.buf as sys::ggml_backend_buffer_t;
                    (*t).data = span.start as *mut std::ffi::c_void;
                    t
                });
                sys::ggml_backend_tensor_get_async(backend, t, base.add(*off).cast(), 0, len);
                if let Some(&e) = b.streams[d].events.get(c) {
                    sys::ggml_backend_event_record(e, backend);
                }
                for &(i, a) in &span.members {
                    let (t, _, n) = items[i];
                    b.tensors.insert(t as usize, (base.add(off + (a - span.start)) as *const u8, n, d, c));
                }
                super::tensor::DEVICE_TO_HOST_BYTES.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
            }
            if b.streams[d].events.is_empty() {
                sys::ggml_backend_synchronize(backend);
                b.streams[d].done = placed.len();
                self.waits += 1;
            }
            self.tensors += items.len() as u64;
            self.copies += placed.len() as u64;
            self.batches += 1;
        }
        STAGED.with_borrow_mut(|m| *m = b);
        self.busy += t0.elapsed();
        Ok(())
    }

    /// A context with room for `n` span tensors, emptied (the last batch's are done with).
    unsafe fn span_context(&mut self, n: usize) -> Result<*mut sys::ggml_context> {
        if let Some(c) = self.spans.as_ref().filter(|c| c.capacity >= n) {
            sys::ggml_reset(c.ctx);
            return Ok(c.ctx);
        }
        if let Some(c) = self.spans.take() {
            sys::ggml_free(c.ctx);
        }
        let capacity = (n + n / 2).max(64);
        let ctx = sys::ggml_init(sys::ggml_init_params { mem_size: sys::ggml_tensor_overhead() * capacity, mem_buffer: std::ptr::null_mut(), no_alloc: true });
        if ctx.is_null() {
            bail!("ggml_init failed for the copies' spans");
        }
        self.spans = Some(SpanContext { ctx, capacity });
        Ok(ctx)
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
        if let Some(c) = self.spans.take() {
            // SAFETY: our context, its tensors' copies done (released above).
            unsafe { sys::ggml_free(c.ctx) };
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Nearby tensors of a buffer share a copy; a gap over `SPAN_GAP`, another buffer or the
    /// `SPAN_MAX` limit start a new one; a view inside another tensor joins it; every tensor is
    /// in exactly one span, inside it; the spans come in the order their tensors are read.
    #[test]
    fn nearby_tensors_share_a_copy() {
        let k = 1024;
        let gap = SPAN_GAP;
        // (buffer, address, bytes) in read order
        let items = [
            (1, 10_000 * k, 4 * k),            // 0: buffer 1, far from the rest
            (2, 4 * k + gap, 4 * k),           // 1: buffer 2 from here
            (2, 0, 4 * k),                     // 2: SPAN_GAP before 1
            (2, 8 * k + gap + 64, 2 * k),      // 3: 64 bytes after 1
            (2, 9 * k + gap, 512),             // 4: a view inside 3
            (2, 10 * k + 2 * gap + 65, k),     // 5: just past the gap after 3
            (2, 200 * k, SPAN_MAX),            // 6: too large to join
            (2, 200 * k + SPAN_MAX, 4),        // 7: right after it, alone past SPAN_MAX
        ];
        let spans = coalesce(&items);
        let members: Vec<Vec<usize>> = spans.iter().map(|s| s.members.iter().map(|m| m.0).collect()).collect();
        assert_eq!(members, vec![vec![0], vec![2, 1, 3, 4], vec![5], vec![6], vec![7]]);
        for s in &spans {
            for &(i, a) in &s.members {
                let (buf, at, n) = items[i];
                assert!(buf == s.buf && a == at && s.start <= at && at + n <= s.end, "{i} outside {s:?}");
            }
        }
        assert_eq!((spans[1].start, spans[1].end), (0, 10 * k + gap + 64));
        assert!(coalesce(&[]).is_empty());
    }

    #[test]
    fn staged_tensors_keep_their_device_alignment() {
        // a span starting at a view 2 bytes into a line, with an f32 tensor after it; spans
        // of odd lengths; one tensor alone at an aligned address
        let items = [(1, 1_000_002, 6), (1, 1_000_064, 256), (1, 2_000_000, 100), (2, 3_000_037, 3), (2, 4_000_000, 8)];
        let spans = coalesce(&items);
        assert_eq!(spans.len(), 4, "{spans:?}");
        let (placed, total) = place(spans);
        let mut last_end = 0;
        for (s, at) in &placed {
            assert!(*at >= last_end, "{s:?} at {at} overlaps the span before (ends at {last_end})");
            last_end = at + s.end - s.start;
            for &(i, a) in &s.members {
                let staged = at + (a - s.start);
                assert_eq!(staged % ALIGN, items[i].1 % ALIGN, "tensor {i} staged at {staged}");
            }
        }
        assert_eq!(total, last_end);
        // aligned single tensors are placed as before: at multiples of ALIGN
        let (one, _) = place(vec![Span { buf: 1, start: 0, end: 100, members: vec![(0, 0)] }, Span { buf: 1, start: 4096, end: 4100, members: vec![(1, 4096)] }]);
        assert_eq!(one.iter().map(|p| p.1).collect::<Vec<_>>(), vec![0, 128]);
    }
}
