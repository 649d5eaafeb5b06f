//! Syntax and bounds of what clients send, checked before anything reaches the database.

use crate::api::{
    DeviceSpec, RegisterProvider, MAX_CAPACITY_BYTES, MAX_DEVICES_PER_PROVIDER,
    MAX_HEARTBEAT_TTL_MS, MAX_LEASE_TTL_MS, MAX_NAME_LEN, MAX_TRAITS, MIN_HEARTBEAT_TTL_MS,
    MIN_LEASE_TTL_MS,
};
use crate::error::{Error, Result};
use crate::rules;

/// A provider or device name ([`rules::name`]).
pub fn name(what: &str, v: &str) -> Result<()> {
    rules::name(what, v).map_err(Error::invalid)
}

/// Free text (consumer, compute host): 1..=255 bytes, no control characters.
pub fn text(what: &str, v: &str) -> Result<()> {
    if v.is_empty() || v.len() > MAX_NAME_LEN || v.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "{what} must be 1 to {MAX_NAME_LEN} bytes without control characters"
        )));
    }
    Ok(())
}

/// A resource class: `BLOCK`, `NIC` or `PCI_<4 hex>_<4 hex>` (upper case).
pub fn class(v: &str) -> Result<()> {
    let hex4 = |s: &str| {
        s.len() == 4
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b))
    };
    let ok = match v {
        "BLOCK" | "NIC" => true,
        _ => v
            .strip_prefix("PCI_")
            .and_then(|r| r.split_once('_'))
            .is_some_and(|(ven, dev)| hex4(ven) && hex4(dev)),
    };
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "resource class {v:?} is not BLOCK, NIC or PCI_<vendor>_<device> \
             (four upper-case hex digits each, e.g. PCI_8086_0A54)"
        )))
    }
}

/// A trait: upper-case `[A-Z0-9_]+`, at most 64 bytes.
pub fn trait_name(v: &str) -> Result<()> {
    let ok = !v.is_empty()
        && v.len() <= 64
        && v.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "trait {v:?} is not 1 to 64 of upper-case A-Z, 0-9 and _ (e.g. FABRIC_TCP)"
        )))
    }
}

/// A list of traits: each valid, at most [`MAX_TRAITS`]; returned sorted, deduplicated.
pub fn traits(v: &[String]) -> Result<Vec<String>> {
    if v.len() > MAX_TRAITS {
        return Err(Error::invalid(format!(
            "{} traits given, at most {MAX_TRAITS} accepted",
            v.len()
        )));
    }
    for t in v {
        trait_name(t)?;
    }
    let mut out = v.to_vec();
    out.sort();
    out.dedup();
    Ok(out)
}

/// A fabric address ([`rules::address`]).
pub fn address(v: &str) -> Result<()> {
    rules::address(v).map_err(Error::invalid)
}

/// A provider's further fabric addresses beside `primary` ([`rules::fabric_paths`]).
pub fn fabric_paths(primary: &str, paths: &[String]) -> Result<()> {
    rules::fabric_paths(primary, paths).map_err(Error::invalid)
}

/// A capacity in bytes: at most [`MAX_CAPACITY_BYTES`].
pub fn capacity(what: &str, v: u64) -> Result<()> {
    if v > MAX_CAPACITY_BYTES {
        return Err(Error::invalid(format!(
            "{what} {v} is larger than the {MAX_CAPACITY_BYTES} bytes (1 EiB) accepted"
        )));
    }
    Ok(())
}

/// A lease TTL in ms: [`MIN_LEASE_TTL_MS`]..=[`MAX_LEASE_TTL_MS`].
pub fn lease_ttl(v: u64) -> Result<()> {
    if !(MIN_LEASE_TTL_MS..=MAX_LEASE_TTL_MS).contains(&v) {
        return Err(Error::invalid(format!(
            "ttl_ms {v} is outside {MIN_LEASE_TTL_MS}..={MAX_LEASE_TTL_MS} ms"
        )));
    }
    Ok(())
}

/// A generation as sent: it must fit the database's signed 64-bit counter.
pub fn generation(v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::invalid(format!("generation {v} is out of range")))
}

/// A whole registration; returns the device specs with traits sorted.
pub fn registration(name_: &str, r: &RegisterProvider) -> Result<Vec<DeviceSpec>> {
    name("provider name", name_)?;
    rules::reachable_address(&r.fabric_address).map_err(Error::invalid)?;
    fabric_paths(&r.fabric_address, &r.fabric_paths)?;
    if r.transports.len() > 8
        || r.transports.iter().any(|t| {
            t.is_empty()
                || t.len() > 32
                || !t
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        })
    {
        return Err(Error::invalid(
            "transports must be at most 8 lower-case names such as \"tcp\" or \"rdma\"",
        ));
    }
    if !(MIN_HEARTBEAT_TTL_MS..=MAX_HEARTBEAT_TTL_MS).contains(&r.heartbeat_ttl_ms) {
        return Err(Error::invalid(format!(
            "heartbeat_ttl_ms {} is outside {MIN_HEARTBEAT_TTL_MS}..={MAX_HEARTBEAT_TTL_MS} ms",
            r.heartbeat_ttl_ms
        )));
    }
    if r.devices.len() > MAX_DEVICES_PER_PROVIDER {
        return Err(Error::invalid(format!(
            "{} devices given, at most {MAX_DEVICES_PER_PROVIDER} per provider",
            r.devices.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(r.devices.len());
    for d in &r.devices {
        name("device name", &d.name)?;
        if !seen.insert(d.name.as_str()) {
            return Err(Error::invalid(format!(
                "device {:?} is listed twice",
                d.name
            )));
        }
        class(&d.resource_class)?;
        capacity("capacity_bytes", d.capacity_bytes)?;
        out.push(DeviceSpec {
            traits: traits(&d.traits)?,
            ..d.clone()
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        for ok in ["BLOCK", "NIC", "PCI_8086_0A54", "PCI_10DE_2330"] {
            assert!(class(ok).is_ok(), "{ok}");
        }
        for bad in [
            "block",
            "",
            "PCI_8086",
            "PCI_8086_0a54",
            "PCI_8086_0A545",
            "GPU",
            "PCI__",
        ] {
            assert!(class(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn traits_and_names() {
        assert_eq!(
            traits(&["NUMA_0".into(), "DISCARD".into(), "NUMA_0".into()]).unwrap(),
            ["DISCARD", "NUMA_0"]
        );
        for bad in ["", "fabric_tcp", "A B", "A-B", "É"] {
            assert!(trait_name(bad).is_err(), "{bad}");
        }
        assert!(name("n", "disk0").is_ok());
        for bad in ["", "a/b", "a b", "a\0"] {
            assert!(name("n", bad).is_err(), "{bad:?}");
        }
        assert!(text("c", "vm 1").is_ok());
        assert!(text("c", "vm\u{0}").is_err());
    }
}
