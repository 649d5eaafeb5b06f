//! A virtqueue the guest never enables must cost nothing when its fabric session is
//! lost. Found in a trial: a guest with one vCPU uses one queue of a two-queue disk
//! (Linux sets up a queue per CPU at most); when the lender went away, the unused
//! queue's closed socket stayed readable in its worker's epoll set, the worker returned
//! at once because the queue was not ready, and it woke again: a core at 100 % with no
//! log line, for as long as the guest ran.
//!
//! The rig: a real in-process lender, a real `BlkBackend` of two queues served by the
//! vendored `vhost-user-backend` daemon on a socket pair, a frontend that negotiates and
//! sets up nothing (no queue is ever ready). The lender shuts down (every session
//! closed); the process's CPU time over the next second must stay small.

use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use devlend_backend::blk::backend::BlkBackend;
use devlend_backend::blk::engine::QueueStats;
use devlend_backend::blk::DeviceLimits;
use devlend_backend::lender::LenderTarget;
use devlend_fabric::BlockGeometry;
use vhost::vhost_user::Frontend;
use vhost::VhostBackend;
use vhost_user_backend::VhostUserDaemon;

/// CPU time (user + system) this process has used.
fn cpu_time() -> Duration {
    // SAFETY: rusage is plain old data; all-zero is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a live, writable rusage for the call.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) }, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[test]
fn a_queue_the_guest_never_enabled_does_not_spin_when_its_session_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let lender = devlend_device_agent::Lender::bind(
        "127.0.0.1:0",
        vec![devlend_device_agent::DeviceSpec::new(
            "disk",
            devlend_device_agent::BlockSpec::new(img),
        )],
    )
    .unwrap()
    .spawn();
    let target = LenderTarget::direct(lender.local_addr().to_string(), "disk", [3; 16]);
    let geometry = BlockGeometry {
        capacity_sectors: 2048,
        block_size: 512,
        max_transfer: 1 << 20,
        ..BlockGeometry::default()
    };
    // Both queues open their sessions now (not a migration's destination).
    let backend = Arc::new(BlkBackend::new(
        "idle-queue".into(),
        Arc::new(DeviceLimits::from_device_info(&geometry)),
        2,
        &target,
        Arc::new(QueueStats::new(2)),
        Duration::from_secs(1),
    ));
    let (ours, theirs) = UnixStream::pair().unwrap();
    let mut daemon =
        VhostUserDaemon::new("idle-queue".into(), backend.clone(), backend.memory()).unwrap();
    backend.attach_handlers(&daemon.get_epoll_handlers());
    daemon.start_stream(theirs).unwrap();
    let fe = Frontend::from_stream(ours, 2);
    fe.set_owner().unwrap();

    // Settled: nothing to do, nothing spent.
    std::thread::sleep(Duration::from_millis(300));
    let before = cpu_time();
    std::thread::sleep(Duration::from_millis(500));
    let idle = cpu_time() - before;
    assert!(idle < Duration::from_millis(150), "idle already: {idle:?}");

    // The lender goes: both sessions see their peer close.
    lender.shutdown();
    std::thread::sleep(Duration::from_millis(200));
    let before = cpu_time();
    std::thread::sleep(Duration::from_secs(1));
    let spent = cpu_time() - before;
    assert!(
        spent < Duration::from_millis(200),
        "{spent:?} of CPU in one second with no queue enabled and the lender gone"
    );
    drop(fe);
}
