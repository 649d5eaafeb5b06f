//! A stream's two halves: [`MuxReader`] hands on the peer's bytes and grants it more
//! window as they are consumed, [`MuxWriter`] sends within the peer's credit.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::mpsc;

use super::frame::{KIND_DATA, KIND_FIN, KIND_WINDOW};
use super::{Inbound, Link, MuxError, StreamState, MAX_DATA};

/// One relayed session on a link.
pub struct MuxStream {
    pub(super) id: u32,
    pub(super) link: Arc<Link>,
    pub(super) shared: Arc<StreamState>,
    pub(super) inbox: mpsc::UnboundedReceiver<Inbound>,
}

impl MuxStream {
    /// The stream id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Splits into a reader and a writer, usable from two tasks.
    pub fn split(self) -> (MuxReader, MuxWriter) {
        (
            MuxReader {
                id: self.id,
                link: self.link.clone(),
                shared: self.shared.clone(),
                inbox: self.inbox,
                pending: 0,
                done: false,
            },
            MuxWriter {
                id: self.id,
                link: self.link,
                shared: self.shared,
                done: false,
            },
        )
    }
}

/// The receiving half of a stream. Dropped before the peer's FIN, it resets the stream.
pub struct MuxReader {
    id: u32,
    link: Arc<Link>,
    shared: Arc<StreamState>,
    inbox: mpsc::UnboundedReceiver<Inbound>,
    pending: u32,
    done: bool,
}

impl MuxReader {
    /// The next bytes of the session; `None` after the peer's FIN. Call
    /// [`Self::consumed`] once they have been passed on, to give the peer credit.
    ///
    /// # Errors
    /// [`MuxError::Reset`] (by the peer, or the link was lost).
    pub async fn recv(&mut self) -> Result<Option<Vec<u8>>, MuxError> {
        match self.inbox.recv().await {
            Some(Inbound::Data(d)) => Ok(Some(d)),
            Some(Inbound::Fin) => {
                self.done = true;
                Ok(None)
            }
            Some(Inbound::Reset(why)) => {
                self.done = true;
                Err(MuxError::Reset(why))
            }
            None => {
                self.done = true;
                Err(MuxError::Closed)
            }
        }
    }

    /// Records that `n` received bytes were passed on; grants the peer a WINDOW once a
    /// quarter of the window has been.
    pub fn consumed(&mut self, n: usize) {
        self.pending = self.pending.saturating_add(n as u32);
        if self.pending >= self.link.recv_window / 4 {
            let n = std::mem::take(&mut self.pending);
            self.shared
                .allowance
                .fetch_add(i64::from(n), Ordering::AcqRel);
            let _ = self.link.send_with_len(KIND_WINDOW, self.id, n, Vec::new());
        }
    }
}

impl Drop for MuxReader {
    fn drop(&mut self) {
        if !self.done {
            self.link
                .reset(self.id, "the relaying gateway ended the session");
        }
    }
}

/// The sending half of a stream. Dropped before [`Self::finish`], it resets the stream.
pub struct MuxWriter {
    id: u32,
    link: Arc<Link>,
    shared: Arc<StreamState>,
    done: bool,
}

impl MuxWriter {
    /// Sends `data` as DATA frames, each waiting for credit.
    ///
    /// # Errors
    /// [`MuxError::Closed`]: the stream was reset or the link lost.
    pub async fn send(&mut self, data: &[u8]) -> Result<(), MuxError> {
        let max = MAX_DATA.min(self.link.send_window as usize);
        for chunk in data.chunks(max) {
            let permit = self
                .shared
                .credit
                .acquire_many(chunk.len() as u32)
                .await
                .map_err(|_| MuxError::Closed)?;
            permit.forget();
            self.link.send(KIND_DATA, self.id, chunk.to_vec())?;
            self.link
                .stats
                .bytes_sent
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// As [`Self::send`], without a copy when `data` fits one frame.
    ///
    /// # Errors
    /// [`MuxError::Closed`].
    pub async fn send_owned(&mut self, data: Vec<u8>) -> Result<(), MuxError> {
        let max = MAX_DATA.min(self.link.send_window as usize);
        if data.len() > max || data.is_empty() {
            return self.send(&data).await;
        }
        let n = data.len();
        let permit = self
            .shared
            .credit
            .acquire_many(n as u32)
            .await
            .map_err(|_| MuxError::Closed)?;
        permit.forget();
        self.link.send(KIND_DATA, self.id, data)?;
        self.link
            .stats
            .bytes_sent
            .fetch_add(n as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Sends FIN: nothing more from this side.
    ///
    /// # Errors
    /// [`MuxError::Closed`].
    pub fn finish(&mut self) -> Result<(), MuxError> {
        self.done = true;
        self.shared.fin_sent.store(true, Ordering::Release);
        let r = self.link.send(KIND_FIN, self.id, Vec::new());
        self.link.retire_if_done(self.id, &self.shared);
        r
    }

    /// Aborts the stream both ways with a reason for the peer.
    pub fn reset(&mut self, why: &str) {
        self.done = true;
        self.link.reset(self.id, why);
    }
}

impl Drop for MuxWriter {
    fn drop(&mut self) {
        if !self.done {
            self.link
                .reset(self.id, "the relaying gateway ended the session");
        }
    }
}
