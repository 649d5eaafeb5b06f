//! What every kind of lent device answers, serves and shows ([`LentKind`], one impl per
//! kind: `block/`, `nic/`, `pci/`), and the kind's own fields as the status views show
//! them ([`KindView`], in the leaf `kind_view`). The session layer (`session/`) and the
//! server reach a kind only through this trait.

use devlend_fabric::{DeviceDescription, Hello};

use crate::kind_view::KindView;
use crate::session::open::{Opened, Opening, Refused, TcpSession};

/// What each kind of lent device answers and shows; one impl per kind.
pub(crate) trait LentKind {
    /// What the handshake answers for the device (one function per kind).
    fn device_info(&self) -> DeviceDescription;

    /// Refuses a hello this kind cannot serve, with the message for the borrower
    /// (`device`: the name it asked for).
    ///
    /// # Errors
    /// The reason, e.g. a NIC asked for by a borrower that does not speak frames.
    fn check_hello(&self, device: &str, hello: &Hello) -> Result<(), String>;

    /// Opens a session of it over TCP (or TLS), once the hello is admitted: takes what
    /// the session needs before the reply, and says what the reply grants.
    ///
    /// # Errors
    /// The refusal to answer (e.g. `Busy`: a PCIe function lent to another session, or
    /// a block device's I/O ring that cannot be set up).
    fn open_tcp<'a>(
        &'a self,
        at: &Opening<'a>,
    ) -> Result<Opened<Box<dyn TcpSession + 'a>>, Refused>;

    /// Opens a session of it over RDMA, once the hello is admitted (as
    /// [`Self::open_tcp`]); `conn` is the session's queue pair, for the buffers it
    /// registers.
    ///
    /// # Errors
    /// The refusal to answer; a kind lent over TCP only refuses every hello.
    #[cfg(feature = "rdma")]
    fn open_rdma<'a>(
        &'a self,
        at: &Opening<'a>,
        conn: &devlend_fabric::rdma::verbs::Connection,
    ) -> Result<Opened<Box<dyn crate::session::open::RdmaSession + 'a>>, Refused>;

    /// Refuses an RDMA session when the lender requires TLS (RDMA carries none): a
    /// borrower that holds the device through a TLS session (`held`) may add RDMA
    /// sessions; a kind without a holding session is refused.
    ///
    /// # Errors
    /// The message for the borrower.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    fn check_rdma_under_tls(&self, device: &str, held: bool) -> Result<(), String> {
        if held {
            Ok(())
        } else {
            Err(format!(
                "this lender requires TLS: open the holding session of {device:?} over TLS first (attach with --tls)"
            ))
        }
    }

    /// The pool's resource class: `BLOCK`, `NIC` or `PCI_<VENDOR>_<DEVICE>`.
    fn resource_class(&self) -> String;

    /// Lendable bytes as registered with the pool (0 for a kind without a capacity).
    fn capacity_bytes(&self) -> u64 {
        0
    }

    /// The traits the lender derives for it (`DISCARD`, `READ_ONLY`, ...), besides
    /// `FABRIC_TCP` and the configured ones.
    fn derived_traits(&self) -> Vec<&'static str> {
        Vec::new()
    }

    /// Whether a borrower's new session on a queue fences its earlier sessions of that
    /// queue before it runs anything (`docs/protocol.md`, "Fencing a queue's earlier
    /// session"): a block device's requests, resent on the new session, must not run
    /// beside their copies on the old one.
    fn fences_earlier_sessions(&self) -> bool {
        false
    }

    /// Whether it counts block requests (reads, writes, ... and their latency); the
    /// other kinds count sessions, and a NIC its frames.
    fn counts_block_requests(&self) -> bool {
        false
    }

    /// Whether limits (`docs/qos.md`) apply to it, so that it counts what they held
    /// back.
    fn is_limited(&self) -> bool {
        true
    }

    /// Its own fields, as the status views show them.
    fn view(&self) -> KindView;
}
