//! Verified I/O without a pause: the libblkio frontend on a thread, writing and
//! reading back on the leased disk through every outage.

use super::*;

/// Connects the libblkio frontend to `sock`, retrying for up to 30 s: a restarted
/// agent listens once it has set its attachment up again (its old socket file may be
/// there before).
pub(crate) fn connect_retry(sock: &Path) -> Result<BlkClient, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match BlkClient::connect(sock, 1, MIB as usize) {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => return Err(format!("{e:#}")),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// What a load saw when it stopped.
#[derive(Debug)]
pub(crate) struct LoadEnd {
    pub(crate) ops: u64,
    pub(crate) errors: Vec<String>,
    pub(crate) longest: Duration,
}

/// A thread doing verified I/O on a vhost-user-blk socket until told to stop: rounds of
/// four 16 KiB writes at QD4 to slots of its region, then the four read back at QD4 and
/// compared with what was written.
pub(crate) struct Load {
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) ops: Arc<AtomicU64>,
    pub(crate) failed: Arc<AtomicU64>,
    /// The first failures, as they happen.
    pub(crate) seen: Arc<std::sync::Mutex<Vec<String>>>,
    pub(crate) handle: Option<JoinHandle<LoadEnd>>,
}

impl Load {
    pub(crate) fn start(sock: &Path, region: u64, seed: u8) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (s, o, f, seen2) = (stop.clone(), ops.clone(), failed.clone(), seen.clone());
        let sock = sock.to_path_buf();
        let handle = std::thread::spawn(move || {
            let mut end = LoadEnd {
                ops: 0,
                errors: Vec::new(),
                longest: Duration::ZERO,
            };
            let mut c = match connect_retry(&sock) {
                Ok(c) => c,
                Err(e) => {
                    end.errors.push(format!("connect: {e}"));
                    f.fetch_add(1, Ordering::Relaxed);
                    return end;
                }
            };
            const LEN: usize = 16 << 10;
            let mut round = 0u64;
            while !s.load(Ordering::Relaxed) {
                let t = Instant::now();
                let slot = round % 64;
                let pattern = seed.wrapping_add(round as u8);
                for (i, b) in c.buffer()[..4 * LEN].iter_mut().enumerate() {
                    *b = pattern.wrapping_add((i % 253) as u8);
                }
                let at = |i: usize| region + (slot * 4 + i as u64) * LEN as u64;
                let writes: Vec<BlkOp> = (0..4)
                    .map(|i| BlkOp::Write {
                        offset: at(i),
                        buf: i * LEN,
                        len: LEN,
                    })
                    .collect();
                let reads: Vec<BlkOp> = (0..4)
                    .map(|i| BlkOp::Read {
                        offset: at(i),
                        buf: 4 * LEN + i * LEN,
                        len: LEN,
                    })
                    .collect();
                let mut bad = Vec::new();
                for (what, batch) in [("write", &writes), ("read", &reads)] {
                    match c.run(0, batch) {
                        Ok(r) if r.iter().all(|&x| x == 0) => {}
                        Ok(r) => bad.push(format!("round {round}: {what} statuses {r:?}")),
                        Err(e) => bad.push(format!("round {round}: {what}: {e:#}")),
                    }
                }
                if bad.is_empty() {
                    let b = c.buffer();
                    if b[..4 * LEN] != b[4 * LEN..8 * LEN] {
                        bad.push(format!("round {round}: read back differs"));
                    }
                }
                end.longest = end.longest.max(t.elapsed());
                if !bad.is_empty() {
                    if let Ok(mut v) = seen2.lock() {
                        v.extend(bad.iter().cloned());
                    }
                    f.fetch_add(bad.len() as u64, Ordering::Relaxed);
                    end.errors.extend(bad);
                    if end.errors.len() > 20 {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                } else {
                    end.ops += 8;
                    o.fetch_add(8, Ordering::Relaxed);
                }
                round += 1;
            }
            end
        });
        Load {
            stop,
            ops,
            failed,
            seen,
            handle: Some(handle),
        }
    }

    /// Waits `d`; the I/Os completed meanwhile. Panics on a failed I/O.
    pub(crate) fn run_for(&self, d: Duration, what: &str) -> u64 {
        let before = self.ops.load(Ordering::Relaxed);
        let end = Instant::now() + d;
        while Instant::now() < end {
            if self.failed.load(Ordering::Relaxed) != 0 {
                std::thread::sleep(Duration::from_millis(300));
                panic!(
                    "{what}: a leased I/O failed: {:?}",
                    self.seen.lock().map(|v| v.clone()).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.ops.load(Ordering::Relaxed) - before
    }

    /// Stops the load (waiting up to 40 s for its last round) and what it saw.
    pub(crate) fn finish(mut self) -> LoadEnd {
        self.stop.store(true, Ordering::Relaxed);
        let h = self.handle.take().expect("finished once");
        let deadline = Instant::now() + Duration::from_secs(40);
        while !h.is_finished() {
            assert!(
                Instant::now() < deadline,
                "the I/O stalled: a request is pending for over 40 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        h.join().expect("the load thread")
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
