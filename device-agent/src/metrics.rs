//! The lender's Prometheus metrics, read from the device counters at scrape time.
//!
//! Per device (label `device`): `devlend_device_requests_total{op}`,
//! `devlend_device_bytes_total{op}`, `devlend_device_errors_total{kind}` (`request`:
//! answered IOERR/UNSUPP, `protocol`: sessions closed for a protocol error),
//! `devlend_device_sessions` (open now), `devlend_device_sessions_opened_total`,
//! `devlend_device_operations_total` (operations issued to the backing file).

use devlend_daemon::metrics::{counter, gauge, Collector, DescriptorEncoder, Labels};

use crate::StatsView;

/// Reads the lender's counters at each scrape.
#[derive(Debug)]
pub struct DeviceMetrics(pub StatsView);

fn l(device: &str, extra: &[(&str, &str)]) -> Labels {
    let mut v = vec![("device".to_owned(), device.to_owned())];
    v.extend(
        extra
            .iter()
            .map(|(k, x)| ((*k).to_owned(), (*x).to_owned())),
    );
    v
}

impl Collector for DeviceMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let all = self.0.all();
        let (mut req, mut bytes, mut errs, mut sess, mut opened, mut ops) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        for (name, s) in &all {
            for (op, n) in [
                ("read", s.reads),
                ("write", s.writes),
                ("flush", s.flushes),
                ("discard", s.discards),
                ("write_zeroes", s.write_zeroes),
            ] {
                req.push((l(name, &[("op", op)]), n));
            }
            bytes.push((l(name, &[("op", "read")]), s.bytes_read));
            bytes.push((l(name, &[("op", "write")]), s.bytes_written));
            errs.push((l(name, &[("kind", "request")]), s.request_errors));
            errs.push((l(name, &[("kind", "protocol")]), s.protocol_errors));
            sess.push((l(name, &[]), s.sessions_active as i64));
            opened.push((l(name, &[]), s.sessions_opened));
            ops.push((l(name, &[]), s.device_ops));
        }
        counter(
            &mut enc,
            "devlend_device_requests",
            "Requests received, by operation.",
            &req,
        )?;
        counter(
            &mut enc,
            "devlend_device_bytes",
            "Data bytes moved by successful requests, by operation.",
            &bytes,
        )?;
        counter(&mut enc, "devlend_device_errors", "Errors, by kind.", &errs)?;
        gauge(
            &mut enc,
            "devlend_device_sessions",
            "Fabric sessions open now.",
            &sess,
        )?;
        counter(
            &mut enc,
            "devlend_device_sessions_opened",
            "Fabric sessions opened.",
            &opened,
        )?;
        counter(
            &mut enc,
            "devlend_device_operations",
            "Operations issued to the backing file or device.",
            &ops,
        )?;
        Ok(())
    }
}
