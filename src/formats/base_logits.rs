//! The base model's log-probabilities, in the file format of upstream's
//! `llama-perplexity --kl-divergence-base FILE` (tools/perplexity/perplexity.cpp at the pin), so
//! files written by either tool are read by the other.
//!
//! Layout (native little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `_logits_` |
//! | 4 | `n_ctx` (u32), tokens per chunk |
//! | 4 | `n_vocab` (i32) |
//! | 4 | `n_chunk` (i32) |
//! | 4·n_ctx·n_chunk | the evaluated tokens (i32), chunk after chunk |
//! | 2·nv per row | one row per scored token: chunk after chunk, `n_ctx − 1 − n_ctx/2` rows each |
//!
//! `nv = 2·⌈n_vocab/2⌉ + 4` u16. A row starts with two f32 in its first four slots, `scale` and
//! `min_log_prob`, then `n_vocab` u16 `q[i]`: log p(i) ≈ `scale·q[i] + min_log_prob`. The
//! minimum is clamped at 16 below the maximum logit; tokens at or below it store 0 (and the
//! KL sum skips terms at or below −16). Upstream writes no checksum and no model identity;
//! `eval` keeps those in a sidecar (see `eval::cache`).

use anyhow::{bail, Context as _, Result};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 8] = b"_logits_";

/// u16 slots per row: the two f32 plus `n_vocab` rounded up to even.
pub fn row_len(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// Scored tokens per chunk: the second half, less the last position (no next token).
pub fn scored_per_chunk(n_ctx: usize) -> usize {
    n_ctx - 1 - n_ctx / 2
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub n_ctx: u32,
    pub n_vocab: i32,
    pub n_chunk: i32,
    /// `n_ctx · n_chunk` tokens
    pub tokens: Vec<i32>,
}

impl Header {
    pub fn byte_len(&self) -> u64 {
        20 + 4 * self.tokens.len() as u64
    }

    /// The file's length with every row present.
    pub fn file_len(&self) -> u64 {
        let rows = self.n_chunk as u64 * scored_per_chunk(self.n_ctx as usize) as u64;
        self.byte_len() + rows * 2 * row_len(self.n_vocab as usize) as u64
    }

    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(MAGIC)?;
        w.write_all(&self.n_ctx.to_le_bytes())?;
        w.write_all(&self.n_vocab.to_le_bytes())?;
        w.write_all(&self.n_chunk.to_le_bytes())?;
        let mut buf = Vec::with_capacity(4 * self.tokens.len());
        for t in &self.tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        w.write_all(&buf)
    }

    /// Reads and checks the header; errors name `path` and what is wrong.
    pub fn read_from(r: &mut impl Read, path: &Path) -> Result<Header> {
        let mut head = [0u8; 20];
        r.read_exact(&mut head).with_context(|| format!("base log-probs {}: shorter than its header", path.display()))?;
        if &head[..8] != MAGIC {
            bail!("base log-probs {}: does not start with `_logits_` (not a --kl-divergence-base file)", path.display());
        }
        let word = |i: usize| i32::from_le_bytes(head[i..i + 4].try_into().unwrap());
        let (n_ctx, n_vocab, n_chunk) = (word(8), word(12), word(16));
        if n_ctx < 4 || n_vocab <= 0 || n_chunk <= 0 {
            bail!("base log-probs {}: bad header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk})", path.display());
        }
        let n = n_ctx as usize * n_chunk as usize;
        let mut bytes = vec![0u8; 4 * n];
        r.read_exact(&mut bytes).with_context(|| format!("base log-probs {}: ends inside its {n} tokens", path.display()))?;
        let tokens = bytes.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap())).collect();
        Ok(Header { n_ctx: n_ctx as u32, n_vocab, n_chunk, tokens })
    }

    /// Reads only the header of the file at `path`, and checks the file's length against it.
    pub fn read(path: &Path) -> Result<Header> {
        let f = std::fs::File::open(path).with_context(|| format!("base log-probs {}", path.display()))?;
        let len = f.metadata()?.len();
        let h = Header::read_from(&mut BufReader::new(f), path)?;
        if len != h.file_len() {
            bail!(
                "base log-probs {}: {len} bytes, but its header (n_ctx {}, n_vocab {}, n_chunk {}) needs {} (truncated or not this format)",
                path.display(),
                h.n_ctx,
                h.n_vocab,
                h.n_chunk,
                h.file_len()
            );
        }
        Ok(h)
    }
}

/// Upstream's `nearest_int`: round to nearest (ties to even) through the float's mantissa.
fn nearest_int(f: f32) -> i32 {
    let v = f + 12582912.0f32;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// Encodes one row of logits as upstream's base pass does (`log_softmax` with a `uint16_t *`
/// at the pin), into `out` (`row_len(n_vocab)` slots; padding left as is). Returns −log p(tok)
/// as upstream computes it (f32 arithmetic).
pub fn encode_row(logits: &[f32], tok: usize, out: &mut [u16]) -> f32 {
    let n_vocab = logits.len();
    let mut max_logit = logits[0];
    let mut min_logit = logits[0];
    for &l in &logits[1..] {
        max_logit = max_logit.max(l);
        min_logit = min_logit.min(l);
    }
    min_logit = min_logit.max(max_logit - 16.0);
    let mut sum_exp = 0.0f64;
    for &l in logits {
        sum_exp += (l - max_logit).exp() as f64;
    }
    let log_sum_exp = sum_exp.ln() as f32;
    let min_log_prob = min_logit - max_logit - log_sum_exp;
    let scale = (max_logit - min_logit) / 65535.0f32;
    let (head, q) = out.split_at_mut(4);
    for (i, x) in [scale, min_log_prob].into_iter().enumerate() {
        let b = x.to_bits();
        head[2 * i] = b as u16;
        head[2 * i + 1] = (b >> 16) as u16;
    }
    if scale != 0.0 {
        let inv_scale = 1.0f32 / scale;
        for (d, &l) in q[..n_vocab].iter_mut().zip(logits) {
            // upstream stores an int into a uint16_t: truncation, as `as u16` does
            *d = if l > min_logit { nearest_int(inv_scale * (l - min_logit)) as u16 } else { 0 };
        }
    } else {
        q[..n_vocab].fill(0);
    }
    max_logit + log_sum_exp - logits[tok]
}

/// (scale, min_log_prob) of an encoded row.
pub fn row_scale(row: &[u16]) -> (f32, f32) {
    let f = |i: usize| f32::from_bits(row[i] as u32 | (row[i + 1] as u32) << 16);
    (f(0), f(2))
}

/// Streams the rows of an existing file, one chunk at a time.
pub struct Reader {
    file: BufReader<std::fs::File>,
    pub header: Header,
    path: PathBuf,
    chunk_bytes: Vec<u8>,
}

impl Reader {
    pub fn open(path: &Path) -> Result<Reader> {
        let header = Header::read(path)?;
        let mut file = BufReader::with_capacity(1 << 20, std::fs::File::open(path)?);
        std::io::copy(&mut (&mut file).take(header.byte_len()), &mut std::io::sink())?;
        Ok(Reader { file, header, path: path.to_path_buf(), chunk_bytes: Vec::new() })
    }

    /// The next chunk's rows, `scored_per_chunk(n_ctx) · row_len(n_vocab)` slots.
    pub fn next_chunk(&mut self, rows: &mut Vec<u16>) -> Result<()> {
        let n = scored_per_chunk(self.header.n_ctx as usize) * row_len(self.header.n_vocab as usize);
        self.chunk_bytes.resize(2 * n, 0);
        self.file.read_exact(&mut self.chunk_bytes).with_context(|| format!("base log-probs {}: reading a chunk's rows", self.path.display()))?;
        rows.clear();
        rows.extend(self.chunk_bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])));
        Ok(())
    }
}

/// Writes a file front to back: the header, then chunks of rows. Hashes what it writes, so the
/// sidecar can name the exact file without reading it back.
pub struct Writer<W: Write> {
    out: BufWriter<W>,
    hasher: sha2::Sha256,
    bytes: Vec<u8>,
}

impl<W: Write> Writer<W> {
    pub fn new(inner: W, header: &Header) -> std::io::Result<Self> {
        use sha2::Digest;
        let mut head = Vec::new();
        header.write_to(&mut head)?;
        let mut out = BufWriter::with_capacity(1 << 20, inner);
        out.write_all(&head)?;
        let mut hasher = sha2::Sha256::new();
        hasher.update(&head);
        Ok(Writer { out, hasher, bytes: Vec::new() })
    }

    pub fn write_rows(&mut self, rows: &[u16]) -> std::io::Result<()> {
        use sha2::Digest;
        self.bytes.clear();
        self.bytes.extend(rows.iter().flat_map(|x| x.to_le_bytes()));
        self.hasher.update(&self.bytes);
        self.out.write_all(&self.bytes)
    }

    /// Flushes; returns the sha256 (lowercase hex) of everything written.
    pub fn finish(mut self) -> std::io::Result<String> {
        use sha2::Digest;
        self.out.flush()?;
        Ok(self.hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even_like_upstream() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(65534.6), 65535);
        assert_eq!(nearest_int(-3.2), -3);
    }

    #[test]
    fn a_row_encodes_scale_minimum_and_quantized_log_probs() {
        // logits 0, 1, 2 (vocab 3 → 6 u16 slots + padding)
        let logits = [0.0f32, 1.0, 2.0];
        let mut row = vec![7u16; row_len(3)];
        assert_eq!(row.len(), 8);
        let nll = encode_row(&logits, 1, &mut row);
        // log Σ e^(l − 2) = ln(e^-2 + e^-1 + 1) = 0.40760596…
        let lse = (1.0f64 + (-1.0f64).exp() + (-2.0f64).exp()).ln();
        assert!((nll as f64 - (1.0 + lse)).abs() < 1e-6, "{nll}");
        let (scale, min_lp) = row_scale(&row);
        assert_eq!(scale, 2.0f32 / 65535.0);
        assert!((min_lp as f64 - (-2.0 - lse)).abs() < 1e-6);
        // the minimum logit itself is not above min_logit: 0; the max is 65535; the middle 32768
        // (1/scale = 32767.5, rounded to even)
        assert_eq!(&row[4..7], &[0, 32768, 65535]);
        assert_eq!(row[7], 7, "padding is not written");
        // decoded: scale·q + min ≈ the exact log-probs
        for (i, &q) in row[4..7].iter().enumerate() {
            let exact = i as f64 - 2.0 - lse;
            assert!((scale as f64 * q as f64 + min_lp as f64 - exact).abs() < 1e-4);
        }
    }

    #[test]
    fn logits_far_below_the_maximum_are_clamped_to_zero() {
        let logits = [-100.0f32, 0.0, -15.0];
        let mut row = vec![0u16; row_len(3)];
        encode_row(&logits, 0, &mut row);
        let (scale, _) = row_scale(&row);
        assert_eq!(scale, 16.0 / 65535.0);
        assert_eq!(row[4], 0);
        assert_eq!(row[5], 65535);
        // −15 is 1 above the clamp at −16: 1/scale = 4095.94 → 4096
        assert_eq!(row[6], 4096);
    }

    #[test]
    fn a_constant_row_has_zero_scale_and_zero_entries() {
        let mut row = vec![9u16; row_len(4)];
        encode_row(&[1.0; 4], 0, &mut row);
        assert_eq!(row_scale(&row).0, 0.0);
        assert_eq!(&row[4..8], &[0, 0, 0, 0]);
    }

    #[test]
    fn header_and_rows_round_trip_and_a_short_file_is_refused() {
        let d = std::env::temp_dir().join(format!("reap-base-logits-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("base.bin");
        let h = Header { n_ctx: 8, n_vocab: 3, n_chunk: 2, tokens: (0..16).collect() };
        let per_chunk = scored_per_chunk(8) * row_len(3);
        assert_eq!(scored_per_chunk(8), 3);
        let rows: Vec<u16> = (0..2 * per_chunk as u16).collect();
        let mut w = Writer::new(std::fs::File::create(&p).unwrap(), &h).unwrap();
        w.write_rows(&rows[..per_chunk]).unwrap();
        w.write_rows(&rows[per_chunk..]).unwrap();
        let sha = w.finish().unwrap();
        assert_eq!(sha, crate::formats::sha256::sha256_file(&p).unwrap());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), h.file_len());
        let mut r = Reader::open(&p).unwrap();
        assert_eq!(r.header, h);
        let mut got = Vec::new();
        r.next_chunk(&mut got).unwrap();
        assert_eq!(got, &rows[..per_chunk]);
        r.next_chunk(&mut got).unwrap();
        assert_eq!(got, &rows[per_chunk..]);
        // truncated by one byte: refused by length, naming the file
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
        let e = format!("{:#}", Reader::open(&p).err().unwrap());
        assert!(e.contains("base.bin") && e.contains("truncated"), "{e}");
        std::fs::write(&p, b"not a logits file at all").unwrap();
        let e = format!("{:#}", Header::read(&p).err().unwrap());
        assert!(e.contains("_logits_"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
