//! The shared glue without a VMM: the protocol features each device offers, the queue
//! layout over workers and the epoll ids above it, the fabric socket's registration
//! in a worker's epoll set, and the exit eventfds.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use vhost::vhost_user::message::VhostUserProtocolFeatures as P;
use vhost_user_backend::VhostUserBackend;

use super::*;
use crate::blk::backend::BlkBackend;
use crate::blk::engine::QueueStats;
use crate::blk::request::DeviceLimits;
use crate::lender::LenderTarget;
use crate::net::backend::NetBackend;
use crate::net::stats::NetStats;

/// A lender address that refuses at once: the disk's sessions fail to open (and are
/// retried at the first request), which these tests never make.
fn nowhere() -> LenderTarget {
    LenderTarget::direct("127.0.0.1:1", "dev", [1; 16])
}

fn disk(queues: u16) -> BlkBackend {
    let geometry = devlend_fabric::BlockGeometry {
        capacity_sectors: 1 << 21,
        block_size: 512,
        max_transfer: 1 << 20,
        ..devlend_fabric::BlockGeometry::default()
    };
    BlkBackend::new(
        Arc::from("t"),
        Arc::new(DeviceLimits::from_device_info(&geometry)),
        queues,
        &nowhere(),
        Arc::new(QueueStats::new(queues)),
        Duration::from_secs(1),
    )
}

fn nic(pairs: u16) -> NetBackend {
    let link = devlend_fabric::net::LinkState {
        up: true,
        mtu: 1500,
        mac: [2, 0, 0, 0, 0, 1],
    };
    NetBackend::new(
        Arc::from("t"),
        &nowhere(),
        pairs,
        &link,
        false,
        Arc::new(NetStats::new(pairs, true, 1500)),
    )
    .expect("timerfds")
}

#[test]
fn every_device_offers_the_same_protocol_features_and_the_disk_tracks_inflight_too() {
    let common = P::CONFIG | P::MQ | P::REPLY_ACK | P::CONFIGURE_MEM_SLOTS | P::LOG_SHMFD;
    assert_eq!(protocol_features(), common);
    // Only the disk resubmits what a restarted backend left in flight.
    assert_eq!(disk(2).protocol_features(), common | P::INFLIGHT_SHMFD);
    assert_eq!(nic(2).protocol_features(), common);
    // Nothing that would let the frontend expect messages devlend does not serve.
    for p in [
        P::BACKEND_REQ,
        P::HOST_NOTIFIER,
        P::PAGEFAULT,
        P::DEVICE_STATE,
    ] {
        assert!(!disk(1).protocol_features().contains(p), "{p:?}");
        assert!(!nic(1).protocol_features().contains(p), "{p:?}");
    }
}

#[test]
fn a_disk_has_one_queue_per_worker_and_a_nic_one_pair() {
    let d = disk(4);
    assert_eq!(d.num_queues(), 4);
    assert_eq!(d.queues_per_thread(), vec![0b1, 0b10, 0b100, 0b1000]);
    let n = nic(3);
    assert_eq!(n.num_queues(), 6);
    assert_eq!(n.queues_per_thread(), vec![0b11, 0b1100, 0b11_0000]);
}

#[test]
fn each_queue_is_served_by_exactly_one_worker() {
    for (count, per) in [(1, 1), (16, 1), (1, 2), (8, 2)] {
        let w = Workers::new(count, per);
        let masks = w.queues_per_thread();
        assert_eq!(masks.len(), count);
        let all = masks.iter().fold(0u64, |acc, m| {
            assert_eq!(acc & m, 0, "two workers share a queue: {masks:?}");
            acc | m
        });
        assert_eq!(all, (1u64 << w.num_queues()) - 1, "a queue has no worker");
        for q in 0..w.num_queues() as u32 {
            let (worker, place) = w.worker_of(q).expect("a queue of the device");
            assert_ne!(
                masks[worker] & (1 << q),
                0,
                "queue {q} is not worker {worker}'s"
            );
            assert_eq!(worker * per + place, q as usize);
        }
    }
}

#[test]
fn a_queue_index_past_the_device_has_no_worker() {
    let pairs = Workers::new(2, 2);
    assert_eq!(pairs.worker_of(2), Some((1, 0)), "pair 1's receiveq");
    assert_eq!(pairs.worker_of(3), Some((1, 1)), "pair 1's transmitq");
    assert_eq!(pairs.worker_of(4), None);
    assert_eq!(pairs.worker_of(u32::MAX), None);
    assert_eq!(Workers::new(3, 1).worker_of(3), None);
    // Unknown indexes are ignored, not an error that would end the connection.
    assert!(disk(2).stop_vring(2).is_ok());
    assert!(nic(1).stop_vring(7).is_ok());
}

#[test]
fn the_fabric_and_timer_ids_are_above_what_the_library_reserves() {
    // The library refuses a listener whose id is a queue index or the exit event's
    // (`num_queues`).
    for w in [Workers::new(1, 1), Workers::new(16, 1), Workers::new(8, 2)] {
        let reserved = w.num_queues() as u64;
        assert!(w.fabric_event() > reserved);
        assert!(w.timer_event() > reserved);
        assert_ne!(w.fabric_event(), w.timer_event());
    }
    let d = disk(3);
    assert_eq!((d.fabric_event(), d.timer_event()), (4, 5));
}

/// An epoll set that records what is asked of it, refusing fds in `refuse`.
#[derive(Default)]
struct Recorder {
    calls: RefCell<Vec<(&'static str, RawFd, EventSet)>>,
    refuse: Vec<RawFd>,
}

impl Recorder {
    fn take(&self) -> Vec<(&'static str, RawFd, EventSet)> {
        self.calls.take()
    }
}

const ID: u64 = 9;

impl Listeners for Recorder {
    fn register(&self, fd: RawFd, events: EventSet, id: u64) -> io::Result<()> {
        assert_eq!(id, ID);
        self.calls.borrow_mut().push(("add", fd, events));
        if self.refuse.contains(&fd) {
            return Err(io::Error::from_raw_os_error(libc::EBADF));
        }
        Ok(())
    }

    fn unregister(&self, fd: RawFd, events: EventSet, id: u64) -> io::Result<()> {
        assert_eq!(id, ID);
        self.calls.borrow_mut().push(("del", fd, events));
        Ok(())
    }
}

#[test]
fn the_fabric_socket_is_registered_once_and_for_writability_only_while_asked() {
    let epoll = Recorder::default();
    let mut w = FabricWatch::default();
    w.update(&epoll, (Some(7), 1, false), ID).unwrap();
    assert_eq!(epoll.take(), vec![("add", 7, EventSet::IN)]);
    // Unchanged: the epoll set is left alone (this runs after every event).
    w.update(&epoll, (Some(7), 1, false), ID).unwrap();
    assert!(epoll.take().is_empty());
    // Requests wait for room in the socket: watched for writability too, then not.
    w.update(&epoll, (Some(7), 1, true), ID).unwrap();
    assert_eq!(
        epoll.take(),
        vec![
            ("del", 7, EventSet::IN),
            ("add", 7, EventSet::IN | EventSet::OUT)
        ]
    );
    w.update(&epoll, (Some(7), 1, false), ID).unwrap();
    assert_eq!(
        epoll.take(),
        vec![
            ("del", 7, EventSet::IN | EventSet::OUT),
            ("add", 7, EventSet::IN)
        ]
    );
}

#[test]
fn a_new_session_on_the_old_fd_number_is_registered_again() {
    let epoll = Recorder::default();
    let mut w = FabricWatch::default();
    w.update(&epoll, (Some(7), 1, false), ID).unwrap();
    epoll.take();
    // The lost session's socket was closed (epoll dropped it) and the new one got its
    // number: only the generation tells, and without a new registration the worker
    // would never hear of the new session.
    w.update(&epoll, (Some(7), 2, false), ID).unwrap();
    assert_eq!(
        epoll.take(),
        vec![("del", 7, EventSet::IN), ("add", 7, EventSet::IN)]
    );
    // A stopped queue's socket is not watched at all.
    w.update(&epoll, (None, 2, false), ID).unwrap();
    assert_eq!(epoll.take(), vec![("del", 7, EventSet::IN)]);
    assert!(w.is((None, 2, false)));
}

#[test]
fn a_refused_registration_is_reported_once_not_retried_at_every_event() {
    let epoll = Recorder {
        refuse: vec![8],
        ..Recorder::default()
    };
    let mut w = FabricWatch::default();
    assert!(w.update(&epoll, (Some(8), 1, false), ID).is_err());
    assert!(w.update(&epoll, (Some(8), 1, false), ID).is_ok());
    assert_eq!(epoll.take(), vec![("add", 8, EventSet::IN)]);
}

#[test]
fn the_exit_event_wakes_its_worker_and_its_fd_is_closed_by_the_backend() {
    use std::os::fd::IntoRawFd;
    let glue = Glue::<NetBackend>::new(Workers::new(1, 2));
    let (consumer, notifier) = glue.exit_event().expect("an eventfd");
    notifier.notify().unwrap();
    consumer.consume().expect("the worker's exit is heard");
    // The library takes the consumer's fd into its epoll set and never closes it.
    let fd = consumer.into_raw_fd();
    assert_eq!(lock(&glue.exit_fds).as_slice()[0].1, fd);
    glue.close_exit_fds();
    assert!(lock(&glue.exit_fds).is_empty(), "closed once, not again");
}
