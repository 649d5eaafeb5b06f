//! The pump: one thread per TLS connection that moves bytes between the engine's
//! plaintext end of a socket pair and the rustls session on the TCP socket (the shape
//! and the ends are in [`super`]'s documentation).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Size of each of the pump's two buffers (bytes).
const PUMP_BUF: usize = 64 << 10;

/// How long the pump keeps trying to send what it holds to the peer once the engine has
/// closed its end (a peer that does not read must not keep the thread forever).
const LINGER: Duration = Duration::from_secs(30);

/// Starts the pump for an established TLS session on `tcp` and returns the plaintext
/// end for the engine. `label` names the connection in the pump's logs (e.g. the peer
/// address). The pump thread ends when both directions have ended, when the engine has
/// closed its end and everything is sent (or `LINGER` has passed), or on the first
/// TLS or socket error; then it closes the TCP socket and its end of the pair.
///
/// Data the handshake already received (e.g. requests right behind the hello) stays in
/// `conn` and is delivered first.
///
/// # Errors
/// The socket pair or the thread could not be created, or a socket refused
/// `O_NONBLOCK`.
pub fn spawn_pump(
    conn: impl Into<rustls::Connection>,
    tcp: TcpStream,
    label: &str,
) -> io::Result<UnixStream> {
    let (outer, inner) = UnixStream::pair()?;
    tcp.set_read_timeout(None)?;
    tcp.set_write_timeout(None)?;
    tcp.set_nonblocking(true)?;
    inner.set_nonblocking(true)?;
    let mut pump = Pump {
        conn: conn.into(),
        tcp,
        unix: inner,
        label: label.to_owned(),
        up: Buf::new(),
        down: Buf::new(),
        tcp_in: Buf::new(),
        tcp_eof: false,
        tls_eof: false,
        down_done: false,
        up_done: false,
        tcp_write_shut: false,
        tcp_hup: false,
        local_hup: false,
        linger_until: None,
    };
    std::thread::Builder::new()
        .name("dl-tls-pump".into())
        .spawn(move || pump.run())?;
    Ok(outer)
}

/// A byte buffer being drained: `data[off..len]` is pending.
struct Buf {
    data: Box<[u8]>,
    off: usize,
    len: usize,
}

impl Buf {
    fn new() -> Buf {
        Buf {
            data: vec![0u8; PUMP_BUF].into_boxed_slice(),
            off: 0,
            len: 0,
        }
    }

    fn pending(&self) -> &[u8] {
        &self.data[self.off..self.len]
    }

    fn is_empty(&self) -> bool {
        self.off == self.len
    }

    fn consume(&mut self, n: usize) {
        self.off = (self.off + n).min(self.len);
        if self.off == self.len {
            self.off = 0;
            self.len = 0;
        }
    }
}

/// Why the pump stopped early.
enum Fatal {
    /// TLS failed mid-session (bad record, protocol violation, alert).
    Tls(rustls::Error),
    /// The TCP connection failed (reset, timed out).
    Socket(io::Error),
}

struct Pump {
    conn: rustls::Connection,
    tcp: TcpStream,
    unix: UnixStream,
    label: String,
    /// Plaintext from the engine, on its way into rustls.
    up: Buf,
    /// Plaintext from rustls, on its way to the engine.
    down: Buf,
    /// TLS records received from the TCP socket, on their way into rustls.
    tcp_in: Buf,
    /// The TCP socket's receive side ended.
    tcp_eof: bool,
    /// The peer's stream ended (close_notify, or TCP end).
    tls_eof: bool,
    /// Nothing more goes to the engine (its write side of the pair is shut).
    down_done: bool,
    /// The engine's stream ended; close_notify is queued.
    up_done: bool,
    tcp_write_shut: bool,
    /// The TCP socket reported hang-up or an error: no more polling it.
    tcp_hup: bool,
    /// The engine's end of the pair is closed in both directions.
    local_hup: bool,
    linger_until: Option<Instant>,
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl Pump {
    fn run(&mut self) {
        match self.pump() {
            Ok(()) => tracing::debug!(connection = %self.label, "TLS session ended"),
            Err(Fatal::Tls(e)) => {
                // Send the alert rustls queued, if the socket takes it.
                let _ = self.conn.write_tls(&mut self.tcp);
                tracing::warn!(connection = %self.label, error = %e, "TLS session failed; connection closed");
            }
            Err(Fatal::Socket(e)) => {
                tracing::debug!(connection = %self.label, error = %e, "TLS connection lost");
            }
        }
        let _ = self.tcp.shutdown(Shutdown::Both);
        let _ = self.unix.shutdown(Shutdown::Both);
    }

    fn pump(&mut self) -> Result<(), Fatal> {
        loop {
            let mut progress = self.down()?;
            progress |= self.up()?;
            progress |= self.flush()?;
            let flushed = !self.conn.wants_write();
            if self.up_done && flushed && !self.tcp_write_shut {
                let _ = self.tcp.shutdown(Shutdown::Write);
                self.tcp_write_shut = true;
            }
            if self.up_done && flushed && (self.down_done || self.local_hup) {
                return Ok(());
            }
            if progress {
                continue;
            }
            if self.up_done && self.local_hup {
                let until = *self
                    .linger_until
                    .get_or_insert_with(|| Instant::now() + LINGER);
                if Instant::now() >= until {
                    return Ok(());
                }
            }
            if !self.wait() {
                return Ok(());
            }
        }
    }

    /// TLS → engine. Returns whether anything moved.
    fn down(&mut self) -> Result<bool, Fatal> {
        let mut progress = false;
        while !self.down_done {
            while !self.down.is_empty() {
                match (&self.unix).write(self.down.pending()) {
                    Ok(n) => {
                        self.down.consume(n);
                        progress = true;
                    }
                    Err(e) if would_block(&e) => return Ok(progress),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        // The engine closed its end: nobody reads any more.
                        self.down = Buf::new();
                        self.down_done = true;
                        return Ok(true);
                    }
                }
            }
            if self.tls_eof {
                let _ = self.unix.shutdown(Shutdown::Write);
                self.down_done = true;
                return Ok(true);
            }
            match self.conn.reader().read(&mut self.down.data) {
                Ok(0) => {
                    self.tls_eof = true;
                    continue;
                }
                Ok(n) => {
                    self.down.off = 0;
                    self.down.len = n;
                    progress = true;
                    continue;
                }
                Err(e) if would_block(&e) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    // TCP ended without close_notify: a lost connection (a lender
                    // killed, a borrower gone), passed on as end of stream.
                    self.tls_eof = true;
                    continue;
                }
                Err(e) => return Err(Fatal::Socket(e)),
            }
            // rustls reads at most 4 KiB per `read_tls`: receive in large chunks here
            // and feed it from memory (one system call for many records).
            if self.tcp_in.is_empty() && !self.tcp_eof {
                match (&self.tcp).read(&mut self.tcp_in.data) {
                    Ok(0) => self.tcp_eof = true,
                    Ok(n) => {
                        self.tcp_in.off = 0;
                        self.tcp_in.len = n;
                    }
                    Err(e) if would_block(&e) => return Ok(progress),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(Fatal::Socket(e)),
                }
            }
            let mut chunk = self.tcp_in.pending();
            let fed = match self.conn.read_tls(&mut chunk) {
                Ok(n) => n,
                Err(e) => return Err(Fatal::Socket(e)),
            };
            self.tcp_in.consume(fed);
            if let Err(e) = self.conn.process_new_packets() {
                return Err(Fatal::Tls(e));
            }
            if fed == 0 {
                // The end of the TCP stream, now known to rustls: its reader reports
                // a clean end (after close_notify) or an unexpected one, both above.
                self.tcp_hup = true;
            }
            progress = true;
        }
        Ok(progress)
    }

    /// Engine → TLS. Returns whether anything moved.
    fn up(&mut self) -> Result<bool, Fatal> {
        let mut progress = false;
        loop {
            if !self.up.is_empty() {
                match self.conn.writer().write(self.up.pending()) {
                    Ok(0) => return Ok(progress), // rustls's buffer is full: flush first
                    Ok(n) => {
                        self.up.consume(n);
                        progress = true;
                        continue;
                    }
                    Err(e) => return Err(Fatal::Socket(e)),
                }
            }
            if self.up_done || self.conn.wants_write() {
                // Records wait for the TCP socket: read no more from the engine
                // (backpressure) until `flush` sent them.
                return Ok(progress);
            }
            match (&self.unix).read(&mut self.up.data) {
                Ok(0) => {
                    self.up_done = true;
                    self.conn.send_close_notify();
                    return Ok(true);
                }
                Ok(n) => {
                    self.up.off = 0;
                    self.up.len = n;
                    progress = true;
                }
                Err(e) if would_block(&e) => return Ok(progress),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.up_done = true;
                    self.local_hup = true;
                    self.conn.send_close_notify();
                    return Ok(true);
                }
            }
        }
    }

    /// Sends queued TLS records to the TCP socket. Returns whether anything moved.
    fn flush(&mut self) -> Result<bool, Fatal> {
        let mut progress = false;
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut self.tcp) {
                Ok(_) => progress = true,
                Err(e) if would_block(&e) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Fatal::Socket(e)),
            }
        }
        Ok(progress)
    }

    /// Sleeps until a socket can move what is waiting. Returns false when nothing can
    /// ever move again.
    fn wait(&mut self) -> bool {
        let mut tcp_events = 0;
        if !self.down_done
            && self.down.is_empty()
            && self.tcp_in.is_empty()
            && !self.tls_eof
            && !self.tcp_eof
        {
            tcp_events |= libc::POLLIN;
        }
        if self.conn.wants_write() {
            tcp_events |= libc::POLLOUT;
        }
        let mut unix_events = 0;
        if !self.up_done && self.up.is_empty() && !self.conn.wants_write() {
            unix_events |= libc::POLLIN;
        }
        if !self.down_done && !self.down.is_empty() {
            unix_events |= libc::POLLOUT;
        }
        let mut fds = [
            libc::pollfd {
                fd: if self.tcp_hup && tcp_events & libc::POLLOUT == 0 {
                    -1
                } else {
                    self.tcp.as_raw_fd()
                },
                events: tcp_events,
                revents: 0,
            },
            libc::pollfd {
                fd: if self.local_hup {
                    -1
                } else {
                    self.unix.as_raw_fd()
                },
                events: unix_events,
                revents: 0,
            },
        ];
        if fds[0].fd < 0 && fds[1].fd < 0 {
            return false;
        }
        let timeout = match self.linger_until {
            Some(t) => t
                .saturating_duration_since(Instant::now())
                .as_millis()
                .clamp(1, i32::MAX as u128) as libc::c_int,
            None => -1,
        };
        // SAFETY: `fds` is a live array of two pollfd for the duration of the call; the
        // kernel writes only their `revents`.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return e.kind() == io::ErrorKind::Interrupted;
        }
        if fds[0].revents & (libc::POLLHUP | libc::POLLERR) != 0 {
            self.tcp_hup = true;
        }
        if fds[1].revents & libc::POLLHUP != 0 {
            self.local_hup = true;
        }
        true
    }
}
