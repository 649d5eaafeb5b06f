//! A session's budget of requests in flight, and its free list of request buffers.
//!
//! The request reader takes a [`Request`] before it reads a request's data and starts
//! its I/O; the completion thread gives requests back once their responses are written.
//! When the budget is spent the reader waits, and so stops reading the socket: the
//! borrower sees TCP backpressure. The mutex is private to the session.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use crate::request::Request;

/// Largest buffer capacity in bytes kept for reuse; larger buffers are freed.
const RETAIN_MAX_BUF: usize = 2 << 20;
/// Most bytes of buffer capacity kept in the free list.
const RETAIN_MAX_TOTAL: usize = 32 << 20;

#[derive(Debug)]
struct State {
    /// Boxed: a request's address is its `user_data` while in flight, and the box
    /// travels to the kernel and back without being reallocated.
    #[allow(clippy::vec_box)]
    free: Vec<Box<Request>>,
    /// Capacity in bytes of the buffers in `free`.
    retained: usize,
    in_flight: usize,
    bytes: usize,
    closed: bool,
}

/// The in-flight budget and the free list.
#[derive(Debug)]
pub(crate) struct Pool {
    state: Mutex<State>,
    released: Condvar,
    max_in_flight: usize,
    max_bytes: usize,
}

/// What [`Pool::try_acquire`] found.
pub(crate) enum Acquire {
    /// A request, charged `bytes`.
    Got(Box<Request>),
    /// The budget is spent.
    Full,
    /// The session is ending.
    Closed,
}

impl Pool {
    /// A pool allowing `max_in_flight` requests and `max_bytes` of data in flight.
    pub(crate) fn new(max_in_flight: usize, max_bytes: usize) -> Pool {
        Pool {
            state: Mutex::new(State {
                free: Vec::new(),
                retained: 0,
                in_flight: 0,
                bytes: 0,
                closed: false,
            }),
            released: Condvar::new(),
            max_in_flight,
            max_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take(&self, st: &mut State, bytes: usize) -> Acquire {
        if st.closed {
            return Acquire::Closed;
        }
        // A request of any size fits when nothing else is in flight.
        if st.in_flight >= self.max_in_flight
            || (st.in_flight > 0 && st.bytes + bytes > self.max_bytes)
        {
            return Acquire::Full;
        }
        st.in_flight += 1;
        st.bytes += bytes;
        let mut req = match st.free.pop() {
            Some(r) => {
                st.retained -= r.buf.capacity();
                r
            }
            None => Box::new(Request::new()),
        };
        req.charge = bytes;
        Acquire::Got(req)
    }

    /// Takes a request charged `bytes` if the budget allows, without waiting.
    pub(crate) fn try_acquire(&self, bytes: usize) -> Acquire {
        let mut st = self.lock();
        self.take(&mut st, bytes)
    }

    /// Takes a request charged `bytes`, waiting for completions while the budget is
    /// spent. `None` once the session is closing.
    pub(crate) fn acquire(&self, bytes: usize) -> Option<Box<Request>> {
        let mut st = self.lock();
        loop {
            match self.take(&mut st, bytes) {
                Acquire::Got(r) => return Some(r),
                Acquire::Closed => return None,
                Acquire::Full => {
                    st = self
                        .released
                        .wait(st)
                        .unwrap_or_else(PoisonError::into_inner)
                }
            }
        }
    }

    /// Gives requests back (finished, or never submitted); returns how many remain in
    /// flight.
    pub(crate) fn release(&self, reqs: impl IntoIterator<Item = Box<Request>>) -> usize {
        let mut st = self.lock();
        for mut r in reqs {
            st.in_flight = st.in_flight.saturating_sub(1);
            st.bytes = st.bytes.saturating_sub(r.charge);
            r.charge = 0;
            let cap = r.buf.capacity();
            if cap > RETAIN_MAX_BUF || st.retained + cap > RETAIN_MAX_TOTAL {
                r.buf = Vec::new();
            }
            st.retained += r.buf.capacity();
            st.free.push(r);
        }
        let left = st.in_flight;
        drop(st);
        self.released.notify_all();
        left
    }

    /// Requests in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.lock().in_flight
    }

    /// Wakes the reader and makes every later acquire fail.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_counts_requests_and_bytes() {
        let p = Pool::new(2, 1000);
        let Acquire::Got(a) = p.try_acquire(600) else {
            panic!("first")
        };
        assert!(matches!(p.try_acquire(600), Acquire::Full));
        let Acquire::Got(b) = p.try_acquire(400) else {
            panic!("second")
        };
        assert!(matches!(p.try_acquire(0), Acquire::Full));
        assert_eq!(p.release([a]), 1);
        let Acquire::Got(c) = p.try_acquire(600) else {
            panic!("third")
        };
        assert_eq!(p.release([b, c]), 0);
        // Alone, an over-budget request still fits.
        let Acquire::Got(d) = p.try_acquire(5000) else {
            panic!("big")
        };
        p.release([d]);
        p.close();
        assert!(p.acquire(1).is_none());
    }

    #[test]
    fn large_buffers_are_not_retained() {
        let p = Pool::new(4, usize::MAX);
        let Acquire::Got(mut a) = p.try_acquire(0) else {
            panic!()
        };
        a.buffer(RETAIN_MAX_BUF + 512);
        p.release([a]);
        let Acquire::Got(a) = p.try_acquire(0) else {
            panic!()
        };
        assert_eq!(a.buf.capacity(), 0);
    }
}
