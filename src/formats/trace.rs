//! The binary routing trace (`--trace-out`): see docs/formats.md for the layout.
//!
//! `TraceFile` appends rows and rewrites the header after every flush, so a killed run
//! leaves a file readable up to the last flush. `TraceReader` maps a file with memmap2 and
//! hands out zero-copy row views.

use anyhow::{bail, Context as _, Result};
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

pub const MAGIC: &[u8; 8] = b"REAPTRC1";
/// Version 2 gives each row a phase (the u32 that version 1 left reserved, always 0 there, so a
/// version-1 row reads as prefill). Both are read; version 2 is written.
pub const VERSION: u32 = 2;
/// flags bit 0: the gate weights are normalised over the top-k
pub const FLAG_NORMALISED: u32 = 1;
/// flags bit 1: written by `trace-decode`: `chunk` is the prompt index (the sequence), each
/// sequence's rows are its prompt (phase prefill) then its generated tokens (phase decode)
pub const FLAG_DECODE: u32 = 2;
/// Row phases: a token of the evaluated text or prompt (teacher-forced)...
pub const PHASE_PREFILL: u32 = 0;
/// ... or a token the model generated, fed back one at a time.
pub const PHASE_DECODE: u32 = 1;

/// The phase's name, as the CLI and the JSON outputs spell it.
pub fn phase_name(phase: u32) -> &'static str {
    match phase {
        PHASE_PREFILL => "prefill",
        PHASE_DECODE => "decode",
        _ => "unknown",
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceHeader {
    /// block index of each MoE layer, in order
    pub layers: Vec<u32>,
    pub n_expert: u32,
    pub k: u32,
    pub top_n: u32,
    pub n_tokens: u64,
    pub flags: u32,
}

/// The versions `decode` accepts.
const READABLE_VERSIONS: [u32; 2] = [1, 2];

impl TraceHeader {
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn header_size(&self) -> usize {
        (64 + 4 * self.layers.len()).div_ceil(16) * 16
    }

    pub fn row_size(&self) -> usize {
        let per = self.layers.len() * (self.k + self.top_n) as usize;
        (16 + 4 * per + 2 * per).div_ceil(4) * 4
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.header_size());
        b.extend_from_slice(MAGIC);
        for v in [VERSION, self.header_size() as u32, self.layers.len() as u32, self.n_expert, self.k, self.top_n] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.n_tokens.to_le_bytes());
        b.extend_from_slice(&self.flags.to_le_bytes());
        b.extend_from_slice(&(self.row_size() as u32).to_le_bytes());
        b.extend_from_slice(&[0u8; 16]);
        for l in &self.layers {
            b.extend_from_slice(&l.to_le_bytes());
        }
        b.resize(self.header_size(), 0);
        b
    }

    pub fn decode(b: &[u8]) -> Result<TraceHeader> {
        if b.len() < 64 || &b[..8] != MAGIC {
            bail!("not a reap-imatrix trace (no REAPTRC1 magic)");
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let version = u32_at(8);
        if !READABLE_VERSIONS.contains(&version) {
            bail!("unsupported trace version {version} (this build reads versions 1 and 2)");
        }
        let n_layers = u32_at(16) as usize;
        let header_size = u32_at(12) as usize;
        if b.len() < 64 + 4 * n_layers || header_size < 64 + 4 * n_layers {
            bail!("header says {n_layers} layers but is only {} bytes", header_size.min(b.len()));
        }
        let (n_expert, k, top_n) = (u32_at(20), u32_at(24), u32_at(28));
        // the shape first: the sizes below are computed from it
        if k == 0 || top_n < k || top_n > n_expert || n_expert > u16::MAX as u32 + 1 {
            bail!("implausible shape: n_expert {n_expert}, k {k}, top_n {top_n}");
        }
        let h = TraceHeader {
            layers: (0..n_layers).map(|i| u32_at(64 + 4 * i)).collect(),
            n_expert,
            k,
            top_n,
            n_tokens: u64::from_le_bytes(b[32..40].try_into().unwrap()),
            flags: u32_at(40),
        };
        if h.header_size() != header_size || h.row_size() != u32_at(44) as usize {
            bail!("header sizes are inconsistent (header {header_size}, row {})", u32_at(44));
        }
        Ok(h)
    }

    /// Byte offsets of the row's arrays.
    pub fn layout(&self) -> RowLayout {
        let (l, k, n) = (self.layers.len(), self.k as usize, self.top_n as usize);
        let sel_weight = 16;
        let cand_prob = sel_weight + 4 * l * k;
        let sel_id = cand_prob + 4 * l * n;
        let cand_id = sel_id + 2 * l * k;
        RowLayout { k, n, sel_weight, cand_prob, sel_id, cand_id, size: self.row_size() }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct RowLayout {
    pub k: usize,
    pub n: usize,
    pub sel_weight: usize,
    pub cand_prob: usize,
    pub sel_id: usize,
    pub cand_id: usize,
    pub size: usize,
}

/// One token's routing, as the collector hands it over.
pub struct RowData<'a> {
    pub chunk: u32,
    pub pos: u32,
    pub token: i32,
    /// PHASE_PREFILL or PHASE_DECODE
    pub phase: u32,
    /// L·k, layer-major
    pub sel_weight: &'a [f32],
    pub cand_prob: &'a [f32],
    pub sel_id: &'a [u16],
    pub cand_id: &'a [u16],
}

impl RowLayout {
    /// Appends one encoded row to `out`.
    pub fn encode(&self, r: &RowData, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + self.size, 0);
        self.encode_into(r, &mut out[start..]);
    }

    /// Writes one encoded row over `out` (`size` bytes; the padding zeroed).
    pub fn encode_into(&self, r: &RowData, out: &mut [u8]) {
        let out = &mut out[..self.size];
        for (i, v) in [r.chunk, r.pos, r.token as u32, r.phase].into_iter().enumerate() {
            out[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        fn put<const N: usize, T: Copy>(out: &mut [u8], at: usize, v: &[T], le: impl Fn(T) -> [u8; N]) -> usize {
            for (d, &x) in out[at..at + N * v.len()].chunks_exact_mut(N).zip(v) {
                d.copy_from_slice(&le(x));
            }
            at + N * v.len()
        }
        let at = put(out, 16, r.sel_weight, f32::to_le_bytes);
        let at = put(out, at, r.cand_prob, f32::to_le_bytes);
        let at = put(out, at, r.sel_id, u16::to_le_bytes);
        let at = put(out, at, r.cand_id, u16::to_le_bytes);
        out[at..].fill(0);
    }
}

/// A trace being written. Staged ([TraceFile::create_staged]), it starts under a temporary
/// name beside `path` and takes its place at [TraceFile::publish] (calibration: with the first
/// checkpoint), so a run that fails or is killed before then leaves the previous trace at
/// `path` as it was, beside the previous imatrix and JSON it belongs with. A device
/// (`/dev/null`) is written in place.
pub struct TraceFile {
    file: File,
    header: TraceHeader,
    path: std::path::PathBuf,
    /// (temporary name, final file, its removal on a fatal signal) until published
    staged: Option<(std::path::PathBuf, std::path::PathBuf, crate::interrupt::RemoveOnSignal)>,
    /// a device cannot be synced
    sync: bool,
}

impl TraceFile {
    /// A trace written at `path` from the start (tests, tools that write one file at once).
    pub fn create(path: &Path, header: TraceHeader) -> Result<TraceFile> {
        Self::open(path, header, false)
    }

    /// A trace written under a temporary name until [TraceFile::publish].
    pub fn create_staged(path: &Path, header: TraceHeader) -> Result<TraceFile> {
        Self::open(path, header, true)
    }

    fn open(path: &Path, mut header: TraceHeader, staged: bool) -> Result<TraceFile> {
        header.n_tokens = 0;
        let real = crate::formats::atomic::resolve(path);
        let in_place = crate::formats::atomic::in_place(&real);
        let (open_at, staged) = if in_place || !staged {
            (real, None)
        } else {
            let tmp = crate::formats::atomic::temp_path(&real);
            let guard = crate::interrupt::remove_on_signal(&tmp);
            (tmp.clone(), Some((tmp, real, guard)))
        };
        let file = File::create(&open_at).with_context(|| format!("creating trace {}", open_at.display()))?;
        // from here a failure drops `t`, which removes the temporary file
        let mut t = TraceFile { file, header, path: path.to_path_buf(), staged, sync: !in_place };
        let bytes = t.header.encode();
        t.file.write_all(&bytes).with_context(|| format!("writing trace {}", open_at.display()))?;
        Ok(t)
    }

    /// Moves the trace to its name (once; later calls do nothing). The file stays open: rows
    /// appended afterwards go to it there.
    pub fn publish(&mut self) -> Result<()> {
        if let Some((tmp, real, _guard)) = self.staged.take() {
            std::fs::rename(&tmp, &real).with_context(|| format!("renaming {} to {}", tmp.display(), real.display()))?;
        }
        Ok(())
    }

    /// Appends `n_rows` encoded rows, then rewrites the header with the new count: a reader
    /// never sees a count that covers rows not yet on disk.
    pub fn append(&mut self, rows: &[u8], n_rows: u64) -> Result<()> {
        debug_assert_eq!(rows.len(), n_rows as usize * self.header.row_size());
        let r = (|| -> std::io::Result<()> {
            self.file.seek(SeekFrom::End(0))?;
            self.file.write_all(rows)?;
            if self.sync {
                self.file.sync_data()?;
            }
            self.file.seek(SeekFrom::Start(0))?;
            let mut h = self.header.clone();
            h.n_tokens += n_rows;
            self.file.write_all(&h.encode())
        })();
        // on failure the header on disk still counts only complete rows
        r.with_context(|| format!("writing trace {} (its header still counts the {} rows written before)", self.path.display(), self.header.n_tokens))?;
        self.header.n_tokens += n_rows;
        Ok(())
    }

    pub fn rows_written(&self) -> u64 {
        self.header.n_tokens
    }
}

impl Drop for TraceFile {
    /// Never published (the run failed first): the previous trace stays, the new one goes.
    fn drop(&mut self) {
        if let Some((tmp, _, _)) = self.staged.take() {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// A trace mapped for reading.
pub struct TraceReader {
    map: memmap2::Mmap,
    pub header: TraceHeader,
    layout: RowLayout,
    /// rows readable (the header's count, or what is present when the header says 0)
    pub n_rows: u64,
    /// set when the header said 0 tokens but rows were present
    pub header_count_missing: bool,
}

impl TraceReader {
    pub fn open(path: &Path) -> Result<TraceReader> {
        let file = File::open(path).with_context(|| format!("trace file {}", path.display()))?;
        // SAFETY: read-only map; a concurrent writer only appends and rewrites the header.
        let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("mapping trace {}", path.display()))?;
        Self::from_map(map).with_context(|| format!("trace file {}", path.display()))
    }

    /// A trace held in memory (a copy of `bytes`), read exactly as a file would be.
    pub fn from_bytes(bytes: &[u8]) -> Result<TraceReader> {
        let mut m = memmap2::MmapMut::map_anon(bytes.len().max(1)).context("mapping memory")?;
        m[..bytes.len()].copy_from_slice(bytes);
        let map = m.make_read_only().context("mapping memory")?;
        if bytes.is_empty() {
            bail!("empty file (no REAPTRC1 magic)");
        }
        Self::from_map(map)
    }

    fn from_map(map: memmap2::Mmap) -> Result<TraceReader> {
        let header = TraceHeader::decode(&map)?;
        let layout = header.layout();
        let present = (map.len().saturating_sub(header.header_size()) / layout.size) as u64;
        let (n_rows, header_count_missing) = if header.n_tokens == 0 && present > 0 {
            (present, true)
        } else if header.n_tokens > present {
            bail!("header says {} rows but only {present} are present (truncated file)", header.n_tokens);
        } else {
            (header.n_tokens, false)
        };
        Ok(TraceReader { map, header, layout, n_rows, header_count_missing })
    }

    pub fn layout(&self) -> RowLayout {
        self.layout
    }

    pub fn row(&self, i: u64) -> Row<'_> {
        assert!(i < self.n_rows, "row {i} out of range ({} rows)", self.n_rows);
        let start = self.header.header_size() + i as usize * self.layout.size;
        Row { b: &self.map[start..start + self.layout.size], l: self.layout }
    }

    pub fn rows(&self) -> impl Iterator<Item = Row<'_>> {
        (0..self.n_rows).map(move |i| self.row(i))
    }
}

/// A zero-copy view of one row.
#[derive(Clone, Copy)]
pub struct Row<'a> {
    b: &'a [u8],
    l: RowLayout,
}

impl<'a> Row<'a> {
    fn u32_at(&self, o: usize) -> u32 {
        u32::from_le_bytes(self.b[o..o + 4].try_into().unwrap())
    }
    pub fn chunk(&self) -> u32 {
        self.u32_at(0)
    }
    pub fn pos(&self) -> u32 {
        self.u32_at(4)
    }
    pub fn token(&self) -> i32 {
        self.u32_at(8) as i32
    }
    /// PHASE_PREFILL or PHASE_DECODE (version-1 rows hold 0 here: prefill).
    pub fn phase(&self) -> u32 {
        self.u32_at(12)
    }
    /// The model's selected experts in layer slot `li` (index into the header's layer list).
    pub fn sel_ids(&self, li: usize) -> &'a [u16] {
        cast_u16(&self.b[self.l.sel_id + 2 * li * self.l.k..][..2 * self.l.k])
    }
    pub fn sel_weights(&self, li: usize) -> &'a [f32] {
        cast_f32(&self.b[self.l.sel_weight + 4 * li * self.l.k..][..4 * self.l.k])
    }
    /// Router candidates, best first.
    pub fn cand_ids(&self, li: usize) -> &'a [u16] {
        cast_u16(&self.b[self.l.cand_id + 2 * li * self.l.n..][..2 * self.l.n])
    }
    pub fn cand_probs(&self, li: usize) -> &'a [f32] {
        cast_f32(&self.b[self.l.cand_prob + 4 * li * self.l.n..][..4 * self.l.n])
    }
}

// The file is little-endian and rows are 4-byte aligned within a page-aligned map, so on a
// little-endian machine the arrays can be viewed in place.
#[cfg(target_endian = "little")]
fn cast_f32(b: &[u8]) -> &[f32] {
    assert!(b.as_ptr() as usize % 4 == 0);
    // SAFETY: aligned, in bounds, any bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len() / 4) }
}

#[cfg(target_endian = "little")]
fn cast_u16(b: &[u8]) -> &[u16] {
    assert!(b.as_ptr() as usize % 2 == 0);
    // SAFETY: aligned, in bounds, any bit pattern is a valid u16.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len() / 2) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> TraceHeader {
        TraceHeader { layers: vec![0, 2, 5], n_expert: 16, k: 2, top_n: 4, n_tokens: 0, flags: FLAG_NORMALISED }
    }

    fn row(h: &TraceHeader, t: u32, out: &mut Vec<u8>) {
        let l = h.n_layers();
        let sel_w: Vec<f32> = (0..l * 2).map(|i| i as f32 * 0.5 + t as f32).collect();
        let cand_p: Vec<f32> = (0..l * 4).map(|i| 1.0 / (i + 1) as f32).collect();
        let sel_id: Vec<u16> = (0..l * 2).map(|i| ((i as u32 + t) % 16) as u16).collect();
        let cand_id: Vec<u16> = (0..l * 4).map(|i| ((i as u32 * 3 + t) % 16) as u16).collect();
        h.layout().encode(&RowData { chunk: t / 4, pos: t % 4, token: 1000 + t as i32, phase: t % 2, sel_weight: &sel_w, cand_prob: &cand_p, sel_id: &sel_id, cand_id: &cand_id }, out);
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("reap-trace-test-{}-{name}", std::process::id()));
        d
    }

    #[test]
    fn header_round_trips() {
        let h = TraceHeader { n_tokens: 42, ..header() };
        let b = h.encode();
        assert_eq!(b.len(), h.header_size());
        assert_eq!(b.len() % 16, 0);
        assert_eq!(TraceHeader::decode(&b).unwrap(), h);
    }

    #[test]
    fn rows_round_trip_through_a_file() {
        let p = tmp("rt");
        let h = header();
        let mut f = TraceFile::create(&p, h.clone()).unwrap();
        let mut buf = Vec::new();
        for t in 0..3 {
            row(&h, t, &mut buf);
        }
        f.append(&buf, 3).unwrap();
        buf.clear();
        for t in 3..5 {
            row(&h, t, &mut buf);
        }
        f.append(&buf, 2).unwrap();
        f.publish().unwrap();
        let r = TraceReader::open(&p).unwrap();
        assert_eq!(r.n_rows, 5);
        let x = r.row(3);
        assert_eq!((x.chunk(), x.pos(), x.token(), x.phase()), (0, 3, 1003, PHASE_DECODE));
        assert_eq!(r.row(2).phase(), PHASE_PREFILL);
        assert_eq!(x.sel_ids(1), &[((2 + 3) % 16) as u16, ((3 + 3) % 16) as u16]);
        assert_eq!(x.sel_weights(2), &[4.0 * 0.5 + 3.0, 5.0 * 0.5 + 3.0]);
        assert_eq!(x.cand_ids(0).len(), 4);
        assert_eq!(x.cand_probs(0)[1], 0.5);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn rows_past_the_header_count_are_ignored_and_a_zero_count_reads_what_is_there() {
        let p = tmp("partial");
        let h = header();
        let mut f = TraceFile::create(&p, h.clone()).unwrap();
        let mut buf = Vec::new();
        row(&h, 0, &mut buf);
        f.append(&buf, 1).unwrap();
        f.publish().unwrap();
        drop(f);
        // a killed writer: one more row (and half of another) on disk, header still says 1
        let mut extra = Vec::new();
        row(&h, 1, &mut extra);
        row(&h, 2, &mut extra);
        extra.truncate(extra.len() - 7);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes.extend_from_slice(&extra);
        std::fs::write(&p, &bytes).unwrap();
        let r = TraceReader::open(&p).unwrap();
        assert_eq!((r.n_rows, r.header_count_missing), (1, false));
        // header count 0 (an old writer): the complete rows present are read
        bytes[32..40].copy_from_slice(&0u64.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        let r = TraceReader::open(&p).unwrap();
        assert_eq!((r.n_rows, r.header_count_missing), (2, true));
        let _ = std::fs::remove_file(&p);
    }

    /// A version-1 file, byte by byte as the version-1 writer laid it out (the row's fourth u32
    /// reserved and zero), still reads: every row is prefill.
    #[test]
    fn a_version_1_file_reads_with_every_row_prefill() {
        let p = tmp("v1");
        let (l, k, n) = (2usize, 1usize, 2usize);
        let mut b = Vec::new();
        b.extend_from_slice(b"REAPTRC1");
        let row_size = (16 + 6 * l * (k + n)).div_ceil(4) * 4;
        for v in [1u32, 80, l as u32, 4, k as u32, n as u32] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&(row_size as u32).to_le_bytes());
        b.extend_from_slice(&[0; 16]);
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&7u32.to_le_bytes());
        b.resize(80, 0);
        for t in 0..2u32 {
            let start = b.len();
            for v in [5u32, t, 100 + t, 0] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            for w in [1.0f32, 1.0, 0.7, 0.3, 0.6, 0.4] {
                b.extend_from_slice(&w.to_le_bytes());
            }
            for id in [t as u16, 2, t as u16, 1, 2, 3] {
                b.extend_from_slice(&id.to_le_bytes());
            }
            b.resize(start + row_size, 0);
        }
        std::fs::write(&p, &b).unwrap();
        let r = TraceReader::open(&p).unwrap();
        assert_eq!(r.header.layers, [3, 7]);
        assert_eq!(r.n_rows, 2);
        let x = r.row(1);
        assert_eq!((x.chunk(), x.pos(), x.token(), x.phase()), (5, 1, 101, PHASE_PREFILL));
        assert_eq!((x.sel_ids(0), x.sel_ids(1), x.cand_ids(1)), (&[1u16][..], &[2u16][..], &[2u16, 3][..]));
        assert_eq!(x.cand_probs(0), &[0.7, 0.3]);
        // an unknown version is refused by name
        b[8] = 3;
        std::fs::write(&p, &b).unwrap();
        assert!(format!("{:#}", TraceReader::open(&p).err().unwrap()).contains("unsupported trace version 3"));
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_truncated_file_is_refused() {
        let p = tmp("trunc");
        let h = TraceHeader { n_tokens: 10, ..header() };
        std::fs::write(&p, h.encode()).unwrap();
        let e = TraceReader::open(&p).err().unwrap();
        assert!(format!("{e:#}").contains("header says 10 rows but only 0"), "{e:#}");
        std::fs::write(&p, b"junk").unwrap();
        assert!(format!("{:#}", TraceReader::open(&p).err().unwrap()).contains("REAPTRC1"));
        let _ = std::fs::remove_file(&p);
    }
}
