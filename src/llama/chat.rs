//! Chat rendering through llama.cpp's `llama_chat_apply_template`: the template stored in the
//! GGUF (`tokenizer.chat_template`) is recognised by llama.cpp (ChatML, Llama 3, Gemma, …; not a
//! Jinja interpreter) and rendered the way llama.cpp's own tools render it.

use super::sys;
use anyhow::{bail, Context as _, Result};
use std::ffi::CString;

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// Renders `messages` with `template` (the GGUF's template text or a built-in name such as
/// `chatml`); `add_assistant` opens the assistant's turn at the end (a generation prompt).
pub fn apply_template(template: &str, messages: &[Message], add_assistant: bool) -> Result<String> {
    let tmpl = CString::new(template).context("chat template contains a NUL byte")?;
    let owned: Vec<(CString, CString)> = messages
        .iter()
        .map(|m| Ok((CString::new(m.role.as_str())?, CString::new(m.content.as_str())?)))
        .collect::<Result<_, std::ffi::NulError>>()
        .context("a chat message contains a NUL byte")?;
    let chat: Vec<sys::llama_chat_message> = owned.iter().map(|(r, c)| sys::llama_chat_message { role: r.as_ptr(), content: c.as_ptr() }).collect();
    let total: usize = messages.iter().map(|m| m.role.len() + m.content.len()).sum();
    let mut buf = vec![0u8; 2 * total + 256];
    for _ in 0..2 {
        // SAFETY: every pointer in `chat` points into `owned`, alive for the call; buf and its
        // length are passed together.
        let n = unsafe { sys::llama_chat_apply_template(tmpl.as_ptr(), chat.as_ptr(), chat.len(), add_assistant, buf.as_mut_ptr().cast(), buf.len() as i32) };
        if n < 0 {
            bail!("llama.cpp does not recognise this chat template (llama_chat_apply_template supports a fixed list of templates)");
        }
        if (n as usize) <= buf.len() {
            buf.truncate(n as usize);
            return String::from_utf8(buf).context("the rendered chat is not UTF-8");
        }
        buf.resize(n as usize, 0);
    }
    bail!("llama_chat_apply_template kept asking for a larger buffer")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }

    /// ChatML, written out by hand: `<|im_start|>ROLE\nCONTENT<|im_end|>\n` per message.
    #[test]
    fn chatml_by_name_matches_a_hand_rendering() {
        let m = [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hello!")];
        let got = apply_template("chatml", &m, false).unwrap();
        assert_eq!(got, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n");
    }

    #[test]
    fn unknown_templates_are_refused() {
        let e = apply_template("{{ no such template }}", &[msg("user", "x")], false).unwrap_err();
        assert!(format!("{e:#}").contains("does not recognise"), "{e:#}");
    }
}
