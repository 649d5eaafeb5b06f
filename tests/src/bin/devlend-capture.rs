//! A recorder and a replayer of devlend handshakes, for the test that a captured
//! session opens nothing over RDMA either (`tests/tests/guest_rdma.rs`). It is a test
//! tool, not part of devlend.
//!
//! - `devlend-capture relay LISTEN TARGET OUT`: relays TCP connections from `LISTEN`
//!   to `TARGET` and writes what each connection's client sent to `OUT.N` (N from 0,
//!   in order of accept), until killed.
//! - `devlend-capture replay-rdma LENDER FILE`: reads the hello and, when the hello
//!   proves possession, the possession message at the start of `FILE` (as `relay`
//!   wrote them), sends them as they were over a new RDMA connection to `LENDER`, and
//!   prints `DEVLEND-RESULT replay_status=S` with the last status the lender answered
//!   (`Ok`, `Denied`, ...; `none` when it answered nothing).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use devlend_fabric::holder_proof::Possession;
use devlend_fabric::{Hello, HelloReply, HelloStatus};

fn relay(listen: &str, target: &str, out: &str) -> Result<(), String> {
    let l = TcpListener::bind(listen).map_err(|e| e.to_string())?;
    for (n, client) in l.incoming().flatten().enumerate() {
        let Ok(server) = TcpStream::connect(target) else {
            continue;
        };
        let file = Arc::new(Mutex::new(
            std::fs::File::create(format!("{out}.{n}")).map_err(|e| e.to_string())?,
        ));
        let (mut c_in, mut s_out) = (
            client.try_clone().map_err(|e| e.to_string())?,
            server.try_clone().map_err(|e| e.to_string())?,
        );
        std::thread::spawn(move || {
            let mut b = [0u8; 65536];
            while let Ok(k) = c_in.read(&mut b) {
                if k == 0 || s_out.write_all(&b[..k]).is_err() {
                    break;
                }
                if let Ok(mut f) = file.lock() {
                    let _ = f.write_all(&b[..k]);
                }
            }
            let _ = s_out.shutdown(std::net::Shutdown::Write);
        });
        let (mut s_in, mut c_out) = (server, client);
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut s_in, &mut c_out);
            let _ = c_out.shutdown(std::net::Shutdown::Write);
        });
    }
    Ok(())
}

fn replay_rdma(lender: &str, file: &str) -> Result<String, String> {
    let bytes = std::fs::read(file).map_err(|e| e.to_string())?;
    let mut rest = bytes.as_slice();
    let hello = Hello::read_from(&mut rest).map_err(|e| format!("the captured hello: {e}"))?;
    let hello_bytes = &bytes[..bytes.len() - rest.len()];
    let possession = if hello.proves_possession() {
        let before = rest;
        Possession::read_from(&mut rest).map_err(|e| format!("the captured possession: {e}"))?;
        Some(&before[..before.len() - rest.len()])
    } else {
        None
    };
    let mut c = devlend_fabric::rdma::verbs::open_connection(
        None,
        lender,
        devlend_fabric::rdma::verbs::BORROWER,
        Duration::from_secs(5),
    )
    .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(10);
    c.send_msg(0, hello_bytes, 0).map_err(|e| e.to_string())?;
    let mut last = "none".to_owned();
    let mut sent_possession = false;
    while let Ok((i, n)) = c.wait_recv(deadline, "a reply") {
        let reply = HelloReply::read_from(&mut c.recv_msg(i, n)).map_err(|e| e.to_string())?;
        let _ = c.post_recv(i);
        last = format!("{:?}", reply.status);
        match (reply.status, possession) {
            (HelloStatus::Prove, Some(p)) if !sent_possession => {
                sent_possession = true;
                c.send_msg(0, p, 0).map_err(|e| e.to_string())?;
            }
            _ => break,
        }
    }
    Ok(last)
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let r = match a.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["relay", listen, target, out] => relay(listen, target, out).map(|()| String::new()),
        ["replay-rdma", lender, file] => replay_rdma(lender, file),
        _ => Err("usage: devlend-capture relay LISTEN TARGET OUT | replay-rdma LENDER FILE".into()),
    };
    match r {
        Ok(status) => println!("DEVLEND-RESULT replay_status={status}"),
        Err(e) => {
            eprintln!("devlend-capture: {e}");
            println!("DEVLEND-RESULT replay_status=error");
            std::process::exit(1);
        }
    }
}
