//! Where a lender may serve without authenticating its borrowers.
//!
//! A lender with no device pool, no auth keys and no required TLS client certificates
//! serves any borrower that reaches its port. That is allowed on loopback only (the
//! demo, tests, a borrower on the same host); anywhere else it needs `--insecure`
//! (`insecure = true`), or the lender refuses to start. The TCP listener and the RDMA
//! one (`--transport rdma`) bind the same `listen` address, so one check covers both.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};

use crate::Error;

/// Whether `listen` (`IP:PORT`, `[IPv6]:PORT` or `HOST:PORT`) can only be reached from
/// this host: every address it stands for is loopback (127.0.0.0/8, `::1`, or
/// `::ffff:127.x.y.z`). A wildcard (`0.0.0.0`, `::`) is not loopback; a host name is
/// resolved, and is loopback only if all its addresses are (and it has at least one).
///
/// # Errors
/// `listen` is not `HOST:PORT`, or the host name does not resolve.
pub fn is_loopback_only(listen: &str) -> io::Result<bool> {
    let addrs: Vec<SocketAddr> = listen.to_socket_addrs()?.collect();
    Ok(!addrs.is_empty() && addrs.iter().all(|a| a.ip().to_canonical().is_loopback()))
}

/// Why an unauthenticated lender may serve on its listen address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unauthenticated {
    /// The address is loopback only: no other host reaches it.
    Loopback,
    /// The address is reachable from other hosts, and `--insecure` allows that.
    Insecure,
}

/// Decides whether a lender that authenticates no borrower (no pool, no auth keys, no
/// required client certificates) may serve on `listen`: on loopback, yes; elsewhere only
/// with `insecure`.
///
/// # Errors
/// [`Error::Unauthenticated`] when `listen` is not loopback only and `insecure` is
/// false (the message names the ways out); [`Error::Bind`] when `listen` does not
/// resolve (the listener could not be bound either).
pub fn allow_unauthenticated(listen: &str, insecure: bool) -> Result<Unauthenticated, Error> {
    let loopback = is_loopback_only(listen).map_err(|source| Error::Bind {
        addr: listen.to_owned(),
        source,
    })?;
    match (loopback, insecure) {
        (true, _) => Ok(Unauthenticated::Loopback),
        (false, true) => Ok(Unauthenticated::Insecure),
        (false, false) => Err(Error::Unauthenticated {
            addr: listen.to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses_are_loopback_only() {
        for a in [
            "127.0.0.1:7700",
            "127.0.0.1:0",
            "127.1.2.3:7700",
            "[::1]:7700",
            "[::ffff:127.0.0.1]:7700",
        ] {
            assert!(is_loopback_only(a).unwrap(), "{a}");
        }
    }

    #[test]
    fn wildcards_and_other_addresses_are_not() {
        for a in [
            "0.0.0.0:7700",
            "0.0.0.0:0",
            "[::]:7700",
            "10.9.0.1:7700",
            "192.168.1.2:1",
            "128.0.0.1:7700",
            "[fe80::1]:7700",
            "[::ffff:10.0.0.1]:7700",
            "[::2]:7700",
        ] {
            assert!(!is_loopback_only(a).unwrap(), "{a}");
        }
    }

    #[test]
    fn localhost_resolves_to_loopback_only() {
        // /etc/hosts maps localhost to 127.0.0.1 (and ::1) on any sane system.
        assert!(is_loopback_only("localhost:7700").unwrap());
    }

    #[test]
    fn unparsable_or_unresolvable_addresses_are_errors() {
        assert!(is_loopback_only("127.0.0.1").is_err());
        assert!(is_loopback_only("no-such-host.invalid:7700").is_err());
        assert!(matches!(
            allow_unauthenticated("no-such-host.invalid:7700", true),
            Err(Error::Bind { .. })
        ));
    }

    #[test]
    fn unauthenticated_beyond_loopback_needs_insecure() {
        assert_eq!(
            allow_unauthenticated("127.0.0.1:7700", false).unwrap(),
            Unauthenticated::Loopback
        );
        assert_eq!(
            allow_unauthenticated("[::1]:7700", true).unwrap(),
            Unauthenticated::Loopback
        );
        assert_eq!(
            allow_unauthenticated("0.0.0.0:7700", true).unwrap(),
            Unauthenticated::Insecure
        );
        let e = allow_unauthenticated("0.0.0.0:7700", false).unwrap_err();
        assert!(matches!(&e, Error::Unauthenticated { addr } if addr == "0.0.0.0:7700"));
        let msg = e.to_string();
        for way_out in ["devlend keygen", "--auth-key", "--pool", "--insecure"] {
            assert!(msg.contains(way_out), "{way_out} not in: {msg}");
        }
        assert!(matches!(
            allow_unauthenticated("[::]:7700", false),
            Err(Error::Unauthenticated { .. })
        ));
    }
}
