//! A queue's send side on a byte-stream session: request headers (and a write's guest
//! data) waiting to be written, written without ever blocking.
//!
//! The worker that owns a virtqueue must never sleep in a socket write while it holds
//! the vring and the engine: the lender may be busy sending it responses that only this
//! worker reads (a circular wait). So requests are queued here, each write takes what
//! the socket accepts now (`sendmsg` with `MSG_DONTWAIT`), a partial write is resumed
//! where it stopped, and when the socket is full the queue says so
//! ([`TxQueue::blocked`]): the worker then watches the socket for writability (EPOLLOUT)
//! and goes back to reading responses.
//!
//! How much is queued is bounded by the session's credit (`devlend_fabric::Credit`),
//! which the table applies before a request gets here. The queue lives as long as its
//! session: when that is lost, the queue goes with it, and its requests are resent
//! whole on the next one.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use devlend_fabric::wire::REQUEST_HEADER_LEN;

use crate::guest::HostIov;

/// Most iovecs per `sendmsg` (Linux UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// One request to write: its header, then, for a write, the guest data of the request
/// in slot `head`.
#[derive(Debug)]
struct Entry {
    header: [u8; REQUEST_HEADER_LEN],
    head: u16,
    /// Bytes on the wire: the header, then the guest data of slot `head` if longer.
    len: usize,
}

/// Requests waiting to be written on a stream, in order.
#[derive(Debug, Default)]
pub(crate) struct TxQueue {
    entries: VecDeque<Entry>,
    /// Bytes of the first entry already written.
    done: usize,
    /// The last write stopped because the socket was full.
    blocked: bool,
    iovs: Vec<libc::iovec>,
}

impl TxQueue {
    /// Queues a request: its encoded header, and `data_len` bytes of the guest data of
    /// slot `head` after it (0: none).
    pub(crate) fn push(&mut self, header: [u8; REQUEST_HEADER_LEN], head: u16, data_len: usize) {
        self.entries.push_back(Entry {
            header,
            head,
            len: REQUEST_HEADER_LEN + data_len,
        });
    }

    /// Nothing waits to be written.
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The socket was full at the last write and requests still wait: watch it for
    /// writability.
    pub(crate) fn blocked(&self) -> bool {
        self.blocked && !self.entries.is_empty()
    }

    /// Writes what `fd` takes now, without blocking; `data(head)` gives the guest
    /// buffers of a write queued for slot `head`, which must stay mapped and unchanged
    /// until the entry is written. Returns once everything is written or the socket is
    /// full ([`Self::blocked`]).
    ///
    /// # Errors
    /// The socket's error (the session is then lost).
    pub(crate) fn write<'a>(
        &mut self,
        fd: RawFd,
        data: impl Fn(u16) -> &'a [HostIov],
    ) -> io::Result<()> {
        self.blocked = false;
        while !self.entries.is_empty() {
            self.build_iovs(&data);
            let n = match send_nonblocking(fd, &self.iovs)? {
                Some(n) => n,
                None => {
                    self.blocked = true;
                    return Ok(());
                }
            };
            self.advance(n);
        }
        Ok(())
    }

    /// Points `iovs` at the unwritten bytes, from the first entry on, at most
    /// [`IOV_MAX`] of them.
    fn build_iovs<'a>(&mut self, data: &impl Fn(u16) -> &'a [HostIov]) {
        self.iovs.clear();
        let mut skip = self.done;
        for e in &self.entries {
            let header = [libc::iovec {
                iov_base: e.header.as_ptr().cast_mut().cast(),
                iov_len: e.header.len(),
            }];
            let guest = if e.len > REQUEST_HEADER_LEN {
                data(e.head)
            } else {
                &[]
            };
            for iov in header
                .into_iter()
                .chain(guest.iter().map(HostIov::as_iovec))
            {
                if self.iovs.len() == IOV_MAX {
                    return;
                }
                if skip >= iov.iov_len {
                    skip -= iov.iov_len;
                    continue;
                }
                self.iovs.push(libc::iovec {
                    // SAFETY: skip < iov_len, so the pointer stays inside the buffer.
                    iov_base: unsafe { iov.iov_base.cast::<u8>().add(skip) }.cast(),
                    iov_len: iov.iov_len - skip,
                });
                skip = 0;
            }
        }
    }

    /// `n` more bytes were written: drops the entries written whole.
    fn advance(&mut self, n: usize) {
        let mut left = self.done + n;
        while let Some(e) = self.entries.front() {
            if left < e.len {
                break;
            }
            left -= e.len;
            self.entries.pop_front();
        }
        self.done = left;
    }
}

/// Sends `iovs` without blocking. `Ok(None)` when the socket takes nothing now.
fn send_nonblocking(fd: RawFd, iovs: &[libc::iovec]) -> io::Result<Option<usize>> {
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iovs.as_ptr().cast_mut();
    msg.msg_iovlen = iovs.len();
    // SAFETY: msg describes `iovs`, each pointing at memory that is mapped and alive for
    // the call (a header owned by the queue or a guest buffer kept alive by its
    // request); sendmsg only reads from it.
    super::nonblock::retry(|| unsafe {
        libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    fn header(tag: u8) -> [u8; REQUEST_HEADER_LEN] {
        [tag; REQUEST_HEADER_LEN]
    }

    #[test]
    fn a_full_socket_blocks_the_queue_not_the_thread_and_the_rest_follows_in_order() {
        let (a, mut b) = UnixStream::pair().unwrap();
        // 1 MiB of "guest data" per write: far more than the socket buffer holds.
        let mut bufs: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i + 1; 1 << 20]).collect();
        let iovs: Vec<Vec<HostIov>> = bufs
            .iter_mut()
            .map(|b| {
                vec![
                    HostIov {
                        ptr: b.as_mut_ptr(),
                        len: 4096,
                    },
                    HostIov {
                        ptr: b[4096..].as_mut_ptr(),
                        len: b.len() - 4096,
                    },
                ]
            })
            .collect();
        let mut q = TxQueue::default();
        for i in 0..4u16 {
            q.push(header(0xa0 + i as u8), i, 1 << 20);
            q.push(header(0xb0 + i as u8), 100 + i, 0);
        }
        let data = |h: u16| iovs[usize::from(h)].as_slice();
        let t = std::time::Instant::now();
        q.write(a.as_raw_fd(), data).unwrap();
        assert!(
            t.elapsed() < std::time::Duration::from_secs(1),
            "it blocked"
        );
        assert!(q.blocked(), "the socket cannot take 4 MiB at once");
        // The peer reads everything, the writer resumes as the socket drains.
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            b.read_to_end(&mut all).unwrap();
            all
        });
        while !q.is_empty() {
            let mut p = libc::pollfd {
                fd: a.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the call.
            unsafe { libc::poll(&mut p, 1, 1000) };
            q.write(a.as_raw_fd(), data).unwrap();
        }
        assert!(!q.blocked());
        drop(a);
        let all = reader.join().unwrap();
        let mut want = Vec::new();
        for i in 0..4u8 {
            want.extend_from_slice(&header(0xa0 + i));
            want.extend_from_slice(&bufs[usize::from(i)]);
            want.extend_from_slice(&header(0xb0 + i));
        }
        assert_eq!(all.len(), want.len());
        assert!(
            all == want,
            "bytes out of order or lost across partial writes"
        );
    }

    #[test]
    fn a_closed_peer_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let mut q = TxQueue::default();
        q.push(header(1), 0, 0);
        assert!(q.write(a.as_raw_fd(), |_| &[]).is_err());
        assert!(!q.blocked(), "not full: broken");
    }
}
