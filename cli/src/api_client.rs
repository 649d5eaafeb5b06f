//! The compute agent's control API, over its unix socket.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use devlend_compute_agent::api::{ApiError, AttachRequest, AttachmentInfo, HandoverInfo};
use reqwest::blocking::{Client, Response};

/// A client of one compute agent.
pub struct ApiClient {
    http: Client,
    socket: String,
}

impl ApiClient {
    /// A client for the API socket at `socket` (nothing is sent yet).
    ///
    /// # Errors
    /// The HTTP client could not be built.
    pub fn new(socket: &Path) -> Result<Self> {
        let http = devlend_pool::https::http_only_builder()
            .unix_socket(socket)
            .timeout(Duration::from_secs(120))
            .build()
            .context("cannot build the HTTP client")?;
        Ok(ApiClient {
            http,
            socket: socket.display().to_string(),
        })
    }

    fn check(&self, r: reqwest::Result<Response>) -> Result<Response> {
        let r = r.with_context(|| {
            format!(
                "cannot reach the compute agent at {} (is devlend-compute-agent running?)",
                self.socket
            )
        })?;
        if r.status().is_success() {
            return Ok(r);
        }
        let status = r.status();
        let msg = r
            .json::<ApiError>()
            .map(|e| e.error)
            .unwrap_or_else(|_| status.to_string());
        Err(anyhow!("{msg}"))
    }

    /// `POST /v1/attachments`.
    ///
    /// # Errors
    /// The agent's refusal, as its message.
    pub fn attach(&self, req: &AttachRequest) -> Result<AttachmentInfo> {
        let r = self.check(
            self.http
                .post("http://localhost/v1/attachments")
                .json(req)
                .send(),
        )?;
        r.json().context("bad answer from the compute agent")
    }

    /// `GET /v1/attachments`.
    ///
    /// # Errors
    /// The agent is unreachable.
    pub fn list(&self) -> Result<Vec<AttachmentInfo>> {
        let r = self.check(self.http.get("http://localhost/v1/attachments").send())?;
        r.json().context("bad answer from the compute agent")
    }

    /// `DELETE /v1/attachments/{id}`, where `target` is an id or a socket path;
    /// `release_timeout_s` bounds the wait for the guest to release a live-plugged device.
    ///
    /// # Errors
    /// No such attachment; the agent is unreachable.
    pub fn detach(&self, target: &str, release_timeout_s: u64) -> Result<AttachmentInfo> {
        let id = if target.contains('/') {
            self.list()?
                .into_iter()
                .find(|a| a.socket == Path::new(target))
                .map(|a| a.id)
                .ok_or_else(|| anyhow!("no attachment on socket {target}"))?
        } else {
            target.to_owned()
        };
        let url =
            format!("http://localhost/v1/attachments/{id}?release_timeout_s={release_timeout_s}");
        let r = self.check(self.http.delete(url).send())?;
        r.json().context("bad answer from the compute agent")
    }

    /// `POST /v1/attachments/{id}/handover`: a live migration's handover token.
    ///
    /// # Errors
    /// No such attachment, or one that cannot migrate; the agent is unreachable.
    pub fn handover(
        &self,
        id: &str,
        compute_host: Option<&str>,
        to_key: Option<&str>,
    ) -> Result<HandoverInfo> {
        let url = format!("http://localhost/v1/attachments/{id}/handover");
        let body = devlend_compute_agent::api::HandoverRequest {
            compute_host: compute_host.map(str::to_owned),
            to_key: to_key.map(str::to_owned),
        };
        let r = self.check(self.http.post(url).json(&body).send())?;
        r.json().context("bad answer from the compute agent")
    }

    /// `DELETE /v1/attachments/{id}/handover`: the migration failed or was cancelled.
    ///
    /// # Errors
    /// No such attachment; the agent is unreachable.
    pub fn cancel_handover(&self, id: &str) -> Result<AttachmentInfo> {
        let url = format!("http://localhost/v1/attachments/{id}/handover");
        let r = self.check(self.http.delete(url).send())?;
        r.json().context("bad answer from the compute agent")
    }

    /// `POST /v1/attachments/{id}/finish`: the VM migrated away.
    ///
    /// # Errors
    /// No such attachment, or one not being handed over; the agent is unreachable.
    pub fn finish_handover(&self, id: &str) -> Result<AttachmentInfo> {
        let url = format!("http://localhost/v1/attachments/{id}/finish");
        let r = self.check(self.http.post(url).send())?;
        r.json().context("bad answer from the compute agent")
    }
}
