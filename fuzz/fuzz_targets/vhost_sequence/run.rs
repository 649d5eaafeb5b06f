//! Sending a message and checking its answer against the model, and a session's start
//! and teardown.

use super::*;

impl<'w> Run<'w> {
    pub(crate) fn open(&self) -> bool {
        self.s.as_ref().is_some_and(|s| s.fe.is_some())
    }

    /// Sends `m`, then a barrier (GET_PROTOCOL_FEATURES, or GET_FEATURES after one),
    /// reads everything up to the barrier's reply, and checks it. `None` if the session
    /// was closed before.
    pub(crate) fn send(&mut self, m: Msg<'_>) -> Option<Outcome> {
        let s = self.s.as_mut()?;
        let reply_ack = s.reply_ack();
        let fe = s.fe.as_mut()?;
        self.messages += 1;
        let code = m.code;
        let what = format!(
            "{}(flags {:#x}, {} bytes{}, {} fds)",
            name(code),
            m.flags,
            m.payload.len(),
            m.lie
                .map(|l| format!(", header says {l}"))
                .unwrap_or_default(),
            m.fds.len()
        );
        let well_formed = m.lie.is_none()
            && m.flags & !NEED_REPLY == VERSION
            && m.payload.len() <= 0x1000
            && (m.fds.is_empty() || takes_fds(code))
            && fixed_size(code).is_none_or(|n| n == m.payload.len());
        // SET_PROTOCOL_FEATURES (always taken when well formed) is acked under the
        // features it sets.
        let reply_ack = if code == req::SET_PROTOCOL_FEATURES && well_formed {
            let v = u64::from_ne_bytes(m.payload.try_into().expect("8 bytes"));
            s.features_seen && v & proto::REPLY_ACK != 0
        } else {
            reply_ack
        };
        let must_reply = well_formed
            && match code {
                req::GET_FEATURES | req::GET_PROTOCOL_FEATURES | req::GET_CONFIG => true,
                req::SET_INFLIGHT_FD => {
                    // num_queues and queue_size (u16 at 16 and 18) must not be 0.
                    m.flags & NEED_REPLY != 0
                        && reply_ack
                        && m.payload[16..18] != [0, 0]
                        && m.payload[18..20] != [0, 0]
                }
                c => ack_form(c) && m.flags & NEED_REPLY != 0 && reply_ack,
            };
        let may_reply =
            must_reply || has_reply_body(code) || m.flags & NEED_REPLY != 0 && reply_ack;

        // The barrier: a request answered whatever the state, of another code than `m`'s.
        let barrier = if code == req::GET_PROTOCOL_FEATURES {
            req::GET_FEATURES
        } else {
            req::GET_PROTOCOL_FEATURES
        };
        let sent = match m.lie {
            Some(size) => fe.send_header(code, m.flags, size),
            None => fe.send(code, m.flags, m.payload, m.fds),
        }
        .and_then(|()| fe.send(barrier, VERSION, &[], &[]));
        let mut replies = Vec::new();
        let mut closed = sent.is_err();
        let mut barrier_reply = None;
        while !closed {
            match fe.recv_with_fds() {
                Ok((r, fds)) if r.request == barrier => {
                    if r.flags & REPLY == 0 || r.payload.len() != 8 || !fds.is_empty() {
                        panic!(
                            "{what}: the barrier was answered with {r:?} and {} fds",
                            fds.len()
                        );
                    }
                    barrier_reply = Some(u64::from_ne_bytes(
                        r.payload.as_slice().try_into().expect("8 bytes"),
                    ));
                    break;
                }
                Ok(reply) => replies.push(reply),
                Err(e) => match e.downcast_ref::<std::io::Error>().map(|e| e.kind()) {
                    Some(std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                        panic!("hang: the backend did not answer within {REPLY_TIMEOUT:?} after {what}")
                    }
                    _ => closed = true,
                },
            }
        }
        if closed {
            s.fe = None;
        }
        if replies.len() > 1 {
            panic!(
                "{what}: {} replies: {:?}",
                replies.len(),
                replies.iter().map(|r| &r.0).collect::<Vec<_>>()
            );
        }
        let reply = replies.pop();
        if let Some((r, _)) = &reply {
            if r.flags & REPLY == 0 || r.request != code {
                panic!("{what}: answered with {r:?}");
            }
            if !may_reply {
                panic!("{what}: answered ({r:?}) though it asked for no reply (REPLY_ACK in effect: {reply_ack})");
            }
        } else if must_reply {
            panic!(
                "{what}: no reply (REPLY_ACK in effect: {reply_ack}; connection closed: {closed})"
            );
        }
        if must_reply && closed {
            panic!("{what}: the backend answered, then closed the session");
        }
        if let Some(v) = barrier_reply {
            if barrier == req::GET_FEATURES {
                s.offered_features = v;
                s.features_seen = v & F_PROTOCOL != 0;
            }
        }
        let out = match reply {
            Some((r, fds)) if !has_reply_body(code) => {
                let v: [u8; 8] = r
                    .payload
                    .as_slice()
                    .try_into()
                    .unwrap_or_else(|_| panic!("{what}: an ack of {} bytes", r.payload.len()));
                assert!(fds.is_empty(), "{what}: an ack with fds");
                Outcome::Ack(u64::from_ne_bytes(v))
            }
            Some((r, fds)) => Outcome::Reply(r, fds),
            None if closed => Outcome::Closed,
            None => Outcome::Done,
        };
        show!("  {what} => {}", ack_of(&out));
        if let (Outcome::Reply(r, _), req::GET_FEATURES) = (&out, code) {
            if let Ok(v) = <[u8; 8]>::try_from(r.payload.as_slice()) {
                let s = self.s.as_mut().expect("session");
                s.offered_features = u64::from_ne_bytes(v);
                s.features_seen = s.offered_features & F_PROTOCOL != 0;
            }
        }
        if let (Outcome::Reply(r, _), req::GET_PROTOCOL_FEATURES) = (&out, code) {
            if let Ok(v) = <[u8; 8]>::try_from(r.payload.as_slice()) {
                self.s.as_mut().expect("session").offered_proto = u64::from_ne_bytes(v);
            }
        }
        // A queue is started by SET_VRING_KICK and stopped by GET_VRING_BASE; a new base
        // while started leaves requests in flight from before, which complete into the
        // new epoch (a frontend's error: the model stops checking that queue).
        if m.lie.is_none() && m.payload.len() >= 4 {
            let q = usize::from(m.payload[0]);
            let rest_zero = m.payload[1..4] == [0, 0, 0];
            if let Some(qm) = self.q.get_mut(q).filter(|_| rest_zero) {
                match (code, &out) {
                    (req::SET_VRING_KICK, o) if o.accepted() => qm.started = true,
                    // A reply without a body is a refusal: the queue runs on.
                    (req::GET_VRING_BASE, Outcome::Reply(r, _)) if !r.payload.is_empty() => {
                        qm.started = false
                    }
                    _ => {}
                }
            }
        }
        if code == req::SET_PROTOCOL_FEATURES
            && out.accepted()
            && m.payload.len() == 8
            && m.lie.is_none()
        {
            let v = u64::from_ne_bytes(m.payload.try_into().expect("8 bytes"));
            self.s.as_mut().expect("session").proto_acked = v;
        }
        Some(out)
    }

    /// Starts a new epoch of queue q at `base` (the backend took SET_VRING_BASE).
    pub(crate) fn epoch(&mut self, q: usize, base: u16) {
        let r = ring(q, 256);
        let avail = r.avail_idx(&self.w.ram);
        let m = &mut self.q[q];
        if m.started {
            m.tainted = true;
        }
        m.base = base;
        m.used_at_base = r.used_idx(&self.w.ram);
        let d = dist(avail, base);
        m.offered = if d <= 0x8000 { d } else { 0 };
    }

    /// The guest published avail index `idx` on queue q.
    pub(crate) fn published(&mut self, q: usize, idx: u16) {
        let m = &mut self.q[q];
        let d = dist(idx, m.base);
        if d <= 0x8000 {
            m.offered = m.offered.max(d);
        }
    }

    pub(crate) fn taint_all(&mut self) {
        for m in &mut self.q {
            m.tainted = true;
        }
    }

    /// The used-index invariant on every queue the model alone laid out.
    pub(crate) fn check_used(&self, after: &str) {
        for (q, m) in self.q.iter().enumerate() {
            if m.tainted {
                continue;
            }
            let used = ring(q, 256).used_idx(&self.w.ram);
            if used != m.used_at_base && dist(used, m.base) > m.offered {
                panic!(
                    "queue {q}: used.idx {used} is {} past the base {} but only {} were made available (after {after})",
                    dist(used, m.base),
                    m.base,
                    m.offered
                );
            }
        }
    }

    // --- sessions -----------------------------------------------------------------------

    pub(crate) fn start_session(&mut self) {
        let w = self.w;
        arm("session start", TEARDOWN_TIMEOUT);
        let backend = Arc::new(BlkBackend::new(
            Arc::from("fuzz"),
            w.limits.clone(),
            NQ,
            &w.target,
            w.stats.clone(),
            Duration::from_secs(1),
        ));
        let tb = Instant::now();
        let mut daemon =
            VhostUserDaemon::new("fuzz-vhost".into(), backend.clone(), backend.memory())
                .expect("vhost-user daemon");
        backend.attach_handlers(&daemon.get_epoll_handlers());
        let fe = RawFrontend::connect(&w.sock).expect("connect");
        fe.set_timeout(REPLY_TIMEOUT).expect("timeout");
        daemon
            .start(&mut w.listener.borrow_mut())
            .expect("daemon accepts");
        disarm();
        show!("  daemon start {:?}", tb.elapsed());
        self.s = Some(Session {
            backend,
            daemon,
            fe: Some(fe),
            features_seen: false,
            proto_acked: 0,
            offered_features: 0,
            offered_proto: 0,
        });
        self.sessions += 1;
        // A new backend's queues start at 0 until told otherwise.
        for q in 0..usize::from(NQ) {
            self.q[q].started = false;
            self.epoch(q, 0);
        }
    }

    pub(crate) fn end_session(&mut self) {
        let Some(mut s) = self.s.take() else { return };
        if s.fe.is_some() {
            let t = Instant::now();
            check_spin();
            show!("  spin check {:?}", t.elapsed());
        }
        arm("teardown", TEARDOWN_TIMEOUT);
        drop(s.fe.take());
        let r = s.daemon.wait();
        show!("  session ended: {r:?}");
        drop(s.daemon);
        s.backend.close_exit_fds();
        let refs = Arc::strong_count(&s.backend);
        assert_eq!(
            refs, 1,
            "{refs} references to the backend are left after its teardown"
        );
        drop(s.backend);
        disarm();
    }
}
