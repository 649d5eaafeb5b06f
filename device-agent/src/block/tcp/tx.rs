//! A TCP session's responses on their way out: the finished requests in order, written
//! without blocking, many per `sendmsg`; a read whose data stays in a memory file sends
//! its header with `sendmsg` (`MSG_MORE`) and its data with `sendfile`
//! ([`DeviceIo::send_file`]). A response's request goes back to the request budget once it left
//! whole.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use devlend_fabric::wire::RESPONSE_HEADER_LEN;

use super::budget::RequestBudget;
use crate::block::io::{DeviceIo, Request};
use crate::block::wire::ResponseData;

/// Most iovecs per `sendmsg` (Linux UIO_MAXIOV).
const MAX_IOV: usize = 1024;

/// Finished requests whose responses are not fully sent, in order.
pub(super) struct Tx {
    out: VecDeque<Box<Request>>,
    /// Bytes of `out[0]`'s response (header, then data) already sent.
    sent: usize,
    iovs: Vec<libc::iovec>,
}

impl Tx {
    pub(super) fn new() -> Tx {
        Tx {
            out: VecDeque::new(),
            sent: 0,
            iovs: Vec::with_capacity(64),
        }
    }

    /// Nothing to send.
    pub(super) fn is_empty(&self) -> bool {
        self.out.is_empty()
    }

    /// Queues a finished request's response.
    pub(super) fn push(&mut self, mut req: Box<Request>) {
        req.encode_response();
        self.out.push_back(req);
    }

    /// Drops every response (the socket failed), giving the requests back.
    pub(super) fn clear(&mut self, budget: &mut RequestBudget) {
        while let Some(r) = self.out.pop_front() {
            budget.release(r);
        }
        self.sent = 0;
    }

    /// One `sendmsg` of as many responses as fit, or one `sendfile` of a response's
    /// data. `Some(whether a response completed)`, or `None` when the socket is full.
    ///
    /// # Errors
    /// The socket's (not EAGAIN), or the device's for `sendfile`.
    pub(super) fn send_some<I: DeviceIo>(
        &mut self,
        sock: RawFd,
        io: &mut I,
        budget: &mut RequestBudget,
    ) -> io::Result<Option<bool>> {
        // A response whose header is out and whose data comes from the file.
        if let Some(first) = self.out.front() {
            if let (_, ResponseData::File { offset, len }) = first.response() {
                if self.sent >= RESPONSE_HEADER_LEN {
                    let done = self.sent - RESPONSE_HEADER_LEN;
                    return match io.send_file(sock, offset + done as u64, len - done) {
                        Ok(n) => Ok(Some(self.advance(n, budget))),
                        Err(e) => would_block(e),
                    };
                }
            }
        }
        self.iovs.clear();
        let mut skip = self.sent;
        let mut more = false;
        for r in &self.out {
            if self.iovs.len() + 2 > MAX_IOV {
                break;
            }
            let (head, data) = r.response();
            if skip < head.len() {
                self.iovs.push(libc::iovec {
                    // SAFETY: skip < head.len(), inside the header.
                    iov_base: unsafe { head.as_ptr().add(skip) } as *mut libc::c_void,
                    iov_len: head.len() - skip,
                });
                skip = 0;
            } else {
                skip -= head.len();
            }
            match data {
                ResponseData::Buf(d) => {
                    if skip < d.len() {
                        self.iovs.push(libc::iovec {
                            // SAFETY: skip < d.len(), inside the data.
                            iov_base: unsafe { d.as_ptr().add(skip) } as *mut libc::c_void,
                            iov_len: d.len() - skip,
                        });
                    }
                    skip = 0;
                }
                ResponseData::File { .. } => {
                    // Its data follows with sendfile; hold the header back to go with it.
                    more = true;
                    break;
                }
            }
        }
        if self.iovs.is_empty() {
            return Ok(Some(false));
        }
        // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = self.iovs.as_mut_ptr();
        msg.msg_iovlen = self.iovs.len();
        let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 };
        loop {
            // SAFETY: each iovec points into a response header or data buffer owned by a
            // request in `out`, alive and untouched during the call.
            let n = unsafe { libc::sendmsg(sock, &msg, flags) };
            if n >= 0 {
                return Ok(Some(self.advance(n as usize, budget)));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return would_block(e);
            }
        }
    }

    /// Accounts `n` bytes sent: releases the responses that left entirely. Returns
    /// whether one did.
    fn advance(&mut self, mut n: usize, budget: &mut RequestBudget) -> bool {
        let mut done = false;
        while let Some(r) = self.out.front() {
            let total = RESPONSE_HEADER_LEN
                + match r.response().1 {
                    ResponseData::Buf(d) => d.len(),
                    ResponseData::File { len, .. } => len,
                };
            let left = total - self.sent;
            if n < left {
                self.sent += n;
                break;
            }
            n -= left;
            self.sent = 0;
            if let Some(r) = self.out.pop_front() {
                budget.release(r);
            }
            done = true;
        }
        done
    }
}

/// `Ok(None)` for EAGAIN (the socket is full), else the error.
fn would_block<T>(e: io::Error) -> io::Result<Option<T>> {
    if e.kind() == io::ErrorKind::WouldBlock {
        Ok(None)
    } else {
        Err(e)
    }
}
