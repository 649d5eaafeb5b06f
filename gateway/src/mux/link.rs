//! One multiplexed connection to a peer gateway: its HELLO exchange, its table of
//! streams, and what the streams send through it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, watch, Semaphore};

use super::frame::{decode_header, encode_header, KIND_HELLO, KIND_OPEN, KIND_PING, KIND_RESET};
use super::io_tasks::{reader, writer};
use super::{
    Inbound, Incoming, LinkHello, LinkStats, MuxError, MuxStream, Out, Role, StreamState,
    FRAME_HEADER_LEN, MAX_RESET_MSG, MIN_WINDOW,
};

/// One multiplexed connection to a peer gateway.
pub struct Link {
    pub(super) out: mpsc::UnboundedSender<Out>,
    pub(super) streams: Mutex<HashMap<u32, Arc<StreamState>>>,
    pub(super) next_id: AtomicU32,
    /// The window the peer grants each stream (our send credit at open).
    pub(super) send_window: u32,
    /// The window we grant each stream.
    pub(super) recv_window: u32,
    pub(super) epoch: Instant,
    pub(super) closed: watch::Sender<bool>,
    /// The peer's cluster, from its HELLO.
    pub peer_cluster: String,
    /// This link's counters.
    pub stats: LinkStats,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("peer_cluster", &self.peer_cluster)
            .finish_non_exhaustive()
    }
}

impl Link {
    /// Runs the HELLO exchange on `io` (bounded by `timeout`) and starts the link's
    /// reader and writer tasks on the current tokio runtime. `window` is the per-stream
    /// window this side grants (bytes, ≥ [`MIN_WINDOW`]). As [`Role::Acceptor`], the
    /// streams the peer opens are handed to `incoming`; a dialer's `incoming` is unused.
    ///
    /// # Errors
    /// [`MuxError::Io`], [`MuxError::Protocol`] (a bad HELLO), [`MuxError::Timeout`].
    pub async fn start<T>(
        io: T,
        role: Role,
        hello: LinkHello,
        timeout: Duration,
        incoming: Option<mpsc::UnboundedSender<Incoming>>,
    ) -> Result<Arc<Link>, MuxError>
    where
        T: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (r, w) = tokio::io::split(io);
        let mut r = BufReader::with_capacity(512 << 10, r);
        let mut w = BufWriter::with_capacity(512 << 10, w);
        let exchange = async {
            w.write_all(&hello.encode()).await.map_err(MuxError::Io)?;
            w.flush().await.map_err(MuxError::Io)?;
            let mut hb = [0u8; FRAME_HEADER_LEN];
            r.read_exact(&mut hb).await.map_err(MuxError::Io)?;
            let h = decode_header(&hb).map_err(MuxError::Protocol)?;
            if h.kind != KIND_HELLO {
                return Err(MuxError::Protocol("the first frame is not a HELLO".into()));
            }
            let mut p = vec![0u8; h.len as usize];
            r.read_exact(&mut p).await.map_err(MuxError::Io)?;
            LinkHello::decode(&p).map_err(MuxError::Protocol)
        };
        let peer = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| MuxError::Timeout(timeout))??;
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let (closed, _) = watch::channel(false);
        let link = Arc::new(Link {
            out: out_tx,
            streams: Mutex::new(HashMap::new()),
            next_id: AtomicU32::new(1),
            send_window: peer.window,
            recv_window: hello.window.max(MIN_WINDOW),
            epoch: Instant::now(),
            closed,
            peer_cluster: peer.cluster,
            stats: LinkStats::default(),
        });
        let incoming = if role == Role::Acceptor {
            incoming
        } else {
            None
        };
        tokio::spawn(writer(link.clone(), w, out_rx));
        tokio::spawn(reader(link.clone(), r, incoming));
        Ok(link)
    }

    /// Opens a stream whose OPEN frame carries `open` (the encoded relay request).
    ///
    /// # Errors
    /// [`MuxError::Closed`].
    pub fn open(self: &Arc<Self>, open: Vec<u8>) -> Result<MuxStream, MuxError> {
        if self.is_closed() {
            return Err(MuxError::Closed);
        }
        let id = self.next_id.fetch_add(2, Ordering::Relaxed);
        let stream = self.add_stream(id)?;
        self.send(KIND_OPEN, id, open)?;
        Ok(stream)
    }

    /// Registers stream `id`. Checked under the streams' lock, which [`Self::close`]
    /// takes after marking the link closed: a stream is either refused here or reset
    /// by the close, never left waiting on a dead link.
    pub(super) fn add_stream(self: &Arc<Self>, id: u32) -> Result<MuxStream, MuxError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(StreamState {
            inbox: tx,
            credit: Semaphore::new(self.send_window as usize),
            allowance: AtomicI64::new(i64::from(self.recv_window)),
            fin_sent: AtomicBool::new(false),
            fin_received: AtomicBool::new(false),
        });
        {
            let mut streams = self.lock();
            if self.is_closed() {
                return Err(MuxError::Closed);
            }
            streams.insert(id, shared.clone());
        }
        self.stats.sessions_total.fetch_add(1, Ordering::Relaxed);
        self.stats.sessions_active.fetch_add(1, Ordering::Relaxed);
        Ok(MuxStream {
            id,
            link: self.clone(),
            shared,
            inbox: rx,
        })
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<StreamState>>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn send(&self, kind: u8, stream: u32, payload: Vec<u8>) -> Result<(), MuxError> {
        self.send_with_len(kind, stream, payload.len() as u32, payload)
    }

    pub(super) fn send_with_len(
        &self,
        kind: u8,
        stream: u32,
        len: u32,
        payload: Vec<u8>,
    ) -> Result<(), MuxError> {
        self.out
            .send(Out {
                header: encode_header(kind, stream, len),
                payload,
            })
            .map_err(|_| MuxError::Closed)
    }

    /// Sends a PING; the PONG updates [`LinkStats::rtt_us`].
    ///
    /// # Errors
    /// [`MuxError::Closed`].
    pub fn ping(&self) -> Result<(), MuxError> {
        let t = self.epoch.elapsed().as_nanos() as u64;
        self.send(KIND_PING, 0, t.to_le_bytes().to_vec())
    }

    /// How long since the peer last sent a frame.
    pub fn silent_for(&self) -> Duration {
        let heard = Duration::from_millis(self.stats.last_heard_ms.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(heard)
    }

    /// Whether the link has ended.
    pub fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    /// Waits until the link has ended.
    pub async fn wait_closed(&self) {
        let mut rx = self.closed.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }

    /// Ends the link: every stream on it is reset.
    pub fn close(&self) {
        self.closed.send_replace(true);
        let streams: Vec<_> = self.lock().drain().map(|(_, s)| s).collect();
        for s in streams {
            self.stats.sessions_active.fetch_sub(1, Ordering::Relaxed);
            let _ = s.inbox.send(Inbound::Reset(
                "the link to the peer gateway was lost".into(),
            ));
            s.credit.close();
        }
    }

    /// Aborts stream `id` both ways (locally and at the peer), if it is still open.
    pub(super) fn reset(&self, id: u32, why: &str) {
        let Some(s) = self.lock().remove(&id) else {
            return;
        };
        self.stats.sessions_active.fetch_sub(1, Ordering::Relaxed);
        let _ = s.inbox.send(Inbound::Reset(why.to_owned()));
        s.credit.close();
        let mut msg = why.as_bytes().to_vec();
        msg.truncate(MAX_RESET_MSG);
        let _ = self.send(KIND_RESET, id, msg);
    }

    /// Forgets stream `id` once both directions have ended.
    pub(super) fn retire_if_done(&self, id: u32, s: &StreamState) {
        if s.fin_sent.load(Ordering::Acquire)
            && s.fin_received.load(Ordering::Acquire)
            && self.lock().remove(&id).is_some()
        {
            self.stats.sessions_active.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
