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
//! The contract (the document and the two checkers) is in `contract.rs`, the stand-in
//! API server in `stand_in.rs`; the tests are here.

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

mod contract;
mod stand_in;
use contract::{contract, parse_ch_option, request_schema_ref};
use stand_in::StandIn;

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
        paths: Vec::new(),
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
        vm: None,
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
