//! Tests of the link: streams, windows, resets, protocol violations.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::frame::{decode_header, encode_header, HELLO_MAGIC, KIND_DATA, KIND_OPEN};
use super::*;

async fn pair(window: u32) -> (Arc<Link>, Arc<Link>, mpsc::UnboundedReceiver<Incoming>) {
    let (a, b) = tokio::io::duplex(1 << 20);
    let (tx, rx) = mpsc::unbounded_channel();
    let hello = |c: &str| LinkHello {
        cluster: c.into(),
        window,
    };
    let t = Duration::from_secs(5);
    let (d, acc) = tokio::join!(
        Link::start(a, Role::Dialer, hello("a"), t, None),
        Link::start(b, Role::Acceptor, hello("b"), t, Some(tx))
    );
    (d.unwrap(), acc.unwrap(), rx)
}

#[tokio::test]
async fn streams_carry_bytes_both_ways_and_finish() {
    let (d, acc, mut inc) = pair(MIN_WINDOW).await;
    assert_eq!(d.peer_cluster, "b");
    assert_eq!(acc.peer_cluster, "a");
    let s = d.open(b"hello-open-payload".to_vec()).unwrap();
    let (t, open) = inc.recv().await.unwrap();
    assert_eq!(open, b"hello-open-payload");
    let (mut dr, mut dw) = s.split();
    let (mut ar, mut aw) = t.split();
    // Far more than one window: credit must flow back.
    let data: Vec<u8> = (0..1_000_000u32).map(|i| i as u8).collect();
    let send = data.clone();
    let sender = tokio::spawn(async move {
        dw.send(&send).await.unwrap();
        dw.finish().unwrap();
        dw
    });
    let mut got = Vec::new();
    while let Some(c) = ar.recv().await.unwrap() {
        ar.consumed(c.len());
        got.extend_from_slice(&c);
    }
    assert_eq!(got, data);
    aw.send(b"back").await.unwrap();
    aw.finish().unwrap();
    assert_eq!(dr.recv().await.unwrap().unwrap(), b"back");
    assert!(dr.recv().await.unwrap().is_none());
    drop(sender.await.unwrap());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(d.stats.sessions_active.load(Ordering::Relaxed), 0);
    assert_eq!(acc.stats.sessions_active.load(Ordering::Relaxed), 0);
    assert_eq!(d.stats.bytes_sent.load(Ordering::Relaxed), 1_000_000);
    d.ping().unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(d.stats.rtt_us.load(Ordering::Relaxed) > 0);
}

#[tokio::test]
async fn a_closed_link_refuses_and_resets_streams() {
    let (d, _acc, mut inc) = pair(MIN_WINDOW).await;
    let s = d.open(b"before-the-close-1".to_vec()).unwrap();
    let _far = inc.recv().await.unwrap();
    let (mut r, mut w) = s.split();
    d.close();
    assert!(matches!(r.recv().await, Err(MuxError::Reset(_))));
    assert!(w.send(b"x").await.is_err());
    assert!(matches!(
        d.open(b"after-the-close-12".to_vec()),
        Err(MuxError::Closed)
    ));
}

#[tokio::test]
async fn a_stalled_stream_does_not_stall_another() {
    let (d, _acc, mut inc) = pair(MIN_WINDOW).await;
    let slow = d.open(b"slow-open-request".to_vec()).unwrap();
    let (_slow_far, _) = inc.recv().await.unwrap(); // never read
    let (_sr, mut sw) = slow.split();
    // Fills its window, then waits for credit that never comes.
    let stuck = tokio::spawn(async move { sw.send(&vec![1u8; 4 * MIN_WINDOW as usize]).await });
    let fast = d.open(b"fast-open-request".to_vec()).unwrap();
    let (far, _) = inc.recv().await.unwrap();
    let (_fr, mut fw) = fast.split();
    let (mut r, _w) = far.split();
    let total = 8 * MIN_WINDOW as usize;
    let sender = tokio::spawn(async move {
        fw.send(&vec![2u8; total]).await.unwrap();
        fw
    });
    let mut got = 0;
    while got < total {
        let c = tokio::time::timeout(Duration::from_secs(5), r.recv())
            .await
            .expect("the fast stream stalled")
            .unwrap()
            .unwrap();
        got += c.len();
        r.consumed(c.len());
    }
    assert!(!stuck.is_finished());
    drop(sender.await.unwrap());
    stuck.abort();
}

#[tokio::test]
async fn data_past_the_window_closes_the_link() {
    let (a, b) = tokio::io::duplex(1 << 20);
    let (tx, mut inc) = mpsc::unbounded_channel();
    let acc = tokio::spawn(Link::start(
        b,
        Role::Acceptor,
        LinkHello {
            cluster: "b".into(),
            window: MIN_WINDOW,
        },
        Duration::from_secs(5),
        Some(tx),
    ));
    // A rogue dialer speaking frames by hand.
    let (mut r, mut w) = tokio::io::split(a);
    w.write_all(
        &LinkHello {
            cluster: "a".into(),
            window: MIN_WINDOW,
        }
        .encode(),
    )
    .await
    .unwrap();
    let acc = acc.await.unwrap().unwrap();
    let mut hb = [0u8; FRAME_HEADER_LEN];
    r.read_exact(&mut hb).await.unwrap();
    let mut p = vec![0u8; decode_header(&hb).unwrap().len as usize];
    r.read_exact(&mut p).await.unwrap();
    let open = devlend_fabric::relay::RelayRequest::new("b", "l")
        .encode()
        .unwrap();
    let mut f = encode_header(KIND_OPEN, 1, open.len() as u32).to_vec();
    f.extend_from_slice(&open);
    w.write_all(&f).await.unwrap();
    let (_s, _) = inc.recv().await.unwrap();
    let chunk = vec![0u8; MAX_DATA];
    for _ in 0..(MIN_WINDOW as usize / MAX_DATA + 2) {
        let mut f = encode_header(KIND_DATA, 1, MAX_DATA as u32).to_vec();
        f.extend_from_slice(&chunk);
        if w.write_all(&f).await.is_err() {
            break;
        }
    }
    tokio::time::timeout(Duration::from_secs(5), acc.wait_closed())
        .await
        .expect("the link stays open after a window violation");
}

/// Random input never panics a decoder, and random frames after a valid HELLO
/// close the link (or leave it up, when they happen to be valid) without a panic.
#[tokio::test]
async fn random_input_is_refused_without_panics() {
    use rand::{Rng, SeedableRng};
    // DEVLEND_TEST_SEED replays a failed run's seed.
    let seed = devlend_tests::test_seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..20_000 {
        let mut h = [0u8; FRAME_HEADER_LEN];
        rng.fill(&mut h[..]);
        if rng.random_bool(0.5) {
            h[0] = rng.random_range(0..10);
            h[1..4].fill(0);
        }
        let _ = decode_header(&h);
        let n = rng.random_range(0..100);
        let mut p = vec![0u8; n];
        rng.fill(&mut p[..]);
        if n >= 4 && rng.random_bool(0.5) {
            p[..4].copy_from_slice(&HELLO_MAGIC);
        }
        let _ = LinkHello::decode(&p);
    }
    let panicked = std::sync::Arc::new(AtomicBool::new(false));
    let flag = panicked.clone();
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |i| {
        flag.store(true, Ordering::SeqCst);
        eprintln!("{i}");
    }));
    for _ in 0..50 {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (tx, _inc) = mpsc::unbounded_channel();
        let acc = tokio::spawn(Link::start(
            b,
            Role::Acceptor,
            LinkHello {
                cluster: "b".into(),
                window: MIN_WINDOW,
            },
            Duration::from_secs(5),
            Some(tx),
        ));
        let (r, mut w) = tokio::io::split(a);
        w.write_all(
            &LinkHello {
                cluster: "a".into(),
                window: MIN_WINDOW,
            }
            .encode(),
        )
        .await
        .unwrap();
        let link = acc.await.unwrap().unwrap();
        // The peer's end goes once the junk is written: end of stream at the latest.
        // At least a header's first four bytes, which the frame-like case below writes.
        let mut junk = vec![0u8; rng.random_range(4..4096)];
        rng.fill(&mut junk[..]);
        // Frame-like junk: a plausible kind, zero flags, a small length.
        if rng.random_bool(0.7) {
            junk[0] = rng.random_range(1..9);
            junk[1..4].fill(0);
        }
        let _ = w.write_all(&junk).await;
        drop((r, w));
        tokio::time::timeout(Duration::from_secs(5), link.wait_closed())
            .await
            .expect("the link stays open after junk and the peer's end");
    }
    std::panic::set_hook(prev);
    assert!(!panicked.load(Ordering::SeqCst), "a task panicked");
}
