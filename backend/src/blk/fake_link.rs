//! An in-memory lender and the [`QueueLink`] to it, for the engine's unit tests: it
//! records every request that reaches it, answers what a test tells it to (in any
//! order), grants the credit a test sets, takes a limited number of requests per send
//! (a socket that accepts part of what is queued), refuses sessions while down, and
//! cuts the session on demand.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use devlend_fabric::tcp::ConnectError;
use devlend_fabric::wire::{RequestHeader, ResponseHeader, REQUEST_HEADER_LEN};
use devlend_fabric::{BlockGeometry, BlockRequest, Bytes, Credit, HelloReply, Op, Status};

use crate::blk::complete::Completer;
use crate::blk::link::{check_response, next_request, FabricFault, QueueLink};
use crate::blk::table::RequestTable;
use crate::lender::target::LenderTarget;

/// The device the fake lender lends.
pub(crate) fn geometry() -> BlockGeometry {
    BlockGeometry {
        capacity_sectors: 1 << 21,
        block_size: 512,
        max_transfer: 1 << 20,
        ..BlockGeometry::default()
    }
}

/// A request as it reached the lender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Received {
    /// The session it came on (1 for the first).
    pub(crate) session: u32,
    pub(crate) id: u64,
    pub(crate) request: BlockRequest,
}

impl Received {
    /// The head of the chain it was made from.
    pub(crate) fn head(&self) -> u16 {
        crate::blk::request_id::head_of(self.id)
    }
}

/// The fake lender's state, shared by a test and the links it opens.
#[derive(Debug, Default)]
pub(crate) struct Lender {
    /// Sessions opened so far.
    pub(crate) sessions: u32,
    /// The credit stated in the hello reply (`None`: none, as a lender of before
    /// credit).
    pub(crate) credit: Option<Credit>,
    /// Sessions are refused (for now) while set.
    pub(crate) down: bool,
    /// Every request that reached the lender, in order.
    pub(crate) received: Vec<Received>,
    /// Requests of the current session not answered yet, in order.
    pub(crate) unanswered: Vec<Received>,
    /// Answers the next receive delivers, in order.
    pub(crate) answers: VecDeque<(Received, Status)>,
    /// Most requests a send writes (`None`: all).
    pub(crate) per_send: Option<usize>,
    /// The session fails at its next receive.
    pub(crate) cut: bool,
    /// Most requests unanswered on the lender at once.
    pub(crate) max_unanswered: usize,
}

impl Lender {
    /// Answers the unanswered request made from `head` with `status` (delivered at the
    /// next receive).
    ///
    /// # Panics
    /// No request from `head` is unanswered.
    pub(crate) fn answer(&mut self, head: u16, status: Status) {
        let i = self
            .unanswered
            .iter()
            .position(|r| r.head() == head)
            .unwrap_or_else(|| panic!("no request from head {head} to answer"));
        let r = self.unanswered.remove(i);
        self.answers.push_back((r, status));
    }

    /// The heads of the requests received on `session`, in order.
    pub(crate) fn heads_on(&self, session: u32) -> Vec<u16> {
        self.received
            .iter()
            .filter(|r| r.session == session)
            .map(Received::head)
            .collect()
    }
}

/// A test's handle on the fake lender.
pub(crate) type SharedLender = Arc<Mutex<Lender>>;

fn lock(l: &SharedLender) -> MutexGuard<'_, Lender> {
    l.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the engine opens sessions with: a [`FakeLink`] to `lender`.
pub(crate) fn opener(
    lender: SharedLender,
) -> impl FnMut(&LenderTarget, u16) -> Result<(Box<dyn QueueLink>, HelloReply), ConnectError> + Send
{
    move |target, _| {
        let mut l = lock(&lender);
        if l.down {
            return Err(ConnectError::Connect {
                addr: target.addr.clone(),
                source: io::Error::from(io::ErrorKind::ConnectionRefused),
            });
        }
        l.sessions += 1;
        l.unanswered.clear();
        l.answers.clear();
        let mut reply = HelloReply::ok(geometry());
        reply.credit = l.credit;
        let link = FakeLink {
            lender: Arc::clone(&lender),
            session: l.sessions,
            tx: VecDeque::new(),
            blocked: false,
        };
        Ok((Box::new(link), reply))
    }
}

/// A session to the fake lender.
pub(crate) struct FakeLink {
    lender: SharedLender,
    session: u32,
    /// Request headers handed to the link and not written yet.
    tx: VecDeque<[u8; REQUEST_HEADER_LEN]>,
    blocked: bool,
}

impl QueueLink for FakeLink {
    fn fd(&self) -> RawFd {
        -1
    }

    fn default_credit(&self) -> Credit {
        Credit::V1_DEFAULT
    }

    fn send(&mut self, table: &mut RequestTable, _: &mut Completer<'_>) -> Result<(), FabricFault> {
        while let Some((_, header, _)) = next_request(table, Instant::now()) {
            self.tx.push_back(header);
        }
        let mut l = lock(&self.lender);
        for _ in 0..l.per_send.unwrap_or(usize::MAX) {
            let Some(raw) = self.tx.pop_front() else {
                break;
            };
            let h = RequestHeader::decode(&raw).map_err(FabricFault::Wire)?;
            let r = Received {
                session: self.session,
                id: h.id,
                request: h.request,
            };
            l.received.push(r);
            l.unanswered.push(r);
            l.max_unanswered = l.max_unanswered.max(l.unanswered.len());
        }
        self.blocked = !self.tx.is_empty();
        Ok(())
    }

    fn unsent(&self) -> bool {
        !self.tx.is_empty()
    }

    fn wants_write(&self) -> bool {
        self.blocked
    }

    fn receive(
        &mut self,
        table: &mut RequestTable,
        done: &mut Completer<'_>,
    ) -> Result<(), FabricFault> {
        loop {
            let (r, status) = {
                let mut l = lock(&self.lender);
                if l.sessions != self.session || std::mem::take(&mut l.cut) {
                    return Err(FabricFault::Closed);
                }
                match l.answers.pop_front() {
                    Some(a) => a,
                    None => return Ok(()),
                }
            };
            // A read's data would land in its buffers here; its bytes do not matter.
            let len = match r.request {
                BlockRequest::Read { len, .. } if status == Status::Ok => len,
                _ => Bytes::ZERO,
            };
            let raw = ResponseHeader {
                status,
                len,
                id: r.id,
                throttled: false,
            }
            .encode();
            let resp = check_response(table, &raw)?;
            debug_assert!(r.request.op() != Op::Read || resp.data == len.0);
            done.complete(table, resp.head, resp.status)?;
        }
    }
}
