//! What the sessions of one borrower of one device share: its limits' buckets
//! ([`Group`]); and what the borrowers of devices on one backing store share: the
//! store's capacity, divided by weight among those that are busy ([`Store`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use devlend_fabric::qos::{Qos, DEFAULT_WEIGHT};

use super::bucket::{Buckets, Cost};

/// A borrower is busy on a store (counts in the division of its capacity) for this
/// long after its last request, and for as long as a request of it waits.
pub(crate) const BUSY_WINDOW: Duration = Duration::from_millis(300);

/// How often a borrower's share of its store is computed again.
const SHARE_EVERY: Duration = Duration::from_millis(20);

/// A backing store that several lent devices sit on, and the capacity the operator
/// says it has (`[[store]]`): the borrowers busy on it share that capacity in
/// proportion to their weights.
#[derive(Debug)]
pub(crate) struct Store {
    /// Its capacity, as limits (block lanes).
    pub(crate) capacity: Qos,
    members: Mutex<HashMap<u64, Member>>,
    next_id: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
struct Member {
    weight: u32,
    /// Its last request.
    last: Instant,
    /// A request of it waits for its buckets until then: busy however long that is.
    waits_until: Instant,
}

impl Store {
    /// A store of `capacity`.
    pub(crate) fn new(capacity: Qos) -> Store {
        Store {
            capacity,
            members: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        }
    }

    fn members(&self) -> MutexGuard<'_, HashMap<u64, Member>> {
        self.members.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn join(&self, weight: u32, now: Instant) -> u64 {
        let id = self.next_id.fetch_add(1, Relaxed);
        self.members().insert(
            id,
            Member {
                weight,
                last: now,
                waits_until: now,
            },
        );
        id
    }

    /// Member `id` has a request waiting until `until`.
    fn waiting(&self, id: u64, until: Instant) {
        if let Some(me) = self.members().get_mut(&id) {
            me.waits_until = me.waits_until.max(until);
        }
    }

    fn leave(&self, id: u64) {
        self.members().remove(&id);
    }

    /// Marks member `id` busy at `now` and returns its share: its weight over the sum
    /// of the weights of the members busy within [`BUSY_WINDOW`].
    fn share(&self, id: u64, now: Instant) -> f64 {
        let mut m = self.members();
        let Some(me) = m.get_mut(&id) else {
            return 1.0;
        };
        me.last = now;
        let mine = f64::from(me.weight);
        let busy: f64 = m
            .values()
            .filter(|o| now.saturating_duration_since(o.last) <= BUSY_WINDOW || o.waits_until > now)
            .map(|o| f64::from(o.weight))
            .sum();
        if busy > 0.0 {
            mine / busy
        } else {
            1.0
        }
    }
}

/// The limits of one holder of a device, shared by all its sessions (one per
/// virtqueue), with the counters of their throttling.
#[derive(Debug)]
pub(crate) struct Group {
    /// The limits enforced: the device's own and the lease's, the tighter of each.
    pub(crate) qos: Qos,
    state: Mutex<State>,
    store: Option<(Arc<Store>, u64)>,
}

#[derive(Debug)]
struct State {
    own: Buckets,
    /// The store's capacity times this group's share.
    share: Option<StoreShare>,
}

#[derive(Debug)]
struct StoreShare {
    buckets: Buckets,
    fraction: f64,
    at: Instant,
}

impl Group {
    /// The group of a holder with limits `qos` on a device that sits on `store`.
    pub(crate) fn new(qos: Qos, store: Option<Arc<Store>>, now: Instant) -> Group {
        let weight = qos.weight.unwrap_or(DEFAULT_WEIGHT);
        let store = store.filter(|s| !s.capacity.is_empty()).map(|s| {
            let id = s.join(weight, now);
            (s, id)
        });
        let share = store.as_ref().map(|(s, id)| {
            let fraction = s.share(*id, now);
            StoreShare {
                buckets: Buckets::new(&s.capacity, fraction, now),
                fraction,
                at: now,
            }
        });
        Group {
            qos,
            state: Mutex::new(State {
                own: Buckets::new(&qos, 1.0, now),
                share,
            }),
            store,
        }
    }

    /// Whether it limits nothing (no limit, no store): its sessions need no throttle.
    pub(crate) fn is_unlimited(&self) -> bool {
        self.store.is_none() && self.state().own.is_empty()
    }

    /// The store it shares, if any.
    pub(crate) fn store(&self) -> Option<&Arc<Store>> {
        self.store.as_ref().map(|(s, _)| s)
    }

    /// Its current share of its store's capacity (1.0 without a store).
    pub(crate) fn share(&self) -> f64 {
        self.state().share.as_ref().map_or(1.0, |s| s.fraction)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Refills the buckets to `now`; how long until no bucket `cost` draws from is in
    /// debt (zero: now).
    fn due(&self, st: &mut State, cost: &Cost, now: Instant) -> Duration {
        st.own.refill(now);
        let mut wait = st.own.wait(cost);
        if let (Some(sh), Some((store, id))) = (st.share.as_mut(), &self.store) {
            sh.buckets.refill(now);
            if now.saturating_duration_since(sh.at) >= SHARE_EVERY {
                sh.fraction = store.share(*id, now);
                sh.at = now;
                sh.buckets.set_rates(&store.capacity, sh.fraction);
            }
            wait = wait.max(sh.buckets.wait(cost));
        }
        wait
    }

    /// Takes `cost` if no bucket it draws from is in debt; else how long until none
    /// is.
    pub(crate) fn take(&self, cost: &Cost, now: Instant) -> Result<(), Duration> {
        let mut st = self.state();
        let wait = self.due(&mut st, cost, now);
        if !wait.is_zero() {
            if let Some((store, id)) = &self.store {
                // Busy while it waits, even when that is longer than the busy window
                // (a 1 MiB request on a slow share): its share is not given away.
                store.waiting(*id, now + wait);
            }
            return Err(wait);
        }
        st.own.charge(cost);
        if let Some(sh) = st.share.as_mut() {
            sh.buckets.charge(cost);
        }
        Ok(())
    }

    /// How long from now until `cost` could be taken (zero: now), taking nothing.
    pub(crate) fn take_probe(&self, cost: &Cost) -> Duration {
        let mut st = self.state();
        self.due(&mut st, cost, Instant::now())
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some((store, id)) = &self.store {
            store.leave(*id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devlend_fabric::qos::Lane;
    use devlend_fabric::Op;

    /// Two groups with weights 1 and 3 on a store of 4000 reads a second, both always
    /// asking: the reads each gets in 5 s of simulated time.
    #[test]
    fn busy_groups_share_their_store_by_weight_and_an_idle_ones_share_goes_to_the_other() {
        let t0 = Instant::now();
        let store = Arc::new(Store::new(Qos::default().with(Lane::IopsRead, 4000, 0)));
        let a = Group::new(Qos::default().with_weight(1), Some(Arc::clone(&store)), t0);
        let b = Group::new(Qos::default().with_weight(3), Some(Arc::clone(&store)), t0);
        let cost = Cost::block(Op::Read, 4096);
        let (mut na, mut nb) = (0u64, 0u64);
        let mut now = t0;
        let end = t0 + Duration::from_secs(5);
        while now < end {
            let wa = a.take(&cost, now).map(|()| na += 1).err();
            let wb = b.take(&cost, now).map(|()| nb += 1).err();
            if let (Some(x), Some(y)) = (wa, wb) {
                now += x.min(y);
            }
        }
        let ratio = nb as f64 / na as f64;
        assert!((2.7..=3.3).contains(&ratio), "{na} {nb}");
        assert!((19_000..=21_000).contains(&(na + nb)), "{na} {nb}");
        // b goes idle: past the busy window a alone gets the whole store.
        now += BUSY_WINDOW * 2;
        let mut n = 0;
        let end = now + Duration::from_secs(2);
        while now < end {
            match a.take(&cost, now) {
                Ok(()) => n += 1,
                Err(w) => now += w,
            }
        }
        assert!((7_500..=8_500).contains(&n), "{n}");
        assert!((a.share() - 1.0).abs() < 1e-9);
        drop(b);
        assert_eq!(store.members().len(), 1);
    }

    /// Requests whose wait is longer than the busy window (1 MiB at 1 MiB/s) keep
    /// their group busy: the shares stay 1:3 and the store is not overdrawn.
    #[test]
    fn a_group_waiting_longer_than_the_busy_window_keeps_its_share() {
        let t0 = Instant::now();
        let store = Arc::new(Store::new(Qos::default().with(Lane::BpsRead, 4 << 20, 0)));
        let a = Group::new(Qos::default().with_weight(1), Some(Arc::clone(&store)), t0);
        let b = Group::new(Qos::default().with_weight(3), Some(Arc::clone(&store)), t0);
        let cost = Cost::block(Op::Read, 1 << 20);
        let (mut na, mut nb) = (0u64, 0u64);
        let (mut ta, mut tb) = (t0, t0);
        let end = t0 + Duration::from_secs(30);
        while ta < end || tb < end {
            // Each asks again only when its last wait is over, as a session does.
            if ta <= tb {
                match a.take(&cost, ta) {
                    Ok(()) => na += 1,
                    Err(w) => ta += w,
                }
            } else {
                match b.take(&cost, tb) {
                    Ok(()) => nb += 1,
                    Err(w) => tb += w,
                }
            }
        }
        let ratio = nb as f64 / na as f64;
        assert!((2.6..=3.4).contains(&ratio), "{na} {nb}");
        assert!(
            na + nb <= 4 * 30 + 4,
            "the store was overdrawn: {na} + {nb} MiB in 30 s"
        );
    }

    #[test]
    fn a_group_without_limits_or_store_is_unlimited() {
        let t0 = Instant::now();
        assert!(Group::new(Qos::default(), None, t0).is_unlimited());
        let empty = Arc::new(Store::new(Qos::default()));
        assert!(Group::new(Qos::default(), Some(empty), t0).is_unlimited());
        let q = Qos::default().with(Lane::IopsWrite, 10, 0);
        assert!(!Group::new(q, None, t0).is_unlimited());
    }
}
