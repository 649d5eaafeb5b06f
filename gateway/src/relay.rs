//! Routing one session and splicing its two ends.
//!
//! A session arrives either from a borrower of this cluster (the local listener, the
//! preamble first on the TCP connection: [`serve_local`]) or from a peer gateway (a
//! stream whose OPEN carries the preamble: [`transit`]). Its destination is a lender of
//! this cluster (connected directly) or another cluster (a new stream on the link to
//! that cluster's gateway, the TTL one less). A refusal is answered with a
//! [`RelayReply`] naming what failed; on success the lender's end answers
//! [`RelayStatus::Ok`] and from then on bytes are copied both ways, unparsed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use devlend_fabric::relay::{RelayReply, RelayRequest, RelayStatus, REQUEST_FIXED_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::mux::{MuxReader, MuxStream, MuxWriter};
use crate::Gateway;

/// How long a borrower may take to send its preamble.
pub const PREAMBLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound of the connect to a lender (under the borrower's 3 s wait for the reply, so
/// that it gets the gateway's reason rather than a timeout).
pub const LENDER_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Size of each read from a TCP end.
const READ_CHUNK: usize = 256 << 10;

/// Accepts borrowers' sessions on `listener` and relays each. Runs for ever.
pub async fn serve_local(gw: Arc<Gateway>, listener: tokio::net::TcpListener) {
    loop {
        let (sock, remote) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                devlend_fabric::limited!(warn, error = %e, "cannot accept a session");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        tokio::spawn(local_session(gw.clone(), sock, remote));
    }
}

async fn read_preamble(sock: &mut TcpStream) -> Result<RelayRequest, String> {
    let mut fixed = [0u8; REQUEST_FIXED_LEN];
    sock.read_exact(&mut fixed)
        .await
        .map_err(|e| format!("reading the relay preamble: {e}"))?;
    let prefix = RelayRequest::decode_prefix(&fixed).map_err(|e| e.to_string())?;
    let mut rest = vec![0u8; prefix.rest_len()];
    sock.read_exact(&mut rest)
        .await
        .map_err(|e| format!("reading the relay preamble: {e}"))?;
    RelayRequest::decode_rest(prefix, &rest).map_err(|e| e.to_string())
}

async fn local_session(gw: Arc<Gateway>, mut sock: TcpStream, remote: std::net::SocketAddr) {
    gw.local.sessions_total.fetch_add(1, Ordering::Relaxed);
    let req = match tokio::time::timeout(PREAMBLE_TIMEOUT, read_preamble(&mut sock)).await {
        Ok(Ok(r)) => r,
        Ok(Err(why)) => {
            gw.local.refused.fetch_add(1, Ordering::Relaxed);
            devlend_fabric::limited!(warn, %remote, reason = %why, "malformed relay preamble; closing the session");
            refuse_local(sock, RelayReply::refuse(RelayStatus::BadRequest, &why)).await;
            return;
        }
        Err(_) => {
            gw.local.refused.fetch_add(1, Ordering::Relaxed);
            devlend_fabric::limited!(warn, %remote, "no relay preamble within {PREAMBLE_TIMEOUT:?}; closing the session");
            return;
        }
    };
    let dest = match route(&gw, &req).await {
        Ok(d) => d,
        Err(reply) => {
            gw.local.refused.fetch_add(1, Ordering::Relaxed);
            devlend_fabric::limited!(info, %remote, cluster = %req.cluster, lender = %req.lender, status = ?reply.status, reason = %reply.message, "session refused");
            refuse_local(sock, reply).await;
            return;
        }
    };
    devlend_fabric::limited!(debug, %remote, cluster = %req.cluster, lender = %req.lender, "session relayed");
    gw.local.sessions_active.fetch_add(1, Ordering::Relaxed);
    let far = match dest {
        Dest::Lender(mut t) => {
            if sock.write_all(&RelayReply::ok().encode()).await.is_err() {
                let _ = t.shutdown().await;
                gw.local.sessions_active.fetch_sub(1, Ordering::Relaxed);
                return;
            }
            End::Tcp(t)
        }
        // The far gateway answers; its reply comes back through the stream.
        Dest::Peer(s) => End::Mux(s),
    };
    let counters = Counters {
        a_to_b: Some(&gw.local.bytes_in),
        b_to_a: Some(&gw.local.bytes_out),
    };
    if let Err(why) = splice(End::Tcp(sock), far, counters).await {
        devlend_fabric::limited!(debug, %remote, cluster = %req.cluster, lender = %req.lender, reason = %why, "session ended abnormally");
    }
    gw.local.sessions_active.fetch_sub(1, Ordering::Relaxed);
}

/// Answers a refusal and closes: the write side first, then what the peer may still
/// send is read and dropped for up to a second, so that the close does not reset the
/// connection before the peer has read the reply.
async fn refuse_local(mut sock: TcpStream, reply: RelayReply) {
    if sock.write_all(&reply.encode()).await.is_err() {
        return;
    }
    let _ = sock.shutdown().await;
    let drain = async {
        let mut buf = [0u8; 4096];
        let mut left = 64usize << 10;
        while left > 0 {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// Relays one stream a peer gateway opened, whose OPEN payload is `open`.
pub async fn transit(gw: Arc<Gateway>, stream: MuxStream, open: Vec<u8>) {
    let (r, mut w) = stream.split();
    let refuse = |mut w: MuxWriter, reply: RelayReply| async move {
        if w.send_owned(reply.encode()).await.is_ok() {
            let _ = w.finish();
        }
    };
    let req = match parse_open(&open) {
        Ok(req) => req,
        Err(why) => {
            devlend_fabric::limited!(warn, reason = %why, "malformed relay request from a peer gateway; refusing the session");
            refuse(w, RelayReply::refuse(RelayStatus::BadRequest, &why)).await;
            drop(r);
            return;
        }
    };
    let far = match route(&gw, &req).await {
        Ok(Dest::Lender(t)) => {
            if w.send_owned(RelayReply::ok().encode()).await.is_err() {
                return;
            }
            End::Tcp(t)
        }
        Ok(Dest::Peer(s)) => End::Mux(s),
        Err(reply) => {
            devlend_fabric::limited!(info, cluster = %req.cluster, lender = %req.lender, status = ?reply.status, reason = %reply.message, "relayed session refused");
            refuse(w, reply).await;
            drop(r);
            return;
        }
    };
    let near = End::MuxHalves(r, w);
    if let Err(why) = splice(near, far, Counters::default()).await {
        devlend_fabric::limited!(debug, cluster = %req.cluster, lender = %req.lender, reason = %why, "relayed session ended abnormally");
    }
}

fn parse_open(open: &[u8]) -> Result<RelayRequest, String> {
    RelayRequest::decode(open).map_err(|e| e.to_string())
}

/// Where a session goes.
enum Dest {
    /// A lender of this cluster, connected.
    Lender(TcpStream),
    /// A stream to the next gateway, its OPEN sent.
    Peer(MuxStream),
}

async fn route(gw: &Gateway, req: &RelayRequest) -> Result<Dest, RelayReply> {
    let own = &gw.config.cluster;
    if &req.cluster == own {
        let Some(addr) = gw.config.lenders.get(&req.lender) else {
            let known: Vec<&str> = gw.config.lenders.keys().map(String::as_str).collect();
            return Err(RelayReply::refuse(
                RelayStatus::UnknownLender,
                &format!(
                    "cluster {own:?} has no lender {:?} (its gateway knows: {})",
                    req.lender,
                    if known.is_empty() {
                        "none".into()
                    } else {
                        known.join(", ")
                    }
                ),
            ));
        };
        return match tokio::time::timeout(LENDER_CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(t)) => {
                let _ = t.set_nodelay(true);
                Ok(Dest::Lender(t))
            }
            Ok(Err(e)) => Err(RelayReply::refuse(
                RelayStatus::Unreachable,
                &format!("lender {:?} of cluster {own:?} at {addr} is unreachable: {e}", req.lender),
            )),
            Err(_) => Err(RelayReply::refuse(
                RelayStatus::Unreachable,
                &format!(
                    "lender {:?} of cluster {own:?} at {addr} did not answer within {LENDER_CONNECT_TIMEOUT:?}",
                    req.lender
                ),
            )),
        };
    }
    if req.ttl == 0 {
        return Err(RelayReply::refuse(
            RelayStatus::TtlExceeded,
            &format!(
                "the session to cluster {:?} ran out of hops at the gateway of cluster {own:?} (a routing loop, or a path longer than the TTL)",
                req.cluster
            ),
        ));
    }
    let Some(slot) = gw.peers.for_cluster(&req.cluster) else {
        return Err(RelayReply::refuse(
            RelayStatus::UnknownCluster,
            &format!(
                "unknown cluster {:?}: the gateway of cluster {own:?} has no route to it",
                req.cluster
            ),
        ));
    };
    let unreachable = || {
        RelayReply::refuse(
            RelayStatus::Unreachable,
            &format!(
                "the gateway for cluster {:?} at {} is unreachable: {}",
                req.cluster,
                slot.addr,
                slot.last_error()
            ),
        )
    };
    let Some(link) = slot
        .link(Duration::from_millis(gw.config.peer_wait_ms))
        .await
    else {
        return Err(unreachable());
    };
    let next = RelayRequest {
        ttl: req.ttl - 1,
        cluster: req.cluster.clone(),
        lender: req.lender.clone(),
    };
    let open = next
        .encode()
        .map_err(|e| RelayReply::refuse(RelayStatus::BadRequest, &e.to_string()))?;
    link.open(open).map(Dest::Peer).map_err(|_| unreachable())
}

/// One end of a session.
enum End {
    Tcp(TcpStream),
    Mux(MuxStream),
    MuxHalves(MuxReader, MuxWriter),
}

enum Rd {
    Tcp(OwnedReadHalf, Vec<u8>),
    Mux(MuxReader),
}

enum Wr {
    Tcp(OwnedWriteHalf),
    Mux(MuxWriter),
}

impl End {
    fn split(self) -> (Rd, Wr) {
        match self {
            End::Tcp(t) => {
                let (r, w) = t.into_split();
                (Rd::Tcp(r, vec![0u8; READ_CHUNK]), Wr::Tcp(w))
            }
            End::Mux(s) => {
                let (r, w) = s.split();
                (Rd::Mux(r), Wr::Mux(w))
            }
            End::MuxHalves(r, w) => (Rd::Mux(r), Wr::Mux(w)),
        }
    }
}

impl Rd {
    /// The next bytes; `None` at the end of this direction.
    async fn next(&mut self) -> Result<Option<Vec<u8>>, String> {
        match self {
            Rd::Tcp(t, buf) => match t.read(buf).await {
                Ok(0) => Ok(None),
                Ok(n) => Ok(Some(buf[..n].to_vec())),
                Err(e) => Err(format!("connection: {e}")),
            },
            Rd::Mux(m) => m.recv().await.map_err(|e| devlend_fabric::error::chain(&e)),
        }
    }

    fn consumed(&mut self, n: usize) {
        if let Rd::Mux(m) = self {
            m.consumed(n);
        }
    }
}

impl Wr {
    async fn write(&mut self, data: Vec<u8>) -> Result<(), String> {
        match self {
            Wr::Tcp(t) => t
                .write_all(&data)
                .await
                .map_err(|e| format!("connection: {e}")),
            Wr::Mux(m) => m
                .send_owned(data)
                .await
                .map_err(|e| devlend_fabric::error::chain(&e)),
        }
    }

    async fn finish(&mut self) {
        match self {
            Wr::Tcp(t) => {
                let _ = t.shutdown().await;
            }
            Wr::Mux(m) => {
                let _ = m.finish();
            }
        }
    }

    fn abort(&mut self, why: &str) {
        if let Wr::Mux(m) = self {
            m.reset(why);
        }
    }
}

/// Byte counters for the two directions of a splice.
#[derive(Default, Clone, Copy)]
struct Counters<'a> {
    a_to_b: Option<&'a AtomicU64>,
    b_to_a: Option<&'a AtomicU64>,
}

async fn pump(mut r: Rd, mut w: Wr, count: Option<&AtomicU64>) -> Result<(), String> {
    loop {
        match r.next().await {
            Ok(Some(d)) => {
                let n = d.len();
                w.write(d).await?;
                r.consumed(n);
                if let Some(c) = count {
                    c.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
            Ok(None) => {
                w.finish().await;
                return Ok(());
            }
            Err(e) => {
                w.abort(&e);
                return Err(e);
            }
        }
    }
}

/// Copies bytes both ways until both directions have ended; the first failure ends
/// both (a stream end is reset, a TCP end closed).
async fn splice(a: End, b: End, c: Counters<'_>) -> Result<(), String> {
    let (ra, wa) = a.split();
    let (rb, wb) = b.split();
    tokio::try_join!(pump(ra, wb, c.a_to_b), pump(rb, wa, c.b_to_a)).map(|_| ())
}
