//! The pool servers a client may ask, and the clock it signs requests with.
//!
//! A pool URL may name several servers of one pool (sharing one database), separated by
//! commas: `http://pool-a:7400,http://pool-b:7400`. Requests go to the server that last
//! answered; one that cannot be connected to is skipped for the next at once (the
//! request was never sent), and one that timed out is skipped from the next request on
//! (it may have been carried out: it is not sent twice).
//!
//! Signed requests carry the caller's time, which the pool accepts within five minutes
//! of its own. When a pool's answer shows its clock over [`CORRECT_ABOVE`] away from
//! ours (the HTTP `Date` header), requests are signed with the pool's time from then on:
//! a host whose clock is minutes off still reaches the pool.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reqwest::Url;

/// A clock difference below this is left alone (`Date` has whole seconds).
pub const CORRECT_ABOVE: Duration = Duration::from_secs(30);

/// Most servers one pool URL may name.
pub const MAX_SERVERS: usize = 16;

/// The servers of one pool and what the client learned of them. Shared by the clones
/// of a client.
#[derive(Debug)]
pub(crate) struct Endpoints {
    bases: Vec<Url>,
    /// Index of the server asked first.
    current: AtomicUsize,
    /// The pool's clock minus ours, in ms (0 until corrected).
    offset_ms: AtomicI64,
}

/// Why a pool URL list was refused: the URL at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadBase(pub String);

impl Endpoints {
    /// Parses `list` (one URL, or several separated by commas, all `http://` or all
    /// `https://`). Returns the servers and whether they are HTTPS.
    pub(crate) fn parse(list: &str) -> Result<(Arc<Endpoints>, bool), BadBase> {
        let mut bases = Vec::new();
        let mut https = None;
        for part in list.split(',') {
            let part = part.trim();
            let bad = || BadBase(part.to_string());
            let mut base = Url::parse(part).map_err(|_| bad())?;
            let secure = match base.scheme() {
                "http" => false,
                "https" => true,
                _ => return Err(bad()),
            };
            if base.cannot_be_a_base() || base.host().is_none() {
                return Err(bad());
            }
            if *https.get_or_insert(secure) != secure {
                // One TLS setting for the whole pool: mixing would downgrade it.
                return Err(bad());
            }
            if !base.path().ends_with('/') {
                let p = format!("{}/", base.path());
                base.set_path(&p);
            }
            bases.push(base);
        }
        if bases.len() > MAX_SERVERS {
            return Err(BadBase(list.to_string()));
        }
        let https = https.ok_or_else(|| BadBase(list.to_string()))?;
        Ok((
            Arc::new(Endpoints {
                bases,
                current: AtomicUsize::new(0),
                offset_ms: AtomicI64::new(0),
            }),
            https,
        ))
    }

    /// The servers in the order to try them: the current one first.
    pub(crate) fn in_order(&self) -> impl Iterator<Item = (usize, &Url)> {
        let n = self.bases.len();
        let first = self.current.load(Ordering::Relaxed) % n;
        (0..n).map(move |i| {
            let j = (first + i) % n;
            (j, &self.bases[j])
        })
    }

    /// The server asked first now.
    pub(crate) fn current(&self) -> &Url {
        let n = self.bases.len();
        &self.bases[self.current.load(Ordering::Relaxed) % n]
    }

    /// Every server, in configuration order.
    pub(crate) fn all(&self) -> &[Url] {
        &self.bases
    }

    /// Server `i` answered: ask it first from now on.
    pub(crate) fn answered(&self, i: usize) {
        self.current.store(i, Ordering::Relaxed);
    }

    /// Server `i` failed after the request may have been sent: ask the next first from
    /// the next request on.
    pub(crate) fn skip(&self, i: usize) {
        let n = self.bases.len();
        let _ = self
            .current
            .compare_exchange(i, (i + 1) % n, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The time to sign a request with: ours, corrected by the pool's clock once it was
    /// seen over [`CORRECT_ABOVE`] away. Ms since the Unix epoch.
    pub(crate) fn now_ms(&self) -> u64 {
        let ours = i64::try_from(devlend_fabric::lease_token::now_ms()).unwrap_or(i64::MAX);
        u64::try_from(ours.saturating_add(self.offset_ms.load(Ordering::Relaxed))).unwrap_or(0)
    }

    /// Takes in a pool's `Date` header, seen at `ours` (our clock): when it is over
    /// [`CORRECT_ABOVE`] away from ours, later requests are signed with the pool's time.
    /// Returns whether the correction changed.
    pub(crate) fn saw_date(&self, date: &str, ours: SystemTime) -> bool {
        let Ok(theirs) = httpdate::parse_http_date(date) else {
            return false;
        };
        let diff_ms = match theirs.duration_since(ours) {
            Ok(ahead) => i64::try_from(ahead.as_millis()).unwrap_or(i64::MAX),
            Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
        };
        let offset = if diff_ms.unsigned_abs() > CORRECT_ABOVE.as_millis() as u64 {
            diff_ms
        } else {
            0
        };
        self.offset_ms.swap(offset, Ordering::Relaxed) != offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_names_several_servers_of_one_scheme() {
        let (e, https) = Endpoints::parse("http://a:1, http://b:2/x").unwrap();
        assert!(!https);
        let urls: Vec<String> = e.in_order().map(|(_, u)| u.to_string()).collect();
        assert_eq!(urls, ["http://a:1/", "http://b:2/x/"]);
        assert!(Endpoints::parse("http://a:1,https://b:2").is_err());
        assert!(Endpoints::parse("http://a:1,").is_err());
        assert!(Endpoints::parse("ftp://a:1").is_err());
        let client = crate::PoolClient::new("http://a:1, http://b:2/x").unwrap();
        assert_eq!(client.pool_url(), "http://a:1,http://b:2/x");
    }

    #[test]
    fn failover_moves_the_first_server_and_skip_moves_past_one_that_timed_out() {
        let (e, _) = Endpoints::parse("http://a:1,http://b:2,http://c:3").unwrap();
        e.answered(1);
        let order: Vec<usize> = e.in_order().map(|(i, _)| i).collect();
        assert_eq!(order, [1, 2, 0]);
        e.skip(1);
        assert_eq!(e.current().as_str(), "http://c:3/");
        // A stale skip (another request moved on already) changes nothing.
        e.skip(1);
        assert_eq!(e.current().as_str(), "http://c:3/");
    }

    #[test]
    fn a_pool_clock_minutes_away_corrects_the_signing_time_and_a_near_one_does_not() {
        let (e, _) = Endpoints::parse("http://a:1").unwrap();
        let ours = SystemTime::now();
        let ahead = httpdate::fmt_http_date(ours + Duration::from_secs(300));
        assert!(e.saw_date(&ahead, ours));
        let signed = e.now_ms() as i64 - devlend_fabric::lease_token::now_ms() as i64;
        assert!((298_000..302_000).contains(&signed), "{signed}");
        let behind = httpdate::fmt_http_date(ours - Duration::from_secs(600));
        assert!(e.saw_date(&behind, ours));
        let signed = e.now_ms() as i64 - devlend_fabric::lease_token::now_ms() as i64;
        assert!((-602_000..-598_000).contains(&signed), "{signed}");
        let near = httpdate::fmt_http_date(ours + Duration::from_secs(5));
        assert!(e.saw_date(&near, ours));
        assert_eq!(e.offset_ms.load(Ordering::Relaxed), 0);
        assert!(!e.saw_date("not a date", ours));
    }
}
