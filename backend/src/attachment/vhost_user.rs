//! Starting a block device (vhost-user-blk) or a NIC (vhost-user-net) attachment: the
//! holding session to the lender, the listening socket and the serving thread.

use devlend_fabric::DeviceDescription;

use super::frontends::Frontends;
use super::*;
use crate::lender::path_probe::PathProbe;
use crate::net::NetBackend;

/// What the lender lends, of what vhost-user serves.
#[derive(Clone, Copy)]
enum Lent<'r> {
    Block(&'r devlend_fabric::BlockGeometry),
    Nic(&'r devlend_fabric::NicLink),
}

impl Attachment {
    /// The vhost-user part of [`Attachment::start`]: the device is whatever the lender's
    /// handshake reply says, a block device or a NIC.
    pub(super) fn start_vhost(mut config: AttachmentConfig) -> Result<Self, AttachmentError> {
        // This session holds the device on the lender for the attachment's lifetime
        // (a device is lent to one borrower at a time); it carries no I/O.
        let (hold, reply, hold_path) =
            crate::blk::holder::open(&config.lender).map_err(AttachmentError::Lender)?;
        // With several paths, every session from now on must reach the lender that
        // answered this one.
        if config.lender.pin_lender(&reply) {
            tracing::info!(
                attachment = %config.id,
                path = %config.lender.path_addr(hold_path),
                "every path must prove the key of the lender that answered the holding session",
            );
        }
        let lent = match &reply.device {
            Some(DeviceDescription::Block(g)) => Lent::Block(g),
            Some(DeviceDescription::Nic(n)) => Lent::Nic(n),
            other => {
                return Err(AttachmentError::NotVhostUser {
                    device: config.lender.device.clone(),
                    lent: other.as_ref().map(DeviceDescription::kind),
                })
            }
        };
        let lent_kind = match lent {
            Lent::Block(_) => DeviceKind::Block,
            Lent::Nic(_) => DeviceKind::Nic,
        };
        if let Some(expected) = config.expect.filter(|&k| k != lent_kind) {
            return Err(AttachmentError::KindChanged {
                device: config.lender.device.clone(),
                expected,
                lent: lent_kind,
            });
        }
        if let (Lent::Nic(_), devlend_fabric::transport::Transport::Rdma) =
            (lent, config.lender.transport.kind())
        {
            return Err(AttachmentError::TcpOnly {
                device: config.lender.device.clone(),
                kind: lent_kind,
            });
        }
        // An RDMA attachment fails now, with the reason, when RDMA cannot work (no
        // device, no route, the lender not serving it), not later at the first request.
        crate::blk::engine::probe_transport(&config.lender).map_err(AttachmentError::Lender)?;
        let holder = Holder::start(&config.id, config.lender.clone(), hold, hold_path)
            .map_err(AttachmentError::Thread)?;
        let shared = Arc::new(Serving {
            handover: Arc::new(crate::handover::Handover::new(Some(holder.control()))),
            ..Serving::default()
        });
        let hold = Some(holder);
        let listener =
            Listener::new(&config.socket, true).map_err(|source| AttachmentError::Listen {
                path: config.socket.clone(),
                source,
            })?;
        // Only the owner and its group (e.g. the VMM's) may join the socket.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&config.socket, std::fs::Permissions::from_mode(0o660))
                .map_err(|source| AttachmentError::Listen {
                    path: config.socket.clone(),
                    source: vhost::vhost_user::Error::SocketError(source),
                })?;
        }
        let wake = EventFd::new(EFD_NONBLOCK).map_err(AttachmentError::Thread)?;
        let geometry = match lent {
            Lent::Block(g) => g,
            Lent::Nic(nic) => {
                let offload = reply.features & devlend_fabric::net::FEATURE_NET_OFFLOAD != 0;
                return Self::start_nic(config, hold, shared, listener, wake, nic, offload);
            }
        };
        let limits = Arc::new(DeviceLimits::from_device_info(geometry));
        let stats =
            Arc::new(QueueStats::new(config.num_queues).with_paths(config.lender.path_addrs()));
        let probe = PathProbe::start(&config.id, stats.clone()).map_err(AttachmentError::Thread)?;
        let thread = {
            let (config, limits, stats, shared) = (
                config.clone(),
                limits.clone(),
                stats.clone(),
                shared.clone(),
            );
            let wake = wake.try_clone().map_err(AttachmentError::Thread)?;
            std::thread::Builder::new()
                .name(format!("attach-{}", config.lender.device))
                .spawn(move || serve(listener, wake, config, limits, stats, shared))
                .map_err(AttachmentError::Thread)?
        };
        Ok(Attachment {
            hold,
            part: Part::Block(BlockPart {
                _probe: probe,
                limits,
                stats,
            }),
            config,
            shared,
            wake,
            thread: Some(thread),
        })
    }

    /// A lent NIC on vhost-user-net: `num_queues` counts queue pairs.
    fn start_nic(
        config: AttachmentConfig,
        hold: Option<Holder>,
        shared: Arc<Serving>,
        listener: Listener,
        wake: EventFd,
        nic: &devlend_fabric::NicLink,
        offload: bool,
    ) -> Result<Self, AttachmentError> {
        if config.num_queues > MAX_QUEUE_PAIRS {
            return Err(AttachmentError::QueuePairs(config.num_queues));
        }
        let link = nic.link();
        crate::net::spec::check_link(&link).map_err(AttachmentError::BadLink)?;
        let net = Arc::new(
            NetStats::new(config.num_queues, link.up, link.mtu)
                .with_paths(config.lender.path_addrs()),
        );
        let probe = PathProbe::start(&config.id, net.clone()).map_err(AttachmentError::Thread)?;
        let thread = {
            let (config, net, shared) = (config.clone(), net.clone(), shared.clone());
            let wake = wake.try_clone().map_err(AttachmentError::Thread)?;
            std::thread::Builder::new()
                .name(format!("attach-{}", config.lender.device))
                .spawn(move || {
                    let frontends = Frontends {
                        id: &config.id,
                        socket: &config.socket,
                        name: format!("devlend-net-{}", config.lender.device),
                        shared: &shared,
                    };
                    let pairs = config.num_queues;
                    frontends.serve(
                        listener,
                        |l| wait_for_client(l, &wake, &shared),
                        || {
                            NetBackend::new(
                                Arc::from(config.id.as_str()),
                                &config.lender,
                                pairs,
                                &link,
                                offload,
                                net.clone(),
                            )
                            .map(|b| Arc::new(b.with_handover(shared.handover.clone())))
                            .map_err(|e| e.to_string())
                        },
                        |c| {
                            if let Ok(mut h) = shared.net_handle.lock() {
                                *h = c.and_then(|(_, handle)| handle);
                            }
                        },
                    )
                })
                .map_err(AttachmentError::Thread)?
        };
        Ok(Attachment {
            hold,
            part: Part::Nic(NicPart {
                net,
                link,
                _probe: probe,
            }),
            config,
            shared,
            wake,
            thread: Some(thread),
        })
    }
}

fn set_current(shared: &Serving, v: Option<(Arc<BlkBackend>, Option<ShutdownHandle>)>) {
    if let Ok(mut c) = shared.current.lock() {
        *c = v;
    }
}

/// Waits until the listener has a pending connection (true) or stop is asked (false).
fn wait_for_client(listener: &Listener, wake: &EventFd, shared: &Serving) -> bool {
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return false;
        }
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of two pollfds for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n > 0 && fds[0].revents & libc::POLLIN != 0 && !shared.stop.load(Ordering::Acquire) {
            return true;
        }
    }
}

fn serve(
    listener: Listener,
    wake: EventFd,
    config: AttachmentConfig,
    limits: Arc<DeviceLimits>,
    stats: Arc<QueueStats>,
    shared: Arc<Serving>,
) {
    let frontends = Frontends {
        id: &config.id,
        socket: &config.socket,
        name: format!("devlend-blk-{}", config.lender.device),
        shared: &shared,
    };
    frontends.serve(
        listener,
        |l| wait_for_client(l, &wake, &shared),
        || {
            Ok(Arc::new(
                BlkBackend::new(
                    Arc::from(config.id.as_str()),
                    limits.clone(),
                    config.num_queues,
                    &config.lender,
                    stats.clone(),
                    config.reconnect_deadline,
                )
                .with_poll(config.poll)
                .with_handover(shared.handover.clone()),
            ))
        },
        |c| set_current(&shared, c),
    );
}
