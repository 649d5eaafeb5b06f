//! The stand-in Cloud Hypervisor API server: on a unix socket, it validates each
//! request against the contract's schemas, records it and answers as the document says.

use super::*;

/// A request the stand-in received.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    pub(crate) path: String,
    pub(crate) content_type: String,
    pub(crate) body: Value,
    /// What the schema checkers found wrong with it.
    pub(crate) errors: Vec<String>,
}

#[derive(Default)]
pub(crate) struct StandInState {
    pub(crate) received: Mutex<Vec<Received>>,
    /// Device id to PCI address.
    pub(crate) devices: Mutex<BTreeMap<String, String>>,
    pub(crate) next_slot: Mutex<u8>,
    /// An answer to give to the next request instead of the usual one.
    pub(crate) next_answer: Mutex<Option<(u16, String)>>,
}

/// A stand-in for Cloud Hypervisor's API server on a unix socket, running on its own
/// thread and tokio runtime so that the blocking client under test runs on the test's
/// thread, as it would in devlend.
pub(crate) struct StandIn {
    pub(crate) socket: PathBuf,
    pub(crate) state: Arc<StandInState>,
    pub(crate) stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub(crate) thread: Option<std::thread::JoinHandle<()>>,
    pub(crate) _dir: tempfile::TempDir,
}

impl StandIn {
    pub(crate) fn start() -> StandIn {
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

    pub(crate) fn received(&self) -> Vec<Received> {
        self.state.received.lock().expect("lock").clone()
    }

    pub(crate) fn answer_next(&self, status: u16, body: &str) {
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

pub(crate) fn answer(status: u16, body: String) -> Response {
    let status = StatusCode::from_u16(status).expect("status");
    if status == StatusCode::NO_CONTENT {
        return status.into_response();
    }
    (status, body).into_response()
}

/// Records the request and checks it against `schema`; the status and body of the
/// answer if it must be refused.
pub(crate) fn stand_in_receive(
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
