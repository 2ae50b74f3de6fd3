//! Views of graph tensors as the eval callback sees them.
//!
//! `TensorInfo` is plain data (name, op, type, shape, strides) so the callback's decisions
//! are unit-tested without a model; `Node` wraps a live `ggml_tensor` for the duration of one
//! callback and reads its data, copying from device memory when needed.

use super::sys;
use std::ffi::CStr;
use std::marker::PhantomData;

/// The shape of a tensor, detached from ggml.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo<'a> {
    pub name: &'a str,
    pub op: sys::ggml_op,
    pub ty: sys::ggml_type,
    /// elements per dimension
    pub ne: [i64; 4],
    /// bytes between consecutive elements of each dimension
    pub nb: [usize; 4],
}

impl TensorInfo<'_> {
    /// Rows = product of dimensions 1..3.
    pub fn nrows(&self) -> i64 {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Byte offset of element (i0, i1, i2, i3).
    pub fn offset(&self, i: [i64; 4]) -> usize {
        (0..4).map(|d| i[d] as usize * self.nb[d]).sum()
    }

    /// Bytes spanned by the tensor's data, strides included (what `ggml_nbytes` returns).
    pub fn nbytes(&self) -> usize {
        if self.ne.iter().any(|&n| n <= 0) {
            return 0;
        }
        // SAFETY: pure function of the type id.
        let blck = unsafe { sys::ggml_blck_size(self.ty) } as i64;
        let tsize = unsafe { sys::ggml_type_size(self.ty) };
        let mut n = (self.ne[0] / blck) as usize * tsize;
        for d in 1..4 {
            n += (self.ne[d] as usize - 1) * self.nb[d];
        }
        n
    }

    /// Reads the `i32` at (i0, i1) of a 2-D integer tensor through its strides.
    pub fn read_i32(&self, data: &[u8], i0: i64, i1: i64) -> i32 {
        let o = i0 as usize * self.nb[0] + i1 as usize * self.nb[1];
        i32::from_ne_bytes(data[o..o + 4].try_into().unwrap())
    }
}

/// A live graph node during one eval-callback call.
#[derive(Clone, Copy)]
pub struct Node<'a> {
    raw: *const sys::ggml_tensor,
    _life: PhantomData<&'a sys::ggml_tensor>,
}

impl<'a> Node<'a> {
    /// # Safety
    /// `raw` must point to a valid tensor that outlives `'a`.
    pub unsafe fn from_raw(raw: *const sys::ggml_tensor) -> Option<Node<'a>> {
        (!raw.is_null()).then_some(Node { raw, _life: PhantomData })
    }

    fn t(&self) -> &'a sys::ggml_tensor {
        // SAFETY: guaranteed by from_raw's contract.
        unsafe { &*self.raw }
    }

    /// The buffer holding the tensor's data (null before allocation).
    pub(crate) fn raw_buffer(&self) -> sys::ggml_backend_buffer_t {
        self.t().buffer
    }

    /// The tensor itself, for building graphs that read it (`reduce`).
    pub(crate) fn as_ptr(&self) -> *mut sys::ggml_tensor {
        self.raw as *mut sys::ggml_tensor
    }

    pub fn name(&self) -> &'a str {
        // SAFETY: ggml names are NUL-terminated fixed arrays inside the tensor.
        unsafe { CStr::from_ptr(self.t().name.as_ptr()) }.to_str().unwrap_or("")
    }

    pub fn info(&self) -> TensorInfo<'a> {
        let t = self.t();
        TensorInfo { name: self.name(), op: t.op, ty: t.type_, ne: t.ne, nb: t.nb }
    }

    pub fn src(&self, i: usize) -> Option<Node<'a>> {
        let p = *self.t().src.get(i)?;
        // SAFETY: sources of a live node are live for the same call.
        unsafe { Node::from_raw(p) }
    }

    /// Whether the graph keeps this tensor's data to its end (a graph output, and so is the
    /// tensor it views): patch 0002 marks what the callback reads that way.
    pub fn is_kept(&self) -> bool {
        let t = self.t();
        let out = |t: &sys::ggml_tensor| t.flags & sys::GGML_TENSOR_FLAG_OUTPUT as i32 != 0;
        // SAFETY: a live tensor's view source is live.
        out(t) && (t.view_src.is_null() || out(unsafe { &*t.view_src }))
    }

    /// Whether the data lives in host memory (readable in place).
    pub fn is_host(&self) -> bool {
        let t = self.t();
        if t.buffer.is_null() {
            return !t.data.is_null();
        }
        // SAFETY: a live tensor's buffer.
        unsafe { sys::ggml_backend_buffer_is_host(t.buffer) }
    }

    /// The tensor's bytes where they can be read without a device copy: in place on the host,
    /// or the copy a batch of reads staged (`prefetch`), valid until that batch is released
    /// (the observer releases it after the reads it made them for).
    pub fn resident_bytes(&self) -> Option<&'a [u8]> {
        let n = self.info().nbytes();
        let t = self.t();
        if self.is_host() && !t.data.is_null() {
            // SAFETY: host data of a live tensor spans nbytes.
            return Some(unsafe { std::slice::from_raw_parts(t.data as *const u8, n) });
        }
        let (p, len) = super::prefetch::staged(self.raw)?;
        debug_assert_eq!(len, n);
        // SAFETY: the staged copy of this tensor, valid until the batch is released, which
        // comes after the reads of the batch (not copied again: at the exact imatrix's sizes,
        // hundreds of MB per ubatch, a second copy cost as much as the sums)
        Some(unsafe { std::slice::from_raw_parts(p, len) })
    }

    /// The tensor's bytes: [`Self::resident_bytes`] where it can, else copied into `scratch`.
    pub fn bytes<'s>(&self, scratch: &'s mut Vec<u8>) -> &'s [u8]
    where
        'a: 's,
    {
        if let Some(b) = self.resident_bytes() {
            return b;
        }
        let n = self.info().nbytes();
        scratch.resize(n, 0);
        DEVICE_TO_HOST_BYTES.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: copying nbytes out of a live tensor into a buffer of that size.
        unsafe { sys::ggml_backend_tensor_get(self.raw, scratch.as_mut_ptr().cast(), 0, n) };
        &scratch[..]
    }
}

impl<'a> Node<'a> {
    /// `len` bytes of the tensor's data from byte `offset`: in place on the host, else copied.
    pub fn bytes_at<'s>(&self, offset: usize, len: usize, scratch: &'s mut Vec<u8>) -> &'s [u8]
    where
        'a: 's,
    {
        assert!(offset + len <= self.info().nbytes(), "{}: bytes {offset}..{} past its end", self.name(), offset + len);
        let t = self.t();
        if self.is_host() && !t.data.is_null() {
            // SAFETY: inside the host data of a live tensor (checked above).
            return unsafe { std::slice::from_raw_parts((t.data as *const u8).add(offset), len) };
        }
        scratch.resize(len, 0);
        DEVICE_TO_HOST_BYTES.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: copying a range inside a live tensor into a buffer of that size.
        unsafe { sys::ggml_backend_tensor_get(self.raw, scratch.as_mut_ptr().cast(), offset, len) };
        &scratch[..]
    }
}

/// Bytes copied from device buffers by [`Node::bytes`] in this process (0 on a host-only run):
/// what observing an offloaded graph costs in transfers.
pub static DEVICE_TO_HOST_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
