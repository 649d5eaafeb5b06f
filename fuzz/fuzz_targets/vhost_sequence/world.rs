//! The process-wide world: the lender, the vhost-user listening socket, the guest RAM
//! and the temporary folder they live in.

use super::*;

pub(crate) struct World {
    pub(crate) _lender: LenderHandle,
    pub(crate) _dir: PathBuf,
    pub(crate) sock: PathBuf,
    pub(crate) listener: RefCell<Listener>,
    pub(crate) limits: Arc<DeviceLimits>,
    pub(crate) target: LenderTarget,
    pub(crate) stats: Arc<QueueStats>,
    pub(crate) ram: GuestRam,
    pub(crate) ram2: GuestRam,
    /// An eventfd and a pipe's read end: fds of the wrong kind for a memory table.
    pub(crate) junk_event: OwnedFd,
    pub(crate) junk_pipe: OwnedFd,
    /// Per queue: kick, call, err eventfds.
    pub(crate) events: Vec<[OwnedFd; 3]>,
    /// Fds and threads of the process between iterations, once settled.
    pub(crate) baseline: Option<(usize, usize)>,
    pub(crate) baseline_lists: (Vec<String>, Vec<String>),
    /// What /proc/self/fd shows for `junk_pipe`.
    pub(crate) junk_pipe_name: String,
}

pub(crate) fn eventfd() -> OwnedFd {
    // SAFETY: eventfd with valid flags; the fd is new and owned here.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: as above.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

impl World {
    pub(crate) fn new() -> World {
        // The compute agent runs with SIGPIPE ignored (Rust's runtime does it); libFuzzer's
        // main does not, and a write to a closed socket would kill the process.
        // SAFETY: setting a signal disposition to SIG_IGN.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let _ = tracing::subscriber::set_global_default(CountingSubscriber);
        let _ = log::set_logger(&LOGGER);
        log::set_max_level(log::LevelFilter::Info);
        start_watchdog();

        let dir = std::env::temp_dir().join(format!("devlend-fuzz-vhost-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        // libFuzzer ends the process with exit(): remove the disk image and socket then.
        let _ = TEMP_DIR.set(dir.clone());
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(remove_temp_dir) };
        let disk = dir.join("disk.img");
        std::fs::File::create(&disk)
            .and_then(|f| f.set_len(1 << 20))
            .expect("disk image");
        let mut block = BlockSpec::new(disk);
        block.serial = Some("FUZZ-VHOST-SEQUENCE".into());
        let spec = DeviceSpec::new("disk", block);
        let lender = Lender::bind("127.0.0.1:0", vec![spec])
            .expect("lender")
            .spawn();
        let addr = lender.local_addr().to_string();
        let (_s, reply) =
            devlend_fabric::tcp::connect(&addr, "disk", 0, Duration::from_secs(5)).expect("hello");
        let geometry = reply.block().expect("the lender describes a block device");
        let limits = Arc::new(DeviceLimits::from_device_info(geometry));
        let sock = dir.join("vhost.sock");
        let listener = Listener::new(&sock, true).expect("vhost-user listener");
        let mut pipe = [0; 2];
        // SAFETY: pipe2 fills the two-element array.
        assert_eq!(
            unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) },
            0
        );
        // SAFETY: both ends are new fds owned here; the write end is closed at once.
        let (junk_pipe, _w) =
            unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
        let junk_pipe_name = std::fs::read_link(format!("/proc/self/fd/{}", junk_pipe.as_raw_fd()))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        World {
            junk_pipe_name,
            _lender: lender,
            _dir: dir,
            sock,
            listener: RefCell::new(listener),
            limits,
            target: LenderTarget::direct(addr, "disk", [7; 16]),
            stats: Arc::new(QueueStats::new(NQ)),
            ram: GuestRam::new(0, RAM_LEN).expect("guest RAM"),
            ram2: GuestRam::new(RAM2_GPA, RAM2_LEN).expect("guest RAM2"),
            junk_event: eventfd(),
            junk_pipe,
            events: (0..NQ).map(|_| [eventfd(), eventfd(), eventfd()]).collect(),
            baseline: None,
            baseline_lists: (Vec::new(), Vec::new()),
        }
    }
}

pub(crate) static TEMP_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

extern "C" fn remove_temp_dir() {
    if let Some(d) = TEMP_DIR.get() {
        let _ = std::fs::remove_dir_all(d);
    }
}
