//! `devlend-rogue-rdma-lender --listen IP:PORT --capacity BYTES --tag NAME`: a lender
//! that abuses what a borrower's RDMA requests let it reach, for the test of how much
//! guest memory a lender can touch (`tests/tests/guest_rdma.rs`). It answers the
//! handshake like a lender and then, on the write requests it is sent (whose data it
//! may RDMA READ):
//! 1. reads the first buffer of the first write: `{tag}_inside=ok` (what any lender
//!    does);
//! 2. reads 512 bytes of guest memory outside every request it has been sent and not
//!    answered (near that buffer, in the same guest memory region as far as it can
//!    tell): `{tag}_outside=ok` or `{tag}_outside=refused (STATUS)`;
//! 3. answers that first write, waits 300 ms, and reads its buffer again with the same
//!    key (after a refusal in 2, on the first write of the session the borrower opens
//!    again): `{tag}_stale=ok` or `{tag}_stale=refused (STATUS)`.
//!
//! Then it exits. Reads are answered as done (their data is not written), everything
//! else as OK. Results go to stdout as `DEVLEND-RESULT` lines. It is a test tool, not
//! part of devlend.

use std::time::{Duration, Instant};

use devlend_fabric::rdma::verbs::{lender_shape, wait_fd, Completion, Connection, Listener, Mr};
use devlend_fabric::rdma::{decode_request, Segment};
use devlend_fabric::wire::{BlockRequest, Status, RESPONSE_HEADER_LEN};
use devlend_fabric::{BlockGeometry, Bytes, Hello, HelloReply, ResponseHeader, SERIAL_LEN};

const RECV_BIT: u64 = devlend_fabric::rdma::verbs::RECV_BIT;
/// Work-request id of the probes' RDMA READs.
const PROBE: u64 = 1 << 40;
/// Work-request ids of response SENDs.
const SEND: u64 = 2 << 40;
const PROBE_LEN: u32 = 512;

struct Args {
    listen: String,
    capacity: u64,
    tag: String,
}

fn args() -> Args {
    let mut a = Args {
        listen: String::new(),
        capacity: 64 << 20,
        tag: "rogue".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_default();
        match k.as_str() {
            "--listen" => a.listen = v,
            "--capacity" => a.capacity = v.parse().unwrap_or(a.capacity),
            "--tag" => a.tag = v,
            _ => {
                eprintln!("usage: devlend-rogue-rdma-lender --listen IP:PORT [--capacity BYTES] [--tag NAME]");
                std::process::exit(2);
            }
        }
    }
    a
}

/// What the probes found so far.
#[derive(Default)]
struct Findings {
    outside: Option<String>,
    stale: Option<String>,
}

impl Findings {
    fn done(&self) -> bool {
        self.outside.is_some() && self.stale.is_some()
    }
}

fn main() {
    let a = args();
    let listener = match Listener::bind(&a.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("rogue: listen {}: {e}", a.listen);
            std::process::exit(1);
        }
    };
    eprintln!("rogue: listening on {} (RDMA)", a.listen);
    let mut found = Findings::default();
    let deadline = Instant::now() + Duration::from_secs(300);
    while !found.done() && Instant::now() < deadline {
        wait_fd(listener.fd(), Duration::from_millis(200));
        while let Some(inc) = listener.accept() {
            let peer = inc.peer();
            match inc.establish(lender_shape(4), Instant::now() + Duration::from_secs(10)) {
                Ok((mut conn, i, n)) => {
                    if let Err(e) = conn
                        .grow()
                        .map_err(|e| e.to_string())
                        .and_then(|()| session(conn, i, n, &a, &mut found))
                    {
                        eprintln!("rogue: session from {peer} ended: {e}");
                    }
                }
                Err(e) => eprintln!("rogue: connection from {peer}: {e}"),
            }
            if found.done() {
                break;
            }
        }
    }
    if found.outside.is_none() {
        report(&a.tag, "outside", Some("not-tried"));
    }
    if found.stale.is_none() {
        report(&a.tag, "stale", Some("not-tried"));
    }
}

/// Prints one finding at once (the test may kill this process afterwards).
fn report(tag: &str, probe: &str, v: Option<&str>) {
    use std::io::Write;
    println!("DEVLEND-RESULT {tag}_{probe}={}", v.unwrap_or("not-tried"));
    let _ = std::io::stdout().flush();
}

/// One borrower session: the handshake, then requests until both probes are done or
/// the session fails.
fn session(
    mut conn: Connection,
    i: usize,
    n: usize,
    a: &Args,
    found: &mut Findings,
) -> Result<(), String> {
    let hello = Hello::read_from(&mut conn.recv_msg(i, n)).map_err(|e| e.to_string())?;
    conn.post_recv(i).map_err(|e| e.to_string())?;
    let info = BlockGeometry {
        capacity_sectors: a.capacity / 512,
        block_size: 512,
        max_transfer: 1 << 20,
        max_discard_sectors: 0,
        max_write_zeroes_sectors: 0,
        flags: 0,
        serial: [0; SERIAL_LEN],
    };
    let mut msg = Vec::new();
    HelloReply::ok(info)
        .write_to(&mut msg)
        .map_err(|e| e.to_string())?;
    let last = conn.send_slots() - 1;
    conn.send_msg(last, &msg, SEND | 0xffff)
        .map_err(|e| e.to_string())?;
    eprintln!(
        "rogue: session for {:?} queue {}",
        hello.device, hello.queue_index
    );

    let mut local = vec![0u8; 1 << 20];
    // SAFETY: `local` outlives the MR (dropped first, at the end of this function) and
    // is not moved or resized meanwhile.
    let mr = unsafe { Mr::register(conn.pd(), local.as_mut_ptr(), local.len(), false) }
        .map_err(|e| e.to_string())?;
    let mut next_send = 0usize;
    let mut held: Vec<(u64, Vec<Segment>)> = Vec::new();
    let mut first_write: Option<Instant> = None;
    let mut out: Vec<Completion> = Vec::new();
    let mut segs = Vec::new();
    let mut respond = |conn: &mut Connection, id: u64, len: u32| -> Result<(), String> {
        let h = ResponseHeader {
            status: Status::Ok,
            len: Bytes(len),
            id,
            throttled: false,
        }
        .encode();
        let slot = next_send % last;
        next_send += 1;
        conn.send_msg(slot, &h[..RESPONSE_HEADER_LEN], SEND | slot as u64)
            .map_err(|e| e.to_string())
    };
    loop {
        // The outside probe, once the writes sent together have all come in.
        if found.outside.is_none()
            && first_write.is_some_and(|t| t.elapsed() > Duration::from_millis(300))
        {
            let (_, s) = &held[0];
            let inside = read(
                &mut conn,
                &mr,
                s[0].addr,
                s[0].rkey,
                PROBE_LEN.min(s[0].len),
            )?;
            report(&a.tag, "inside", Some(&inside));
            let target = outside(&held);
            eprintln!(
                "rogue: reading {PROBE_LEN} bytes at {target:#x}, outside the {} requests held",
                held.len()
            );
            let r = read(&mut conn, &mr, target, s[0].rkey, PROBE_LEN)?;
            let refused = r != "ok";
            found.outside = Some(r);
            report(&a.tag, "outside", found.outside.as_deref());
            if refused {
                return Err("the outside read was refused; the queue pair is gone".into());
            }
            // Still connected: the stale-key probe on the first request held.
            let mut held = std::mem::take(&mut held).into_iter();
            if let Some((id, s)) = held.next() {
                respond(&mut conn, id, 0)?;
                stale_probe(&mut conn, &mr, s[0], &a.tag, found)?;
            }
            for (id, _) in held {
                respond(&mut conn, id, 0)?;
            }
        }
        out.clear();
        let polled = conn.poll(&mut out);
        for c in out.drain(..) {
            if let Some(e) = c.error {
                return Err(format!("a completion failed: {e}"));
            }
            if !c.recv {
                continue;
            }
            let i = (c.wr_id & !RECV_BIT) as usize;
            let h = decode_request(conn.recv_msg(i, c.byte_len as usize), &mut segs)
                .map_err(|e| e.to_string())?;
            conn.post_recv(i).map_err(|e| e.to_string())?;
            match h.request {
                BlockRequest::Write { .. } if found.outside.is_none() => {
                    first_write.get_or_insert_with(Instant::now);
                    held.push((h.id, segs.clone()));
                }
                BlockRequest::Write { .. } if found.stale.is_none() => {
                    respond(&mut conn, h.id, 0)?;
                    stale_probe(&mut conn, &mr, segs[0], &a.tag, found)?;
                }
                BlockRequest::Write { .. } => respond(&mut conn, h.id, 0)?,
                BlockRequest::Read { len, .. } => respond(&mut conn, h.id, len.0)?,
                _ => respond(&mut conn, h.id, 0)?,
            }
        }
        polled.map_err(|e| e.to_string())?;
        if found.done() {
            return Ok(());
        }
        wait_fd(conn.fd(), Duration::from_millis(50));
    }
}

/// After answering the request whose first buffer is `s`: waits 300 ms and reads the
/// buffer again with its key. An error when the read was refused (the queue pair is
/// then gone).
fn stale_probe(
    conn: &mut Connection,
    mr: &Mr,
    s: Segment,
    tag: &str,
    found: &mut Findings,
) -> Result<(), String> {
    std::thread::sleep(Duration::from_millis(300));
    let r = read(conn, mr, s.addr, s.rkey, PROBE_LEN.min(s.len))?;
    let refused = r != "ok";
    found.stale = Some(r);
    report(tag, "stale", found.stale.as_deref());
    if refused {
        return Err("the stale-key read was refused; the queue pair is gone".into());
    }
    Ok(())
}

/// An address 512 bytes long outside every held request's buffers: the first one found
/// going up from the end of the first buffer, in 4 KiB steps.
fn outside(held: &[(u64, Vec<Segment>)]) -> u64 {
    let s = held[0].1[0];
    let overlaps = |a: u64| {
        held.iter()
            .flat_map(|(_, v)| v.iter())
            .any(|g| a < g.addr + u64::from(g.len) && g.addr < a + u64::from(PROBE_LEN))
    };
    let mut a = (s.addr + u64::from(s.len) + 4095) & !4095;
    while overlaps(a) {
        a += 4096;
    }
    a
}

/// RDMA READs `len` bytes at `addr` with `rkey` into `mr`: "ok", or "refused (STATUS)".
fn read(conn: &mut Connection, mr: &Mr, addr: u64, rkey: u32, len: u32) -> Result<String, String> {
    conn.post_rdma(true, PROBE, mr.addr(), mr.lkey(), len, addr, rkey, true)
        .map_err(|e| e.to_string())?;
    let until = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while Instant::now() < until {
        out.clear();
        let polled = conn.poll(&mut out);
        for c in &out {
            if c.wr_id == PROBE {
                return Ok(match c.error {
                    None => "ok".into(),
                    Some(e) => format!("refused ({})", e.replace(' ', "-")),
                });
            }
        }
        if let Err(e) = polled {
            return Ok(format!("refused (session ended: {e})"));
        }
        wait_fd(conn.fd(), Duration::from_millis(20));
    }
    Err("no completion for the probe's read in 10 s".into())
}
