//! The borrower's fabric session to the lender of a PCIe function: requests answered in
//! order, and interrupts delivered on a channel as they arrive.
//!
//! One reader thread reads every message: replies go to the caller waiting in
//! [`Link::call`] (one call at a time), [`KIND_IRQ`] messages to the interrupt channel
//! returned by [`Link::connect`]. When the connection ends, both channels close: calls
//! fail with [`LinkError::Closed`] and the interrupt channel's receiver ends.

use std::net::Shutdown;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::pci::{
    Irq, Message, PciInfo, PciStatus, FEATURE_PCI, FLAG_MORE, KIND_INFO, KIND_IRQ, REPLY,
};
use devlend_fabric::tcp::{self, ConnectError};
use devlend_fabric::tls::TlsTarget;
use devlend_fabric::{Hello, WireError};

/// Why a request to the lender failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The lender refused the request; the session goes on.
    #[error("the lender refused: {status:?}: {reason}")]
    Refused {
        /// The reply's status.
        status: PciStatus,
        /// The lender's reason.
        reason: String,
    },
    /// The connection is gone (closed by either side, or broken).
    #[error("the fabric session is closed")]
    Closed,
    /// Sending failed.
    #[error("sending to the lender")]
    Send(#[source] WireError),
    /// The lender answered with something else than the reply expected.
    #[error("protocol error: {0}")]
    Protocol(String),
}

/// Where and how to reach the lender.
#[derive(Debug, Clone)]
pub struct LinkTarget {
    /// `HOST:PORT` of the lender.
    pub lender: String,
    /// The device name on the lender.
    pub device: String,
    /// The borrower's identity (random, non-zero): the lender lends the function to one
    /// identity at a time.
    pub borrower: [u8; 16],
    /// The pool's lease token (binary form); empty in direct mode.
    pub token: Vec<u8>,
    /// TLS, or `None` for plain TCP.
    pub tls: Option<TlsTarget>,
    /// Bound on the connect and the handshake.
    pub timeout: Duration,
}

/// An open PCI session.
#[derive(Debug)]
pub struct Link {
    stream: Stream,
    write: Mutex<()>,
    replies: Mutex<Receiver<Message>>,
}

impl Link {
    /// Connects, performs the handshake asking for [`FEATURE_PCI`], starts the reader
    /// and fetches the function's [`PciInfo`].
    ///
    /// # Errors
    /// [`ConnectError`] (including the lender's refusal: `Busy` while another borrower
    /// holds the function), or a failed info request as [`ConnectError::Handshake`].
    pub fn connect(t: &LinkTarget) -> Result<(Link, PciInfo, Receiver<Irq>), ConnectError> {
        let mut hello = Hello::new(&t.device, 0);
        hello.features = FEATURE_PCI;
        hello.borrower = t.borrower;
        hello.token = t.token.clone();
        let (stream, reply) = tcp::open(&t.lender, &hello, t.timeout, t.tls.as_ref())?;
        let bad = |what: &'static str| ConnectError::Handshake {
            addr: t.lender.clone(),
            source: WireError::Invalid(what),
        };
        if !reply.device.is_pci() || reply.features & FEATURE_PCI == 0 {
            return Err(bad("the lender's device is not a PCIe function"));
        }
        let io = |e: std::io::Error| ConnectError::Handshake {
            addr: t.lender.clone(),
            source: WireError::Io(e),
        };
        let reader = stream.try_clone().map_err(io)?;
        let (reply_tx, reply_rx) = mpsc::channel();
        let (irq_tx, irq_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("devlend-pci-rx".into())
            .spawn(move || read_loop(reader, reply_tx, irq_tx))
            .map_err(io)?;
        let link = Link {
            stream,
            write: Mutex::new(()),
            replies: Mutex::new(reply_rx),
        };
        let info = link
            .call(Message::new(KIND_INFO, Vec::new()))
            .map_err(|e| {
                tracing::warn!(error = %e, "info request failed");
                bad("the lender did not answer the info request")
            })
            .and_then(|r| {
                PciInfo::decode(&r[0].payload).map_err(|source| ConnectError::Handshake {
                    addr: t.lender.clone(),
                    source,
                })
            })?;
        Ok((link, info, irq_rx))
    }

    /// Sends `m` and waits for its answer: one reply, or for a pull the replies up to
    /// the one without [`FLAG_MORE`]. Calls are serialized.
    ///
    /// # Errors
    /// [`LinkError`].
    pub fn call(&self, m: Message) -> Result<Vec<Message>, LinkError> {
        let replies = self.replies.lock().unwrap_or_else(PoisonError::into_inner);
        self.send(&m)?;
        let mut out = Vec::new();
        loop {
            let r = replies.recv().map_err(|_| LinkError::Closed)?;
            if r.kind != m.kind | REPLY {
                return Err(LinkError::Protocol(format!(
                    "reply {:#04x} to request {:#04x}",
                    r.kind, m.kind
                )));
            }
            if r.status != PciStatus::Ok {
                return Err(LinkError::Refused {
                    status: r.status,
                    reason: String::from_utf8_lossy(&r.payload).into_owned(),
                });
            }
            let more = r.flags & FLAG_MORE != 0;
            out.push(r);
            if !more {
                return Ok(out);
            }
        }
    }

    /// Sends `m` expecting no reply (a push message with [`FLAG_MORE`]).
    ///
    /// # Errors
    /// [`LinkError::Send`].
    pub fn send(&self, m: &Message) -> Result<(), LinkError> {
        let _g = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        m.write_to(&mut &self.stream).map_err(LinkError::Send)
    }

    /// Shuts the connection down both ways: the lender's session ends (and it quiesces
    /// the function), pending and later calls fail.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn read_loop(stream: Stream, replies: Sender<Message>, irqs: Sender<Irq>) {
    loop {
        let m = match Message::read_from(&mut &stream) {
            Ok(m) => m,
            Err(WireError::Closed) => {
                tracing::info!("the lender closed the PCI session");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %devlend_fabric::error::chain(&e), "PCI session lost");
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
        };
        if m.kind == KIND_IRQ {
            match Irq::decode(&m.payload) {
                Ok(irq) => {
                    let _ = irqs.send(irq);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "malformed interrupt message; closing the session");
                    let _ = stream.shutdown(Shutdown::Both);
                    return;
                }
            }
        } else if m.kind & REPLY == 0 {
            tracing::warn!(
                kind = m.kind,
                "request from the lender; closing the session"
            );
            let _ = stream.shutdown(Shutdown::Both);
            return;
        } else if replies.send(m).is_err() {
            return;
        }
    }
}
