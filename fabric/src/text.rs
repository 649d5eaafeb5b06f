//! Text that outside input supplies, bounded before it is echoed: in a refusal on the
//! wire, in an error message, in a log line.

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub fn prefix(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `s` whole when it is at most `max` bytes, else its [`prefix`] of `max` bytes followed
/// by `... (N bytes)`, N its full length: what an error message quotes of a value that
/// may be huge, so that a huge value costs its sender a short answer, not an echo.
pub fn shortened(s: &str, max: usize) -> String {
    if s.len() <= max {
        s.to_owned()
    } else {
        format!("{}... ({} bytes)", prefix(s, max), s.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_on_a_character_boundary() {
        assert_eq!(prefix("abc", 10), "abc");
        assert_eq!(prefix("abc", 2), "ab");
        // "é" is 2 bytes: 3 bytes hold one of them.
        assert_eq!(prefix("éé", 3), "é");
        assert_eq!(prefix("é", 1), "");
        assert_eq!(shortened("short", 5), "short");
        assert_eq!(shortened("éééé", 5), "éé... (8 bytes)");
    }
}
