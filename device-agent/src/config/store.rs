//! A backing store that several lent devices share, as `--store NAME:KEY=N,...` or a
//! `[[store]]` table gives it: its name and its capacity, which the borrowers busy on
//! its devices divide by weight (`docs/qos.md`).

use std::str::FromStr;

use devlend_fabric::qos::{Lane, Qos};
use serde::{Deserialize, Serialize};

use super::spec_flag::{apply_bursts, qos_option};
use crate::{DeviceSpec, Error};

/// A backing store and its capacity.
///
/// In the config file:
/// ```toml
/// [[store]]
/// name = "nvme0"
/// [store.capacity]
/// bps_total = 2000000000
/// iops_total = 400000
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSpec {
    /// The name devices give as `store`.
    pub name: String,
    /// What it can do, as block limits (`iops_*`, `bps_*`; bytes per second). The
    /// operator measures it: devlend cannot know a device's capacity.
    pub capacity: Qos,
}

impl StoreSpec {
    /// Checks the name and that the capacity is of block lanes, and not empty.
    ///
    /// # Errors
    /// [`Error::BadSpec`].
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |reason: &str| {
            Err(Error::BadSpec {
                spec: self.name.clone(),
                reason: format!("store: {reason}"),
            })
        };
        if self.name.is_empty() || self.name.len() > 255 {
            return bad("the name must be 1 to 255 bytes");
        }
        if self.capacity.limits.iter().all(Option::is_none) {
            return bad("no capacity: give at least one of iops_* or bps_*");
        }
        if self.capacity.weight.is_some() {
            return bad("a store has a capacity, not a weight (weights are the borrowers')");
        }
        if devlend_fabric::qos::LANES
            .iter()
            .any(|(l, _)| *l >= Lane::TxPps && self.capacity.get(*l).is_some())
        {
            return bad("a store's capacity is in block lanes (iops_*, bps_*)");
        }
        self.capacity.validate().map_err(|e| Error::BadSpec {
            spec: self.name.clone(),
            reason: format!("store: {e}"),
        })
    }
}

impl FromStr for StoreSpec {
    type Err = Error;

    /// Parses `NAME:KEY=N[,KEY=N...]`, e.g. `nvme0:bps_total=2000000000` or
    /// `nvme0:bps_total=2G` (K, M, G, T: powers of 1024).
    ///
    /// # Errors
    /// [`Error::BadSpec`].
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |reason: String| Error::BadSpec {
            spec: s.to_owned(),
            reason,
        };
        let (name, rest) = s
            .split_once(':')
            .ok_or_else(|| bad("expected NAME:KEY=N[,KEY=N...]".into()))?;
        let mut capacity = Qos::default();
        let mut bursts = Vec::new();
        for opt in rest.split(',') {
            match qos_option(&mut capacity, &mut bursts, opt) {
                Some(r) => r.map_err(bad)?,
                None => return Err(bad(format!("unknown capacity {opt:?}"))),
            }
        }
        apply_bursts(&mut capacity, bursts).map_err(bad)?;
        let spec = StoreSpec {
            name: name.to_owned(),
            capacity,
        };
        spec.validate()?;
        Ok(spec)
    }
}

/// Checks that store names are unique and that every device's `store` names one.
///
/// # Errors
/// [`Error::BadSpec`].
pub(crate) fn check_stores(stores: &[StoreSpec], devices: &[DeviceSpec]) -> Result<(), Error> {
    for (i, s) in stores.iter().enumerate() {
        s.validate()?;
        if stores[..i].iter().any(|o| o.name == s.name) {
            return Err(Error::BadSpec {
                spec: s.name.clone(),
                reason: "store: the name is given twice".into(),
            });
        }
    }
    for d in devices {
        if let Some(name) = d.store() {
            if !stores.iter().any(|s| s.name == name) {
                return Err(Error::BadSpec {
                    spec: d.name.clone(),
                    reason: format!("store {name:?} is not configured (--store or [[store]])"),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_form_parses_and_checks() {
        let s: StoreSpec = "nvme0:bps_total=2000000000,iops_read=1000,iops_read_burst=50"
            .parse()
            .unwrap();
        assert_eq!(s.name, "nvme0");
        assert_eq!(
            s.capacity.get(Lane::BpsTotal).unwrap().per_sec,
            2_000_000_000
        );
        assert_eq!(s.capacity.get(Lane::IopsRead).unwrap().burst, 50);
        // The suffixes of every size and rate (powers of 1024), as the CLI takes them.
        let s: StoreSpec = "nvme0:bps_total=50M,iops_total=400K".parse().unwrap();
        assert_eq!(s.capacity.get(Lane::BpsTotal).unwrap().per_sec, 52_428_800);
        assert_eq!(s.capacity.get(Lane::IopsTotal).unwrap().per_sec, 400 << 10);
        for bad in [
            "nvme0",
            "nvme0:",
            "nvme0:weight=3",
            "nvme0:tx_pps=5",
            "nvme0:bps_total=0",
            "nvme0:bps_total=x",
            "nvme0:bps_total=50Q",
            ":bps_total=5",
            "nvme0:iops_read_burst=5",
        ] {
            assert!(bad.parse::<StoreSpec>().is_err(), "{bad}");
        }
    }
}
