//! The prompts file of `trace-decode`.
//!
//! - `*.jsonl`: one JSON object per non-empty line, `{"text": "..."}` or
//!   `{"messages": [{"role": "...", "content": "..."}, ...]}` (rendered later with the model's
//!   chat template, the assistant's turn opened).
//! - anything else: plain text, prompts separated by a line that is exactly `---` (trailing
//!   spaces and a CR allowed); leading and trailing blank lines of each prompt are dropped and
//!   empty prompts skipped, so a prompt may hold blank lines and code.

use crate::error::UsageError;
use crate::llama::ChatMessage;
use anyhow::{bail, Result};
use serde_json::Value;
use std::path::Path;

/// The line separating two prompts of a plain-text file.
pub const SEPARATOR: &str = "---";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptBody {
    Text(String),
    Chat(Vec<ChatMessage>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    /// 1-based line of the file where the prompt starts, for error messages
    pub line: usize,
    pub body: PromptBody,
}

pub fn read(path: &Path) -> Result<Vec<Prompt>> {
    let bytes = std::fs::read(path).map_err(|e| UsageError(format!("prompts file {}: {e}", path.display())))?;
    let text = String::from_utf8(bytes).map_err(|e| UsageError(format!("prompts file {}: not UTF-8 ({e})", path.display())))?;
    let prompts = if path.extension().is_some_and(|e| e == "jsonl") { parse_jsonl(path, &text)? } else { parse_text(&text) };
    if prompts.is_empty() {
        bail!(UsageError(format!("prompts file {}: no prompts in it", path.display())));
    }
    Ok(prompts)
}

pub fn parse_text(text: &str) -> Vec<Prompt> {
    let mut out = Vec::new();
    let mut cur: Vec<&str> = Vec::new();
    let mut start = 1;
    let mut flush = |cur: &mut Vec<&str>, start: usize| {
        let first = cur.iter().position(|l| !l.trim().is_empty());
        let last = cur.iter().rposition(|l| !l.trim().is_empty());
        if let (Some(a), Some(b)) = (first, last) {
            out.push(Prompt { line: start + a, body: PromptBody::Text(cur[a..=b].join("\n")) });
        }
        cur.clear();
    };
    for (i, line) in text.split('\n').enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.trim_end() == SEPARATOR {
            flush(&mut cur, start);
            start = i + 2;
        } else {
            cur.push(line);
        }
    }
    flush(&mut cur, start);
    out
}

pub fn parse_jsonl(path: &Path, text: &str) -> Result<Vec<Prompt>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let v: Value = serde_json::from_str(line).map_err(|e| UsageError(format!("{}: not a JSON object: {e}", at())))?;
        let body = if let Some(t) = v.get("text") {
            let Some(t) = t.as_str() else { bail!(UsageError(format!("{}: \"text\" must be a string", at()))) };
            PromptBody::Text(t.to_string())
        } else if let Some(m) = v.get("messages") {
            PromptBody::Chat(messages(m).map_err(|e| UsageError(format!("{}: {e}", at())))?)
        } else {
            bail!(UsageError(format!("{}: expected an object with \"text\" (a string) or \"messages\" (a list)", at())));
        };
        out.push(Prompt { line: i + 1, body });
    }
    Ok(out)
}

fn messages(m: &Value) -> std::result::Result<Vec<ChatMessage>, String> {
    let list = m.as_array().ok_or("\"messages\" must be a list")?;
    if list.is_empty() {
        return Err("\"messages\" is empty".into());
    }
    list.iter()
        .enumerate()
        .map(|(j, x)| {
            let field = |k: &str| x.get(k).and_then(Value::as_str).map(str::to_string);
            match (field("role"), field("content")) {
                (Some(role), Some(content)) => Ok(ChatMessage { role, content }),
                _ => Err(format!("message {j} needs \"role\" and \"content\" strings")),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(p: &Prompt) -> &str {
        match &p.body {
            PromptBody::Text(t) => t,
            PromptBody::Chat(_) => panic!("chat"),
        }
    }

    #[test]
    fn plain_text_splits_on_separator_lines_and_keeps_inner_blank_lines() {
        let p = parse_text("\nfirst prompt\n\nstill first\n---\n\n---  \r\nsecond\n---\n");
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].line, text(&p[0])), (2, "first prompt\n\nstill first"));
        assert_eq!((p[1].line, text(&p[1])), (8, "second"));
        // a separator inside a line is text
        assert_eq!(parse_text("a --- b").len(), 1);
    }

    #[test]
    fn jsonl_reads_text_and_messages_and_names_the_bad_line() {
        let f = Path::new("p.jsonl");
        let p = parse_jsonl(f, "{\"text\": \"hi\"}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"yo\"}]}\n").unwrap();
        assert_eq!((p[0].line, text(&p[0])), (1, "hi"));
        assert_eq!(p[1].line, 3);
        assert_eq!(p[1].body, PromptBody::Chat(vec![ChatMessage { role: "user".into(), content: "yo".into() }]));
        for (bad, why) in [
            ("{\"text\": \"ok\"}\n{oops", "p.jsonl:2: not a JSON object"),
            ("{\"text\": 3}", "p.jsonl:1: \"text\" must be a string"),
            ("{\"other\": 1}", "p.jsonl:1: expected an object"),
            ("{\"messages\": [{\"role\": \"user\"}]}", "p.jsonl:1: message 0 needs"),
            ("{\"messages\": []}", "p.jsonl:1: \"messages\" is empty"),
        ] {
            let e = format!("{:#}", parse_jsonl(f, bad).unwrap_err());
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
