//! A GGUF header as bytes: parse the key-value pairs and tensor infos of a file held in memory
//! (a memory map), and encode a header for a file whose tensors change shape.
//!
//! Why not the gguf C API: a context from `gguf_init_empty` keeps its default alignment even
//! after `gguf_set_kv` copies a `general.alignment`, and its writer re-derives each tensor's
//! dimension count with `ggml_n_dims` (a declared `[n, 1]` becomes `[n]`, a 3-D expert tensor
//! pruned to one expert becomes 2-D). Here every key-value pair is copied as the bytes it was,
//! and tensor infos keep their declared dimension count, so rewriting a header with nothing
//! changed reproduces it byte for byte.
//!
//! Layout (GGUF v2/v3, little-endian): magic `GGUF`, version u32, n_tensors u64, n_kv u64; each
//! pair: key (u64 length + bytes), type u32, value; each tensor info: name, n_dims u32,
//! `ne[n_dims]` u64, ggml type u32, offset u64 (relative to the data section); zero padding to
//! `general.alignment` (default 32); the data, each tensor padded to the alignment.

use crate::llama::sys;
use std::ops::Range;

pub const DEFAULT_ALIGNMENT: u64 = 32;
const TYPE_U8: u32 = 0;
const TYPE_I8: u32 = 1;
const TYPE_U16: u32 = 2;
const TYPE_I16: u32 = 3;
const TYPE_U32: u32 = 4;
const TYPE_I32: u32 = 5;
const TYPE_F32: u32 = 6;
const TYPE_BOOL: u32 = 7;
const TYPE_STRING: u32 = 8;
const TYPE_ARRAY: u32 = 9;
const TYPE_U64: u32 = 10;
const TYPE_I64: u32 = 11;
const TYPE_F64: u32 = 12;

/// One key-value pair: where its bytes are in the file.
#[derive(Clone, Debug)]
pub struct Kv {
    pub key: String,
    pub ty: u32,
    /// the whole pair (key, type, value) in the source bytes
    pub raw: Range<usize>,
    /// the value alone
    pub value: Range<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// as declared (the dimension count is kept)
    pub ne: Vec<u64>,
    pub ggml_type: u32,
    /// relative to the data section
    pub offset: u64,
}

impl TensorInfo {
    /// Bytes of the tensor's data (rows of `ne[0]` elements in blocks of its type).
    pub fn nbytes(&self) -> u64 {
        // SAFETY: pure size query on a type checked by `parse`.
        let row = unsafe { sys::ggml_row_size(self.ggml_type as sys::ggml_type, self.ne.first().copied().unwrap_or(1) as i64) } as u64;
        self.ne.iter().skip(1).product::<u64>() * row
    }
}

#[derive(Clone, Debug)]
pub struct Header {
    pub version: u32,
    pub kvs: Vec<Kv>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// file offset of the data section
    pub data_start: u64,
}

pub fn pad(n: u64, alignment: u64) -> u64 {
    n.div_ceil(alignment) * alignment
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], String> {
        let end = (self.pos as u64).checked_add(n).filter(|&e| e <= self.b.len() as u64);
        let end = end.ok_or_else(|| format!("truncated header (reading {what} at byte {})", self.pos))? as usize;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.u64(what)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| format!("{what} at byte {} is not UTF-8", self.pos))
    }
    /// Skips one value of type `ty` (arrays of scalars or strings; nested arrays are refused,
    /// as upstream refuses them).
    fn skip_value(&mut self, ty: u32, what: &str) -> Result<(), String> {
        match ty {
            TYPE_ARRAY => {
                let et = self.u32(what)?;
                let n = self.u64(what)?;
                match et {
                    TYPE_ARRAY => return Err(format!("{what}: nested arrays are not supported")),
                    TYPE_STRING => {
                        for _ in 0..n {
                            let len = self.u64(what)?;
                            self.take(len, what)?;
                        }
                    }
                    _ => {
                        let size = scalar_size(et).ok_or_else(|| format!("{what}: unknown array element type {et}"))?;
                        self.take(n.checked_mul(size).ok_or_else(|| format!("{what}: array too large"))?, what)?;
                    }
                }
            }
            TYPE_STRING => {
                let len = self.u64(what)?;
                self.take(len, what)?;
            }
            _ => {
                let size = scalar_size(ty).ok_or_else(|| format!("{what}: unknown value type {ty}"))?;
                self.take(size, what)?;
            }
        }
        Ok(())
    }
}

fn scalar_size(ty: u32) -> Option<u64> {
    Some(match ty {
        TYPE_U8 | TYPE_I8 | TYPE_BOOL => 1,
        TYPE_U16 | TYPE_I16 => 2,
        TYPE_U32 | TYPE_I32 | TYPE_F32 => 4,
        TYPE_U64 | TYPE_I64 | TYPE_F64 => 8,
        _ => return None,
    })
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl Header {
    /// Parses the header of a whole GGUF file `b` and checks every tensor lies inside it.
    /// Errors say what is wrong, without the file name (the caller adds it).
    pub fn parse(b: &[u8]) -> Result<Header, String> {
        let mut r = Reader { b, pos: 0 };
        if r.take(4, "magic").ok() != Some(b"GGUF".as_slice()) {
            return Err("not a GGUF file (no GGUF magic)".into());
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(format!("GGUF version {version} is not supported (2 or 3)"));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("key-value count")?;
        let mut kvs = Vec::new();
        for i in 0..n_kv {
            let start = r.pos;
            let key = r.string(&format!("key {i}"))?;
            let ty = r.u32(&key)?;
            let vstart = r.pos;
            r.skip_value(ty, &key)?;
            kvs.push(Kv { key, ty, raw: start..r.pos, value: vstart..r.pos });
        }
        let mut h = Header { version, kvs, tensors: Vec::new(), alignment: DEFAULT_ALIGNMENT, data_start: 0 };
        if let Some(kv) = h.kv("general.alignment") {
            let a = if kv.ty == TYPE_U32 { h.uint(b, "general.alignment") } else { None };
            match a {
                Some(a) if a > 0 && a.is_power_of_two() => h.alignment = a,
                _ => return Err("general.alignment is not a u32 power of 2".into()),
            }
        }
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor info {i}"))?;
            let n_dims = r.u32(&name)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(format!("tensor {name}: {n_dims} dimensions"));
            }
            let ne = (0..n_dims).map(|_| r.u64(&name)).collect::<Result<Vec<u64>, String>>()?;
            let ggml_type = r.u32(&name)?;
            let offset = r.u64(&name)?;
            // SAFETY: type traits lookup of a type index checked against the count first.
            let ok = ggml_type < sys::GGML_TYPE_COUNT && unsafe { sys::ggml_blck_size(ggml_type as sys::ggml_type) } > 0;
            if !ok {
                return Err(format!("tensor {name}: unknown ggml type {ggml_type}"));
            }
            let blck = unsafe { sys::ggml_blck_size(ggml_type as sys::ggml_type) } as u64;
            if ne[0] % blck != 0 || ne.iter().any(|&n| n > i64::MAX as u64) {
                return Err(format!("tensor {name}: shape {ne:?} does not fit its type"));
            }
            h.tensors.push(TensorInfo { name, ne, ggml_type, offset });
        }
        h.data_start = pad(r.pos as u64, h.alignment);
        for t in &h.tensors {
            let end = h.data_start.checked_add(t.offset).and_then(|s| s.checked_add(t.nbytes()));
            if end.map_or(true, |e| e > b.len() as u64) {
                return Err(format!("tensor {} lies past the end of the file (truncated?)", t.name));
            }
        }
        Ok(h)
    }

    pub fn kv(&self, key: &str) -> Option<&Kv> {
        self.kvs.iter().find(|k| k.key == key)
    }

    /// An unsigned or non-negative integer value.
    pub fn uint(&self, b: &[u8], key: &str) -> Option<u64> {
        let kv = self.kv(key)?;
        let v = &b[kv.value.clone()];
        let le = |n: usize| {
            let mut a = [0u8; 8];
            a[..n].copy_from_slice(&v[..n]);
            u64::from_le_bytes(a)
        };
        match kv.ty {
            TYPE_U8 | TYPE_U16 | TYPE_U32 | TYPE_U64 => Some(le(scalar_size(kv.ty)? as usize)),
            TYPE_I8 => u64::try_from(v[0] as i8).ok(),
            TYPE_I16 => u64::try_from(i16::from_le_bytes(v[..2].try_into().unwrap())).ok(),
            TYPE_I32 => u64::try_from(i32::from_le_bytes(v[..4].try_into().unwrap())).ok(),
            TYPE_I64 => u64::try_from(i64::from_le_bytes(v[..8].try_into().unwrap())).ok(),
            _ => None,
        }
    }

    /// An integer value, or each element of an array of integers (a per-layer
    /// `expert_used_count`, as Nemotron-H's Puzzle variants write it).
    pub fn uints(&self, b: &[u8], key: &str) -> Option<Vec<u64>> {
        let kv = self.kv(key)?;
        if kv.ty != TYPE_ARRAY {
            return self.uint(b, key).map(|v| vec![v]);
        }
        let v = &b[kv.value.clone()];
        let ety = u32::from_le_bytes(v.get(..4)?.try_into().ok()?);
        let n = u64::from_le_bytes(v.get(4..12)?.try_into().ok()?) as usize;
        let size = scalar_size(ety)? as usize;
        let items = v.get(12..12 + n.checked_mul(size)?)?;
        items
            .chunks_exact(size)
            .map(|c| {
                let mut a = [0u8; 8];
                a[..size].copy_from_slice(c);
                let raw = u64::from_le_bytes(a);
                match ety {
                    TYPE_U8 | TYPE_U16 | TYPE_U32 | TYPE_U64 => Some(raw),
                    TYPE_I8 => u64::try_from(c[0] as i8).ok(),
                    TYPE_I16 => u64::try_from(raw as u16 as i16).ok(),
                    TYPE_I32 => u64::try_from(raw as u32 as i32).ok(),
                    TYPE_I64 => u64::try_from(raw as i64).ok(),
                    _ => None,
                }
            })
            .collect()
    }

    pub fn string(&self, b: &[u8], key: &str) -> Option<String> {
        let kv = self.kv(key).filter(|kv| kv.ty == TYPE_STRING)?;
        String::from_utf8(b[kv.value.start + 8..kv.value.end].to_vec()).ok()
    }

    /// The bytes of `kv` with its integer value replaced by `v`, in the same type.
    pub fn encode_uint(kv: &Kv, v: u64) -> Result<Vec<u8>, String> {
        let size = match kv.ty {
            TYPE_U8 | TYPE_I8 | TYPE_U16 | TYPE_I16 | TYPE_U32 | TYPE_I32 | TYPE_U64 | TYPE_I64 => scalar_size(kv.ty).unwrap() as usize,
            _ => return Err(format!("{} is not an integer", kv.key)),
        };
        let signed = matches!(kv.ty, TYPE_I8 | TYPE_I16 | TYPE_I32 | TYPE_I64);
        let bits = 8 * size as u32 - signed as u32;
        if bits < 64 && v >= 1u64 << bits {
            return Err(format!("{}: {v} does not fit its type", kv.key));
        }
        let mut out = Vec::new();
        put_str(&mut out, &kv.key);
        out.extend_from_slice(&kv.ty.to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes()[..size]);
        Ok(out)
    }
}

/// A scalar pair: the key, the type, the value's little-endian bytes.
fn encode_scalar_kv(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    put_str(&mut out, key);
    out.extend_from_slice(&ty.to_le_bytes());
    out.extend_from_slice(value);
    out
}

/// A u16 pair (`split.no`, `split.count` as llama-gguf-split writes them).
pub fn encode_u16_kv(key: &str, v: u16) -> Vec<u8> {
    encode_scalar_kv(key, TYPE_U16, &v.to_le_bytes())
}

/// An i32 pair (`split.tensors.count`).
pub fn encode_i32_kv(key: &str, v: i32) -> Vec<u8> {
    encode_scalar_kv(key, TYPE_I32, &v.to_le_bytes())
}

impl Header {
    /// The length of an array value (None for a scalar).
    pub fn array_len(&self, b: &[u8], key: &str) -> Option<u64> {
        let kv = self.kv(key).filter(|kv| kv.ty == TYPE_ARRAY)?;
        Some(u64::from_le_bytes(b.get(kv.value.start + 4..kv.value.start + 12)?.try_into().ok()?))
    }

    /// The bytes of the array pair `kv` with only its first `n` elements.
    pub fn encode_array_prefix(kv: &Kv, b: &[u8], n: u64) -> Result<Vec<u8>, String> {
        if kv.ty != TYPE_ARRAY {
            return Err(format!("{} is not an array", kv.key));
        }
        let v = &b[kv.value.clone()];
        let ety = u32::from_le_bytes(v[..4].try_into().unwrap());
        let len = u64::from_le_bytes(v[4..12].try_into().unwrap());
        if n > len {
            return Err(format!("{}: has {len} elements, not {n}", kv.key));
        }
        // the first n elements' bytes (parse checked the whole array)
        let end = match ety {
            TYPE_STRING => {
                let mut pos = 12usize;
                for _ in 0..n {
                    pos += 8 + u64::from_le_bytes(v[pos..pos + 8].try_into().unwrap()) as usize;
                }
                pos
            }
            _ => 12 + (n * scalar_size(ety).ok_or_else(|| format!("{}: unknown array element type {ety}", kv.key))?) as usize,
        };
        let mut out = Vec::new();
        put_str(&mut out, &kv.key);
        out.extend_from_slice(&TYPE_ARRAY.to_le_bytes());
        out.extend_from_slice(&ety.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&v[12..end]);
        Ok(out)
    }
}

/// Encodes a header: the pairs as given (raw bytes), then the tensor infos with offsets laid
/// out in order, each tensor padded to `alignment` (as every GGUF writer lays them out), then
/// zero padding up to the data section. Returns the bytes and each tensor's offset.
pub fn encode_header(version: u32, kvs: &[&[u8]], tensors: &[TensorInfo], alignment: u64) -> (Vec<u8>, Vec<u64>) {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for kv in kvs {
        out.extend_from_slice(kv);
    }
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
        for &n in &t.ne {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(&t.ggml_type.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offsets.push(offset);
        offset += pad(t.nbytes(), alignment);
    }
    out.resize(pad(out.len() as u64, alignment) as usize, 0);
    (out, offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv_u32(key: &str, v: u32) -> Vec<u8> {
        let mut out = Vec::new();
        put_str(&mut out, key);
        out.extend_from_slice(&TYPE_U32.to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes());
        out
    }

    /// A header built by hand (a string array, an alignment of 64, a 2-D F32 tensor with a
    /// trailing 1 and a Q8_0 tensor) parses back to what went in and re-encodes identically.
    #[test]
    fn a_hand_built_header_parses_and_reencodes_byte_for_byte() {
        let mut arr = Vec::new();
        put_str(&mut arr, "tokens");
        arr.extend_from_slice(&TYPE_ARRAY.to_le_bytes());
        arr.extend_from_slice(&TYPE_STRING.to_le_bytes());
        arr.extend_from_slice(&2u64.to_le_bytes());
        put_str(&mut arr, "a");
        put_str(&mut arr, "bc");
        let kvs = [kv_u32("general.alignment", 64), arr, kv_u32("x.expert_count", 8)];
        let tensors = vec![
            TensorInfo { name: "a".into(), ne: vec![3, 1], ggml_type: sys::GGML_TYPE_F32, offset: 0 },
            TensorInfo { name: "b".into(), ne: vec![32, 2, 8], ggml_type: sys::GGML_TYPE_Q8_0, offset: 0 },
        ];
        let refs: Vec<&[u8]> = kvs.iter().map(|k| k.as_slice()).collect();
        let (head, offsets) = encode_header(3, &refs, &tensors, 64);
        assert_eq!(offsets, vec![0, 64]);
        assert_eq!(head.len() % 64, 0);
        let mut file = head.clone();
        file.resize(head.len() + 64 + 34 * 16, 7);
        let h = Header::parse(&file).unwrap();
        assert_eq!((h.alignment, h.data_start, h.version), (64, head.len() as u64, 3));
        assert_eq!(h.tensors[1].ne, vec![32, 2, 8]);
        assert_eq!(h.tensors[1].nbytes(), 34 * 16);
        assert_eq!(h.tensors[0].ne, vec![3, 1]);
        assert_eq!(h.uint(&file, "x.expert_count"), Some(8));
        let raws: Vec<&[u8]> = h.kvs.iter().map(|k| &file[k.raw.clone()]).collect();
        let tensors_back: Vec<TensorInfo> = h.tensors.clone();
        assert_eq!(encode_header(h.version, &raws, &tensors_back, h.alignment).0, head);
        let re = Header::encode_uint(h.kv("x.expert_count").unwrap(), 5).unwrap();
        assert_eq!(re, kv_u32("x.expert_count", 5));
        // a file cut inside the last tensor is refused
        let e = Header::parse(&file[..file.len() - 1]).unwrap_err();
        assert!(e.contains("past the end"), "{e}");
        let e = Header::parse(b"GGUX").unwrap_err();
        assert!(e.contains("magic"), "{e}");
    }
}
