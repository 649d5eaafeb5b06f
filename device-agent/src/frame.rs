//! Buffered reading of request frames from the session socket.
//!
//! Between frames the socket is read with no timeout (a borrower may be idle for
//! hours). Once a frame has started, the rest of it must arrive within the mid-frame
//! timeout: the timeout is set on the socket only while a frame is incomplete, so a
//! steady stream of whole frames costs no extra system calls.

use std::io::{self, ErrorKind, Read};
use std::net::TcpStream;
use std::time::Duration;

/// Bytes read from the socket at a time (several request headers per `read`).
const READ_BUF: usize = 64 << 10;

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    /// The peer closed the connection between two frames.
    #[error("peer closed the connection")]
    Closed,
    /// The peer closed the connection inside a frame.
    #[error("peer closed the connection mid-frame ({got} of {want} bytes)")]
    Truncated {
        /// Bytes of the frame received.
        got: usize,
        /// Bytes the frame should have had.
        want: usize,
    },
    /// The rest of a started frame did not arrive within the mid-frame timeout.
    #[error("peer stalled mid-frame for {0:?} ({1} of {2} bytes)")]
    Stalled(Duration, usize, usize),
    /// The socket failed.
    #[error("socket read failed")]
    Io(#[source] io::Error),
}

/// Reads frames from a socket through a buffer.
pub(crate) struct FrameReader<'a> {
    sock: &'a TcpStream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    mid_frame_timeout: Duration,
    armed: bool,
}

impl<'a> FrameReader<'a> {
    /// A reader of `sock`, which must be in blocking mode with no read timeout.
    pub(crate) fn new(sock: &'a TcpStream, mid_frame_timeout: Duration) -> Self {
        FrameReader {
            sock,
            buf: vec![0u8; READ_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
            mid_frame_timeout,
            armed: false,
        }
    }

    /// Bytes already buffered: reading up to this many will not block.
    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Fills `dst`. `frame_done` counts the bytes of the current frame read before
    /// (0 when `dst` starts a frame), and `frame_len` the frame's total, for errors.
    pub(crate) fn read_exact(
        &mut self,
        dst: &mut [u8],
        frame_done: usize,
        frame_len: usize,
    ) -> Result<(), FrameError> {
        let mut got = 0;
        while got < dst.len() {
            if self.start < self.end {
                let n = (self.end - self.start).min(dst.len() - got);
                dst[got..got + n].copy_from_slice(&self.buf[self.start..self.start + n]);
                self.start += n;
                got += n;
                continue;
            }
            let in_frame = frame_done + got > 0;
            self.arm(in_frame).map_err(FrameError::Io)?;
            // A large remainder goes straight into `dst`; else refill the buffer.
            let direct = dst.len() - got >= self.buf.len();
            let res = if direct {
                self.sock.read(&mut dst[got..])
            } else {
                self.sock.read(&mut self.buf)
            };
            match res {
                Ok(0) if !in_frame => return Err(FrameError::Closed),
                Ok(0) => {
                    return Err(FrameError::Truncated {
                        got: frame_done + got,
                        want: frame_len,
                    })
                }
                Ok(n) if direct => got += n,
                Ok(n) => {
                    self.start = 0;
                    self.end = n;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e)
                    if in_frame
                        && matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
                {
                    return Err(FrameError::Stalled(
                        self.mid_frame_timeout,
                        frame_done + got,
                        frame_len,
                    ))
                }
                Err(e) => return Err(FrameError::Io(e)),
            }
        }
        Ok(())
    }

    /// Sets the socket's read timeout for a read inside a frame, clears it for a read
    /// between frames; only when that changes.
    fn arm(&mut self, in_frame: bool) -> io::Result<()> {
        if in_frame != self.armed {
            self.sock
                .set_read_timeout(in_frame.then_some(self.mid_frame_timeout))?;
            self.armed = in_frame;
        }
        Ok(())
    }
}
