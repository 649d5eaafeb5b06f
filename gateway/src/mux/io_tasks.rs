//! A link's two tasks: the writer, which sends the queued frames, and the reader, which
//! takes the peer's frames to the streams (DATA, WINDOW, FIN, RESET) or answers them.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::mpsc;

use super::frame::{
    decode_header, KIND_DATA, KIND_FIN, KIND_HELLO, KIND_OPEN, KIND_PING, KIND_PONG, KIND_RESET,
    KIND_WINDOW,
};
use super::{Inbound, Incoming, Link, MuxError, Out, FRAME_HEADER_LEN};

pub(super) async fn writer<W: AsyncWrite + Unpin>(
    link: Arc<Link>,
    mut w: BufWriter<W>,
    mut rx: mpsc::UnboundedReceiver<Out>,
) {
    let mut closed = link.closed.subscribe();
    let result: Result<(), io::Error> = async {
        loop {
            let frame = tokio::select! {
                f = rx.recv() => f,
                _ = closed.wait_for(|c| *c) => None,
            };
            let Some(mut f) = frame else { break };
            loop {
                w.write_all(&f.header).await?;
                if !f.payload.is_empty() {
                    w.write_all(&f.payload).await?;
                }
                match rx.try_recv() {
                    Ok(next) => f = next,
                    Err(_) => break,
                }
            }
            w.flush().await?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        if !link.is_closed() {
            devlend_fabric::limited!(warn, peer = %link.peer_cluster, error = %e, "cannot write to the peer gateway; closing the link");
        }
    }
    let _ = w.shutdown().await;
    link.close();
}

pub(super) async fn reader<R: AsyncRead + Unpin>(
    link: Arc<Link>,
    mut r: BufReader<R>,
    incoming: Option<mpsc::UnboundedSender<Incoming>>,
) {
    let mut closed = link.closed.subscribe();
    let result = tokio::select! {
        r = read_frames(&link, &mut r, incoming.as_ref()) => r,
        _ = closed.wait_for(|c| *c) => Ok(()),
    };
    match result {
        Err(MuxError::Protocol(m)) => {
            devlend_fabric::limited!(warn, peer = %link.peer_cluster, reason = %m, "peer gateway broke the link protocol; closing the link");
        }
        Err(e) if !link.is_closed() => {
            devlend_fabric::limited!(warn, peer = %link.peer_cluster, error = %devlend_fabric::error::chain(&e), "link to the peer gateway lost");
        }
        _ => {}
    }
    link.close();
}

async fn read_frames<R: AsyncRead + Unpin>(
    link: &Arc<Link>,
    r: &mut BufReader<R>,
    incoming: Option<&mpsc::UnboundedSender<Incoming>>,
) -> Result<(), MuxError> {
    let mut hb = [0u8; FRAME_HEADER_LEN];
    loop {
        match r.read_exact(&mut hb).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(MuxError::Closed);
            }
            Err(e) => return Err(MuxError::Io(e)),
        }
        let h = decode_header(&hb).map_err(MuxError::Protocol)?;
        link.stats
            .last_heard_ms
            .store(link.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        let mut payload = Vec::new();
        if !matches!(h.kind, KIND_WINDOW) && h.len > 0 {
            payload = vec![0u8; h.len as usize];
            r.read_exact(&mut payload).await.map_err(MuxError::Io)?;
        }
        let shared = || link.lock().get(&h.stream).cloned();
        match h.kind {
            KIND_HELLO => return Err(MuxError::Protocol("a second HELLO".into())),
            KIND_OPEN => {
                let Some(tx) = incoming else {
                    return Err(MuxError::Protocol(
                        "an OPEN from the side that accepted the connection".into(),
                    ));
                };
                if h.stream % 2 == 0 || shared().is_some() {
                    return Err(MuxError::Protocol(format!(
                        "OPEN of stream {} (even, or already open)",
                        h.stream
                    )));
                }
                let stream = link.add_stream(h.stream)?;
                if tx.send((stream, payload)).is_err() {
                    return Err(MuxError::Closed);
                }
            }
            KIND_DATA => {
                let Some(s) = shared() else {
                    // A stream this side has reset: its last bytes are dropped.
                    continue;
                };
                let len = i64::from(h.len);
                if s.allowance.fetch_sub(len, Ordering::AcqRel) - len < 0 {
                    return Err(MuxError::Protocol(format!(
                        "stream {} sent {} bytes past its window",
                        h.stream, h.len
                    )));
                }
                if s.fin_received.load(Ordering::Acquire) {
                    return Err(MuxError::Protocol(format!(
                        "DATA on stream {} after its FIN",
                        h.stream
                    )));
                }
                link.stats
                    .bytes_received
                    .fetch_add(u64::from(h.len), Ordering::Relaxed);
                let _ = s.inbox.send(Inbound::Data(payload));
            }
            KIND_WINDOW => {
                if let Some(s) = shared() {
                    if s.credit.available_permits() + h.len as usize
                        > (link.send_window as usize).saturating_mul(2)
                    {
                        return Err(MuxError::Protocol(format!(
                            "WINDOW of {} bytes on stream {} exceeds twice the window",
                            h.len, h.stream
                        )));
                    }
                    s.credit.add_permits(h.len as usize);
                }
            }
            KIND_FIN => {
                if let Some(s) = shared() {
                    s.fin_received.store(true, Ordering::Release);
                    let _ = s.inbox.send(Inbound::Fin);
                    link.retire_if_done(h.stream, &s);
                }
            }
            KIND_RESET => {
                if let Some(s) = link.lock().remove(&h.stream) {
                    link.stats.sessions_active.fetch_sub(1, Ordering::Relaxed);
                    let why = String::from_utf8_lossy(&payload).into_owned();
                    let _ = s
                        .inbox
                        .send(Inbound::Reset(format!("by the peer gateway: {why}")));
                    s.credit.close();
                }
            }
            KIND_PING => {
                link.send(KIND_PONG, 0, payload)?;
            }
            KIND_PONG => {
                let mut t = [0u8; 8];
                t.copy_from_slice(&payload);
                let sent = Duration::from_nanos(u64::from_le_bytes(t));
                if let Some(rtt) = link.epoch.elapsed().checked_sub(sent) {
                    link.stats
                        .rtt_us
                        .store(rtt.as_micros().max(1) as u64, Ordering::Relaxed);
                }
            }
            _ => unreachable_kind(h.kind)?,
        }
    }
}

fn unreachable_kind(k: u8) -> Result<(), MuxError> {
    Err(MuxError::Protocol(format!("unknown frame kind {k}")))
}
