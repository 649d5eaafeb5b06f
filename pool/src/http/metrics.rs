//! `GET /metrics`: the pool's state as Prometheus gauges, read from the store at scrape
//! time (text exposition format 0.0.4). Served on the API's own address, so a scraper
//! needs no second port.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;

use crate::api::{DeviceQuery, DeviceState, LeaseFilter};
use crate::error::Error;
use crate::service::PoolService;

/// The content type of the text exposition format.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

fn device_state(s: DeviceState) -> &'static str {
    match s {
        DeviceState::Available => "available",
        DeviceState::Leased => "leased",
        DeviceState::Unavailable => "unavailable",
    }
}

/// A label value escaped as the exposition format wants (`\`, `"` and newlines).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, help: &str, series: &BTreeMap<String, u64>) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    for (labels, v) in series {
        let _ = writeln!(out, "{name}{labels} {v}");
    }
}

/// The metrics text of the pool behind `service`.
///
/// # Errors
/// [`Error::Database`] when the store cannot be read.
pub async fn render(service: &PoolService) -> Result<String, Error> {
    let providers = service.providers().await?;
    let devices = service.devices(&DeviceQuery::default()).await?;
    let leases = service.leases(LeaseFilter::Active).await?;

    let mut by_avail = BTreeMap::new();
    for a in ["true", "false"] {
        by_avail.insert(format!("{{available=\"{a}\"}}"), 0);
    }
    for p in &providers {
        *by_avail
            .entry(format!("{{available=\"{}\"}}", p.available))
            .or_insert(0) += 1;
    }
    let mut by_state = BTreeMap::new();
    for d in &devices {
        let key = format!(
            "{{class=\"{}\",state=\"{}\"}}",
            escape(&d.resource_class),
            device_state(d.state)
        );
        *by_state.entry(key).or_insert(0) += 1;
    }
    let mut by_lease = BTreeMap::new();
    for s in ["claimed", "bound"] {
        by_lease.insert(format!("{{state=\"{s}\"}}"), 0);
    }
    for l in &leases {
        *by_lease
            .entry(format!("{{state=\"{}\"}}", l.state.as_str()))
            .or_insert(0) += 1;
    }

    let mut out = String::new();
    family(
        &mut out,
        "devlend_pool_providers",
        "Registered providers (lenders), by whether they heartbeat in time.",
        &by_avail,
    );
    family(
        &mut out,
        "devlend_pool_devices",
        "Devices known to the pool, by resource class and state.",
        &by_state,
    );
    family(
        &mut out,
        "devlend_pool_leases",
        "Live leases, by state.",
        &by_lease,
    );
    Ok(out)
}

/// The handler of `GET /metrics`.
pub async fn metrics(State(service): State<PoolService>) -> Result<impl IntoResponse, Error> {
    Ok(([(CONTENT_TYPE, TEXT_FORMAT)], render(&service).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(escape("x\ny"), "x\\ny");
    }

    #[test]
    fn a_family_has_help_type_and_series() {
        let mut s = BTreeMap::new();
        s.insert("{state=\"bound\"}".to_owned(), 2);
        let mut out = String::new();
        family(&mut out, "devlend_pool_leases", "Live leases.", &s);
        assert_eq!(
            out,
            "# HELP devlend_pool_leases Live leases.\n# TYPE devlend_pool_leases gauge\n\
             devlend_pool_leases{state=\"bound\"} 2\n"
        );
    }
}
