//! The E2B calls the suite makes, over the wire exactly as the SDK sends them: REST on the API
//! URL (`X-API-KEY`), envd `process.Process/Start` over Connect JSON through the edge
//! (`E2b-Sandbox-Id`/`E2b-Sandbox-Port` + `X-Access-Token`).

use crate::http::{Conn, Endpoint, HttpError, Response};
use base64::Engine;
use serde_json::{json, Value};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Http(#[from] HttpError),
    /// The server answered with an unexpected status.
    #[error("{op}: HTTP {status}: {body}")]
    Status {
        op: &'static str,
        status: u16,
        body: String,
    },
    #[error("{0}: malformed response: {1}")]
    Malformed(&'static str, String),
    #[error("command {cmd:?} failed: exit {exit}, stderr {stderr:?}")]
    Command {
        cmd: String,
        exit: i64,
        stderr: String,
    },
}

impl ApiError {
    /// HTTP status of a rejected call, if that is what this is.
    pub fn status(&self) -> Option<u16> {
        match self {
            ApiError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub api: Endpoint,
    pub edge: Endpoint,
    pub api_key: String,
    pub template: String,
    /// Sandbox timeout sent on create: leaked sandboxes are reaped by the server.
    pub sandbox_timeout_s: u64,
    pub request_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct Sandbox {
    pub id: String,
    pub token: String,
    pub envd_version: String,
}

pub struct CmdOutput {
    pub stdout: String,
    pub exit_code: i64,
}

/// One worker's connections (one to the API, one to the edge).
pub struct Client {
    pub s: Settings,
    api: Conn,
    edge: Conn,
}

fn expect(op: &'static str, r: &Response, ok: &[u16]) -> Result<(), ApiError> {
    if ok.contains(&r.status) {
        Ok(())
    } else {
        Err(ApiError::Status {
            op,
            status: r.status,
            body: r.snippet(),
        })
    }
}

fn parse_sandbox(op: &'static str, v: &Value) -> Result<Sandbox, ApiError> {
    let id = v["sandboxID"]
        .as_str()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ApiError::Malformed(op, format!("no sandboxID in {v}")))?;
    Ok(Sandbox {
        id: id.to_string(),
        token: v["envdAccessToken"].as_str().unwrap_or("").to_string(),
        envd_version: v["envdVersion"].as_str().unwrap_or("").to_string(),
    })
}

fn json_body(op: &'static str, r: &Response) -> Result<Value, ApiError> {
    serde_json::from_slice(&r.body).map_err(|e| ApiError::Malformed(op, e.to_string()))
}

/// Connect envelope (flags byte, big-endian length, message).
pub fn envelope(msg: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(msg.len() + 5);
    v.push(0);
    v.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    v.extend_from_slice(msg);
    v
}

/// Splits a Connect streaming body into `(flags, message)` envelopes.
pub fn envelopes(mut body: &[u8]) -> Result<Vec<(u8, &[u8])>, String> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body.len() < 5 {
            return Err("truncated envelope header".into());
        }
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        if body.len() < 5 + len {
            return Err("envelope longer than the body".into());
        }
        out.push((body[0], &body[5..5 + len]));
        body = &body[5 + len..];
    }
    Ok(out)
}

/// Reads the events of a `process.Process/Start` stream: stdout, stderr, exit code. A stream
/// that ends without an `end` event or with an error in the end-stream message is an error.
pub fn parse_start_stream(body: &[u8]) -> Result<(String, String, i64), String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let (mut out, mut err, mut exit) = (Vec::new(), Vec::new(), None);
    let mut ended_stream = false;
    for (flags, msg) in envelopes(body)? {
        let v: Value = serde_json::from_slice(msg).map_err(|e| format!("bad event JSON: {e}"))?;
        if flags & 0x02 != 0 {
            if let Some(e) = v.get("error") {
                return Err(format!("stream error: {e}"));
            }
            ended_stream = true;
            continue;
        }
        let ev = &v["event"];
        if let Some(d) = ev.get("data") {
            for (k, sink) in [("stdout", &mut out), ("stderr", &mut err)] {
                if let Some(s) = d[k].as_str() {
                    sink.extend(b64.decode(s).map_err(|e| format!("bad base64 {k}: {e}"))?);
                }
            }
        }
        if let Some(e) = ev.get("end") {
            exit = Some(e["exitCode"].as_i64().unwrap_or(0));
        }
    }
    if !ended_stream {
        return Err("no end-of-stream envelope".into());
    }
    let exit = exit.ok_or("no end event")?;
    Ok((
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
        exit,
    ))
}

impl Client {
    pub fn new(s: Settings) -> Client {
        let api = Conn::new(s.api.clone(), s.request_timeout);
        let edge = Conn::new(s.edge.clone(), s.request_timeout);
        Client { s, api, edge }
    }

    async fn api_call(
        &mut self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Response, ApiError> {
        self.api_call_with(method, path, body, None).await
    }

    async fn api_call_with(
        &mut self,
        method: &str,
        path: &str,
        body: Option<Value>,
        idempotency_key: Option<&str>,
    ) -> Result<Response, ApiError> {
        let key = self.s.api_key.clone();
        let mut h = vec![("x-api-key", key.as_str())];
        if let Some(k) = idempotency_key {
            h.push(("idempotency-key", k));
        }
        if body.is_some() {
            h.push(("content-type", "application/json"));
        }
        let body = body.map(|b| b.to_string().into_bytes());
        Ok(self.api.send(method, path, &h, body).await?)
    }

    /// `POST /v2/sandboxes`: returns once the server says the agent answers (201).
    pub async fn create(&mut self, template: &str) -> Result<Sandbox, ApiError> {
        self.create_keyed(template, None).await
    }

    /// `create` with an `Idempotency-Key`: a retry with the same key answers with the same
    /// sandbox, so a client may resend a create whose answer it lost.
    pub async fn create_keyed(
        &mut self,
        template: &str,
        key: Option<&str>,
    ) -> Result<Sandbox, ApiError> {
        let body = json!({"templateID": template, "timeout": self.s.sandbox_timeout_s,
                          "metadata": {"cube-bench": "1"}});
        let r = self
            .api_call_with("POST", "/v2/sandboxes", Some(body), key)
            .await?;
        expect("create", &r, &[201])?;
        parse_sandbox("create", &json_body("create", &r)?)
    }

    /// `DELETE /sandboxes/{id}`; 404 counts as gone.
    pub async fn kill(&mut self, id: &str) -> Result<(), ApiError> {
        let r = self
            .api_call("DELETE", &format!("/sandboxes/{id}"), None)
            .await?;
        expect("kill", &r, &[204, 404])
    }

    pub async fn detail(&mut self, id: &str) -> Result<Value, ApiError> {
        let r = self
            .api_call("GET", &format!("/sandboxes/{id}"), None)
            .await?;
        expect("get sandbox", &r, &[200])?;
        json_body("get sandbox", &r)
    }

    pub async fn pause(&mut self, id: &str) -> Result<(), ApiError> {
        let r = self
            .api_call("POST", &format!("/sandboxes/{id}/pause"), Some(json!({})))
            .await?;
        expect("pause", &r, &[204])
    }

    /// `POST /v2/sandboxes/{id}/connect`: resumes a paused sandbox (201) or extends a running one (200).
    pub async fn connect(&mut self, id: &str) -> Result<Sandbox, ApiError> {
        let body = json!({"timeout": self.s.sandbox_timeout_s});
        let r = self
            .api_call("POST", &format!("/v2/sandboxes/{id}/connect"), Some(body))
            .await?;
        expect("connect", &r, &[200, 201])?;
        parse_sandbox("connect", &json_body("connect", &r)?)
    }

    /// `POST /sandboxes/{id}/snapshots` → snapshot id.
    pub async fn snapshot(&mut self, id: &str) -> Result<String, ApiError> {
        let r = self
            .api_call(
                "POST",
                &format!("/sandboxes/{id}/snapshots"),
                Some(json!({})),
            )
            .await?;
        expect("snapshot", &r, &[201])?;
        let v = json_body("snapshot", &r)?;
        v["snapshotID"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| ApiError::Malformed("snapshot", format!("no snapshotID in {v}")))
    }

    /// `POST /sandboxes/{id}/fork` with count 1 → the new sandbox.
    pub async fn fork(&mut self, id: &str) -> Result<Sandbox, ApiError> {
        let body = json!({"count": 1, "timeout": self.s.sandbox_timeout_s});
        let r = self
            .api_call("POST", &format!("/sandboxes/{id}/fork"), Some(body))
            .await?;
        expect("fork", &r, &[201])?;
        let v = json_body("fork", &r)?;
        let first = v
            .as_array()
            .and_then(|a| a.first())
            .ok_or_else(|| ApiError::Malformed("fork", format!("expected a list, got {v}")))?;
        if let Some(e) = first.get("error").filter(|e| !e.is_null()) {
            return Err(ApiError::Malformed("fork", format!("fork failed: {e}")));
        }
        parse_sandbox("fork", &first["sandbox"])
    }

    /// `DELETE /templates/{id}` (snapshots are deleted as templates); 404 counts as gone.
    pub async fn delete_template(&mut self, id: &str) -> Result<(), ApiError> {
        let r = self
            .api_call("DELETE", &format!("/templates/{id}"), None)
            .await?;
        expect("delete snapshot", &r, &[200, 204, 404])
    }

    /// Runs `cmd` the way `sbx.commands.run(cmd)` does (`/bin/bash -l -c cmd`) and waits for
    /// the end of the stream; a non-zero exit is an error.
    pub async fn run(&mut self, sb: &Sandbox, cmd: &str) -> Result<CmdOutput, ApiError> {
        let msg =
            json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}, "stdin": false});
        let body = envelope(msg.to_string().as_bytes());
        let mut h = vec![
            ("content-type", "application/connect+json"),
            ("connect-protocol-version", "1"),
            ("connect-timeout-ms", "60000"),
            ("e2b-sandbox-id", sb.id.as_str()),
            ("e2b-sandbox-port", "49983"),
        ];
        if !sb.token.is_empty() {
            h.push(("x-access-token", sb.token.as_str()));
        }
        let r = self
            .edge
            .send("POST", "/process.Process/Start", &h, Some(body))
            .await?;
        expect("process.Process/Start", &r, &[200])?;
        let (stdout, stderr, exit_code) = parse_start_stream(&r.body)
            .map_err(|e| ApiError::Malformed("process.Process/Start", e))?;
        if exit_code != 0 {
            return Err(ApiError::Command {
                cmd: cmd.into(),
                exit: exit_code,
                stderr,
            });
        }
        Ok(CmdOutput { stdout, exit_code })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(flags: u8, v: Value) -> Vec<u8> {
        let mut e = envelope(v.to_string().as_bytes());
        e[0] = flags;
        e
    }

    #[test]
    fn parses_an_echo_hi_stream() {
        let mut body = ev(0, json!({"event": {"start": {"pid": 7}}}));
        body.extend(ev(0, json!({"event": {"data": {"stdout": "aGkK"}}})));
        body.extend(ev(
            0,
            json!({"event": {"end": {"exitCode": 0, "exited": true}}}),
        ));
        body.extend(ev(2, json!({})));
        assert_eq!(
            parse_start_stream(&body).unwrap(),
            ("hi\n".into(), String::new(), 0)
        );
    }

    #[test]
    fn rejects_broken_streams() {
        // No end-stream envelope (the connection was cut).
        let body = ev(0, json!({"event": {"end": {"exitCode": 0}}}));
        assert!(parse_start_stream(&body).is_err());
        // Error in the end-stream message.
        let mut body = ev(0, json!({"event": {"start": {"pid": 1}}}));
        body.extend(ev(
            2,
            json!({"error": {"code": "unavailable", "message": "x"}}),
        ));
        assert!(parse_start_stream(&body)
            .unwrap_err()
            .contains("unavailable"));
        // Truncated.
        let body = ev(0, json!({"event": {}}));
        assert!(parse_start_stream(&body[..body.len() - 1]).is_err());
        // Missing end event.
        assert!(parse_start_stream(&ev(2, json!({}))).is_err());
    }

    #[test]
    fn nonzero_exit_is_reported() {
        let mut body = ev(0, json!({"event": {"data": {"stderr": "bm8K"}}}));
        body.extend(ev(0, json!({"event": {"end": {"exitCode": 3}}})));
        body.extend(ev(2, json!({})));
        assert_eq!(
            parse_start_stream(&body).unwrap(),
            (String::new(), "no\n".into(), 3)
        );
    }
}
