//! `GET /metrics`: the pool's state as Prometheus gauges, read from the store at scrape
//! time, in the OpenMetrics text format that the agents and gateways serve too
//! (`devlend_daemon::metrics`). Served on the API's own address, so a scraper needs no
//! second port.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use devlend_daemon::metrics::{
    gauge, render, Collector, DescriptorEncoder, Labels, CONTENT_TYPE_OPENMETRICS,
};

use crate::api::{DeviceQuery, DeviceState, LeaseFilter};
use crate::error::Error;
use crate::service::PoolService;

fn device_state(s: DeviceState) -> &'static str {
    match s {
        DeviceState::Available => "available",
        DeviceState::Leased => "leased",
        DeviceState::Unavailable => "unavailable",
    }
}

/// One series' labels, from `(name, value)` pairs.
fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Counts by label set, with `zero` label sets present even when nothing has them.
fn count<'a>(zero: &[Labels], items: impl Iterator<Item = Labels> + 'a) -> Vec<(Labels, i64)> {
    let mut by: BTreeMap<Labels, i64> = zero.iter().map(|l| (l.clone(), 0)).collect();
    for l in items {
        *by.entry(l).or_insert(0) += 1;
    }
    by.into_iter().collect()
}

/// The pool's gauges, read from the store for one scrape.
#[derive(Debug)]
struct Snapshot {
    providers: Vec<(Labels, i64)>,
    devices: Vec<(Labels, i64)>,
    leases: Vec<(Labels, i64)>,
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        gauge(
            &mut enc,
            "devlend_pool_providers",
            "Registered providers (lenders), by whether they heartbeat in time.",
            &self.providers,
        )?;
        gauge(
            &mut enc,
            "devlend_pool_devices",
            "Devices known to the pool, by resource class and state.",
            &self.devices,
        )?;
        gauge(
            &mut enc,
            "devlend_pool_leases",
            "Live leases, by state.",
            &self.leases,
        )
    }
}

/// Reads the gauges of the pool behind `service`.
async fn snapshot(service: &PoolService) -> Result<Snapshot, Error> {
    let providers = service.providers().await?;
    let devices = service.devices(&DeviceQuery::default()).await?;
    let leases = service.leases(LeaseFilter::Active).await?;
    Ok(Snapshot {
        providers: count(
            &[
                labels(&[("available", "true")]),
                labels(&[("available", "false")]),
            ],
            providers
                .iter()
                .map(|p| labels(&[("available", if p.available { "true" } else { "false" })])),
        ),
        devices: count(
            &[],
            devices.iter().map(|d| {
                labels(&[
                    ("class", d.resource_class.as_str()),
                    ("state", device_state(d.state)),
                ])
            }),
        ),
        leases: count(
            &[
                labels(&[("state", "claimed")]),
                labels(&[("state", "bound")]),
            ],
            leases
                .iter()
                .map(|l| labels(&[("state", l.state.as_str())])),
        ),
    })
}

/// The metrics text of the pool behind `service`.
///
/// # Errors
/// [`Error::Database`] when the store cannot be read; [`Error::Metrics`] if encoding fails.
pub async fn render_text(service: &PoolService) -> Result<String, Error> {
    render(snapshot(service).await?).map_err(Error::Metrics)
}

/// The handler of `GET /metrics`.
pub async fn metrics(State(service): State<PoolService>) -> Result<impl IntoResponse, Error> {
    Ok((
        [(CONTENT_TYPE, CONTENT_TYPE_OPENMETRICS)],
        render_text(&service).await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_keep_their_zero_series_and_escape_label_values() {
        let s = Snapshot {
            providers: count(&[labels(&[("available", "false")])], std::iter::empty()),
            devices: count(
                &[],
                [labels(&[("class", r#"a"b\c"#), ("state", "leased")])].into_iter(),
            ),
            leases: count(
                &[labels(&[("state", "bound")])],
                [labels(&[("state", "bound")]), labels(&[("state", "bound")])].into_iter(),
            ),
        };
        let out = render(s).unwrap();
        assert!(
            out.contains("# TYPE devlend_pool_providers gauge\n"),
            "{out}"
        );
        assert!(
            out.contains("devlend_pool_providers{available=\"false\"} 0\n"),
            "{out}"
        );
        assert!(
            out.contains(r#"devlend_pool_devices{class="a\"b\\c",state="leased"} 1"#),
            "{out}"
        );
        assert!(
            out.contains("devlend_pool_leases{state=\"bound\"} 2\n"),
            "{out}"
        );
        assert!(out.ends_with("# EOF\n"), "{out}");
    }
}
