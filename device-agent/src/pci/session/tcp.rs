//! One PCI session over TCP (or TLS): the borrower's requests on a lent function,
//! answered in order ([`Lending`]), and the function's interrupts sent as they come
//! (from a second thread, under the same write lock, so that messages never
//! interleave). Pushes carry the pages' data; a pull answers with the pages the function
//! changed.
//!
//! In coherence mode `nvme` the session has a mediator ([`TcpMediated`]): BAR0's
//! controller registers and doorbells go to it (from the request loop, which may read
//! guest memory), the function's interrupts too (from the interrupt thread, which only
//! writes guest memory and raises the guest's interrupts).

use std::io::Read;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use devlend_fabric::conn::Stream;
use devlend_fabric::pci::{
    decode_pages, encode_page, page_cost, Irq, Message, FLAG_MORE, KIND_IRQ, KIND_PULL, KIND_PUSH,
    MAX_ACCESS, REPLY,
};
use devlend_fabric::WireError;
use vmm_sys_util::eventfd::EventFd;

use crate::config::Coherence;
use crate::pci::guest::tcp::TcpMediated;
use crate::pci::guest::AccessCounters;
use crate::pci::irq::IrqTable;
use crate::pci::lending::{invalid, Answer, Lending};
use crate::pci::nvme::throttle::Throttle;
use crate::pci::nvme::Mediator;
use crate::pci::PciFunction;
use crate::session::end::End;

/// How often the interrupt thread looks at its stop flag when no interrupt comes.
const IRQ_POLL: Duration = Duration::from_millis(200);
/// With the NVMe mediator, how often it also looks at the shadow completion queues when
/// no interrupt comes (a controller interrupt may be lost while vectors are re-enabled).
const NVME_IDLE_POLL: Duration = Duration::from_millis(10);

/// Serves one borrower's session on `f` until it closes or breaks the protocol, then
/// quiesces the function; the mediator notes its DMA counters to the borrower when
/// `notes`.
///
/// Between messages the lender waits as long as the borrower likes; once a message has
/// begun, the rest of it must arrive within `frame_timeout`, else the session ends (a
/// borrower stalled mid-message must not hold the function).
pub(crate) fn serve(
    f: &PciFunction,
    sock: &Stream,
    peer: SocketAddr,
    throttle: Option<Throttle>,
    frame_timeout: Duration,
    notes: bool,
) -> End {
    let table = match IrqTable::new() {
        Ok(t) => t,
        Err(e) => return End::Socket(e),
    };
    let writer = Mutex::new(());
    let nvme = match f.coherence {
        Coherence::Nvme => match Mediator::new(f, throttle, notes) {
            Ok(m) => Some(TcpMediated {
                throttled: m.throttled(),
                mediator: Mutex::new(m),
                counters: Mutex::new(AccessCounters::default()),
                broken: Mutex::new(None),
                sock,
                writer: &writer,
                timeout: frame_timeout,
            }),
            Err(e) => return End::Socket(e),
        },
        Coherence::Mirror => None,
    };
    let mut lending = Lending::new(f, &table);
    lending.nvme = nvme.as_ref();
    let end = std::thread::scope(|s| {
        let irq_thread = s.spawn(|| irq_loop(&table, sock, &writer, f, nvme.as_ref()));
        let end = run(&mut lending, sock, &writer, frame_timeout);
        table.stop.store(true, Ordering::Release);
        let _ = table.wake.write(1);
        let _ = irq_thread.join();
        end
    });
    lending.quiesce();
    if let Some(n) = &nvme {
        let m = n.mediator.lock().unwrap_or_else(PoisonError::into_inner);
        let c = n.counters.lock().unwrap_or_else(PoisonError::into_inner);
        tracing::info!(%peer, stats = ?m.stats, dma = ?m.dma, fabric = ?*c, "NVMe mediator ends");
    }
    tracing::info!(%peer, bdf = %f.bdf, "function quiesced for the next borrower");
    end
}

fn send(sock: &Stream, writer: &Mutex<()>, m: &Message) -> Result<(), WireError> {
    let _g = writer.lock().unwrap_or_else(PoisonError::into_inner);
    m.write_to(&mut &*sock)
}

/// Reads one message: the first byte within `wait` (`None`: however long it takes;
/// `Ok(None)` when `wait` passed with nothing), the rest within `frame_timeout`.
fn read_message(
    sock: &Stream,
    frame_timeout: Duration,
    wait: Option<Duration>,
) -> Result<Option<Message>, WireError> {
    let mut first = [0u8; 1];
    if wait.is_some() {
        sock.set_read_timeout(wait)?;
    }
    loop {
        match (&mut &*sock).read(&mut first) {
            Ok(0) => return Err(WireError::Closed),
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if wait.is_some()
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
            {
                sock.set_read_timeout(None)?;
                return Ok(None);
            }
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    sock.set_read_timeout(Some(frame_timeout))?;
    let m = Message::read_from(&mut first.as_slice().chain(sock));
    sock.set_read_timeout(None)?;
    m.map(Some)
}

/// Waits on the enabled vectors' eventfds and sends a [`KIND_IRQ`] for each signal.
fn irq_loop(
    table: &IrqTable,
    sock: &Stream,
    writer: &Mutex<()>,
    f: &PciFunction,
    nvme: Option<&TcpMediated<'_>>,
) {
    loop {
        if table.stop.load(Ordering::Acquire) {
            return;
        }
        let fds: Vec<(u32, u32, Arc<EventFd>)> = table
            .fds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut pfds: Vec<libc::pollfd> = std::iter::once(table.wake.as_raw_fd())
            .chain(fds.iter().map(|(_, _, e)| e.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `pfds` is a live array of `pfds.len()` pollfds; every fd is open for
        // the duration of the call (the Arcs in `fds` keep them).
        let n = unsafe {
            libc::poll(
                pfds.as_mut_ptr(),
                pfds.len() as libc::nfds_t,
                if nvme.is_some() {
                    NVME_IDLE_POLL
                } else {
                    IRQ_POLL
                }
                .as_millis() as libc::c_int,
            )
        };
        if n <= 0 {
            if let Some(nv) = nvme {
                nv.with(table, false, |m, g| m.on_interrupt(f, g, None));
            }
            continue;
        }
        if pfds[0].revents != 0 {
            let _ = table.wake.read();
        }
        for (p, (index, vector, efd)) in pfds[1..].iter().zip(&fds) {
            if p.revents & libc::POLLIN == 0 || efd.read().is_err() {
                continue;
            }
            if let Some(nv) = nvme {
                // The mediator copies the completions, then raises the guest's vector.
                nv.with(table, false, |m, g| m.on_interrupt(f, g, Some(*vector)));
                continue;
            }
            let m = Message::new(
                KIND_IRQ,
                Irq {
                    index: *index,
                    vector: *vector,
                }
                .encode(),
            );
            if let Err(e) = send(sock, writer, &m) {
                tracing::debug!(error = %e, "cannot send an interrupt; the session is ending");
                return;
            }
        }
    }
}

/// The request loop: each message answered in order, until the borrower closes or breaks
/// the protocol.
fn run(
    lending: &mut Lending<'_>,
    sock: &Stream,
    writer: &Mutex<()>,
    frame_timeout: Duration,
) -> End {
    loop {
        // Commands the holder's limits left in the guest's queues are fetched when
        // they may go, by this thread (the one that reads guest memory over TCP).
        let wake = lending.nvme.filter(|n| n.throttled).and_then(|n| {
            let m = n.mediator.lock().unwrap_or_else(PoisonError::into_inner);
            m.wake_at()
        });
        let wait = wake.map(|t| {
            t.saturating_duration_since(std::time::Instant::now())
                .max(Duration::from_millis(1))
        });
        let m = match read_message(sock, frame_timeout, wait) {
            Ok(Some(m)) => m,
            Ok(None) => {
                if let Some(n) = lending.nvme {
                    n.with(lending.table, true, |m, g| m.fetch_waiting(lending.f, g));
                    let broken = n
                        .broken
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take();
                    if let Some(reason) = broken {
                        return End::Protocol(reason);
                    }
                }
                continue;
            }
            Err(WireError::Closed) => return End::PeerClosed,
            Err(WireError::Io(e)) => return End::Socket(e),
            Err(e) => return End::Protocol(e.to_string()),
        };
        if m.kind & REPLY != 0 || m.kind == KIND_IRQ {
            return End::Protocol(format!("message kind {:#04x} from a borrower", m.kind));
        }
        if m.flags & FLAG_MORE != 0 && m.kind != KIND_PUSH {
            return End::Protocol(format!("more flag on request {:#04x}", m.kind));
        }
        let answer = match m.kind {
            KIND_PULL => {
                if !m.payload.is_empty() {
                    return End::Protocol("payload on a pull".into());
                }
                match pull(lending, sock, writer) {
                    Ok(()) => continue,
                    Err(e) => return End::Socket(e),
                }
            }
            KIND_PUSH => match push(lending, &m) {
                Ok(None) => continue,
                Ok(Some(r)) => r,
                Err(e) => return End::Protocol(e.to_string()),
            },
            _ => match lending.request(&m) {
                Ok(r) => r,
                Err(e) => return End::Protocol(e.to_string()),
            },
        };
        if let Some(reason) = lending.nvme.and_then(|n| {
            n.broken
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
        }) {
            return End::Protocol(reason);
        }
        let reply = match answer {
            Ok(payload) => Message::new(m.kind | REPLY, payload),
            Err((status, reason)) => {
                // A borrower may send refusable requests in a loop: rate-limited.
                devlend_fabric::limited!(info, bdf = %lending.f.bdf, kind = m.kind, %reason, "request refused");
                Message::refusal(m.kind, status, &reason)
            }
        };
        if let Err(e) = send(sock, writer, &reply) {
            return match e {
                WireError::Io(e) => End::Socket(e),
                e => End::Protocol(e.to_string()),
            };
        }
    }
}

/// Applies one push message; answers (`Some`) at the last message of the push.
fn push(lending: &mut Lending<'_>, m: &Message) -> Result<Option<Answer>, WireError> {
    for p in decode_pages(&m.payload)? {
        let len = p.data.len() as u64;
        match lending.maps.iter_mut().find(|x| x.contains(p.iova, len)) {
            Some(mirror) => mirror.push(p.iova, p.data),
            None => {
                if lending.push_error.is_none() {
                    lending.push_error = Some(invalid(format!(
                        "pushed {len} bytes at IOVA {:#x}, outside every mapped range",
                        p.iova
                    )));
                }
            }
        }
    }
    if m.flags & FLAG_MORE != 0 {
        return Ok(None);
    }
    Ok(Some(match lending.push_error.take() {
        Some(r) => Err(r),
        None => Ok(Vec::new()),
    }))
}

/// Sends the pages the function changed, in messages of at most about
/// [`MAX_ACCESS`] bytes, the last without [`FLAG_MORE`].
fn pull(lending: &mut Lending<'_>, sock: &Stream, writer: &Mutex<()>) -> std::io::Result<()> {
    let mut chunks: Vec<Vec<u8>> = vec![Vec::new()];
    for m in &mut lending.maps {
        m.pull(|iova, data| {
            let full = chunks
                .last()
                .is_some_and(|c| c.len() + page_cost(data.len()) > MAX_ACCESS as usize);
            if full {
                chunks.push(Vec::new());
            }
            if let Some(c) = chunks.last_mut() {
                encode_page(iova, data, c);
            }
        });
    }
    let n = chunks.len();
    for (i, c) in chunks.into_iter().enumerate() {
        let mut msg = Message::new(KIND_PULL | REPLY, c);
        if i + 1 < n {
            msg.flags = FLAG_MORE;
        }
        send(sock, writer, &msg).map_err(|e| match e {
            WireError::Io(e) => e,
            e => std::io::Error::other(e.to_string()),
        })?;
    }
    Ok(())
}
