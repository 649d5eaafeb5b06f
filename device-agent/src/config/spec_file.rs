//! A `[[device]]` table of the config file read into a [`DeviceSpec`]: its `kind`, or
//! when absent the kind the backing key (`path`, `net` or `pci`) implies, then the
//! kind's own keys, each refused by name when it belongs to another kind.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
use toml::{Table, Value};

use super::spec::{DeviceSpec, KindSpec};

/// The kinds and the keys of each besides `name`, `kind` and `traits` (serde aliases
/// included). The first key of each names its backing.
const KINDS: [(&str, &[&str]); 4] = [
    ("block", &["path", "read_only", "serial", "qos", "store"]),
    ("net", &["net", "interface", "mac", "qos"]),
    ("pci", &["pci", "bdf", "coherence", "qos", "store"]),
    ("pci-pf", &["pf", "vfs", "namespaces", "coherence", "qos"]),
];

/// The keys that name a device's backing, and the kind each implies when `kind` is
/// absent.
const BACKING_KEYS: [(&str, &str); 6] = [
    ("path", "block"),
    ("net", "net"),
    ("interface", "net"),
    ("pci", "pci"),
    ("bdf", "pci"),
    ("pf", "pci-pf"),
];

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<DeviceSpec, D::Error> {
        from_table(Table::deserialize(d)?).map_err(D::Error::custom)
    }
}

/// Reads one `[[device]]` table; the error names the device and the key at fault.
fn from_table(mut t: Table) -> Result<DeviceSpec, String> {
    let name = match t.remove("name") {
        Some(Value::String(s)) => s,
        Some(_) => return Err("device `name` must be a string".into()),
        None => return Err("missing field `name`".into()),
    };
    let who = format!("device `{name}`");
    let traits: Vec<String> = match t.remove("traits") {
        Some(v) => v.try_into().map_err(|e| format!("{who}: traits: {e}"))?,
        None => Vec::new(),
    };
    let kind = match t.remove("kind") {
        Some(Value::String(k)) => match KINDS.iter().find(|(n, _)| *n == k) {
            Some((n, _)) => *n,
            None => {
                return Err(format!(
                    "{who}: unknown kind `{k}` (expected block, net, pci or pci-pf)"
                ))
            }
        },
        Some(_) => return Err(format!("{who}: `kind` must be a string")),
        None => infer_kind(&who, &t)?,
    };
    let own = KINDS
        .iter()
        .find(|(n, _)| *n == kind)
        .map_or(&[][..], |(_, keys)| *keys);
    if let Some(key) = t.keys().find(|k| {
        !own.contains(&k.as_str()) && KINDS.iter().any(|(_, keys)| keys.contains(&k.as_str()))
    }) {
        return Err(format!("{who}: `{key}` does not apply to kind `{kind}`"));
    }
    if let Some(key) = t.keys().find(|k| !own.contains(&k.as_str())) {
        return Err(format!(
            "{who}: unknown key `{key}`; a device of kind `{kind}` takes `name`, `kind`, `traits`, {}",
            own.iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let fields = Value::Table(t);
    let kind = match kind {
        "net" => KindSpec::Net(fields.try_into().map_err(|e| format!("{who}: {e}"))?),
        "pci" => KindSpec::Pci(fields.try_into().map_err(|e| format!("{who}: {e}"))?),
        "pci-pf" => KindSpec::PciPf(fields.try_into().map_err(|e| format!("{who}: {e}"))?),
        _ => KindSpec::Block(fields.try_into().map_err(|e| format!("{who}: {e}"))?),
    };
    Ok(DeviceSpec { name, traits, kind })
}

/// The kind the backing key of `t` implies: exactly one of `path`, `net` (or
/// `interface`) and `pci` (or `bdf`) must be there.
fn infer_kind(who: &str, t: &Table) -> Result<&'static str, String> {
    let mut found = BACKING_KEYS.iter().filter(|(k, _)| t.contains_key(*k));
    match (found.next(), found.next()) {
        (Some((_, kind)), None) => Ok(kind),
        (Some((a, _)), Some((b, _))) => Err(format!(
            "{who}: both `{a}` and `{b}`: a device lends one thing (set `kind` and its keys)"
        )),
        (None, _) => Err(format!(
            "{who}: no `path`, `net`, `pci` or `pf` says what it lends (or set `kind`)"
        )),
    }
}
