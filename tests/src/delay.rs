//! A delaying TCP relay, standing in for a long link (there is no netem on the test
//! kernel): every chunk read from one side is written to the other no earlier than its
//! arrival plus the delay of that moment.
//!
//! It must not cap throughput itself: each direction has a reader that reads as fast as
//! the socket gives (1 MiB reads, 8 MiB socket buffers asked for) into an unbounded
//! delay line (a channel; readers pause only past [`LINE_CAP`] bytes queued, far above
//! any bandwidth × delay of a test), and a writer that sleeps until each chunk is due.
//! Order is kept. An end of stream or an error on one side reaches the other side after
//! the delay (shutdown of the write side, or of both on an error).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;

/// Bytes a direction may hold in its delay line before its reader pauses.
pub const LINE_CAP: usize = 1 << 30;
const READ_CHUNK: usize = 1 << 20;
const SOCK_BUF: libc::c_int = 8 << 20;

/// A running relay from its listening address to `upstream`.
pub struct DelayRelay {
    /// `HOST:PORT` it listens on.
    pub addr: String,
    delay_us: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicU64>,
}

enum Item {
    Data(Instant, Vec<u8>),
    End(Instant),
    Abort(Instant),
}

fn big_buffers(s: &TcpStream) {
    let fd = s.as_raw_fd();
    for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: setsockopt on an open socket with a pointer to a live c_int and its
        // size.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&SOCK_BUF as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    let _ = s.set_nodelay(true);
}

impl DelayRelay {
    /// Listens on `listen` (`HOST:PORT`, port 0 for any) and relays each connection to
    /// `upstream` with `delay` each way.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(listen: &str, upstream: &str, delay: Duration) -> Result<DelayRelay> {
        let l = TcpListener::bind(listen)?;
        let addr = l.local_addr()?.to_string();
        let delay_us = Arc::new(AtomicU64::new(delay.as_micros() as u64));
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicU64::new(0));
        let (d, st, acc, up) = (
            delay_us.clone(),
            stop.clone(),
            accepted.clone(),
            upstream.to_owned(),
        );
        l.set_nonblocking(true)?;
        std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((down, _)) => {
                        acc.fetch_add(1, Ordering::Relaxed);
                        let _ = down.set_nonblocking(false);
                        let up = match TcpStream::connect_timeout(
                            &match up.parse() {
                                Ok(a) => a,
                                Err(_) => return,
                            },
                            Duration::from_secs(2),
                        ) {
                            Ok(u) => u,
                            Err(_) => {
                                // Upstream refuses: so does the link.
                                let _ = down.shutdown(Shutdown::Both);
                                continue;
                            }
                        };
                        big_buffers(&down);
                        big_buffers(&up);
                        let (Ok(down2), Ok(up2)) = (down.try_clone(), up.try_clone()) else {
                            continue;
                        };
                        direction(down, up2, d.clone());
                        direction(up, down2, d.clone());
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(DelayRelay {
            addr,
            delay_us,
            stop,
            accepted,
        })
    }

    /// Changes the one-way delay for chunks read from now on.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_us
            .store(delay.as_micros() as u64, Ordering::Relaxed);
    }
}

impl Drop for DelayRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Relays `from` to `to` through a delay line (two threads).
fn direction(mut from: TcpStream, to: TcpStream, delay_us: Arc<AtomicU64>) {
    let (tx, rx) = mpsc::channel::<Item>();
    let queued = Arc::new(AtomicUsize::new(0));
    let q = queued.clone();
    let src = from.try_clone().ok();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            while q.load(Ordering::Relaxed) > LINE_CAP {
                std::thread::sleep(Duration::from_millis(1));
            }
            let due = || Instant::now() + Duration::from_micros(delay_us.load(Ordering::Relaxed));
            match from.read(&mut buf) {
                Ok(0) => {
                    let _ = tx.send(Item::End(due()));
                    return;
                }
                Ok(n) => {
                    q.fetch_add(n, Ordering::Relaxed);
                    if tx.send(Item::Data(due(), buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    let _ = tx.send(Item::Abort(due()));
                    return;
                }
            }
        }
    });
    std::thread::spawn(move || {
        let mut to = to;
        let wait = |t: Instant| {
            let now = Instant::now();
            if t > now {
                std::thread::sleep(t - now);
            }
        };
        for item in rx {
            match item {
                Item::Data(t, d) => {
                    wait(t);
                    queued.fetch_sub(d.len(), Ordering::Relaxed);
                    if to.write_all(&d).is_err() {
                        let _ = to.shutdown(Shutdown::Both);
                        if let Some(s) = &src {
                            let _ = s.shutdown(Shutdown::Both);
                        }
                        return;
                    }
                }
                Item::End(t) => {
                    wait(t);
                    let _ = to.shutdown(Shutdown::Write);
                    return;
                }
                Item::Abort(t) => {
                    wait(t);
                    let _ = to.shutdown(Shutdown::Both);
                    return;
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_each_way_and_keeps_the_bytes() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let echo_addr = echo.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let (mut s, _) = echo.accept().unwrap();
            let mut b = vec![0u8; 65536];
            loop {
                match s.read(&mut b) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => s.write_all(&b[..n]).unwrap(),
                }
            }
        });
        let r = DelayRelay::start("127.0.0.1:0", &echo_addr, Duration::from_millis(30)).unwrap();
        let mut c = TcpStream::connect(&r.addr).unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7) as u8).collect();
        let t = Instant::now();
        let mut w = c.try_clone().unwrap();
        let d2 = data.clone();
        let writer = std::thread::spawn(move || w.write_all(&d2).unwrap());
        let mut got = vec![0u8; data.len()];
        c.read_exact(&mut got).unwrap();
        writer.join().unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(60),
            "{:?}",
            t.elapsed()
        );
        assert!(got == data);
    }
}
