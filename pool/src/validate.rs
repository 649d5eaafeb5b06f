//! Syntax and bounds of what clients send, checked before anything reaches the database.

use crate::api::{
    DeviceSpec, RegisterProvider, MAX_CAPACITY_BYTES, MAX_DEVICES_PER_PROVIDER, MAX_FABRIC_PATHS,
    MAX_HEARTBEAT_TTL_MS, MAX_LEASE_TTL_MS, MAX_NAME_LEN, MAX_TRAITS, MIN_HEARTBEAT_TTL_MS,
    MIN_LEASE_TTL_MS,
};
use crate::error::{Error, Result};

/// A provider or device name: `[A-Za-z0-9._:-]`, 1..=255 bytes.
pub fn name(what: &str, v: &str) -> Result<()> {
    let ok = !v.is_empty()
        && v.len() <= MAX_NAME_LEN
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{what} {v:?} is not a name: use 1 to {MAX_NAME_LEN} of A-Z a-z 0-9 . _ : -"
        )))
    }
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

/// A fabric address: `HOST:PORT` with a port number, no blanks.
pub fn address(v: &str) -> Result<()> {
    let ok = v.len() <= MAX_NAME_LEN
        && !v
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == ',')
        && v.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "fabric_address {v:?} is not HOST:PORT"
        )))
    }
}

/// A provider's further fabric addresses beside `primary`: at most
/// [`MAX_FABRIC_PATHS`], each an [`address`] that is not a wildcard, all distinct.
pub fn fabric_paths(primary: &str, paths: &[String]) -> Result<()> {
    if paths.len() > MAX_FABRIC_PATHS {
        return Err(Error::invalid(format!(
            "{} fabric_paths given, at most {MAX_FABRIC_PATHS} beside fabric_address",
            paths.len()
        )));
    }
    let mut seen = vec![primary];
    for p in paths {
        address(p)?;
        if p.contains('/') {
            return Err(Error::invalid(format!(
                "fabric_paths address {p:?} is not HOST:PORT"
            )));
        }
        let wildcard = p
            .rsplit_once(':')
            .is_some_and(|(host, _)| matches!(host, "0.0.0.0" | "[::]" | "::" | "*"));
        if wildcard {
            return Err(Error::invalid(format!(
                "fabric_paths address {p:?} is a wildcard: give one borrowers can reach"
            )));
        }
        if seen.contains(&p.as_str()) {
            return Err(Error::invalid(format!(
                "fabric address {p:?} is given twice"
            )));
        }
        seen.push(p);
    }
    Ok(())
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
    address(&r.fabric_address)?;
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

    #[test]
    fn addresses() {
        for ok in ["10.0.0.1:7700", "devsrv:7700", "[::1]:7700"] {
            assert!(address(ok).is_ok(), "{ok}");
        }
        for bad in ["", "devsrv", ":7700", "h:0", "h:99999", "h :1"] {
            assert!(address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn further_fabric_addresses() {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(fabric_paths("a:1", &[]).is_ok());
        assert!(fabric_paths("a:1", &v(&["b:1", "10.0.0.2:7700", "[fd00::2]:7700"])).is_ok());
        let seven = v(&["b:1", "b:2", "b:3", "b:4", "b:5", "b:6", "b:7"]);
        assert!(fabric_paths("a:1", &seven).is_ok());
        let mut eight = seven.clone();
        eight.push("b:8".into());
        assert!(fabric_paths("a:1", &eight).is_err());
        for bad in [
            "0.0.0.0:7700",
            "[::]:7700",
            "b",
            "b:0",
            ":7700",
            "b :1",
            "b:1,c:1",
            "a:1",
        ] {
            assert!(fabric_paths("a:1", &v(&[bad])).is_err(), "{bad}");
        }
        assert!(fabric_paths("a:1", &v(&["b:1", "b:1"])).is_err());
    }
}
