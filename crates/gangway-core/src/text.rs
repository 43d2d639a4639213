//! Strings that reach a terminal: which characters are refused in names
//! and how every user-supplied string is escaped for human-readable
//! output. A job name holding ESC, CR or LF could otherwise forge table and
//! event lines, or drive the reader's terminal (an OSC 52 sequence writes
//! the clipboard); bidirectional overrides reorder what is shown.

use std::borrow::Cow;
use std::fmt::Write;

/// Whether `c` must never reach a terminal raw: the C0 controls (TAB, LF,
/// CR and ESC among them), DEL, the C1 controls (U+0080 to U+009F: U+009B
/// is a one-byte CSI), the bidirectional embeddings, overrides and isolates
/// (U+202A to U+202E, U+2066 to U+2069), the directional marks (U+200E,
/// U+200F, U+061C) and the Unicode line and paragraph separators.
pub fn is_unsafe(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1f}'
        | '\u{7f}'..='\u{9f}'
        | '\u{202a}'..='\u{202e}'
        | '\u{2066}'..='\u{2069}'
        | '\u{200e}' | '\u{200f}' | '\u{061c}'
        | '\u{2028}' | '\u{2029}')
}

/// `s` safe to print: each unsafe character (see [`is_unsafe`]) written as
/// an escape (`\n`, `\r`, `\t`, `\x1b` for the other C0 controls and DEL,
/// `\u{9b}` or `\u{202e}` above), everything else as is. Borrowed when
/// nothing needed escaping (every well-formed name).
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_unsafe) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if !is_unsafe(c) {
            out.push(c);
            continue;
        }
        let _ = match c {
            '\n' => write!(out, "\\n"),
            '\r' => write!(out, "\\r"),
            '\t' => write!(out, "\\t"),
            c if (c as u32) < 0x80 => write!(out, "\\x{:02x}", c as u32),
            c => write!(out, "\\u{{{:x}}}", c as u32),
        };
    }
    Cow::Owned(out)
}

/// Refuses a `field` (a name, a label) that holds an unsafe character,
/// naming the field and the first such character:
/// `name: control character U+001B is not allowed`.
pub fn check_printable(field: &str, s: &str) -> Result<(), String> {
    match s.chars().find(|c| is_unsafe(*c)) {
        Some(c) => Err(format!(
            "{field}: control character U+{:04X} is not allowed",
            c as u32
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unsafe_character_is_escaped_and_nothing_else() {
        assert!(matches!(
            printable("train-7 ünïcödé 日本"),
            Cow::Borrowed(_)
        ));
        assert_eq!(
            printable("a\x1b]52;c;SGVsbG8=\x07b\r\nc\td\x7f"),
            "a\\x1b]52;c;SGVsbG8=\\x07b\\r\\nc\\td\\x7f"
        );
        assert_eq!(
            printable("x\u{9b}31m\u{202e}gpj.exe\u{2066}\u{200f}\u{2028}"),
            "x\\u{9b}31m\\u{202e}gpj.exe\\u{2066}\\u{200f}\\u{2028}"
        );
        // Every code point in the refused ranges, and none next to them.
        for c in (0u32..0x20)
            .chain(0x7f..0xa0)
            .chain(0x202a..0x202f)
            .chain(0x2066..0x206a)
            .filter_map(char::from_u32)
        {
            let shown = printable(&c.to_string()).into_owned();
            assert!(!shown.chars().any(is_unsafe), "{:x}: {shown:?}", c as u32);
            assert!(shown.starts_with('\\'), "{:x}", c as u32);
        }
        for c in [' ', '~', '\u{a0}', '\u{2029}', '\u{2070}'] {
            assert_eq!(
                matches!(printable(&c.to_string()), Cow::Borrowed(_)),
                !is_unsafe(c)
            );
        }
        assert!(!is_unsafe('\u{a0}') && !is_unsafe('\u{2070}') && is_unsafe('\u{2029}'));
    }

    #[test]
    fn a_name_with_a_control_character_is_refused_naming_the_field() {
        assert_eq!(
            check_printable("name", "evil\x1b[2J"),
            Err("name: control character U+001B is not allowed".into())
        );
        assert_eq!(
            check_printable("users[0].name", "bob\u{202e}"),
            Err("users[0].name: control character U+202E is not allowed".into())
        );
        assert_eq!(check_printable("name", "résumé-training"), Ok(()));
    }
}
