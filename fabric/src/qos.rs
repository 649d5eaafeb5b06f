//! Quality of service of a lease: the rates a lender holds one borrower to.
//!
//! A [`Qos`] is a set of limits, each on one [`Lane`] (a kind of thing counted: block
//! operations or bytes, read, write or both; a NIC's packets or bytes, each way), plus
//! an optional weight for sharing a backing store (`docs/qos.md`). The pool sets it on
//! a lease and signs it into the lease token (layout version 3,
//! [`crate::lease_token`]); a lender also has its own per device. The lender enforces
//! the tighter of the two ([`Qos::tighter`]), so a borrower can lower its limits but
//! never lift them.
//!
//! Every limit is a token bucket: it refills at `per_sec` units a second up to `burst`
//! units. A request may start while every bucket it draws from is not in debt; it then
//! takes its whole cost, which may put a bucket in debt (a 1 MiB write under a 64 KiB
//! burst still goes, and the next one waits until the debt is repaid). So over any
//! long interval the rate is `per_sec`, plus at most one burst and one request.
//!
//! Names follow the throttle options operators know from QEMU (`iops-total`,
//! `bps-read`, ...), with `_` for `-`: `bps` is **bytes** per second. `tx` and `rx` are
//! the guest's: `tx` is what the guest sends out through a lent NIC.
//!
//! Wire form (inside a token; integers little-endian): `count: u8` (0..=10), then
//! `count` times `lane: u8, per_sec: u64, burst: u64`, lanes ascending and each at most
//! once, `per_sec >= 1`, `burst` 0 for the default; then `weight: u32` (0 for none).

use serde::{Deserialize, Serialize};

use crate::codec::{self, CodecError, Reader};

/// The largest weight.
pub const MAX_WEIGHT: u32 = 10_000;
/// The weight of a borrower that was given none.
pub const DEFAULT_WEIGHT: u32 = 100;

/// What one limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Lane {
    /// Block operations of any kind a second (reads, writes, flushes, discards, write
    /// zeroes).
    IopsTotal = 1,
    /// Block reads a second.
    IopsRead = 2,
    /// Block writes, discards and write zeroes a second.
    IopsWrite = 3,
    /// Bytes read or written a second.
    BpsTotal = 4,
    /// Bytes read a second.
    BpsRead = 5,
    /// Bytes written a second.
    BpsWrite = 6,
    /// Frames the guest sends a second.
    TxPps = 7,
    /// Frames the guest receives a second.
    RxPps = 8,
    /// Bytes of frames the guest sends a second.
    TxBps = 9,
    /// Bytes of frames the guest receives a second.
    RxBps = 10,
}

/// How many lanes there are.
pub const LANE_COUNT: usize = 10;

/// Every lane, in wire order, with its configuration name.
pub const LANES: [(Lane, &str); LANE_COUNT] = [
    (Lane::IopsTotal, "iops_total"),
    (Lane::IopsRead, "iops_read"),
    (Lane::IopsWrite, "iops_write"),
    (Lane::BpsTotal, "bps_total"),
    (Lane::BpsRead, "bps_read"),
    (Lane::BpsWrite, "bps_write"),
    (Lane::TxPps, "tx_pps"),
    (Lane::RxPps, "rx_pps"),
    (Lane::TxBps, "tx_bps"),
    (Lane::RxBps, "rx_bps"),
];

impl Lane {
    /// The lane of a wire code.
    pub fn from_code(code: u8) -> Option<Lane> {
        LANES
            .get(usize::from(code).checked_sub(1)?)
            .map(|(l, _)| *l)
    }

    /// Its index in [`LANES`] and in [`Qos::limits`].
    pub fn index(self) -> usize {
        self as usize - 1
    }

    /// Its configuration name (`iops_read`, ...).
    pub fn name(self) -> &'static str {
        LANES[self.index()].1
    }
}

/// One limit: a rate and the bucket it fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Units (operations, frames or bytes) a second, at least 1.
    pub per_sec: u64,
    /// Units that may go at once after an idle time (the bucket's size); 0 for the
    /// default, a tenth of a second's worth ([`Limit::bucket`]).
    pub burst: u64,
}

impl Limit {
    /// The bucket size: `burst`, or a tenth of `per_sec` (at least 1) when it is 0.
    pub fn bucket(&self) -> u64 {
        if self.burst > 0 {
            self.burst
        } else {
            (self.per_sec / 10).max(1)
        }
    }
}

/// Why a [`Qos`] is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QosError {
    /// A rate of 0 (nothing would ever be served).
    #[error("{0} must be at least 1")]
    ZeroRate(&'static str),
    /// A burst given without its rate.
    #[error("{0}_burst is given without {0}")]
    BurstWithoutRate(&'static str),
    /// A weight outside 1..=[`MAX_WEIGHT`].
    #[error("weight must be 1..=10000, not {0}")]
    BadWeight(u32),
}

/// The limits of a lease or a device: one optional [`Limit`] per [`Lane`], and a
/// weight. Empty ([`Qos::is_empty`]) means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "QosFields", into = "QosFields")]
pub struct Qos {
    /// Indexed by [`Lane::index`].
    pub limits: [Option<Limit>; LANE_COUNT],
    /// The share of a backing store's capacity, relative to the other borrowers of
    /// devices on the same store (1..=10000; [`DEFAULT_WEIGHT`] when none).
    pub weight: Option<u32>,
}

impl Qos {
    /// No limit and no weight.
    pub fn is_empty(&self) -> bool {
        self.limits.iter().all(Option::is_none) && self.weight.is_none()
    }

    /// The limit on `lane`.
    pub fn get(&self, lane: Lane) -> Option<Limit> {
        self.limits[lane.index()]
    }

    /// Sets the limit on `lane` (builder style).
    #[must_use]
    pub fn with(mut self, lane: Lane, per_sec: u64, burst: u64) -> Qos {
        self.limits[lane.index()] = Some(Limit { per_sec, burst });
        self
    }

    /// Sets the weight (builder style).
    #[must_use]
    pub fn with_weight(mut self, weight: u32) -> Qos {
        self.weight = Some(weight);
        self
    }

    /// Checks every rate and the weight.
    ///
    /// # Errors
    /// [`QosError::ZeroRate`], [`QosError::BadWeight`].
    pub fn validate(&self) -> Result<(), QosError> {
        for (lane, name) in LANES {
            if self.get(lane).is_some_and(|l| l.per_sec == 0) {
                return Err(QosError::ZeroRate(name));
            }
        }
        match self.weight {
            Some(w) if w == 0 || w > MAX_WEIGHT => Err(QosError::BadWeight(w)),
            _ => Ok(()),
        }
    }

    /// The tighter of `self` and `other`, lane by lane: the lower rate (with the
    /// smaller bucket), the lower weight. What a lender enforces of its own limits
    /// and a lease's: neither can lift the other.
    #[must_use]
    pub fn tighter(&self, other: &Qos) -> Qos {
        let mut out = Qos::default();
        for (i, slot) in out.limits.iter_mut().enumerate() {
            *slot = match (self.limits[i], other.limits[i]) {
                (Some(a), Some(b)) => Some(Limit {
                    per_sec: a.per_sec.min(b.per_sec),
                    burst: a.bucket().min(b.bucket()),
                }),
                (a, b) => a.or(b),
            };
        }
        out.weight = match (self.weight, other.weight) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        out
    }

    /// Appends the wire form.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let set: Vec<(Lane, Limit)> = LANES
            .iter()
            .filter_map(|(lane, _)| self.get(*lane).map(|l| (*lane, l)))
            .collect();
        codec::push(out, set.len() as u8);
        for (lane, limit) in set {
            codec::push(out, lane as u8);
            codec::push(out, limit.per_sec);
            codec::push(out, limit.burst);
        }
        codec::push(out, self.weight.unwrap_or(0));
    }

    /// Reads the wire form.
    ///
    /// # Errors
    /// [`QosWireError`] for an unknown, repeated or unordered lane, a zero rate, a
    /// weight out of range, or too few bytes.
    pub fn decode(r: &mut Reader<'_>) -> Result<Qos, QosWireError> {
        let count = usize::from(r.u8()?);
        if count > LANE_COUNT {
            return Err(QosWireError("more limits than lanes"));
        }
        let mut q = Qos::default();
        let mut last = 0u8;
        for _ in 0..count {
            let code = r.u8()?;
            let lane = Lane::from_code(code).ok_or(QosWireError("unknown lane"))?;
            if code <= last {
                return Err(QosWireError("lanes not in ascending order"));
            }
            last = code;
            let per_sec = r.u64()?;
            let burst = r.u64()?;
            q.limits[lane.index()] = Some(Limit { per_sec, burst });
        }
        let weight = r.u32()?;
        q.weight = (weight != 0).then_some(weight);
        q.validate()
            .map_err(|_| QosWireError("rate 0 or weight out of range"))?;
        Ok(q)
    }
}

/// A malformed wire form of a [`Qos`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed QoS: {0}")]
pub struct QosWireError(pub &'static str);

impl From<CodecError> for QosWireError {
    fn from(_: CodecError) -> Self {
        QosWireError("truncated")
    }
}

/// A rate or bucket size of the flat form: a number, or a string with the K, M, G or T
/// suffix every size and rate an operator types takes ([`crate::units::parse_size`]:
/// powers of 1024), so that `bps_read = "50M"` in a lender's TOML means what
/// `bps_read=50M` means in its `--device` flag.
fn size_or_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Value {
        Number(u64),
        Text(String),
    }
    match Option::<Value>::deserialize(d)? {
        None => Ok(None),
        Some(Value::Number(n)) => Ok(Some(n)),
        Some(Value::Text(t)) => crate::units::parse_size(&t)
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

/// The flat configuration and JSON form of a [`Qos`]: `iops_read = 2000`,
/// `iops_read_burst = 400`, `bps_read = 52428800`, `weight = 3`, ...
macro_rules! qos_fields {
    ($( $lane:ident, $rate:ident, $burst:ident; )*) => {
        /// The flat form of a [`Qos`] (what TOML and JSON hold).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct QosFields {
            $(
                #[doc = concat!("Rate of lane `", stringify!($rate), "`.")]
                #[serde(default, deserialize_with = "size_or_number", skip_serializing_if = "Option::is_none")]
                pub $rate: Option<u64>,
                #[doc = concat!("Bucket size of lane `", stringify!($rate), "`.")]
                #[serde(default, deserialize_with = "size_or_number", skip_serializing_if = "Option::is_none")]
                pub $burst: Option<u64>,
            )*
            /// Share of a backing store, 1..=10000.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub weight: Option<u32>,
        }

        impl TryFrom<QosFields> for Qos {
            type Error = QosError;
            fn try_from(f: QosFields) -> Result<Qos, QosError> {
                let mut q = Qos { weight: f.weight, ..Qos::default() };
                $(
                    match (f.$rate, f.$burst) {
                        (Some(per_sec), burst) => {
                            q.limits[Lane::$lane.index()] =
                                Some(Limit { per_sec, burst: burst.unwrap_or(0) });
                        }
                        (None, Some(_)) => {
                            return Err(QosError::BurstWithoutRate(stringify!($rate)))
                        }
                        (None, None) => {}
                    }
                )*
                q.validate()?;
                Ok(q)
            }
        }

        impl From<Qos> for QosFields {
            fn from(q: Qos) -> QosFields {
                let mut f = QosFields { weight: q.weight, ..QosFields::default() };
                $(
                    if let Some(l) = q.get(Lane::$lane) {
                        f.$rate = Some(l.per_sec);
                        f.$burst = (l.burst > 0).then_some(l.burst);
                    }
                )*
                f
            }
        }
    };
}

qos_fields! {
    IopsTotal, iops_total, iops_total_burst;
    IopsRead, iops_read, iops_read_burst;
    IopsWrite, iops_write, iops_write_burst;
    BpsTotal, bps_total, bps_total_burst;
    BpsRead, bps_read, bps_read_burst;
    BpsWrite, bps_write, bps_write_burst;
    TxPps, tx_pps, tx_pps_burst;
    RxPps, rx_pps, rx_pps_burst;
    TxBps, tx_bps, tx_bps_burst;
    RxBps, rx_bps, rx_bps_burst;
}

impl std::fmt::Display for Qos {
    /// `iops_read=2000 bps_read=52428800/5242880 weight=3` (`rate/burst` when a burst
    /// is set), or `unlimited`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_empty() {
            return f.write_str("unlimited");
        }
        let mut sep = "";
        for (lane, name) in LANES {
            if let Some(l) = self.get(lane) {
                write!(f, "{sep}{name}={}", l.per_sec)?;
                if l.burst > 0 {
                    write!(f, "/{}", l.burst)?;
                }
                sep = " ";
            }
        }
        if let Some(w) = self.weight {
            write!(f, "{sep}weight={w}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Qos {
        Qos::default()
            .with(Lane::IopsRead, 2000, 0)
            .with(Lane::BpsWrite, 50 << 20, 1 << 20)
            .with(Lane::RxPps, 10_000, 0)
            .with_weight(3)
    }

    #[test]
    fn wire_form_round_trips() {
        let mut b = Vec::new();
        sample().encode(&mut b);
        let mut r = Reader::new(&b);
        assert_eq!(Qos::decode(&mut r).unwrap(), sample());
        r.finish().unwrap();
        let mut empty = Vec::new();
        Qos::default().encode(&mut empty);
        assert_eq!(empty, [0, 0, 0, 0, 0]);
    }

    #[test]
    fn malformed_wire_forms_are_refused() {
        let mut b = Vec::new();
        sample().encode(&mut b);
        // Unknown lane, repeated lane, rate 0, weight out of range, truncation.
        let mut unknown = b.clone();
        unknown[1] = 11;
        let mut repeated = b.clone();
        repeated[18] = repeated[1];
        let mut zero = b.clone();
        zero[2..10].fill(0);
        let mut heavy = b.clone();
        let n = heavy.len();
        heavy[n - 4..].copy_from_slice(&20_000u32.to_le_bytes());
        for bad in [
            unknown,
            repeated,
            zero,
            heavy,
            b[..b.len() - 1].to_vec(),
            vec![11],
        ] {
            assert!(Qos::decode(&mut Reader::new(&bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn flat_form_rates_take_the_size_suffixes_of_the_flags() {
        let q: Qos = serde_json::from_str(
            r#"{"iops_read": "2000", "bps_write": "50M", "bps_write_burst": "1M",
                "rx_pps": 10000, "weight": 3}"#,
        )
        .unwrap();
        assert_eq!(q, sample());
        let err = serde_json::from_str::<Qos>(r#"{"bps_read": "5Q"}"#).unwrap_err();
        assert!(err.to_string().contains("'Q'"), "{err}");
        assert!(serde_json::from_str::<Qos>(r#"{"bps_read": "1.5M"}"#).is_err());
        assert!(serde_json::from_str::<Qos>(r#"{"bps_read": -1}"#).is_err());
    }

    #[test]
    fn flat_form_reads_and_writes_each_lane() {
        let q: Qos = serde_json::from_str(
            r#"{"iops_read": 2000, "bps_write": 52428800, "bps_write_burst": 1048576,
                "rx_pps": 10000, "weight": 3}"#,
        )
        .unwrap();
        assert_eq!(q, sample());
        let back: Qos = serde_json::from_str(&serde_json::to_string(&q).unwrap()).unwrap();
        assert_eq!(back, q);
        for bad in [
            r#"{"iops_read": 0}"#,
            r#"{"iops_read_burst": 5}"#,
            r#"{"weight": 0}"#,
            r#"{"iops": 5}"#,
        ] {
            assert!(serde_json::from_str::<Qos>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_tighter_of_two_takes_the_lower_of_each() {
        let lender = Qos::default()
            .with(Lane::IopsRead, 1000, 0)
            .with(Lane::BpsRead, 100, 0);
        let lease = Qos::default()
            .with(Lane::IopsRead, 5000, 0)
            .with(Lane::IopsWrite, 10, 0)
            .with_weight(7);
        let t = lender.tighter(&lease);
        assert_eq!(t.get(Lane::IopsRead).map(|l| l.per_sec), Some(1000));
        assert_eq!(t.get(Lane::IopsWrite).map(|l| l.per_sec), Some(10));
        assert_eq!(t.get(Lane::BpsRead).map(|l| l.per_sec), Some(100));
        assert_eq!(t.weight, Some(7));
        assert_eq!(t, lease.tighter(&lender));
        assert_eq!(
            Limit {
                per_sec: 5,
                burst: 0
            }
            .bucket(),
            1
        );
        assert_eq!(
            sample().to_string(),
            "iops_read=2000 bps_write=52428800/1048576 rx_pps=10000 weight=3"
        );
    }
}
