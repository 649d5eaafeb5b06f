//! One PCI session over RDMA: the same requests as over TCP (`tcp.rs`), as
//! SEND/RECV messages, with the DMA mirror kept in sync one-sided.
//!
//! Each DMA map names, beside its IOVA range, the borrower's address and rkey of the
//! guest memory behind it ([`RemoteDmaRange`]); the lender registers the range's mirror
//! on the connection. A push lists the IOVA ranges that changed ([`Range`]s, no data):
//! the lender RDMA-READs them from guest memory straight into the mirror, and answers
//! when the reads completed. A pull RDMA-WRITEs the mirror pages the function changed
//! into guest memory, then answers with their ranges (an RC queue pair places the
//! WRITEs before the answer's SEND). Interrupts leave as [`KIND_IRQ`] messages.
//!
//! A mediated function (coherence mode `nvme`) keeps no mirror: its DMA maps are only
//! recorded with their remote address and rkey, BAR0's controller registers and
//! doorbells go to the [`Mediator`], which reads and writes guest memory one-sided
//! ([`crate::pci::guest::rdma::RdmaGuest`]), and the function's interrupts go to it too: it
//! copies the completions, then sends the guest's interrupt.
//!
//! One thread does it all: it waits on the connection and on the function's interrupt
//! eventfds at once. A malformed message, or a READ/WRITE that fails (a bad rkey or
//! range from the borrower), ends the session with the reason logged; the function is
//! then quiesced as after a TCP session.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use devlend_fabric::pci::{
    decode_ranges, encode_range, Access, DmaRange, Irq, Message, PciStatus, Range, RemoteDmaRange,
    FLAG_MORE, KIND_DMA_MAP, KIND_DMA_UNMAP, KIND_IRQ, KIND_PULL, KIND_PUSH, KIND_READ, KIND_RESET,
    KIND_WRITE, RDMA_MAX_ACCESS, RDMA_MAX_RANGES, REPLY,
};
use devlend_fabric::rdma::channel::{ChannelError, MsgChannel, RdmaOp, MAX_RDMA_OP};
use devlend_fabric::rdma::verbs::{Connection, Mr};
use devlend_fabric::WireError;
use vmm_sys_util::eventfd::EventFd;

use crate::config::Coherence;
use crate::pci::guest::rdma::{Bounce, RdmaGuest, RemoteMap};
use crate::pci::guest::AccessCounters;
use crate::pci::irq::IrqTable;
use crate::pci::lending::{invalid, Answer, Lending};
use crate::pci::mirror::Remote;
use crate::pci::nvme::throttle::Throttle;
use crate::pci::nvme::{Handled, Mediator};
use crate::pci::PciFunction;
use crate::session::end::End;

/// How often the session looks at its stop flag when nothing arrives.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// For a mediated function: after this long without a message or an interrupt, the
/// mediator looks at every shadow completion queue (an interrupt can be lost while the
/// borrower re-enables vectors), as over TCP.
const MEDIATED_IDLE_LOOK: Duration = Duration::from_millis(10);

fn transport(e: ChannelError) -> End {
    match e {
        ChannelError::Message(e) => End::Protocol(e.to_string()),
        ChannelError::Rdma(e) => {
            End::Socket(std::io::Error::other(devlend_fabric::error::chain(&e)))
        }
    }
}

/// Serves one borrower's PCI session on `conn` (handshake answered) until it closes,
/// breaks the protocol or `stop` is set (the lender shutting down, the lease ended),
/// then quiesces the function.
pub(crate) fn serve(
    f: &PciFunction,
    conn: Connection,
    throttle: Option<Throttle>,
    stop: &AtomicBool,
    notes: bool,
) -> End {
    let table = match IrqTable::new() {
        Ok(t) => t,
        Err(e) => return End::Socket(e),
    };
    let mut ch = MsgChannel::new(conn);
    let mut med = match f.coherence {
        Coherence::Mirror => None,
        Coherence::Nvme => {
            let m = match Mediator::new(f, throttle, notes) {
                Ok(m) => m,
                Err(e) => return End::Socket(e),
            };
            let bounce = match Bounce::new(&ch) {
                Ok(b) => b,
                Err(e) => {
                    return End::Socket(std::io::Error::other(devlend_fabric::error::chain(&e)))
                }
            };
            Some(Mediated {
                m,
                maps: Vec::new(),
                bounce,
                counters: AccessCounters::default(),
                ops: Vec::new(),
            })
        }
    };
    let mut lending = Lending::new(f, &table);
    let end = run(&mut lending, &mut ch, &table, stop, &mut med);
    // Mirrors (and their memory regions) go while the queue pair is idle; then the QP.
    lending.quiesce();
    if let Some(md) = &mut med {
        // Bus mastering is off and the function reset: the shadow queues can go.
        md.m.reset();
        tracing::info!(stats = ?md.m.stats, dma = ?md.m.dma, fabric = ?md.counters, "NVMe mediator ends");
    }
    tracing::info!(bdf = %f.bdf, "function quiesced for the next borrower");
    drop(med);
    drop(ch);
    end
}

/// A mediated function's state on an RDMA session.
struct Mediated {
    m: Mediator,
    /// The borrower's DMA maps, with their remote address and rkey.
    maps: Vec<RemoteMap>,
    bounce: Bounce,
    counters: AccessCounters,
    /// The guest access's work requests, reused.
    ops: Vec<RdmaOp>,
}

impl Mediated {
    /// Runs `op` on the mediator with guest memory reached over `ch`.
    fn with<T>(
        &mut self,
        ch: &mut MsgChannel,
        table: &IrqTable,
        op: impl FnOnce(&mut Mediator, &mut RdmaGuest<'_>) -> T,
    ) -> T {
        let index_of = |v: u32| table.index_of(v);
        let mut g = RdmaGuest {
            ch,
            maps: &self.maps,
            bounce: &mut self.bounce,
            index_of: &index_of,
            counters: &mut self.counters,
            ops: &mut self.ops,
        };
        op(&mut self.m, &mut g)
    }
}

fn run(
    lending: &mut Lending<'_>,
    ch: &mut MsgChannel,
    table: &IrqTable,
    stop: &AtomicBool,
    med: &mut Option<Mediated>,
) -> End {
    let f = lending.f;
    // Kept across rounds: a round runs per message batch and, mediated, every 10 ms.
    let mut fds: Vec<(u32, u32, Arc<EventFd>)> = Vec::new();
    let mut pfds: Vec<libc::pollfd> = Vec::new();
    loop {
        if stop.load(Ordering::Acquire) {
            tracing::info!(bdf = %lending.f.bdf, "PCI session over RDMA stopped (lease ended or lender shutting down)");
            return End::PeerClosed;
        }
        fds.clone_from(&table.fds.lock().unwrap_or_else(PoisonError::into_inner));
        pfds.clear();
        pfds.extend(
            std::iter::once(ch.fd())
                .chain(fds.iter().map(|(_, _, e)| e.as_raw_fd()))
                .map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                }),
        );
        let poll_ms = match med.as_ref() {
            None => STOP_CHECK,
            Some(md) => md.m.wake_at().map_or(MEDIATED_IDLE_LOOK, |t| {
                t.saturating_duration_since(std::time::Instant::now())
                    .clamp(Duration::from_millis(1), MEDIATED_IDLE_LOOK)
            }),
        }
        .as_millis() as libc::c_int;
        // SAFETY: `pfds` is a live array of `pfds.len()` pollfds; every fd stays open
        // for the call (the channel and the Arcs in `fds`).
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, poll_ms) };
        if n <= 0 {
            if let Some(md) = med.as_mut() {
                // A quiet interval: look at every queue, lest an interrupt was lost.
                md.with(ch, table, |m, g| m.on_interrupt(f, g, None));
            }
        }
        if let Some(md) = med.as_mut() {
            // Commands the holder's limits left in the guest's queues, when they may go
            // (nothing to do, and no scan, otherwise).
            md.with(ch, table, |m, g| m.fetch_waiting(f, g));
        }
        for (p, (index, vector, efd)) in pfds[1..].iter().zip(&fds) {
            if p.revents & libc::POLLIN == 0 || efd.read().is_err() {
                continue;
            }
            if let Some(md) = med.as_mut() {
                // The mediator copies the completions, then raises the guest's vector.
                md.with(ch, table, |m, g| m.on_interrupt(f, g, Some(*vector)));
                continue;
            }
            let irq = Irq {
                index: *index,
                vector: *vector,
            };
            if let Err(e) = ch.send(&Message::new(KIND_IRQ, irq.encode())) {
                return transport(e);
            }
        }
        match ch.poll() {
            Ok(()) => {}
            Err(ChannelError::Rdma(devlend_fabric::rdma::RdmaError::Disconnected)) => {
                return End::PeerClosed
            }
            Err(e) => return transport(e),
        }
        while let Some(m) = ch.take() {
            let handled = match med.as_mut() {
                Some(md) => handle_mediated(lending, ch, table, md, &m),
                None => handle(lending, ch, &m),
            };
            if let Err(end) = handled {
                return end;
            }
        }
    }
}

/// Answers one message (or takes one part of a push).
fn handle(lending: &mut Lending<'_>, ch: &mut MsgChannel, m: &Message) -> Result<(), End> {
    if m.kind & REPLY != 0 || m.kind == KIND_IRQ {
        return Err(End::Protocol(format!(
            "message kind {:#04x} from a borrower",
            m.kind
        )));
    }
    if m.flags & FLAG_MORE != 0 && m.kind != KIND_PUSH {
        return Err(End::Protocol(format!(
            "more flag on request {:#04x}",
            m.kind
        )));
    }
    let protocol = |e: WireError| End::Protocol(e.to_string());
    let answer: Answer = match m.kind {
        KIND_PULL => {
            if !m.payload.is_empty() {
                return Err(End::Protocol("payload on a pull".into()));
            }
            return pull(lending, ch);
        }
        KIND_PUSH => match push(lending, ch, m)? {
            None => return Ok(()),
            Some(a) => a,
        },
        KIND_DMA_MAP => {
            let r = RemoteDmaRange::decode(&m.payload).map_err(protocol)?;
            dma_map(lending, ch, r)
        }
        KIND_READ => {
            let (a, _) = Access::decode(&m.payload, false).map_err(protocol)?;
            if a.len > RDMA_MAX_ACCESS {
                Err(invalid(format!(
                    "a read of {} bytes over RDMA (at most {RDMA_MAX_ACCESS} per message)",
                    a.len
                )))
            } else {
                lending.request(m).map_err(protocol)?
            }
        }
        _ => lending.request(m).map_err(protocol)?,
    };
    reply(lending, ch, m, answer)
}

/// Sends the answer to request `m`.
fn reply(
    lending: &Lending<'_>,
    ch: &mut MsgChannel,
    m: &Message,
    answer: Answer,
) -> Result<(), End> {
    let reply = match answer {
        Ok(payload) => Message::new(m.kind | REPLY, payload),
        Err((status, reason)) => {
            // A borrower may send refusable requests in a loop: rate-limited.
            devlend_fabric::limited!(info, bdf = %lending.f.bdf, kind = m.kind, %reason, "request refused");
            Message::refusal(m.kind, status, &reason)
        }
    };
    ch.send(&reply).map_err(transport)
}

/// Answers one message of a mediated function: DMA maps are recorded (no mirror),
/// BAR0 accesses go to the mediator first, a reset resets it too; the rest is as for
/// any function. A push or pull has no mirror to work on (the borrower of a mediated
/// function sends neither).
fn handle_mediated(
    lending: &mut Lending<'_>,
    ch: &mut MsgChannel,
    table: &IrqTable,
    md: &mut Mediated,
    m: &Message,
) -> Result<(), End> {
    let protocol = |e: WireError| End::Protocol(e.to_string());
    let f = lending.f;
    let answer: Answer = match m.kind {
        KIND_DMA_MAP if m.flags == 0 => {
            let r = RemoteDmaRange::decode(&m.payload).map_err(protocol)?;
            md.m.map(r.range.iova, r.range.size).map(|()| {
                md.maps.push(RemoteMap {
                    iova: r.range.iova,
                    size: r.range.size,
                    addr: r.addr,
                    rkey: r.rkey,
                });
                Vec::new()
            })
        }
        KIND_DMA_UNMAP if m.flags == 0 => {
            let r = DmaRange::decode(&m.payload).map_err(protocol)?;
            md.m.unmap(r.iova, r.size).map(|()| {
                md.maps.retain(|x| !(x.iova == r.iova && x.size == r.size));
                Vec::new()
            })
        }
        KIND_READ if m.flags == 0 => {
            let (a, _) = Access::decode(&m.payload, false).map_err(protocol)?;
            // Other regions, and reads too long for a message, are as for any function.
            if a.region != 0 || a.len > RDMA_MAX_ACCESS {
                return handle(lending, ch, m);
            }
            match lending.check_read(&a) {
                Err(r) => Err(r),
                Ok(()) => {
                    let mut buf = vec![0u8; a.len as usize];
                    if md.m.bar_read(a.offset, &mut buf) != Handled::Yes {
                        return handle(lending, ch, m);
                    }
                    Ok(buf)
                }
            }
        }
        KIND_WRITE if m.flags == 0 => {
            let (a, data) = Access::decode(&m.payload, true).map_err(protocol)?;
            if a.region != 0 {
                return handle(lending, ch, m);
            }
            match lending.check_write(&a) {
                Err(r) => Err(r),
                Ok(()) => match md.with(ch, table, |med, g| med.bar_write(f, g, a.offset, data)) {
                    Ok(Handled::Yes) => Ok(Vec::new()),
                    Ok(Handled::Pass) => return handle(lending, ch, m),
                    Err(r) => Err(r),
                },
            }
        }
        KIND_RESET if m.payload.is_empty() => {
            handle(lending, ch, m)?;
            md.m.reset();
            return Ok(());
        }
        _ => return handle(lending, ch, m),
    };
    reply(lending, ch, m, answer)
}

/// Maps the range (a mirror at its IOVA, as over TCP) and registers the mirror.
fn dma_map(lending: &mut Lending<'_>, ch: &MsgChannel, r: RemoteDmaRange) -> Answer {
    lending.dma_map(r.range)?;
    let registered = match lending.maps.last_mut() {
        Some(m) if m.iova == r.range.iova => {
            // SAFETY: the mirror's mapping lives as long as the Mirror, which drops its
            // `remote` (this MR) before unmapping.
            unsafe { Mr::register(ch.pd(), m.as_ptr(), m.size, false) }.map(|mr| {
                m.remote = Some(Remote {
                    mr,
                    addr: r.addr,
                    rkey: r.rkey,
                });
            })
        }
        _ => return Err((PciStatus::Io, "the new mirror is not the last map".into())),
    };
    if let Err(e) = registered {
        let _ = lending.dma_unmap(r.range);
        return Err((
            PciStatus::Io,
            format!(
                "registering the mirror for RDMA: {}",
                devlend_fabric::error::chain(&e)
            ),
        ));
    }
    Ok(Vec::new())
}

/// One READ or WRITE per piece of at most [`MAX_RDMA_OP`] bytes of `len` bytes at
/// offset `off` of a mirror.
fn ops(read: bool, remote: &Remote, off: usize, len: usize, out: &mut Vec<RdmaOp>) {
    let mut at = 0;
    while at < len {
        let n = (len - at).min(MAX_RDMA_OP as usize);
        out.push(RdmaOp {
            read,
            local: remote.mr.addr() + (off + at) as u64,
            lkey: remote.mr.lkey(),
            len: n as u32,
            remote: remote.addr + (off + at) as u64,
            rkey: remote.rkey,
        });
        at += n;
    }
}

/// One message of a push: RDMA-READs its ranges into the mirrors; answers (`Some`) at
/// the last message.
fn push(
    lending: &mut Lending<'_>,
    ch: &mut MsgChannel,
    m: &Message,
) -> Result<Option<Answer>, End> {
    let ranges = decode_ranges(&m.payload).map_err(|e| End::Protocol(e.to_string()))?;
    let mut reads = Vec::new();
    let mut landed = Vec::new();
    for r in ranges {
        let len = u64::from(r.len);
        let found = lending
            .maps
            .iter()
            .enumerate()
            .find(|(_, x)| x.contains(r.iova, len));
        match found {
            Some((i, mirror)) => {
                let off = (r.iova - mirror.iova) as usize;
                if let Some(remote) = &mirror.remote {
                    ops(true, remote, off, r.len as usize, &mut reads);
                    landed.push((i, off, r.len as usize));
                }
            }
            None => {
                if lending.push_error.is_none() {
                    lending.push_error = Some(invalid(format!(
                        "push of {len} bytes at IOVA {:#x}, outside every mapped range",
                        r.iova
                    )));
                }
            }
        }
    }
    ch.rdma(&reads).map_err(transport)?;
    for (i, off, len) in landed {
        if let Some(mirror) = lending.maps.get_mut(i) {
            mirror.synced_from_mirror(off, len);
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

/// RDMA-WRITEs the mirror pages the function changed into guest memory and answers with
/// their ranges, in messages of at most [`RDMA_MAX_RANGES`], the last without
/// [`FLAG_MORE`].
fn pull(lending: &mut Lending<'_>, ch: &mut MsgChannel) -> Result<(), End> {
    let mut writes = Vec::new();
    let mut ranges = Vec::new();
    for mirror in &mut lending.maps {
        let base = mirror.iova;
        let mut runs = Vec::new();
        mirror.changed_runs(MAX_RDMA_OP as usize, |off, len| runs.push((off, len)));
        let Some(remote) = &mirror.remote else {
            continue;
        };
        for (off, len) in runs {
            ops(false, remote, off, len, &mut writes);
            ranges.push(Range {
                iova: base + off as u64,
                len: len as u32,
            });
        }
    }
    ch.rdma(&writes).map_err(transport)?;
    let chunks: Vec<&[Range]> = if ranges.is_empty() {
        vec![&[]]
    } else {
        ranges.chunks(RDMA_MAX_RANGES).collect()
    };
    let n = chunks.len();
    for (k, c) in chunks.into_iter().enumerate() {
        let mut payload = Vec::with_capacity(c.len() * 16);
        for r in c {
            encode_range(*r, &mut payload);
        }
        let mut msg = Message::new(KIND_PULL | REPLY, payload);
        if k + 1 < n {
            msg.flags = FLAG_MORE;
        }
        ch.send(&msg).map_err(transport)?;
    }
    Ok(())
}
