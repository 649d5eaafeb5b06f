//! How one call reaches the pool: tried on each server in turn until one answers,
//! signed with the client's identity (again with the pool's time if it refused our
//! clock), and its answer decoded.

use reqwest::blocking::{RequestBuilder, Response};
use reqwest::{Method, StatusCode, Url};
use serde::de::DeserializeOwned;

use crate::api::ErrorBody;
use crate::auth::request;

use super::{ClientError, PoolClient};

impl PoolClient {
    fn url(base: &Url, segments: &[&str], query: &[(&str, String)]) -> Url {
        let mut url = base.clone();
        if let Ok(mut p) = url.path_segments_mut() {
            p.pop_if_empty().extend(segments);
        }
        if !query.is_empty() {
            let mut q = url.query_pairs_mut();
            for (k, v) in query {
                q.append_pair(k, v);
            }
        }
        url
    }

    pub(super) fn call<B: serde::Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| ClientError::Decode {
                status: 0,
                detail: format!("cannot encode the request: {e}"),
            })?,
            None => Vec::new(),
        };
        let mut last = None;
        for (i, base) in self.servers.in_order() {
            let url = Self::url(base, segments, query);
            match self.send(&method, &url, body.is_some(), &bytes) {
                Ok(answer) => {
                    self.servers.answered(i);
                    return answer;
                }
                Err(Sent::Not(e)) => last = Some(e),
                Err(Sent::Maybe(e)) => {
                    self.servers.skip(i);
                    return Err(e);
                }
            }
        }
        Err(last.unwrap_or(ClientError::BadUrl { url: String::new() }))
    }

    /// One request to one server; signed requests refused for a clock the pool found
    /// too far from its own are signed again with the pool's time, once.
    fn send<T: DeserializeOwned>(
        &self,
        method: &Method,
        url: &Url,
        has_body: bool,
        bytes: &[u8],
    ) -> Result<Result<T, ClientError>, Sent> {
        let mut corrected = false;
        loop {
            let (status, date, answer) = self.send_once(method, url, has_body, bytes)?;
            let changed =
                date.is_some_and(|d| self.servers.saw_date(&d, std::time::SystemTime::now()));
            let refused_clock = status == StatusCode::UNAUTHORIZED && self.identity.is_some();
            if refused_clock && changed && !corrected {
                corrected = true;
                continue;
            }
            return Ok(decode(status, &answer));
        }
    }

    fn send_once(
        &self,
        method: &Method,
        url: &Url,
        has_body: bool,
        bytes: &[u8],
    ) -> Result<(StatusCode, Option<String>, Vec<u8>), Sent> {
        let mut req: RequestBuilder = self.http.request(method.clone(), url.clone());
        if let Some(key) = &self.identity {
            let target = match url.query() {
                Some(q) => format!("{}?{q}", url.path()),
                None => url.path().to_string(),
            };
            let value = request::sign(key, method.as_str(), &target, self.servers.now_ms(), bytes)
                .map_err(|e| Sent::Not(ClientError::Sign(e)))?;
            req = req.header(reqwest::header::AUTHORIZATION, value);
        }
        if has_body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(bytes.to_vec());
        }
        let transport = |source: reqwest::Error| match crate::https::tls_failure(&source) {
            Some(reason) => ClientError::Tls {
                url: url.to_string(),
                reason,
                source,
            },
            None => ClientError::Transport {
                url: url.to_string(),
                source,
            },
        };
        let resp: Response = req.send().map_err(|e| {
            // Not connected: the request was never sent, and the next server may take it.
            if e.is_connect() {
                Sent::Not(transport(e))
            } else {
                Sent::Maybe(transport(e))
            }
        })?;
        let status = resp.status();
        let date = resp
            .headers()
            .get(reqwest::header::DATE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = resp.bytes().map_err(|e| Sent::Maybe(transport(e)))?;
        Ok((status, date, body.to_vec()))
    }
}

/// A request that failed: whether the server may have carried it out.
enum Sent {
    /// It never reached the server: the next server may be asked.
    Not(ClientError),
    /// It may have: not sent again.
    Maybe(ClientError),
}

fn decode<T: DeserializeOwned>(status: StatusCode, bytes: &[u8]) -> Result<T, ClientError> {
    if status.is_success() {
        return serde_json::from_slice(bytes).map_err(|e| ClientError::Decode {
            status: status.as_u16(),
            detail: e.to_string(),
        });
    }
    match serde_json::from_slice::<ErrorBody>(bytes) {
        Ok(e) => Err(ClientError::Api {
            status: status.as_u16(),
            code: e.code,
            message: e.message,
        }),
        Err(_) => Err(ClientError::Api {
            status: status.as_u16(),
            code: "http_error".to_string(),
            message: format!(
                "{status}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            ),
        }),
    }
}
