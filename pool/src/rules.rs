//! The pool's rules for names and fabric addresses, as plain checks: the pool's own
//! validation ([`crate::validate`], server side) and the lenders that register with it
//! (before they start, so that a name or address the pool would refuse fails at once,
//! not at every registration) apply the same ones.

use crate::api::{MAX_FABRIC_PATHS, MAX_NAME_LEN};

/// Most bytes of a refused value an error message quotes.
const QUOTED: usize = 64;

/// `v` quoted for an error message: at most [`QUOTED`] bytes of it (cut on a character
/// boundary), then how long it was ([`devlend_fabric::text::shortened`]).
fn quoted(v: &str) -> String {
    if v.len() <= QUOTED {
        format!("{v:?}")
    } else {
        format!(
            "{:?}... ({} bytes)",
            devlend_fabric::text::prefix(v, QUOTED),
            v.len()
        )
    }
}

/// A provider or device name: `[A-Za-z0-9._:-]`, 1..=[`MAX_NAME_LEN`] bytes.
///
/// # Errors
/// Why it is not one, naming `what`.
pub fn name(what: &str, v: &str) -> Result<(), String> {
    let ok = !v.is_empty()
        && v.len() <= MAX_NAME_LEN
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {} is not a name: use 1 to {MAX_NAME_LEN} of A-Z a-z 0-9 . _ : -",
            quoted(v)
        ))
    }
}

/// A fabric address: `HOST:PORT` with a port number, at most [`MAX_NAME_LEN`] bytes,
/// no blanks, control characters or commas.
///
/// # Errors
/// Why it is not one.
pub fn address(v: &str) -> Result<(), String> {
    let ok = v.len() <= MAX_NAME_LEN
        && !v
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == ',')
        && v.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
    if ok {
        Ok(())
    } else {
        Err(format!("fabric address {} is not HOST:PORT", quoted(v)))
    }
}

/// An address borrowers are given to reach a lender at: an [`address`], without a
/// path (`/`), and not a wildcard (`0.0.0.0`, `[::]`, `::`, `*`).
///
/// # Errors
/// Why borrowers could not use it.
pub fn reachable_address(v: &str) -> Result<(), String> {
    address(v)?;
    if v.contains('/') {
        return Err(format!("fabric address {} is not HOST:PORT", quoted(v)));
    }
    let wildcard = v
        .rsplit_once(':')
        .is_some_and(|(host, _)| matches!(host, "0.0.0.0" | "[::]" | "::" | "*"));
    if wildcard {
        return Err(format!(
            "fabric address {} is a wildcard: give one borrowers can reach",
            quoted(v)
        ));
    }
    Ok(())
}

/// A provider's further fabric addresses beside `primary`: at most
/// [`MAX_FABRIC_PATHS`], each a [`reachable_address`], all distinct and none
/// `primary`.
///
/// # Errors
/// The first rule broken.
pub fn fabric_paths(primary: &str, paths: &[String]) -> Result<(), String> {
    if paths.len() > MAX_FABRIC_PATHS {
        return Err(format!(
            "{} further fabric addresses given, at most {MAX_FABRIC_PATHS} beside the first",
            paths.len()
        ));
    }
    let mut seen = vec![primary];
    for p in paths {
        reachable_address(p)?;
        if seen.contains(&p.as_str()) {
            return Err(format!("fabric address {} is given twice", quoted(p)));
        }
        seen.push(p);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_value_is_quoted_short() {
        let huge = "x".repeat(1 << 20);
        for e in [address(&huge), name("provider", &huge)] {
            let e = e.unwrap_err();
            assert!(e.len() < 200, "{} bytes", e.len());
            assert!(e.contains("1048576 bytes"), "{e}");
        }
        assert_eq!(quoted("a:1"), "\"a:1\"");
        // Cut on a character boundary.
        assert!(quoted(&"é".repeat(100)).contains("200 bytes"));
    }

    #[test]
    fn addresses() {
        for ok in ["10.0.0.1:7700", "devsrv:7700", "[::1]:7700"] {
            assert!(address(ok).is_ok(), "{ok}");
            assert!(reachable_address(ok).is_ok(), "{ok}");
        }
        for bad in ["", "devsrv", ":7700", "h:0", "h:99999", "h :1", "h\u{1}:1"] {
            assert!(address(bad).is_err(), "{bad}");
        }
        assert!(address(&format!("{}:1", "h".repeat(MAX_NAME_LEN))).is_err());
        for wild in ["0.0.0.0:7700", "[::]:7700", "*:7700", "h/x:1"] {
            assert!(address(wild).is_ok(), "{wild}");
            assert!(reachable_address(wild).is_err(), "{wild}");
        }
    }

    #[test]
    fn further_fabric_addresses() {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(fabric_paths("a:1", &[]).is_ok());
        assert!(fabric_paths("a:1", &v(&["b:1", "10.0.0.2:7700", "[fd00::2]:7700"])).is_ok());
        let seven = v(&["b:1", "b:2", "b:3", "b:4", "b:5", "b:6", "b:7"]);
        assert!(fabric_paths("a:1", &seven).is_ok());
        let mut eight = seven.clone();
        eight.push("b:8".into());
        assert!(fabric_paths("a:1", &eight).is_err());
        for bad in [
            "0.0.0.0:7700",
            "[::]:7700",
            "b",
            "b:0",
            ":7700",
            "b :1",
            "b:1,c:1",
            "a:1",
        ] {
            assert!(fabric_paths("a:1", &v(&[bad])).is_err(), "{bad}");
        }
        assert!(fabric_paths("a:1", &v(&["b:1", "b:1"])).is_err());
    }

    #[test]
    fn names() {
        assert!(name("provider name", "dev-srv_1.example:a").is_ok());
        for bad in ["", "a b", "a/b", "é"] {
            assert!(name("provider name", bad).is_err(), "{bad}");
        }
        assert!(name("provider name", &"n".repeat(MAX_NAME_LEN + 1)).is_err());
    }
}
