//! The transport of a borrower's queue sessions, defined once: the compute agent's API
//! (`transport`, `rdma_exposure`), the CLI (`--transport`, `--rdma-exposure`) and the
//! borrower's engines all use these two enums.

use serde::{Deserialize, Serialize};

/// How a borrower's virtqueue sessions travel to the lender (the session that holds the
/// device is TCP either way). JSON and command line: `tcp`, `rdma`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// TCP, optionally inside TLS: data inline in the stream.
    #[default]
    Tcp,
    /// RDMA: rdma_cm, one RC queue pair per virtqueue; requests carry (addr, rkey, len)
    /// of guest memory and the lender moves the data one-sided, within what the
    /// [`RdmaExposure`] lets it reach.
    Rdma,
}

/// How much of the guest's memory a lender can reach over RDMA (docs/rdma.md,
/// "Exposure"). JSON and command line: `request`, `guest-memory`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RdmaExposure {
    /// Each request's buffers are registered for it alone, in its direction (the
    /// lender may only write a read's buffers and only read a write's), when it is sent,
    /// and deregistered when its response arrives: the lender reaches nothing else, and
    /// nothing after the request.
    #[default]
    Request,
    /// Every guest memory region is registered once, for remote read and write, for
    /// the session's life: fewer verbs calls per request, but the lender can read and
    /// write all of the guest's RAM while a session is open. For lenders trusted as
    /// much as the host.
    GuestMemory,
}

impl Transport {
    /// Whether this is the default, TCP.
    pub fn is_tcp(&self) -> bool {
        *self == Transport::Tcp
    }

    /// `tcp` or `rdma`.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
        }
    }
}

impl RdmaExposure {
    /// Whether this is the default, `request`.
    pub fn is_request(&self) -> bool {
        *self == RdmaExposure::Request
    }

    /// `request` or `guest-memory`.
    pub fn as_str(self) -> &'static str {
        match self {
            RdmaExposure::Request => "request",
            RdmaExposure::GuestMemory => "guest-memory",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for RdmaExposure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Transport {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tcp" => Ok(Transport::Tcp),
            "rdma" => Ok(Transport::Rdma),
            _ => Err(format!("unknown transport {s:?}: tcp or rdma")),
        }
    }
}

impl std::str::FromStr for RdmaExposure {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "request" => Ok(RdmaExposure::Request),
            "guest-memory" => Ok(RdmaExposure::GuestMemory),
            _ => Err(format!(
                "unknown RDMA exposure {s:?}: request or guest-memory"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_same_in_json_text_and_on_the_command_line() {
        for t in [Transport::Tcp, Transport::Rdma] {
            let json = serde_json::to_value(t).expect("json");
            assert_eq!(json, t.as_str());
            assert_eq!(t.to_string().parse::<Transport>(), Ok(t));
            assert_eq!(serde_json::from_value::<Transport>(json).expect("read"), t);
        }
        for e in [RdmaExposure::Request, RdmaExposure::GuestMemory] {
            let json = serde_json::to_value(e).expect("json");
            assert_eq!(json, e.as_str());
            assert_eq!(e.to_string().parse::<RdmaExposure>(), Ok(e));
            assert_eq!(
                serde_json::from_value::<RdmaExposure>(json).expect("read"),
                e
            );
        }
        assert_eq!(
            serde_json::to_value(RdmaExposure::GuestMemory).expect("json"),
            "guest-memory"
        );
        assert!("udp".parse::<Transport>().is_err());
        assert!("all".parse::<RdmaExposure>().is_err());
        assert!(Transport::default().is_tcp() && RdmaExposure::default().is_request());
    }
}
