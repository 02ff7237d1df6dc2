//! HTTP client for the in-sandbox agent (envd protocol). With cube-vs the agent is reached at
//! the sandbox's unique host address. Without a switch every host end of a sandbox veth has the
//! same gateway address, so connections are bound to the sandbox's host interface
//! (SO_BINDTODEVICE) and go to the fixed guest address.

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use std::net::{SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

/// Errors talking to an agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("connect to agent at {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("agent HTTP: {0}")]
    Http(String),
    #[error("agent answered {status} to {path}: {body}")]
    Status {
        path: String,
        status: u16,
        body: String,
    },
    #[error("agent did not become healthy within {0:?}: {1}")]
    Timeout(Duration, String),
}

/// A client bound to one sandbox.
#[derive(Debug, Clone)]
pub struct AgentClient {
    /// Interface to bind to (only without a switch).
    pub iface: Option<String>,
    pub addr: SocketAddr,
}

impl AgentClient {
    /// A client for the agent at `ip:port`; `iface` binds the connection to an interface
    /// (needed only without a switch, where every sandbox has the same address).
    pub fn new(ip: std::net::Ipv4Addr, port: u16, iface: Option<&str>) -> AgentClient {
        AgentClient {
            iface: iface.map(str::to_string),
            addr: SocketAddr::V4(SocketAddrV4::new(ip, port)),
        }
    }

    async fn connect(&self) -> Result<tokio::net::TcpStream, AgentError> {
        let ce = |source| AgentError::Connect {
            addr: match &self.iface {
                Some(i) => format!("{} via {i}", self.addr),
                None => self.addr.to_string(),
            },
            source,
        };
        let s = tokio::net::TcpSocket::new_v4().map_err(ce)?;
        if let Some(i) = &self.iface {
            s.bind_device(Some(i.as_bytes())).map_err(ce)?;
        }
        let st = s.connect(self.addr).await.map_err(ce)?;
        let _ = st.set_nodelay(true);
        Ok(st)
    }

    /// One request on a fresh connection. Returns status and body.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<(u16, Bytes), AgentError> {
        let fut = async {
            let st = self.connect().await?;
            let (mut send, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(st))
                    .await
                    .map_err(|e| AgentError::Http(e.to_string()))?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            let mut b = hyper::Request::builder()
                .method(method)
                .uri(path)
                .header("host", self.addr.to_string());
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            let req = b
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| AgentError::Http(e.to_string()))?;
            let resp = send
                .send_request(req)
                .await
                .map_err(|e| AgentError::Http(e.to_string()))?;
            let status = resp.status().as_u16();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| AgentError::Http(e.to_string()))?
                .to_bytes();
            Ok((status, bytes))
        };
        tokio::time::timeout(timeout, fut).await.map_err(|_| {
            AgentError::Http(format!("{method} {path}: timed out after {timeout:?}"))
        })?
    }

    /// `GET /health` once.
    pub async fn health(&self) -> Result<(), AgentError> {
        self.health_at("/health").await
    }

    async fn health_at(&self, path: &str) -> Result<(), AgentError> {
        let (st, body) = self
            .request("GET", path, &[], vec![], Duration::from_secs(2))
            .await?;
        if (200..300).contains(&st) {
            Ok(())
        } else {
            Err(AgentError::Status {
                path: path.into(),
                status: st,
                body: String::from_utf8_lossy(&body).into(),
            })
        }
    }

    /// Polls `path` until it answers 2xx or the deadline passes, backing off up to `max_delay`.
    async fn poll_health(
        &self,
        path: &str,
        timeout: Duration,
        max_delay: Duration,
    ) -> Result<(), AgentError> {
        let start = Instant::now();
        let mut delay = Duration::from_micros(200);
        loop {
            let err = match self.health_at(path).await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if start.elapsed() >= timeout {
                return Err(AgentError::Timeout(timeout, err.to_string()));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(max_delay);
        }
    }

    /// Polls `/health` until it answers 2xx or the deadline passes.
    pub async fn wait_healthy(&self, timeout: Duration) -> Result<(), AgentError> {
        // A refused connect costs microseconds; a long backoff would dominate create latency.
        self.poll_health("/health", timeout, Duration::from_millis(1))
            .await
    }

    /// Polls `/health?warm` until the agent serves and its start-up work (the code
    /// interpreter's pre-started worker) is done: a pooled sandbox is then as warm as it will
    /// get. Agents without such work answer as soon as they serve.
    pub async fn wait_warm(&self, timeout: Duration) -> Result<(), AgentError> {
        // Warming up takes a Python start (~100 ms): no need to poll every millisecond.
        self.poll_health("/health?warm", timeout, Duration::from_millis(10))
            .await
    }

    /// `POST /init`.
    pub async fn init(&self, req: &cube_init::HttpInit) -> Result<(), AgentError> {
        self.init_as(req, None).await
    }

    /// `/init` of an agent that may already hold the token `prior` (one restored from a
    /// checkpoint holds its parent's; only its holder may re-initialise it).
    pub async fn init_as(
        &self,
        req: &cube_init::HttpInit,
        prior: Option<&str>,
    ) -> Result<(), AgentError> {
        let body = serde_json::to_vec(req).map_err(|e| AgentError::Http(e.to_string()))?;
        let mut h = vec![("content-type", "application/json")];
        if let Some(t) = prior.or(req.access_token.as_deref()) {
            h.push(("x-access-token", t));
        }
        let (st, b) = self
            .request("POST", "/init", &h, body, Duration::from_secs(5))
            .await?;
        if (200..300).contains(&st) {
            Ok(())
        } else {
            Err(AgentError::Status {
                path: "/init".into(),
                status: st,
                body: String::from_utf8_lossy(&b).into(),
            })
        }
    }

    /// Runs a command through Connect-JSON `process.Process/Start` and collects its output
    /// (used by tests, benches and diagnostics). Returns (exit code, stdout, stderr).
    pub async fn run(
        &self,
        cmd: &str,
        args: &[&str],
        token: Option<&str>,
        timeout: Duration,
    ) -> Result<(i64, String, String), AgentError> {
        let msg = serde_json::json!({"process": {"cmd": cmd, "args": args}, "stdin": false});
        let json = serde_json::to_vec(&msg).map_err(|e| AgentError::Http(e.to_string()))?;
        let mut body = vec![0u8];
        body.extend_from_slice(&(json.len() as u32).to_be_bytes());
        body.extend_from_slice(&json);
        let ms = timeout.as_millis().to_string();
        let mut h = vec![
            ("content-type", "application/connect+json"),
            ("connect-protocol-version", "1"),
            ("connect-timeout-ms", ms.as_str()),
        ];
        if let Some(t) = token {
            h.push(("x-access-token", t));
        }
        let (st, bytes) = self
            .request("POST", "/process.Process/Start", &h, body, timeout)
            .await?;
        if st != 200 {
            return Err(AgentError::Status {
                path: "/process.Process/Start".into(),
                status: st,
                body: String::from_utf8_lossy(&bytes).into(),
            });
        }
        parse_process_stream(&bytes).map_err(AgentError::Http)
    }
}

fn b64decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes() {
        let Some(v) = val(c) else { continue };
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

/// Parses a Connect server stream of process events.
pub fn parse_process_stream(mut b: &[u8]) -> Result<(i64, String, String), String> {
    let (mut out, mut err, mut code) = (Vec::new(), Vec::new(), None);
    while b.len() >= 5 {
        let flags = b[0];
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        if b.len() < 5 + len {
            return Err("truncated envelope".into());
        }
        let v: serde_json::Value =
            serde_json::from_slice(&b[5..5 + len]).map_err(|e| e.to_string())?;
        b = &b[5 + len..];
        if flags & 2 != 0 {
            if let Some(e) = v.get("error") {
                return Err(format!("stream error: {e}"));
            }
            continue;
        }
        let ev = &v["event"];
        if let Some(d) = ev.get("data") {
            if let Some(s) = d.get("stdout").and_then(|x| x.as_str()) {
                out.extend(b64decode(s));
            }
            if let Some(s) = d.get("stderr").and_then(|x| x.as_str()) {
                err.extend(b64decode(s));
            }
        }
        if let Some(e) = ev.get("end") {
            code = Some(e.get("exitCode").and_then(|x| x.as_i64()).unwrap_or(0));
        }
    }
    let code = code.ok_or("stream ended without an end event")?;
    Ok((
        code,
        String::from_utf8_lossy(&out).into(),
        String::from_utf8_lossy(&err).into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_process_stream() {
        let mut s = Vec::new();
        for (f, j) in [
            (0u8, r#"{"event":{"start":{"pid":7}}}"#),
            (0, r#"{"event":{"data":{"stdout":"aGkK"}}}"#),
            (0, r#"{"event":{"end":{"exitCode":3,"exited":true}}}"#),
            (2, "{}"),
        ] {
            s.push(f);
            s.extend((j.len() as u32).to_be_bytes());
            s.extend(j.as_bytes());
        }
        assert_eq!(
            parse_process_stream(&s).unwrap(),
            (3, "hi\n".into(), String::new())
        );
    }
}
