//! devlend's Cloud Hypervisor glue (`vmm::cloud_hypervisor`) checked against Cloud
//! Hypervisor's published OpenAPI document, `cloud-hypervisor.yaml`: the copy in
//! `third_party/cloud-hypervisor/` of this repository (or `$DEVLEND_CH_OPENAPI`).
//!
//! Cloud Hypervisor itself cannot run on devlend's build and CI machines (there is no
//! usable KVM), so this document is the contract:
//! - every body devlend sends is validated against its schema twice: by a JSON-schema
//!   validator (the `jsonschema` crate, draft 4, which OpenAPI 3.0's schema objects
//!   derive from, `$ref`s resolved against the document) and by a strict checker of our
//!   own, which also rejects keys the schema does not declare — OpenAPI schemas allow
//!   unknown keys, so a validator alone would let a misspelled field through, and Cloud
//!   Hypervisor would then ignore or refuse it at run time;
//! - the paths and methods devlend calls, and the answer it parses (`PciDeviceInfo`),
//!   are looked up in the document;
//! - a stand-in Cloud Hypervisor API server (a mock, since the real VMM cannot run
//!   here) listens on a unix socket, validates each request against the same schemas,
//!   records it and answers as the document says (`200` `PciDeviceInfo`, `204`, `4xx`
//!   with a message); `add_disk` and `remove_device` are driven against it.
//!
//! Why this file is over 600 lines: a test file: its 14 tests share one contract, the
//! OpenAPI document and its two checkers (about 310 lines), which the stand-in API server
//! also validates requests with and which splitting would have to export.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::put;
use axum::Router;
use devlend_compute_agent::vmm::cloud_hypervisor::{
    add_disk, cli_arg, disk_config, disk_option, remove_device, remove_device_body, ChError,
    PciDeviceInfo, OP_ADD_DISK, OP_REMOVE_DEVICE,
};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------
// The contract: the OpenAPI document and the two checkers.

const DOC_IN_SHARED: &str = "shared/third_party/cloud-hypervisor/cloud-hypervisor.yaml";

fn doc_path() -> PathBuf {
    if let Some(p) = std::env::var_os("DEVLEND_CH_OPENAPI") {
        return PathBuf::from(p);
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The copy kept in the repository (third_party/cloud-hypervisor/), else a shared/
    // tree above it.
    if let Some(repo) = here.parent() {
        let copy = repo.join("third_party/cloud-hypervisor/cloud-hypervisor.yaml");
        if copy.is_file() {
            return copy;
        }
    }
    here.ancestors()
        .map(|dir| dir.join(DOC_IN_SHARED))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "Cloud Hypervisor's OpenAPI document not found: no {DOC_IN_SHARED} above {} \
                 (set DEVLEND_CH_OPENAPI to its path)",
                here.display()
            )
        })
}

/// Cloud Hypervisor's OpenAPI document, as JSON.
struct Contract {
    doc: Value,
}

fn contract() -> &'static Contract {
    static C: OnceLock<Contract> = OnceLock::new();
    C.get_or_init(|| {
        let path = doc_path();
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let yaml: serde_norway::Value = serde_norway::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not YAML: {e}", path.display()));
        Contract {
            doc: yaml_to_json(yaml),
        }
    })
}

/// YAML to JSON; map keys become strings (the document keys responses by number).
fn yaml_to_json(y: serde_norway::Value) -> Value {
    use serde_norway::Value as Y;
    match y {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                n.as_f64().map_or(Value::Null, Value::from)
            }
        }
        Y::String(s) => Value::String(s),
        Y::Sequence(v) => Value::Array(v.into_iter().map(yaml_to_json).collect()),
        Y::Mapping(m) => Value::Object(
            m.into_iter()
                .map(|(k, v)| {
                    let key = match k {
                        Y::String(s) => s,
                        Y::Number(n) => n.to_string(),
                        Y::Bool(b) => b.to_string(),
                        other => panic!("unexpected YAML map key {other:?}"),
                    };
                    (key, yaml_to_json(v))
                })
                .collect(),
        ),
        Y::Tagged(t) => yaml_to_json(t.value),
    }
}

impl Contract {
    /// `components/schemas/NAME`.
    fn schema(&self, name: &str) -> &Value {
        let s = &self.doc["components"]["schemas"][name];
        assert!(
            s.is_object(),
            "no components/schemas/{name} in the document"
        );
        s
    }

    /// Follows `$ref`s (`#/...` pointers into the document).
    fn resolve<'a>(&'a self, mut s: &'a Value) -> &'a Value {
        for _ in 0..32 {
            let Some(r) = s.get("$ref").and_then(Value::as_str) else {
                return s;
            };
            let pointer = r
                .strip_prefix('#')
                .unwrap_or_else(|| panic!("$ref {r:?} is not local to the document"));
            s = self
                .doc
                .pointer(pointer)
                .unwrap_or_else(|| panic!("$ref {r:?} points nowhere"));
        }
        panic!("$ref chain too long");
    }

    /// Everything wrong with `value` as a `components/schemas/NAME`, by both checkers.
    fn check(&self, name: &str, value: &Value) -> Vec<String> {
        let mut errs = self.jsonschema_errors(name, value);
        errs.extend(self.strict_errors(name, value));
        errs
    }

    /// The JSON-schema validator's verdict: `components/schemas/NAME`, the document's
    /// schemas carried along (converted from OpenAPI 3.0) so that `$ref`s resolve.
    fn jsonschema_errors(&self, name: &str, value: &Value) -> Vec<String> {
        let schemas: serde_json::Map<String, Value> = self.doc["components"]["schemas"]
            .as_object()
            .expect("components/schemas")
            .iter()
            .map(|(k, v)| (k.clone(), openapi_schema_to_json_schema(v)))
            .collect();
        let root = json!({
            "$ref": format!("#/components/schemas/{name}"),
            "components": { "schemas": schemas },
        });
        let validator = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft4)
            .build(&root)
            .unwrap_or_else(|e| panic!("schema {name} does not compile: {e}"));
        validator
            .iter_errors(value)
            .map(|e| format!("jsonschema: {e} (at {})", e.instance_path()))
            .collect()
    }

    /// The strict checker's verdict (see [`Contract::strict`]).
    fn strict_errors(&self, name: &str, value: &Value) -> Vec<String> {
        let mut errs = Vec::new();
        self.strict(self.schema(name), value, name, &mut errs);
        errs
    }

    /// Strict check of `v` against `schema`: every key must be a declared property
    /// (recursively), every `required` key present, types, integer formats and enums
    /// respected. Constructs it does not know are errors, so that it never passes
    /// something it did not look at.
    fn strict(&self, schema: &Value, v: &Value, at: &str, errs: &mut Vec<String>) {
        let s = self.resolve(schema);
        for k in ["allOf", "anyOf", "oneOf", "not"] {
            if s.get(k).is_some() {
                errs.push(format!(
                    "strict: {at}: schema uses {k}, which this checker does not handle"
                ));
                return;
            }
        }
        if v.is_null() {
            if s.get("nullable") != Some(&Value::Bool(true)) {
                errs.push(format!(
                    "strict: {at}: null where the schema is not nullable"
                ));
            }
            return;
        }
        if let Some(allowed) = s.get("enum").and_then(Value::as_array) {
            if !allowed.contains(v) {
                errs.push(format!("strict: {at}: {v} is not one of {allowed:?}"));
            }
        }
        let ty = match s.get("type").and_then(Value::as_str) {
            Some(t) => t,
            None if s.get("properties").is_some() => "object",
            None => {
                errs.push(format!("strict: {at}: schema has no type"));
                return;
            }
        };
        match ty {
            "object" => {
                let Some(obj) = v.as_object() else {
                    errs.push(format!("strict: {at}: {v} is not an object"));
                    return;
                };
                let props = s.get("properties").and_then(Value::as_object);
                for (k, x) in obj {
                    let here = format!("{at}.{k}");
                    match props.and_then(|p| p.get(k)) {
                        Some(ps) => self.strict(ps, x, &here, errs),
                        None => match s.get("additionalProperties") {
                            Some(ap) if ap.is_object() => self.strict(ap, x, &here, errs),
                            _ => {
                                errs.push(format!("strict: {here}: no such property in the schema"))
                            }
                        },
                    }
                }
                for r in s
                    .get("required")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let r = r.as_str().unwrap_or_default();
                    if !obj.contains_key(r) {
                        errs.push(format!("strict: {at}: required property {r:?} missing"));
                    }
                }
            }
            "array" => {
                let Some(items) = v.as_array() else {
                    errs.push(format!("strict: {at}: {v} is not an array"));
                    return;
                };
                let Some(item_schema) = s.get("items") else {
                    errs.push(format!("strict: {at}: array schema without items"));
                    return;
                };
                for (i, x) in items.iter().enumerate() {
                    self.strict(item_schema, x, &format!("{at}[{i}]"), errs);
                }
            }
            "string" if !v.is_string() => errs.push(format!("strict: {at}: {v} is not a string")),
            "boolean" if !v.is_boolean() => {
                errs.push(format!("strict: {at}: {v} is not a boolean"))
            }
            "number" if !v.is_number() => errs.push(format!("strict: {at}: {v} is not a number")),
            "integer" => {
                let n = v.as_i64().map(i128::from).or(v.as_u64().map(i128::from));
                let Some(n) = n else {
                    errs.push(format!("strict: {at}: {v} is not an integer"));
                    return;
                };
                let format = s.get("format").and_then(Value::as_str);
                let range: Option<(i128, i128)> = match format {
                    Some("int8") => Some((i8::MIN.into(), i8::MAX.into())),
                    Some("int16") => Some((i16::MIN.into(), i16::MAX.into())),
                    Some("int32") => Some((i32::MIN.into(), i32::MAX.into())),
                    Some("int64") => Some((i64::MIN.into(), i64::MAX.into())),
                    Some("uint8") => Some((0, u8::MAX.into())),
                    Some("uint16") => Some((0, u16::MAX.into())),
                    Some("uint32") => Some((0, u32::MAX.into())),
                    Some("uint64") => Some((0, u64::MAX.into())),
                    None => None,
                    Some(f) => {
                        errs.push(format!("strict: {at}: unknown integer format {f:?}"));
                        None
                    }
                };
                if let Some((lo, hi)) = range {
                    if !(lo..=hi).contains(&n) {
                        errs.push(format!("strict: {at}: {n} is out of {format:?} range"));
                    }
                }
            }
            "string" | "boolean" | "number" => {}
            other => errs.push(format!("strict: {at}: unknown type {other:?}")),
        }
    }
}

/// An OpenAPI 3.0 schema object as a JSON Schema (draft 4): `nullable: true` becomes a
/// `null` alternative in `type`; OpenAPI-only annotations are dropped; integer formats
/// (`int16`, `uint8`, ...) are left as annotations (the strict checker checks them).
fn openapi_schema_to_json_schema(s: &Value) -> Value {
    let Some(obj) = s.as_object() else {
        return s.clone();
    };
    let mut out = serde_json::Map::new();
    for (k, v) in obj {
        let v = match k.as_str() {
            "nullable" | "example" | "discriminator" | "readOnly" | "writeOnly" | "xml"
            | "externalDocs" | "deprecated" => continue,
            "properties" => Value::Object(
                v.as_object()
                    .into_iter()
                    .flatten()
                    .map(|(p, ps)| (p.clone(), openapi_schema_to_json_schema(ps)))
                    .collect(),
            ),
            "items" | "additionalProperties" | "not" => openapi_schema_to_json_schema(v),
            "allOf" | "anyOf" | "oneOf" => Value::Array(
                v.as_array()
                    .into_iter()
                    .flatten()
                    .map(openapi_schema_to_json_schema)
                    .collect(),
            ),
            _ => v.clone(),
        };
        out.insert(k.clone(), v);
    }
    if obj.get("nullable") == Some(&Value::Bool(true)) {
        if let Some(t) = obj.get("type").and_then(Value::as_str) {
            out.insert("type".into(), json!([t, "null"]));
        }
    }
    Value::Object(out)
}

/// The `$ref` of an operation's JSON request body.
fn request_schema_ref(op: &Value) -> &str {
    op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        .as_str()
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// Checks against the document.

#[test]
fn document_defines_the_operations_devlend_calls() {
    let c = contract();
    let server = c.doc["servers"][0]["url"].as_str().unwrap_or_default();
    assert!(
        server.ends_with("/api/v1"),
        "the API base is {server:?}, devlend calls /api/v1/..."
    );

    let add = &c.doc["paths"][format!("/{OP_ADD_DISK}")]["put"];
    assert!(add.is_object(), "no PUT /{OP_ADD_DISK} in the document");
    assert_eq!(request_schema_ref(add), "#/components/schemas/DiskConfig");
    assert_eq!(add["requestBody"]["required"], json!(true));
    assert_eq!(
        add["responses"]["200"]["content"]["application/json"]["schema"]["$ref"],
        json!("#/components/schemas/PciDeviceInfo"),
        "add_disk parses a PciDeviceInfo from the 200 answer"
    );
    assert!(
        add["responses"]["204"].is_object(),
        "add_disk treats 204 as a cold add"
    );

    let remove = &c.doc["paths"][format!("/{OP_REMOVE_DEVICE}")]["put"];
    assert!(
        remove.is_object(),
        "no PUT /{OP_REMOVE_DEVICE} in the document"
    );
    assert_eq!(
        request_schema_ref(remove),
        "#/components/schemas/VmRemoveDevice"
    );
    assert!(
        remove["responses"]["204"].is_object(),
        "remove_device expects 204"
    );
    assert!(
        remove["responses"]["200"].is_null(),
        "the document now defines a 200 for remove-device: remove_device must take it"
    );

    // Neither is a GET or POST: a wrong method would be refused by the VMM.
    for p in [OP_ADD_DISK, OP_REMOVE_DEVICE] {
        let methods: Vec<&String> = c.doc["paths"][format!("/{p}")]
            .as_object()
            .map(|m| m.keys().collect())
            .unwrap_or_default();
        assert_eq!(methods, ["put"], "methods of /{p}");
    }
}

#[test]
fn disk_config_bodies_satisfy_the_schema() {
    let c = contract();
    let cases = [
        ("/run/devlend/vol1.sock", "vol1", 1, 256, false),
        ("/run/devlend/vol2.sock", "vol2", 4, 128, false),
        ("/run/devlend/ro.sock", "backup-ro", 4, 1024, true),
        ("/run/devlend/one-ro.sock", "x.1_y", 1, 64, true),
        ("/run/devlend/anon.sock", "", 2, 256, false),
    ];
    for (socket, id, queues, qsize, ro) in cases {
        let body = disk_config(Path::new(socket), id, queues, qsize, ro);
        let errs = c.check("DiskConfig", &body);
        assert!(
            errs.is_empty(),
            "{body} is not a valid DiskConfig: {errs:#?}"
        );
        // What Cloud Hypervisor needs of a vhost-user disk beyond the schema: a socket
        // and no path (it refuses both together).
        assert_eq!(body["vhost_user"], json!(true));
        assert_eq!(body["vhost_socket"], json!(socket));
        assert!(body.get("path").is_none(), "{body} has a path");
    }
    assert_eq!(
        disk_config(Path::new("/run/devlend/ro.sock"), "vol9", 4, 128, true),
        json!({
            "vhost_user": true,
            "vhost_socket": "/run/devlend/ro.sock",
            "num_queues": 4,
            "queue_size": 128,
            "id": "vol9",
            "readonly": true,
        })
    );
}

#[test]
fn schema_facts_devlend_relies_on() {
    let c = contract();
    let disk = c.schema("DiskConfig");
    let props = &disk["properties"];
    // vhost_user is a boolean, vhost_socket a string, and path is optional: a
    // vhost-user disk has no image path.
    assert_eq!(props["vhost_user"]["type"], json!("boolean"));
    assert_eq!(props["vhost_socket"]["type"], json!("string"));
    let required: Vec<&str> = disk["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        !required.contains(&"path"),
        "DiskConfig now requires path, which a vhost-user disk cannot give: {required:?}"
    );
    for r in &required {
        assert!(
            disk_config(Path::new("/s"), "d", 1, 128, false)
                .get(*r)
                .is_some(),
            "DiskConfig requires {r:?}, which devlend does not send"
        );
    }
}

#[test]
fn remove_device_body_satisfies_the_schema() {
    let c = contract();
    for id in ["vol1", "backup-ro", "_disk0"] {
        let body = remove_device_body(id);
        let errs = c.check("VmRemoveDevice", &body);
        assert!(errs.is_empty(), "{body}: {errs:#?}");
        assert_eq!(body, json!({ "id": id }));
    }
}

#[test]
fn the_checkers_reject_bad_bodies() {
    let c = contract();
    let good = disk_config(Path::new("/run/devlend/vol1.sock"), "vol1", 4, 256, false);

    // A misspelled key: the schema allows unknown keys, so only the strict checker sees
    // it; that is why it exists.
    let mut typo = good.clone();
    let v = typo
        .as_object_mut()
        .and_then(|o| o.remove("vhost_socket"))
        .expect("vhost_socket");
    typo["vhost_sokcet"] = v;
    assert!(c.jsonschema_errors("DiskConfig", &typo).is_empty());
    let errs = c.strict_errors("DiskConfig", &typo);
    assert!(
        errs.iter().any(|e| e.contains("DiskConfig.vhost_sokcet")),
        "{errs:?}"
    );

    // Wrong types: both.
    for (key, bad) in [
        ("num_queues", json!("4")),
        ("vhost_user", json!("true")),
        ("readonly", json!(1)),
        ("queue_size", json!(128.5)),
        ("vhost_socket", json!(["/a"])),
    ] {
        let mut b = good.clone();
        b[key] = bad.clone();
        assert!(
            !c.jsonschema_errors("DiskConfig", &b).is_empty(),
            "jsonschema took {key}={bad}"
        );
        assert!(
            !c.strict_errors("DiskConfig", &b).is_empty(),
            "strict took {key}={bad}"
        );
    }

    // Through a $ref, into a nested object: an unknown key and a bad enum value.
    let mut nested = good.clone();
    nested["rate_limiter_config"] = json!({ "bandwith": { "size": 1, "refill_time": 1 } });
    let errs = c.strict_errors("DiskConfig", &nested);
    assert!(
        errs.iter()
            .any(|e| e.contains("rate_limiter_config.bandwith")),
        "{errs:?}"
    );
    let mut e = good.clone();
    e["image_type"] = json!("Raw2");
    assert!(!c.jsonschema_errors("DiskConfig", &e).is_empty());
    assert!(!c.strict_errors("DiskConfig", &e).is_empty());
    e["image_type"] = json!("Raw");
    assert!(
        c.check("DiskConfig", &e).is_empty(),
        "{:?}",
        c.check("DiskConfig", &e)
    );

    // Integer formats: pci_segment is an int16.
    let mut seg = good.clone();
    seg["pci_segment"] = json!(70000);
    assert!(!c.strict_errors("DiskConfig", &seg).is_empty());
    seg["pci_segment"] = json!(1);
    assert!(c.check("DiskConfig", &seg).is_empty());

    // A wrong or misspelled remove body.
    assert!(!c
        .strict_errors("VmRemoveDevice", &json!({ "ids": "vol1" }))
        .is_empty());
    assert!(!c.check("VmRemoveDevice", &json!({ "id": 7 })).is_empty());
    assert!(!c.check("VmRemoveDevice", &json!(["vol1"])).is_empty());

    // A PciDeviceInfo without its required bdf.
    let errs = c.check("PciDeviceInfo", &json!({ "id": "vol1" }));
    assert!(
        errs.iter().any(|e| e.starts_with("jsonschema:")),
        "{errs:?}"
    );
    assert!(errs.iter().any(|e| e.starts_with("strict:")), "{errs:?}");
}

#[test]
fn pci_device_info_matches_the_schema() {
    let c = contract();
    let schema = c.schema("PciDeviceInfo");
    let declared: Vec<&String> = schema["properties"]
        .as_object()
        .map(|p| p.keys().collect())
        .unwrap_or_default();
    let ours = serde_json::to_value(PciDeviceInfo {
        id: "vol1".into(),
        bdf: "0000:00:06.0".into(),
    })
    .expect("serialize");
    let ours_keys: Vec<&String> = ours
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    assert_eq!(declared, ours_keys, "PciDeviceInfo fields");
    assert!(c.check("PciDeviceInfo", &ours).is_empty());
    for (k, p) in schema["properties"].as_object().into_iter().flatten() {
        assert_eq!(p["type"], json!("string"), "PciDeviceInfo.{k}");
    }
    // Every required field is one devlend reads; extra fields from a newer VMM are
    // tolerated; a missing required one is an error.
    let parsed: PciDeviceInfo =
        serde_json::from_value(json!({ "id": "a", "bdf": "0000:00:07.0", "extra": 1 }))
            .expect("parse with an extra field");
    assert_eq!(parsed.bdf, "0000:00:07.0");
    assert!(serde_json::from_value::<PciDeviceInfo>(json!({ "id": "a" })).is_err());
}

// ---------------------------------------------------------------------------------------
// cli_arg and disk_option.

/// Splits a Cloud Hypervisor `key=value,...` option the way its option parser does:
/// commas inside double quotes do not split, and the quotes are dropped.
fn parse_ch_option(s: &str) -> Vec<(String, String)> {
    let mut parts = vec![String::new()];
    let mut quoted = false;
    for ch in s.trim().chars() {
        match ch {
            '"' => quoted = !quoted,
            ',' if !quoted => parts.push(String::new()),
            c => parts.last_mut().expect("a part").push(c),
        }
    }
    assert!(!quoted, "unbalanced quotes in {s:?}");
    parts
        .into_iter()
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or_else(|| panic!("no = in {p:?}"));
            (k.to_owned(), v.trim().to_owned())
        })
        .collect()
}

#[test]
fn cli_arg_cases() {
    assert_eq!(
        cli_arg(Path::new("/run/devlend/vol1.sock"), "vol1", 1, 256, false),
        "--disk vhost_user=true,socket=/run/devlend/vol1.sock,num_queues=1,queue_size=256,id=vol1"
    );
    assert_eq!(
        cli_arg(Path::new("/run/devlend/ro.sock"), "ro", 4, 128, true),
        "--disk vhost_user=true,socket=/run/devlend/ro.sock,num_queues=4,queue_size=128,id=ro,readonly=on"
    );
    assert_eq!(
        disk_option(Path::new("/tmp/a,b.sock"), "a", 2, 64, false),
        "vhost_user=true,socket=\"/tmp/a,b.sock\",num_queues=2,queue_size=64,id=a"
    );
}

/// `--disk` and the API body say the same thing, in Cloud Hypervisor's two spellings.
#[test]
fn cli_arg_agrees_with_disk_config() {
    let c = contract();
    let props = c.schema("DiskConfig")["properties"]
        .as_object()
        .expect("DiskConfig properties");
    for (socket, id, q, qs, ro) in [
        ("/run/devlend/vol1.sock", "vol1", 1, 256, false),
        ("/run/devlend/ro.sock", "backup-ro", 4, 128, true),
        ("/tmp/odd,name.sock", "odd", 2, 64, false),
    ] {
        let arg = disk_option(Path::new(socket), id, q, qs, ro);
        assert_eq!(
            cli_arg(Path::new(socket), id, q, qs, ro),
            format!("--disk {arg}")
        );
        let mut from_cli = serde_json::Map::new();
        for (k, v) in parse_ch_option(&arg) {
            // `socket` is the option's name for the API's `vhost_socket`.
            let key = if k == "socket" {
                "vhost_socket".to_owned()
            } else {
                k
            };
            let ty = props
                .get(&key)
                .unwrap_or_else(|| panic!("{arg}: {key} is not a DiskConfig property"))["type"]
                .as_str()
                .unwrap_or_default();
            let value = match ty {
                "boolean" => match v.as_str() {
                    "on" | "true" => json!(true),
                    "off" | "false" => json!(false),
                    other => panic!("{arg}: {key}={other} is not a toggle"),
                },
                "integer" => json!(v.parse::<u64>().expect("integer")),
                _ => json!(v),
            };
            from_cli.insert(key, value);
        }
        let mut body = disk_config(Path::new(socket), id, q, qs, ro);
        if !ro {
            // The option leaves out `readonly=off`, the default.
            body.as_object_mut().map(|o| o.remove("readonly"));
        }
        assert_eq!(Value::Object(from_cli), body, "{arg}");
    }
}

// ---------------------------------------------------------------------------------------
// The stand-in Cloud Hypervisor API server.

/// A request the stand-in received.
#[derive(Debug, Clone)]
struct Received {
    path: String,
    content_type: String,
    body: Value,
    /// What the schema checkers found wrong with it.
    errors: Vec<String>,
}

#[derive(Default)]
struct StandInState {
    received: Mutex<Vec<Received>>,
    /// Device id to PCI address.
    devices: Mutex<BTreeMap<String, String>>,
    next_slot: Mutex<u8>,
    /// An answer to give to the next request instead of the usual one.
    next_answer: Mutex<Option<(u16, String)>>,
}

/// A stand-in for Cloud Hypervisor's API server on a unix socket, running on its own
/// thread and tokio runtime so that the blocking client under test runs on the test's
/// thread, as it would in devlend.
struct StandIn {
    socket: PathBuf,
    state: Arc<StandInState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl StandIn {
    fn start() -> StandIn {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("ch-api.sock");
        let state = Arc::new(StandInState::default());
        *state.next_slot.lock().expect("lock") = 6;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let app = Router::new()
            .route(&format!("/api/v1/{OP_ADD_DISK}"), put(stand_in_add_disk))
            .route(
                &format!("/api/v1/{OP_REMOVE_DEVICE}"),
                put(stand_in_remove_device),
            )
            .with_state(state.clone());
        let sock = socket.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::UnixListener::bind(&sock).expect("bind");
                ready_tx.send(()).expect("ready");
                axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stop_rx.await;
                    })
                    .await
                    .expect("serve");
            });
        });
        ready_rx.recv().expect("stand-in started");
        StandIn {
            socket,
            state,
            stop: Some(stop_tx),
            thread: Some(thread),
            _dir: dir,
        }
    }

    fn received(&self) -> Vec<Received> {
        self.state.received.lock().expect("lock").clone()
    }

    fn answer_next(&self, status: u16, body: &str) {
        *self.state.next_answer.lock().expect("lock") = Some((status, body.to_owned()));
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(status: u16, body: String) -> Response {
    let status = StatusCode::from_u16(status).expect("status");
    if status == StatusCode::NO_CONTENT {
        return status.into_response();
    }
    (status, body).into_response()
}

/// Records the request and checks it against `schema`; the status and body of the
/// answer if it must be refused.
fn stand_in_receive(
    state: &StandInState,
    path: &str,
    schema: &str,
    headers: &HeaderMap,
    bytes: &[u8],
) -> Result<Value, (u16, String)> {
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let (body, errors) = match serde_json::from_slice::<Value>(bytes) {
        Ok(v) => {
            let errs = contract().check(schema, &v);
            (v, errs)
        }
        Err(e) => (Value::Null, vec![format!("body is not JSON: {e}")]),
    };
    state.received.lock().expect("lock").push(Received {
        path: path.to_owned(),
        content_type: content_type.clone(),
        body: body.clone(),
        errors: errors.clone(),
    });
    if content_type != "application/json" {
        return Err((400, format!("content type {content_type:?}")));
    }
    if !errors.is_empty() {
        return Err((400, format!("invalid {schema}: {}", errors.join("; "))));
    }
    if let Some((status, text)) = state.next_answer.lock().expect("lock").take() {
        return Err((status, text));
    }
    Ok(body)
}

async fn stand_in_add_disk(
    State(state): State<Arc<StandInState>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Response {
    let path = format!("/api/v1/{OP_ADD_DISK}");
    let body = match stand_in_receive(&state, &path, "DiskConfig", &headers, &bytes) {
        Ok(b) => b,
        Err((status, text)) => return answer(status, text),
    };
    // Cloud Hypervisor's own rules for a vhost-user disk.
    if body["vhost_user"] == json!(true) && body.get("vhost_socket").is_none() {
        return answer(400, "No socket provided when using vhost-user".into());
    }
    if body.get("vhost_socket").is_some() && body.get("path").is_some() {
        return answer(400, "Disk path and vhost socket both provided".into());
    }
    let mut devices = state.devices.lock().expect("lock");
    let id = match body.get("id").and_then(Value::as_str) {
        Some(id) => id.to_owned(),
        None => format!("_disk{}", devices.len()),
    };
    if devices.contains_key(&id) {
        return answer(409, format!("Identifier {id} is not unique"));
    }
    let mut slot = state.next_slot.lock().expect("lock");
    let bdf = format!("0000:00:{:02x}.0", *slot);
    *slot += 1;
    devices.insert(id.clone(), bdf.clone());
    let info = json!({ "id": id, "bdf": bdf });
    assert!(contract().check("PciDeviceInfo", &info).is_empty());
    (StatusCode::OK, axum::Json(info)).into_response()
}

async fn stand_in_remove_device(
    State(state): State<Arc<StandInState>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Response {
    let path = format!("/api/v1/{OP_REMOVE_DEVICE}");
    let body = match stand_in_receive(&state, &path, "VmRemoveDevice", &headers, &bytes) {
        Ok(b) => b,
        Err((status, text)) => return answer(status, text),
    };
    let id = body["id"].as_str().unwrap_or_default().to_owned();
    match state.devices.lock().expect("lock").remove(&id) {
        Some(_) => StatusCode::NO_CONTENT.into_response(),
        None => answer(404, format!("No device with identifier {id:?}")),
    }
}

#[test]
fn add_and_remove_against_the_stand_in() {
    let ch = StandIn::start();
    let ro = disk_config(Path::new("/run/devlend/vol1.sock"), "vol1", 4, 128, true);
    let info = add_disk(&ch.socket, &ro).expect("add vol1");
    assert_eq!(
        info,
        PciDeviceInfo {
            id: "vol1".into(),
            bdf: "0000:00:06.0".into()
        }
    );
    let rw = disk_config(Path::new("/run/devlend/vol2.sock"), "vol2", 1, 256, false);
    let info2 = add_disk(&ch.socket, &rw).expect("add vol2");
    assert_eq!(info2.bdf, "0000:00:07.0");
    let anon = disk_config(Path::new("/run/devlend/vol3.sock"), "", 1, 256, false);
    let info3 = add_disk(&ch.socket, &anon).expect("add without id");
    assert_eq!(info3.id, "_disk2", "the VMM's id is returned");

    // A duplicate id: the VMM's 409 and message come back.
    let e = add_disk(&ch.socket, &ro).expect_err("duplicate id");
    assert!(matches!(e, ChError::Refused { status: 409, .. }), "{e:?}");
    assert!(
        e.to_string().contains("Identifier vol1 is not unique"),
        "{e}"
    );

    remove_device(&ch.socket, "vol1").expect("remove vol1");
    let e = remove_device(&ch.socket, "vol1").expect_err("already removed");
    assert_eq!(e.status(), Some(404));
    let msg = e.to_string();
    assert!(msg.contains("No device with identifier \"vol1\""), "{msg}");
    assert!(msg.contains(OP_REMOVE_DEVICE), "{msg}");
    assert!(msg.contains(&ch.socket.display().to_string()), "{msg}");

    let got = ch.received();
    let paths: Vec<&str> = got.iter().map(|r| r.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/api/v1/vm.add-disk",
            "/api/v1/vm.add-disk",
            "/api/v1/vm.add-disk",
            "/api/v1/vm.add-disk",
            "/api/v1/vm.remove-device",
            "/api/v1/vm.remove-device",
        ]
    );
    for r in &got {
        assert_eq!(r.content_type, "application/json", "{r:?}");
        assert!(r.errors.is_empty(), "the stand-in found {r:?} invalid");
    }
    assert_eq!(got[0].body, ro);
    assert_eq!(got[1].body, rw);
    assert_eq!(got[2].body, anon);
    assert_eq!(got[4].body, json!({ "id": "vol1" }));
}

#[test]
fn an_error_answer_carries_status_and_body() {
    let ch = StandIn::start();
    let body = disk_config(Path::new("/run/devlend/v.sock"), "v", 1, 256, false);
    let why = "Error from API: The disk could not be added to the VM: \
               Failed to connect to the vhost-user backend";
    ch.answer_next(500, why);
    let e = add_disk(&ch.socket, &body).expect_err("500");
    assert!(matches!(e, ChError::Refused { status: 500, .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("HTTP 500"), "{msg}");
    assert!(msg.contains(why), "{msg}");
    assert!(msg.contains(OP_ADD_DISK), "{msg}");
    assert!(msg.contains(&ch.socket.display().to_string()), "{msg}");

    ch.answer_next(404, "");
    let e = remove_device(&ch.socket, "v").expect_err("404");
    assert!(e.to_string().contains("HTTP 404: (empty body)"), "{e}");
}

#[test]
fn odd_success_answers() {
    let ch = StandIn::start();
    let body = disk_config(Path::new("/run/devlend/v.sock"), "cold", 1, 256, false);

    // 204: the VM is not booted; the disk went into its configuration only.
    ch.answer_next(204, "");
    match add_disk(&ch.socket, &body) {
        Err(ChError::ColdAdded { id, .. }) => assert_eq!(id, "cold"),
        other => panic!("expected ColdAdded, got {other:?}"),
    }

    // A 200 whose body is not a PciDeviceInfo.
    ch.answer_next(200, "{\"id\": \"cold\"}");
    let e = add_disk(&ch.socket, &body).expect_err("bad answer");
    assert!(matches!(e, ChError::BadAnswer { .. }), "{e:?}");
    assert!(std::error::Error::source(&e).is_some());

    // A 200 where remove-device defines only 204.
    ch.answer_next(200, "{}");
    let e = remove_device(&ch.socket, "cold").expect_err("200");
    assert!(
        matches!(e, ChError::UnexpectedStatus { status: 200, .. }),
        "{e:?}"
    );
}

#[test]
fn an_unreachable_socket_is_told_apart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let body = disk_config(Path::new("/run/devlend/v.sock"), "v", 1, 256, false);

    // No such file.
    let missing = dir.path().join("missing.sock");
    let e = add_disk(&missing, &body).expect_err("missing socket");
    assert!(matches!(e, ChError::Unreachable { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&missing.display().to_string()), "{msg}");
    assert!(msg.contains(OP_ADD_DISK), "{msg}");
    assert!(msg.contains("unreachable"), "{msg}");
    assert!(std::error::Error::source(&e).is_some());

    // A socket file nobody listens on any more (the VMM exited).
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let e = remove_device(&stale, "v").expect_err("stale socket");
    assert!(matches!(e, ChError::Unreachable { .. }), "{e:?}");
    assert!(e.to_string().contains(OP_REMOVE_DEVICE), "{e}");
}

#[test]
fn the_stand_in_refuses_what_the_schema_refuses() {
    let ch = StandIn::start();
    let mut typo = disk_config(Path::new("/run/devlend/v.sock"), "v", 1, 256, false);
    typo["num_queue"] = json!(2);
    let e = add_disk(&ch.socket, &typo).expect_err("misspelled key");
    assert_eq!(e.status(), Some(400));
    assert!(
        e.to_string()
            .contains("DiskConfig.num_queue: no such property"),
        "{e}"
    );
    let e = add_disk(&ch.socket, &json!({ "vhost_user": true })).expect_err("no socket");
    assert!(e.to_string().contains("No socket provided"), "{e}");
    let got = ch.received();
    assert_eq!(got.len(), 2);
    assert!(!got[0].errors.is_empty());
}

/// The whole attach path with `--ch-api`: the compute agent's registry serves a device
/// lent by a real (in-process) lender, hot-adds it through the API, and removes it on
/// detach. A VM that is not running (204: cold-added) is rolled back.
#[test]
fn attach_and_detach_through_the_registry_use_the_api() {
    use devlend_compute_agent::api::{AttachRequest, VmmTarget};
    use devlend_compute_agent::registry::Registry;
    use devlend_device_agent::{DeviceSpec, Lender};

    let dir = tempfile::tempdir().expect("tempdir");
    let img = dir.path().join("d.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(1 << 20))
        .expect("image");
    let spec = DeviceSpec::block("d", img);
    let lender = Lender::bind("127.0.0.1:0", vec![spec])
        .expect("bind")
        .spawn();
    let ch = StandIn::start();
    let registry = Registry::default();
    let socket = dir.path().join("d.sock");
    let req = |id: &str| AttachRequest {
        id: Some(id.into()),
        lender: lender.local_addr().to_string(),
        device: "d".into(),
        socket: socket.clone(),
        queues: 2,
        queue_size: 128,
        poll_us: 0,
        reconnect_deadline_s: 30,
        vmm: Some(VmmTarget::CloudHypervisor {
            api: ch.socket.clone(),
        }),
        lease: None,
        lender_key: None,
        tls: false,
        tls_server_name: None,
        transport: Default::default(),
        rdma_exposure: Default::default(),
        kind: Default::default(),
        handover_token: None,
    };
    let info = registry.attach(req("vm1-d")).expect("attach");
    let plug = info.vmm.expect("plugged");
    assert_eq!(
        (plug.device_id.as_str(), plug.location.as_str()),
        ("vm1-d", "0000:00:06.0")
    );
    assert!(socket.exists());
    let got = ch.received();
    assert_eq!(got.len(), 1);
    assert!(got[0].errors.is_empty(), "{:?}", got[0]);
    assert_eq!(got[0].body["vhost_socket"], socket.display().to_string());
    assert_eq!(got[0].body["num_queues"], 2);

    registry
        .detach("vm1-d", std::time::Duration::from_secs(5))
        .expect("detach");
    assert!(!socket.exists());
    let got = ch.received();
    assert_eq!(
        got.last().map(|r| r.body.clone()),
        Some(json!({ "id": "vm1-d" }))
    );

    // A VM that has not booted answers 204: the disk is taken out again, nothing stays.
    ch.answer_next(204, "");
    let e = registry
        .attach(req("vm2-d"))
        .expect_err("cold add must fail");
    assert!(e.to_string().contains("Cloud Hypervisor"), "{e}");
    let got = ch.received();
    assert_eq!(
        got.last().map(|r| r.path.as_str()),
        Some("/api/v1/vm.remove-device")
    );
    assert!(registry.list().is_empty());
    assert!(!socket.exists());
}
