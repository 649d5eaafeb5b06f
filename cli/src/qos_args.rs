//! `devlend attach --class ... --max-iops N --max-bps SIZE --weight N --qos KEY=N,...`:
//! the limits a lease asks the pool for, which the lender then enforces
//! (`docs/qos.md`).

use anyhow::{bail, Context, Result};
use devlend_fabric::qos::Qos;

use devlend_fabric::units::parse_size;

/// The limit flags of `devlend attach`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct QosArgs {
    /// With --class: most block operations a second, reads and writes together (the
    /// lease's `iops_total`).
    #[arg(long, value_name = "N", requires = "class")]
    pub max_iops: Option<u64>,
    /// With --class: most bytes a second, read and written together (the lease's
    /// `bps_total`; K, M, G suffixes are powers of 1024: 50M is 52428800).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, requires = "class")]
    pub max_bps: Option<u64>,
    /// With --class: the lease's weight on a backing store shared with other
    /// borrowers (1..=10000, default 100).
    #[arg(long, value_name = "N", requires = "class")]
    pub weight: Option<u32>,
    /// With --class: any limit as KEY=N (repeatable, or comma-separated): iops_total,
    /// iops_read, iops_write, bps_total, bps_read, bps_write, tx_pps, rx_pps, tx_bps,
    /// rx_bps, each also as KEY_burst (the bucket size), e.g.
    /// `--qos iops_read=2000,iops_read_burst=100`.
    #[arg(
        long = "qos",
        value_name = "KEY=N",
        value_delimiter = ',',
        requires = "class"
    )]
    pub qos: Vec<String>,
}

impl QosArgs {
    /// The limits asked for; `None` when no flag was given.
    ///
    /// # Errors
    /// A malformed `KEY=N`, an unknown key, a rate of 0, a weight out of range.
    pub fn to_qos(&self) -> Result<Option<Qos>> {
        let mut fields = serde_json::Map::new();
        let mut put = |key: &str, n: u64| -> Result<()> {
            if fields.insert(key.to_owned(), n.into()).is_some() {
                bail!("limit {key} is given twice");
            }
            Ok(())
        };
        if let Some(n) = self.max_iops {
            put("iops_total", n)?;
        }
        if let Some(n) = self.max_bps {
            put("bps_total", n)?;
        }
        if let Some(n) = self.weight {
            put("weight", u64::from(n))?;
        }
        for kv in &self.qos {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("--qos {kv:?}: expected KEY=N"))?;
            let n = parse_size(v).map_err(|e| anyhow::anyhow!("--qos {k}: {e}"))?;
            put(k.trim(), n)?;
        }
        if fields.is_empty() {
            return Ok(None);
        }
        let q: Qos = serde_json::from_value(serde_json::Value::Object(fields))
            .context("limits (--max-iops, --max-bps, --weight, --qos)")?;
        Ok(Some(q))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devlend_fabric::qos::Lane;

    #[test]
    fn flags_become_the_leases_limits() {
        let a = QosArgs {
            max_iops: Some(2000),
            max_bps: Some(50 << 20),
            weight: Some(3),
            qos: vec!["iops_read=1K".into(), "iops_read_burst=100".into()],
        };
        let q = a.to_qos().unwrap().unwrap();
        assert_eq!(q.get(Lane::IopsTotal).unwrap().per_sec, 2000);
        assert_eq!(q.get(Lane::BpsTotal).unwrap().per_sec, 50 << 20);
        assert_eq!(q.get(Lane::IopsRead).unwrap().per_sec, 1024);
        assert_eq!(q.get(Lane::IopsRead).unwrap().burst, 100);
        assert_eq!(q.weight, Some(3));
        assert!(QosArgs::default().to_qos().unwrap().is_none());
        for bad in [
            vec!["iops=5"],
            vec!["iops_read"],
            vec!["iops_read=0"],
            vec!["weight=0"],
        ] {
            let a = QosArgs {
                qos: bad.iter().map(|s| s.to_string()).collect(),
                ..QosArgs::default()
            };
            assert!(a.to_qos().is_err(), "{bad:?}");
        }
        let twice = QosArgs {
            max_iops: Some(5),
            qos: vec!["iops_total=6".into()],
            ..QosArgs::default()
        };
        assert!(twice.to_qos().is_err());
    }
}
