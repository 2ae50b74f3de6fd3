//! `--source NAME=FILE.jsonl[:SHARE]` and `--eval FILE.jsonl`: JSONL documents, one per line,
//! `{"text": "…"}` or `{"messages": [{"role": "…", "content": "…"}, …]}`.

use crate::error::UsageError;
use crate::llama::chat::Message;
use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A `--source` as given.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceSpec {
    pub name: String,
    pub path: PathBuf,
    /// fraction of the token budget; None: an equal part of what the given shares leave
    pub share: Option<f64>,
}

impl SourceSpec {
    /// `NAME=FILE[:SHARE]`. The share is the part after the last `:` when it parses as a
    /// number, so a path may hold `:` as long as no share-like suffix follows it.
    pub fn parse(s: &str) -> std::result::Result<SourceSpec, String> {
        let (name, rest) = s.split_once('=').ok_or_else(|| format!("--source {s}: expected NAME=FILE.jsonl[:SHARE]"))?;
        if name.is_empty() || name.contains(['\t', '\n', ',', '=']) {
            return Err(format!("--source {s}: the name must be non-empty, without tabs, newlines, commas or '='"));
        }
        if name == crate::formats::domains::NO_DOMAIN {
            return Err(format!("--source {s}: the name \"{name}\" is kept for tokens outside every document"));
        }
        let (path, share) = match rest.rsplit_once(':') {
            Some((p, sh)) if !p.is_empty() && sh.parse::<f64>().is_ok() => (p, Some(sh.parse::<f64>().unwrap())),
            _ => (rest, None),
        };
        if let Some(sh) = share {
            if !(sh > 0.0 && sh <= 1.0) {
                return Err(format!("--source {s}: share {sh} is not in (0, 1]"));
            }
        }
        if path.is_empty() {
            return Err(format!("--source {s}: no file"));
        }
        Ok(SourceSpec { name: name.to_string(), path: PathBuf::from(path), share })
    }
}

/// Each source's share of the budget: given shares as they are, the rest split equally among
/// the sources without one. Shares must add up to at most 1.
pub fn resolve_shares(specs: &[SourceSpec]) -> std::result::Result<Vec<f64>, String> {
    let given: f64 = specs.iter().filter_map(|s| s.share).sum();
    let open = specs.iter().filter(|s| s.share.is_none()).count();
    if given > 1.0 + 1e-9 {
        let list: Vec<String> = specs.iter().filter_map(|s| s.share.map(|x| format!("{}={x}", s.name))).collect();
        let shown = (given * 1e9).round() / 1e9;
        return Err(format!("--source shares add up to {shown} (> 1): {}", list.join(", ")));
    }
    if open > 0 && given >= 1.0 - 1e-9 {
        return Err(format!("--source shares already add up to {given}, leaving nothing for the {open} source(s) without a share"));
    }
    let rest = if open > 0 { (1.0 - given) / open as f64 } else { 0.0 };
    Ok(specs.iter().map(|s| s.share.unwrap_or(rest)).collect())
}

/// What one JSONL line holds.
#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    Text(String),
    Messages(Vec<Message>),
}

/// One document, with where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Doc {
    /// 1-based line number in its file
    pub line: usize,
    pub body: Body,
}

/// Reads a JSONL file; every error names `file:line`. Blank lines are skipped.
pub fn read_jsonl(path: &Path) -> Result<Vec<Doc>> {
    let bytes = std::fs::read(path).map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
    let text = String::from_utf8(bytes).map_err(|e| UsageError(not_utf8(&path.display().to_string(), e.as_bytes(), e.utf8_error())))?;
    // a UTF-8 byte-order mark (some editors write one) is not part of the first line's JSON
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    parse_jsonl(text, &path.display().to_string()).map_err(|e| UsageError(e).into())
}

/// `name:LINE: not UTF-8 (byte B of the line, offset O of the file)`.
fn not_utf8(name: &str, bytes: &[u8], e: std::str::Utf8Error) -> String {
    let at = e.valid_up_to();
    let line = bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1;
    let col = at - bytes[..at].iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1) + 1;
    format!("{name}:{line}: not valid UTF-8 (byte {col} of the line, offset {at} of the file)")
}

pub fn parse_jsonl(text: &str, name: &str) -> std::result::Result<Vec<Doc>, String> {
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = format!("{name}:{}", i + 1);
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| format!("{at}: not valid JSON ({e})"))?;
        let body = if let Some(t) = v.get("text") {
            Body::Text(t.as_str().ok_or_else(|| format!("{at}: \"text\" is not a string"))?.to_string())
        } else if let Some(m) = v.get("messages") {
            let arr = m.as_array().ok_or_else(|| format!("{at}: \"messages\" is not an array"))?;
            if arr.is_empty() {
                return Err(format!("{at}: \"messages\" is empty"));
            }
            let mut msgs = Vec::with_capacity(arr.len());
            for (j, m) in arr.iter().enumerate() {
                let field = |k: &str| {
                    m.get(k).and_then(Value::as_str).map(str::to_string).ok_or_else(|| format!("{at}: messages[{j}] has no string \"{k}\""))
                };
                msgs.push(Message { role: field("role")?, content: field("content")? });
            }
            Body::Messages(msgs)
        } else {
            return Err(format!("{at}: a document needs \"text\" or \"messages\""));
        };
        docs.push(Doc { line: i + 1, body });
    }
    Ok(docs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_specs_parse() {
        let s = SourceSpec::parse("code=data/c.jsonl:0.25").unwrap();
        assert_eq!((s.name.as_str(), s.path.to_str().unwrap(), s.share), ("code", "data/c.jsonl", Some(0.25)));
        let s = SourceSpec::parse("ja=/x:y/ja.jsonl").unwrap();
        assert_eq!((s.path.to_str().unwrap(), s.share), ("/x:y/ja.jsonl", None));
        assert!(SourceSpec::parse("nofile").unwrap_err().contains("NAME=FILE"));
        assert!(SourceSpec::parse("a=f.jsonl:1.5").unwrap_err().contains("not in (0, 1]"));
    }

    #[test]
    fn shares_resolve_and_must_not_exceed_one() {
        let sp = |s: &str| SourceSpec::parse(s).unwrap();
        assert_eq!(resolve_shares(&[sp("a=x:0.5"), sp("b=y"), sp("c=z")]).unwrap(), [0.5, 0.25, 0.25]);
        assert_eq!(resolve_shares(&[sp("a=x"), sp("b=y")]).unwrap(), [0.5, 0.5]);
        let e = resolve_shares(&[sp("a=x:0.7"), sp("b=y:0.4")]).unwrap_err();
        assert!(e.contains("add up to 1.1") && e.contains("a=0.7"), "{e}");
        assert!(resolve_shares(&[sp("a=x:1"), sp("b=y")]).unwrap_err().contains("nothing for"));
    }

    #[test]
    fn jsonl_errors_name_file_and_line() {
        let ok = "{\"text\": \"a\"}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n";
        let d = parse_jsonl(ok, "s.jsonl").unwrap();
        assert_eq!(d[1].line, 3);
        assert_eq!(d[1].body, Body::Messages(vec![Message { role: "user".into(), content: "hi".into() }]));
        assert!(parse_jsonl("{\"text\": \"a\"}\n{oops\n", "s.jsonl").unwrap_err().starts_with("s.jsonl:2: not valid JSON"));
        assert!(parse_jsonl("{\"body\": 1}\n", "s.jsonl").unwrap_err().contains("s.jsonl:1: a document needs \"text\" or \"messages\""));
        assert!(parse_jsonl("{\"messages\": [{\"role\": \"user\"}]}\n", "s.jsonl").unwrap_err().contains("messages[0] has no string \"content\""));
    }

    #[test]
    fn a_jsonl_that_is_not_utf8_names_the_line_and_a_bom_is_skipped() {
        let d = std::env::temp_dir().join(format!("reap-sources-utf8-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let bad = d.join("bad.jsonl");
        std::fs::write(&bad, b"{\"text\": \"ok\"}\n{\"text\": \"x\xff\"}\n").unwrap();
        let e = format!("{:#}", read_jsonl(&bad).unwrap_err());
        assert!(e.ends_with("bad.jsonl:2: not valid UTF-8 (byte 12 of the line, offset 26 of the file)"), "{e}");
        let bom = d.join("bom.jsonl");
        std::fs::write(&bom, "\u{feff}{\"text\": \"hi\"}\n").unwrap();
        assert_eq!(read_jsonl(&bom).unwrap().len(), 1);
        let _ = std::fs::remove_dir_all(&d);
    }

}
