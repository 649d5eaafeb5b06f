//! A TCP session's budget of requests in flight (its credit), and its free list of
//! request buffers.
//!
//! The session takes a [`Request`] before it reads a request's data and starts its I/O,
//! and gives it back once the response is written. A borrower granted the budget as its
//! credit never spends more; for one without credit, a spent budget stops the session
//! reading its socket until a request is given back: the borrower sees TCP
//! backpressure. Owned by the session's one thread: no lock.

use crate::block::io::Request;

/// Largest buffer capacity in bytes kept for reuse; larger buffers are freed.
const RETAIN_MAX_BUF: usize = 2 << 20;
/// Most bytes of buffer capacity kept in the free list.
const RETAIN_MAX_TOTAL: usize = 32 << 20;

/// The in-flight budget and the free list.
#[derive(Debug)]
pub(crate) struct RequestBudget {
    /// Boxed: a request's address is its `user_data` while in flight, and the box
    /// travels to the kernel and back without being reallocated.
    #[allow(clippy::vec_box)]
    free: Vec<Box<Request>>,
    /// Capacity in bytes of the buffers in `free`.
    retained: usize,
    in_flight: usize,
    bytes: usize,
    max_in_flight: usize,
    max_bytes: usize,
}

impl RequestBudget {
    /// A budget allowing `max_in_flight` requests and `max_bytes` of data in flight.
    pub(crate) fn new(max_in_flight: usize, max_bytes: usize) -> RequestBudget {
        RequestBudget {
            free: Vec::new(),
            retained: 0,
            in_flight: 0,
            bytes: 0,
            max_in_flight,
            max_bytes,
        }
    }

    /// Takes a request charged `bytes`, or `None` while the budget is spent. A request
    /// of any size fits when nothing else is in flight.
    pub(crate) fn acquire(&mut self, bytes: usize) -> Option<Box<Request>> {
        if self.in_flight >= self.max_in_flight
            || (self.in_flight > 0 && self.bytes + bytes > self.max_bytes)
        {
            return None;
        }
        self.in_flight += 1;
        self.bytes += bytes;
        let mut req = match self.free.pop() {
            Some(r) => {
                self.retained -= r.buf.capacity();
                r
            }
            None => Box::new(Request::new()),
        };
        req.charge = bytes;
        Some(req)
    }

    /// Gives a request back (finished, or never submitted).
    pub(crate) fn release(&mut self, mut r: Box<Request>) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(r.charge);
        r.charge = 0;
        let cap = r.buf.capacity();
        if cap > RETAIN_MAX_BUF || self.retained + cap > RETAIN_MAX_TOTAL {
            r.buf = Vec::new();
        }
        self.retained += r.buf.capacity();
        self.free.push(r);
    }

    /// Requests in flight.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_counts_requests_and_bytes() {
        let mut p = RequestBudget::new(2, 1000);
        let a = p.acquire(600).expect("first");
        assert!(p.acquire(600).is_none());
        let b = p.acquire(400).expect("second");
        assert!(p.acquire(0).is_none());
        p.release(a);
        assert_eq!(p.in_flight(), 1);
        let c = p.acquire(600).expect("third");
        p.release(b);
        p.release(c);
        assert_eq!(p.in_flight(), 0);
        // Alone, an over-budget request still fits.
        let d = p.acquire(5000).expect("big");
        p.release(d);
    }

    #[test]
    fn large_buffers_are_not_retained() {
        let mut p = RequestBudget::new(4, usize::MAX);
        let mut a = p.acquire(0).expect("a");
        a.buffer(RETAIN_MAX_BUF + 512);
        p.release(a);
        let a = p.acquire(0).expect("a again");
        assert_eq!(a.buf.capacity(), 0);
    }
}
