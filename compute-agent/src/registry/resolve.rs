//! Where an attachment's sessions go: a lender addressed directly (`HOST:PORT`), or by
//! cluster through this compute agent's gateway (`CLUSTER/LENDER`).

/// Where an attachment's sessions connect: the lender itself, or the local gateway with
/// a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// `HOST:PORT` to connect to: the lender, or the cluster gateway.
    pub addr: String,
    /// The route the gateway is asked for; `None`: direct.
    pub relay: Option<devlend_fabric::relay::Route>,
    /// The device name on the lender.
    pub device: String,
}

/// Resolves a request's `lender` and `device` into where its sessions go.
///
/// - `lender` `HOST:PORT`: direct, `device` as given;
/// - `lender` `CLUSTER/LENDER`, or an empty `lender` and `device`
///   `CLUSTER/LENDER/DEVICE`: through `gateway` (this agent's `(cluster, HOST:PORT)`),
///   which relays to the named lender of that cluster (its own cluster's included: the
///   gateway knows its lenders by name; the hop stays inside the cluster).
///
/// # Errors
/// A message for a malformed address, or a cluster address without a gateway.
pub fn resolve(
    lender: &str,
    device: &str,
    gateway: Option<&(String, String)>,
) -> Result<Resolved, String> {
    let (cluster, name, device) = if lender.contains('/') {
        let (c, l) = lender.split_once('/').unwrap_or((lender, ""));
        let (_, _, d) = devlend_fabric::relay::parse_device_address(&format!("{c}/{l}/{device}"))?;
        (c.to_owned(), l.to_owned(), d)
    } else if lender.is_empty() {
        devlend_fabric::relay::parse_device_address(device)?
    } else {
        return Ok(Resolved {
            addr: lender.to_owned(),
            relay: None,
            device: device.to_owned(),
        });
    };
    let Some((_, gw)) = gateway else {
        return Err(format!(
            "lender {cluster}/{name} is addressed by cluster, but this compute agent has no gateway (configure cluster and gateway)"
        ));
    };
    Ok(Resolved {
        addr: gw.clone(),
        relay: Some(devlend_fabric::relay::Route {
            cluster,
            lender: name,
        }),
        device,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_resolve_direct_or_through_the_gateway() {
        let gw = ("a".to_owned(), "10.0.0.1:7710".to_owned());
        let d = resolve("10.0.0.9:7700", "disk0", Some(&gw)).unwrap();
        assert_eq!(d.addr, "10.0.0.9:7700");
        assert!(d.relay.is_none());
        let r = resolve("b/store1", "disk0", Some(&gw)).unwrap();
        assert_eq!(r.addr, "10.0.0.1:7710");
        assert_eq!(
            r.relay,
            Some(devlend_fabric::relay::Route {
                cluster: "b".into(),
                lender: "store1".into()
            })
        );
        assert_eq!(r.device, "disk0");
        let r = resolve("", "b/store1/disk0", Some(&gw)).unwrap();
        assert_eq!(r.device, "disk0");
        assert_eq!(r.relay.unwrap().lender, "store1");
        let e = resolve("b/store1", "disk0", None).unwrap_err();
        assert!(e.contains("no gateway"), "{e}");
        assert!(resolve("b/", "disk0", Some(&gw)).is_err());
        assert!(resolve("b/x/y", "disk0", Some(&gw)).is_err());
        assert!(resolve("", "disk0", Some(&gw)).is_err());
    }
}
