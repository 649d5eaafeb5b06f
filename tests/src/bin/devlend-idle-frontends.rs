//! `devlend-idle-frontends QUEUES SOCKET...`: connects a vhost-user frontend to every
//! SOCKET (a vhost-user-blk attachment), as a VMM does when its guest boots: features
//! negotiated, a 1 MiB memory table, QUEUES virtqueues started (NUM, BASE, ADDR, CALL,
//! ERR, KICK, ENABLE), then kicks each queue once so that its worker opens its fabric
//! session. Then it submits nothing and holds every connection open until its standard
//! input closes. Prints `DEVLEND-READY N` once N frontends are up (contrib/scale.sh
//! counts the sessions and threads of N attachments whose queues are all live).

use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result};
use devlend_tests::vhost_raw::{proto, GuestRam, RawFrontend, RawQueue};

/// Guest memory per frontend: the rings (one 64 KiB slot per queue).
const RAM_LEN: usize = 1 << 20;
/// Entries per ring.
const QUEUE_SIZE: u16 = 128;
/// VIRTIO_BLK_F_MQ.
const BLK_F_MQ: u64 = 1 << 12;

/// One frontend's connection, its memory and its queues, kept open.
struct Frontend {
    _fe: RawFrontend,
    _ram: GuestRam,
    _queues: Vec<RawQueue>,
}

fn open(sock: &Path, queues: u32) -> Result<Frontend> {
    let mut fe =
        RawFrontend::connect(sock).with_context(|| format!("connect {}", sock.display()))?;
    let features = if queues > 1 { BLK_F_MQ } else { 0 };
    fe.negotiate(features, proto::MQ | proto::CONFIG)?;
    let ram = GuestRam::new(0, RAM_LEN)?;
    let ack = fe.set_mem_table(&[ram.region()], &[ram.fd()])?;
    anyhow::ensure!(ack == 0, "SET_MEM_TABLE refused: {ack}");
    let mut qs = Vec::new();
    for i in 0..queues {
        let q = RawQueue::new(i, u64::from(i) * 0x10000, QUEUE_SIZE);
        q.start(&mut fe, &ram, 0)?;
        q.kick();
        qs.push(q);
    }
    Ok(Frontend {
        _fe: fe,
        _ram: ram,
        _queues: qs,
    })
}

/// Raises the soft limit of open files to the hard one: a frontend holds a socket, a
/// memfd and three eventfds per queue, and a thousand of them pass the usual 1,024.
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit reads one valid rlimit.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((queues, socks)) = args.split_first() else {
        anyhow::bail!("usage: devlend-idle-frontends QUEUES SOCKET...");
    };
    let queues: u32 = queues.parse().context("QUEUES")?;
    raise_fd_limit();
    let mut held = Vec::with_capacity(socks.len());
    for s in socks {
        held.push(open(Path::new(s), queues)?);
    }
    println!("DEVLEND-READY {}", held.len());
    // Hold them until told to go.
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(held);
    Ok(())
}
