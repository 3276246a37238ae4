//! Bounded echoes of untrusted input, for logs, errors and operator output.
//!
//! Anything a client, a registry file or a peer sends can be megabytes long;
//! echoing it whole fills logs and memory (a 50 MB registry value once went
//! into every replica's log). Values are shown as a prefix plus their length,
//! with control characters escaped so one value cannot forge log lines.

use std::fmt::{self, Write};

/// Bytes of a value shown before it is cut.
pub const VALUE_PREFIX_BYTES: usize = 64;
/// Bytes of a whole message (which may quote values itself) shown before it
/// is cut; messages start with what matters (file, field), so the head is kept.
pub const MESSAGE_PREFIX_BYTES: usize = 256;

/// A value for a log line or an error, quoted: `"web"`, or when long
/// `"aaaa…" (52428800 bytes)`.
pub fn for_log(value: &str) -> ForLog<'_> {
    ForLog(value)
}

pub struct ForLog<'a>(&'a str);

impl fmt::Display for ForLog<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let value = self.0;
        if value.len() <= VALUE_PREFIX_BYTES {
            return write!(f, "\"{}\"", value.escape_debug());
        }
        let prefix = &value[..floor_char_boundary(value, VALUE_PREFIX_BYTES)];
        write!(f, "\"{}…\" ({} bytes)", prefix.escape_debug(), value.len())
    }
}

impl fmt::Debug for ForLog<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Renders `message` (an error from a parser, say, which may quote the bad
/// input) into at most [`MESSAGE_PREFIX_BYTES`] bytes plus `… (N bytes)`
/// when longer, control characters escaped. The full text is never held in
/// memory: rendering stops keeping bytes once the bound is reached.
pub fn bounded_message(message: impl fmt::Display) -> String {
    let mut out = Bounded {
        kept: String::new(),
        total: 0,
        limit: MESSAGE_PREFIX_BYTES,
    };
    // Our writer never fails; a failing Display impl leaves what it wrote.
    let _ = write!(out, "{message}");
    if out.total > out.limit {
        let total = out.total;
        let _ = write!(out.kept, "… ({total} bytes)");
    }
    out.kept
}

struct Bounded {
    kept: String,
    /// Bytes of the escaped rendering, kept or not.
    total: usize,
    limit: usize,
}

impl Write for Bounded {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for c in s.chars() {
            let mut buf = [0u8; 4];
            let escaped;
            let piece: &str = if c.is_control() && c != '\t' {
                escaped = c.escape_default().to_string();
                &escaped
            } else {
                c.encode_utf8(&mut buf)
            };
            self.total += piece.len();
            if self.total <= self.limit {
                self.kept.push_str(piece);
            }
        }
        Ok(())
    }
}

/// The largest char boundary of `s` at or below `index`.
fn floor_char_boundary(s: &str, index: usize) -> usize {
    let mut i = index.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_values_are_shown_whole_and_escaped() {
        assert_eq!(for_log("web").to_string(), "\"web\"");
        assert_eq!(for_log("a\nb\"").to_string(), "\"a\\nb\\\"\"");
    }

    #[test]
    fn long_values_are_a_prefix_and_a_length() {
        let value = "a".repeat(52_428_800);
        let shown = for_log(&value).to_string();
        assert_eq!(
            shown,
            format!("\"{}…\" (52428800 bytes)", "a".repeat(VALUE_PREFIX_BYTES))
        );
        // Never cut inside a character.
        let value = "é".repeat(100);
        let shown = for_log(&value).to_string();
        assert!(shown.ends_with("…\" (200 bytes)"), "{shown}");
        assert!(shown.len() < VALUE_PREFIX_BYTES + 32);
    }

    #[test]
    fn messages_are_bounded_and_keep_their_head() {
        assert_eq!(bounded_message("field `x`: bad"), "field `x`: bad");
        let long = format!("field `name`: {}", "z".repeat(10_000));
        let shown = bounded_message(&long);
        assert!(shown.starts_with("field `name`: zzz"), "{shown}");
        assert!(
            shown.ends_with(&format!("… ({} bytes)", long.len())),
            "{shown}"
        );
        assert!(shown.len() < MESSAGE_PREFIX_BYTES + 32);
        assert_eq!(bounded_message("line\nforged"), "line\\nforged");
    }
}
