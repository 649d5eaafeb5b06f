//! Who holds a lent device, and the handover of a live migration.
//!
//! A device is lent to one borrower at a time (its identity is its lease id), for as
//! long as that borrower has a session open: each admitted session takes a [`Claim`],
//! and the device is free again when the holder's last claim drops.
//!
//! A live migration moves the VM, and with it the borrower, to another compute host
//! while the source still holds the device. The destination presents a lease token that
//! names the current holder's lease as its predecessor (`successor_of`, signed by the
//! pool or by a key the lender trusts: the source's consent). It gets a **standby**
//! claim: its holding session (queue [`CONTROL_QUEUE`], which carries no I/O) is
//! admitted, and the lender records the handover `from → to`. Its other sessions are
//! refused as busy while the source holds the device. When the source's last claim
//! drops (its VM stopped, drained, and the source let go), the device is reserved for
//! the handover: only `to` (the migration completed) or `from` (it failed, the source VM
//! resumes) may take it, whichever comes first; any other borrower is refused. The
//! standby claims of `to` become holding claims when `to` takes the device. If the
//! destination goes (its standby sessions all close) before it took the device, the
//! handover is forgotten. A successor's holding session on a free device (the
//! predecessor let go first, or the lender restarted meanwhile) records the same
//! reservation.
//!
//! So two borrowers never hold the device at once, and the source's requests all
//! completed before the destination's first one is served.

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use devlend_fabric::qos::Qos;

use crate::qos::{Group, Store};

/// Queue index of a borrower's holding session (it carries no I/O).
pub(crate) const CONTROL_QUEUE: u16 = u16::MAX;

/// Who holds a device, and a handover in progress.
#[derive(Debug, Default)]
pub(crate) struct Holding {
    state: Mutex<State>,
    /// The limits anonymous sessions share (direct mode without authentication), while
    /// any is open.
    anonymous: Mutex<Weak<Group>>,
}

#[derive(Debug, Default)]
struct State {
    holder: Option<Holder>,
    handover: Option<Handover>,
}

/// The borrower that holds a device.
#[derive(Debug)]
struct Holder {
    borrower: [u8; 16],
    sessions: usize,
    group: Arc<Group>,
}

/// A handover in progress: `to` waits for the device that `from` holds or held last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Handover {
    from: [u8; 16],
    to: [u8; 16],
    /// Open standby sessions of `to`.
    standby: usize,
}

/// Why a claim was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Another borrower holds the device.
    Held([u8; 16]),
    /// The device is reserved for a handover between two other borrowers.
    HandingOver { from: [u8; 16], to: [u8; 16] },
    /// A handover from a lease that does not hold the device (it let go, or another
    /// handover is in progress).
    NotHolder { from: [u8; 16] },
    /// The successor's sessions other than its holding session wait until the holder
    /// lets go.
    Waiting { from: [u8; 16] },
}

impl std::fmt::Display for Refusal {
    // The lease ids stay out of what a refused borrower is told.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Held(_) => write!(f, "attached by another borrower"),
            Refusal::HandingOver { .. } => {
                write!(
                    f,
                    "being handed over between two other borrowers (a live migration)"
                )
            }
            Refusal::NotHolder { .. } => write!(
                f,
                "attached by another borrower than the one this token takes over from"
            ),
            Refusal::Waiting { .. } => write!(
                f,
                "still held by the borrower that hands it over to this one when its VM has stopped"
            ),
        }
    }
}

/// A session's share of a device's ownership; released on drop.
pub(crate) struct Claim {
    /// The holding of the device claimed.
    holding: Arc<Holding>,
    borrower: [u8; 16],
    group: Arc<Group>,
    /// Taken as the successor of a handover, before the device was handed over.
    standby: bool,
}

impl Claim {
    /// The limits the holder's sessions share.
    pub(crate) fn group(&self) -> &Arc<Group> {
        &self.group
    }

    /// Whether this is a successor's holding session, admitted while the device was
    /// still another's: it must carry no I/O.
    pub(crate) fn is_standby(&self) -> bool {
        self.standby
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.borrower == [0; 16] {
            return;
        }
        let mut s = self.holding.lock();
        let s = &mut *s;
        if let Some(h) = s.holder.as_mut() {
            if h.borrower == self.borrower {
                // A holding claim, or a standby claim counted in when its borrower took
                // the device.
                h.sessions -= 1;
                if h.sessions == 0 {
                    s.holder = None;
                }
                return;
            }
        }
        if self.standby {
            if let Some(ho) = s.handover.as_mut() {
                if ho.to == self.borrower {
                    ho.standby -= 1;
                    if ho.standby == 0 {
                        // The destination went before it took the device.
                        s.handover = None;
                    }
                }
            }
        }
    }
}

impl Holding {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a borrower holds the device (has a session open on it).
    pub(crate) fn is_held(&self) -> bool {
        self.lock().holder.is_some()
    }

    /// Whether `borrower` holds the device now.
    pub(crate) fn held_by(&self, borrower: [u8; 16]) -> bool {
        borrower != [0; 16]
            && self
                .lock()
                .holder
                .as_ref()
                .is_some_and(|x| x.borrower == borrower)
    }

    /// The limits its holder's sessions share now, if it is held (or anonymous sessions
    /// are open).
    pub(crate) fn current_group(&self) -> Option<Arc<Group>> {
        match self.lock().holder.as_ref() {
            Some(x) => Some(Arc::clone(&x.group)),
            None => self
                .anonymous
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .upgrade(),
        }
    }
}

/// What a session asks for.
pub(crate) struct Ask<'a> {
    /// The borrower's identity (its lease id; all zero: anonymous).
    pub(crate) borrower: [u8; 16],
    /// The lease this one takes the device over from (its token's `successor_of`).
    pub(crate) successor_of: Option<[u8; 16]>,
    /// The session's queue ([`CONTROL_QUEUE`]: the holding session).
    pub(crate) queue: u16,
    /// The lease's limits.
    pub(crate) lease: Option<&'a Qos>,
}

/// Lets a session of `ask.borrower` use the device whose holding is `holding` (see the
/// module docs). The holder's first session sets the limits all its sessions share: the
/// device's own (`own`) and the lease's, the tighter of each, and the device's `store`.
/// Anonymous sessions share one group of the device's own limits, only while nobody
/// holds the device.
pub(crate) fn claim(
    holding: &Arc<Holding>,
    own: Qos,
    ask: &Ask<'_>,
    store: Option<Arc<Store>>,
) -> Result<Claim, Refusal> {
    let borrower = ask.borrower;
    let mut s = holding.lock();
    let s = &mut *s;
    let new_group = || {
        let qos = ask.lease.map_or(own, |l| own.tighter(l));
        Arc::new(Group::new(qos, store.clone(), Instant::now()))
    };
    let made = |group, standby| Claim {
        holding: Arc::clone(holding),
        borrower,
        group,
        standby,
    };
    if borrower == [0; 16] {
        if let Some(h) = &s.holder {
            return Err(Refusal::Held(h.borrower));
        }
        if let Some(ho) = &s.handover {
            return Err(Refusal::HandingOver {
                from: ho.from,
                to: ho.to,
            });
        }
        let mut anon = holding.anonymous.lock().unwrap_or_else(|p| p.into_inner());
        let group = match anon.upgrade() {
            Some(g) => g,
            None => {
                let g = Arc::new(Group::new(own, store.clone(), Instant::now()));
                *anon = Arc::downgrade(&g);
                g
            }
        };
        return Ok(made(group, false));
    }
    match (&mut s.holder, &mut s.handover) {
        (Some(h), _) if h.borrower == borrower => {
            h.sessions += 1;
            Ok(made(Arc::clone(&h.group), false))
        }
        // The successor's holding session while the source holds the device.
        (Some(h), ho) if ask.successor_of == Some(h.borrower) => {
            match ho {
                Some(x) if x.to != borrower || x.from != h.borrower => {
                    return Err(Refusal::HandingOver {
                        from: x.from,
                        to: x.to,
                    })
                }
                _ => {}
            }
            if ask.queue != CONTROL_QUEUE {
                return Err(Refusal::Waiting { from: h.borrower });
            }
            let x = ho.get_or_insert(Handover {
                from: h.borrower,
                to: borrower,
                standby: 0,
            });
            x.standby += 1;
            Ok(made(new_group(), true))
        }
        (Some(_), _) if ask.successor_of.is_some() => Err(Refusal::NotHolder {
            from: ask.successor_of.unwrap_or_default(),
        }),
        (Some(h), _) => Err(Refusal::Held(h.borrower)),
        // Reserved: the successor takes it (the migration completed), or the source
        // takes it back (it failed).
        (None, Some(x)) if borrower == x.to || borrower == x.from => {
            let group = new_group();
            let sessions = if borrower == x.to {
                let standby = x.standby;
                s.handover = None;
                standby + 1
            } else {
                1
            };
            s.holder = Some(Holder {
                borrower,
                sessions,
                group: Arc::clone(&group),
            });
            Ok(made(group, false))
        }
        (None, Some(x)) => Err(Refusal::HandingOver {
            from: x.from,
            to: x.to,
        }),
        // A free device and a successor's holding session: its predecessor let go
        // before it came, or the lender restarted in the middle of a handover. Reserved
        // for the two of them as if the predecessor had just let go, so that a source
        // whose VM still runs takes it back first.
        (None, None) if ask.queue == CONTROL_QUEUE && ask.successor_of.is_some() => {
            let from = ask.successor_of.unwrap_or_default();
            s.handover = Some(Handover {
                from,
                to: borrower,
                standby: 1,
            });
            Ok(made(new_group(), true))
        }
        // A free device: anyone, a successor's queue sessions too (its VM runs).
        (None, None) => {
            let group = new_group();
            s.holder = Some(Holder {
                borrower,
                sessions: 1,
                group: Arc::clone(&group),
            });
            Ok(made(group, false))
        }
    }
}

#[cfg(test)]
#[path = "holding_tests.rs"]
mod tests;
