//! Placement: which free device a lease request gets, as a pure function over the
//! candidate rows, and why none when none.
//!
//! The rule (also in `docs/pool.md`):
//! 1. **Filter**: resource class equal, capacity >= the minimum, traits a superset of
//!    the wanted ones, the device listed by a provider that is available (heartbeat
//!    within its TTL), the device not held by a live lease.
//! 2. **Order**, first difference wins:
//!    a. the provider's number of live leases, ascending (least-loaded server first);
//!    b. with a `numa_node` preference, devices with trait `NUMA_<n>` first;
//!    c. capacity ascending (best fit: the smallest sufficient device);
//!    d. provider name, then device name (so the order is total and deterministic).
//!
//! The claim then tries the candidates in this order; one lost to a concurrent claim
//! moves on to the next.
//!
//! When nothing passes the filter the reason is, checked in this order:
//! `no_device_of_class`, `too_small`, `no_device_with_traits`, `all_leased` (every
//! matching device on a live provider is leased), `providers_unavailable` (matching
//! devices exist only on providers that stopped heartbeating).

use std::cmp::Ordering;

use uuid::Uuid;

use crate::api::codes;

/// One device as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Device id.
    pub device_id: Uuid,
    /// Device generation, for the conditional claim.
    pub generation: u64,
    /// Provider name.
    pub provider: String,
    /// Device name on the provider.
    pub name: String,
    /// Resource class.
    pub resource_class: String,
    /// Capacity in bytes.
    pub capacity_bytes: u64,
    /// Traits.
    pub traits: Vec<String>,
    /// The provider heartbeats within its TTL and still lists the device.
    pub reachable: bool,
    /// A live lease holds the device.
    pub leased: bool,
    /// Live leases on the device's provider.
    pub provider_load: u64,
}

/// What a lease request asks placement for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Want {
    /// Resource class.
    pub class: String,
    /// Smallest capacity accepted, in bytes.
    pub min_capacity_bytes: u64,
    /// Traits the device must all have.
    pub traits: Vec<String>,
    /// Prefer devices with trait `NUMA_<n>`.
    pub numa_node: Option<u32>,
}

/// Why nothing can be placed; `code()` and `to_string()` are the pool's 409 answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoPlacement {
    /// No device of the class at all.
    #[error("no device of class {class} is registered ({total} devices in the pool)")]
    NoDeviceOfClass {
        /// Class asked for.
        class: String,
        /// Devices of every class.
        total: usize,
    },
    /// Devices of the class, none large enough.
    #[error(
        "no {class} device has at least {}: {count} of that class, the largest has {}",
        size(*min_capacity_bytes),
        size(*largest_bytes)
    )]
    TooSmall {
        /// Class asked for.
        class: String,
        /// Capacity asked for.
        min_capacity_bytes: u64,
        /// Devices of the class.
        count: usize,
        /// Largest of them.
        largest_bytes: u64,
    },
    /// Devices of the class and size, none with every wanted trait.
    #[error(
        "none of the {count} {class} device(s){} has all of {wanted:?}; missing on every \
         one of them: {missing:?}",
        at_least(*min_capacity_bytes)
    )]
    NoDeviceWithTraits {
        /// Class asked for.
        class: String,
        /// Capacity asked for.
        min_capacity_bytes: u64,
        /// Devices of the class and size.
        count: usize,
        /// Traits asked for.
        wanted: Vec<String>,
        /// Wanted traits that none of them has (empty when each exists somewhere, but
        /// never all on one device).
        missing: Vec<String>,
    },
    /// Every matching device on a live provider is leased.
    #[error(
        "all {leased} matching device(s) on available providers are leased \
         ({unavailable} more on unavailable providers)"
    )]
    AllLeased {
        /// Matching devices leased.
        leased: usize,
        /// Matching devices on unavailable providers.
        unavailable: usize,
    },
    /// Matching devices exist only on unavailable providers.
    #[error(
        "the {unavailable} matching device(s) are all on providers that stopped \
         heartbeating (or no longer list them)"
    )]
    ProvidersUnavailable {
        /// Matching devices on unavailable providers.
        unavailable: usize,
    },
}

/// A size for people, with the exact bytes: `2.0 GiB (2147483648 bytes)`.
fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {} ({bytes} bytes)", UNITS[unit])
}

/// ` of at least SIZE`, or nothing when no size was asked for.
fn at_least(bytes: u64) -> String {
    if bytes == 0 {
        String::new()
    } else {
        format!(" of at least {}", size(bytes))
    }
}

impl NoPlacement {
    /// The error code (see [`crate::api::codes`]).
    pub fn code(&self) -> &'static str {
        match self {
            NoPlacement::NoDeviceOfClass { .. } => codes::NO_DEVICE_OF_CLASS,
            NoPlacement::TooSmall { .. } => codes::TOO_SMALL,
            NoPlacement::NoDeviceWithTraits { .. } => codes::NO_DEVICE_WITH_TRAITS,
            NoPlacement::AllLeased { .. } => codes::ALL_LEASED,
            NoPlacement::ProvidersUnavailable { .. } => codes::PROVIDERS_UNAVAILABLE,
        }
    }
}

fn has_all(traits: &[String], wanted: &[String]) -> bool {
    wanted.iter().all(|w| traits.contains(w))
}

fn order(want: &Want, a: &Candidate, b: &Candidate) -> Ordering {
    let numa = want.numa_node.map(|n| format!("NUMA_{n}"));
    let numa_rank = |c: &Candidate| match &numa {
        Some(t) if c.traits.contains(t) => 0u8,
        Some(_) => 1,
        None => 0,
    };
    a.provider_load
        .cmp(&b.provider_load)
        .then_with(|| numa_rank(a).cmp(&numa_rank(b)))
        .then_with(|| a.capacity_bytes.cmp(&b.capacity_bytes))
        .then_with(|| a.provider.cmp(&b.provider))
        .then_with(|| a.name.cmp(&b.name))
}

/// The devices `want` may get, best first, or why there are none.
///
/// # Errors
/// [`NoPlacement`] when no candidate passes the filter.
pub fn place<'a>(
    want: &Want,
    candidates: &'a [Candidate],
) -> Result<Vec<&'a Candidate>, NoPlacement> {
    let of_class: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.resource_class == want.class)
        .collect();
    if of_class.is_empty() {
        return Err(NoPlacement::NoDeviceOfClass {
            class: want.class.clone(),
            total: candidates.len(),
        });
    }
    let big: Vec<&Candidate> = of_class
        .iter()
        .copied()
        .filter(|c| c.capacity_bytes >= want.min_capacity_bytes)
        .collect();
    if big.is_empty() {
        return Err(NoPlacement::TooSmall {
            class: want.class.clone(),
            min_capacity_bytes: want.min_capacity_bytes,
            count: of_class.len(),
            largest_bytes: of_class.iter().map(|c| c.capacity_bytes).max().unwrap_or(0),
        });
    }
    let matching: Vec<&Candidate> = big
        .iter()
        .copied()
        .filter(|c| has_all(&c.traits, &want.traits))
        .collect();
    if matching.is_empty() {
        let missing = want
            .traits
            .iter()
            .filter(|w| !big.iter().any(|c| c.traits.contains(w)))
            .cloned()
            .collect();
        return Err(NoPlacement::NoDeviceWithTraits {
            class: want.class.clone(),
            min_capacity_bytes: want.min_capacity_bytes,
            count: big.len(),
            wanted: want.traits.clone(),
            missing,
        });
    }
    let unavailable = matching.iter().filter(|c| !c.reachable).count();
    let mut free: Vec<&Candidate> = matching
        .iter()
        .copied()
        .filter(|c| c.reachable && !c.leased)
        .collect();
    if free.is_empty() {
        let leased = matching.len() - unavailable;
        return Err(if leased > 0 {
            NoPlacement::AllLeased {
                leased,
                unavailable,
            }
        } else {
            NoPlacement::ProvidersUnavailable { unavailable }
        });
    }
    free.sort_by(|a, b| order(want, a, b));
    Ok(free)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(provider: &str, name: &str, cap: u64, traits: &[&str]) -> Candidate {
        Candidate {
            device_id: Uuid::new_v4(),
            generation: 1,
            provider: provider.into(),
            name: name.into(),
            resource_class: "BLOCK".into(),
            capacity_bytes: cap,
            traits: traits.iter().map(|t| t.to_string()).collect(),
            reachable: true,
            leased: false,
            provider_load: 0,
        }
    }

    fn want(min: u64, traits: &[&str]) -> Want {
        Want {
            class: "BLOCK".into(),
            min_capacity_bytes: min,
            traits: traits.iter().map(|t| t.to_string()).collect(),
            numa_node: None,
        }
    }

    fn names(r: &[&Candidate]) -> Vec<String> {
        r.iter()
            .map(|c| format!("{}/{}", c.provider, c.name))
            .collect()
    }

    #[test]
    fn least_loaded_provider_first_then_best_fit_then_names() {
        let mut a = dev("a", "big", 100, &[]);
        a.provider_load = 1;
        let mut a2 = dev("a", "small", 10, &[]);
        a2.provider_load = 1;
        let b = dev("b", "big", 100, &[]);
        let b2 = dev("b", "mid", 50, &[]);
        let c = dev("c", "mid", 50, &[]);
        let cands = [a, a2, b, b2, c];
        let r = place(&want(10, &[]), &cands).unwrap();
        assert_eq!(names(&r), ["b/mid", "c/mid", "b/big", "a/small", "a/big"]);
    }

    #[test]
    fn numa_preference_comes_after_load_and_before_size() {
        let cands = [
            dev("a", "d0", 10, &["NUMA_0"]),
            dev("a", "d1", 20, &["NUMA_1"]),
            dev("a", "d2", 30, &["NUMA_1"]),
        ];
        let mut w = want(0, &[]);
        w.numa_node = Some(1);
        assert_eq!(names(&place(&w, &cands).unwrap()), ["a/d1", "a/d2", "a/d0"]);
        w.numa_node = None;
        assert_eq!(names(&place(&w, &cands).unwrap()), ["a/d0", "a/d1", "a/d2"]);
    }

    #[test]
    fn sizes_read_for_people_with_the_exact_bytes() {
        assert_eq!(size(1000), "1000 bytes");
        assert_eq!(size(2 << 30), "2.0 GiB (2147483648 bytes)");
        assert_eq!(size(1536 << 20), "1.5 GiB (1610612736 bytes)");
        assert_eq!(at_least(0), "");
        assert_eq!(at_least(1 << 20), " of at least 1.0 MiB (1048576 bytes)");
    }

    #[test]
    fn filters_class_capacity_traits_leased_and_unreachable() {
        let mut nic = dev("a", "nic", 100, &["FABRIC_TCP"]);
        nic.resource_class = "NIC".into();
        let mut leased = dev("a", "leased", 100, &["FABRIC_TCP"]);
        leased.leased = true;
        let mut down = dev("z", "down", 100, &["FABRIC_TCP"]);
        down.reachable = false;
        let cands = [
            nic,
            leased,
            down,
            dev("a", "small", 5, &["FABRIC_TCP"]),
            dev("a", "notcp", 100, &[]),
            dev("a", "ok", 100, &["FABRIC_TCP", "DISCARD"]),
        ];
        let r = place(&want(10, &["FABRIC_TCP"]), &cands).unwrap();
        assert_eq!(names(&r), ["a/ok"]);
    }

    #[test]
    fn reasons_in_order() {
        let e = place(&want(0, &[]), &[]).unwrap_err();
        assert_eq!(e.code(), "no_device_of_class");
        let cands = [dev("a", "d", 10, &["FABRIC_TCP"])];
        let e = place(&want(11, &[]), &cands).unwrap_err();
        assert_eq!(e.code(), "too_small");
        assert!(e.to_string().contains("11 bytes"), "{e}");
        assert!(e.to_string().contains("largest has 10 bytes"), "{e}");
        let e = place(&want(10, &["FABRIC_RDMA"]), &cands).unwrap_err();
        assert_eq!(e.code(), "no_device_with_traits");
        assert!(e.to_string().contains("FABRIC_RDMA"), "{e}");
        let mut leased = cands.clone();
        leased[0].leased = true;
        let e = place(&want(10, &[]), &leased).unwrap_err();
        assert_eq!(e.code(), "all_leased");
        let mut down = cands.clone();
        down[0].reachable = false;
        let e = place(&want(10, &[]), &down).unwrap_err();
        assert_eq!(e.code(), "providers_unavailable");
    }

    #[test]
    fn order_is_total_and_independent_of_input_order() {
        let mut cands: Vec<Candidate> = (0..12)
            .map(|i| {
                let mut c = dev(&format!("p{}", i % 3), &format!("d{i}"), 10 * (i % 4), &[]);
                c.provider_load = i % 2;
                c
            })
            .collect();
        let first = names(&place(&want(0, &[]), &cands).unwrap());
        cands.reverse();
        assert_eq!(first, names(&place(&want(0, &[]), &cands).unwrap()));
        cands.rotate_left(5);
        assert_eq!(first, names(&place(&want(0, &[]), &cands).unwrap()));
    }

    /// A small xorshift generator: the property test below needs no crate.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    #[test]
    fn random_inventories_follow_the_rule() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let all_traits = ["FABRIC_TCP", "FABRIC_RDMA", "DISCARD", "NUMA_0", "NUMA_1"];
        for _ in 0..2000 {
            let cands: Vec<Candidate> = (0..rng.next(12))
                .map(|i| {
                    let traits: Vec<&str> = all_traits
                        .iter()
                        .copied()
                        .filter(|_| rng.next(2) == 0)
                        .collect();
                    let mut c = dev(
                        &format!("p{}", rng.next(3)),
                        &format!("d{i}"),
                        rng.next(5),
                        &traits,
                    );
                    if rng.next(4) == 0 {
                        c.resource_class = "NIC".into();
                    }
                    c.leased = rng.next(3) == 0;
                    c.reachable = rng.next(5) != 0;
                    c.provider_load = rng.next(3);
                    c
                })
                .collect();
            let mut w = want(rng.next(5), &all_traits[..rng.next(3) as usize]);
            w.numa_node = (rng.next(2) == 0).then(|| rng.next(2) as u32);
            let ok = |c: &Candidate| {
                c.resource_class == "BLOCK"
                    && c.capacity_bytes >= w.min_capacity_bytes
                    && has_all(&c.traits, &w.traits)
                    && c.reachable
                    && !c.leased
            };
            match place(&w, &cands) {
                Ok(order) => {
                    assert!(!order.is_empty());
                    assert_eq!(order.len(), cands.iter().filter(|c| ok(c)).count());
                    assert!(order.iter().all(|c| ok(c)));
                    // The documented key, spelled out independently of `order`.
                    let numa = w.numa_node.map(|n| format!("NUMA_{n}"));
                    let key = |c: &Candidate| {
                        let far = numa.as_ref().is_some_and(|t| !c.traits.contains(t));
                        (
                            c.provider_load,
                            far,
                            c.capacity_bytes,
                            c.provider.clone(),
                            c.name.clone(),
                        )
                    };
                    for pair in order.windows(2) {
                        assert!(key(pair[0]) <= key(pair[1]), "{pair:?}");
                    }
                }
                Err(e) => {
                    assert!(!cands.iter().any(ok), "{e} but a device fits");
                }
            }
        }
    }
}
