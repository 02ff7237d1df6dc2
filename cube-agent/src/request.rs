//! What every envd and interpreter handler reads requests with: the per-request context, bodies
//! (bounded), Connect envelopes, query strings, token checks. A leaf: it imports no handler and no
//! router.

use crate::connect::{self, Code, RpcError};
use crate::state::Shared;
use crate::users::User;
use bytes::Bytes;
use http::HeaderMap;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use std::collections::HashMap;
use std::time::Duration;

/// Per-request context handed to handlers.
pub struct Ctx {
    pub state: Shared,
    pub user: User,
    pub headers: HeaderMap,
    pub query: HashMap<String, String>,
}

impl Ctx {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// `Connect-Timeout-Ms`, if present and positive.
    pub fn connect_timeout(&self) -> Option<Duration> {
        self.header("connect-timeout-ms")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis)
    }
}

/// Parses a request body that must be exactly one message envelope.
pub fn single_envelope<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, RpcError> {
    let mut r = connect::EnvelopeReader::new();
    r.push(body);
    let env = r
        .next_envelope()?
        .ok_or_else(|| RpcError::invalid("request body is not a complete envelope"))?;
    if env.flags & connect::FLAG_END_STREAM != 0 {
        return Err(RpcError::invalid(
            "request envelope has the end-stream flag",
        ));
    }
    if r.pending() > 0 {
        return Err(RpcError::invalid(
            "unexpected data after the request envelope",
        ));
    }
    connect::decode_json(&env.payload)
}

/// The next data chunk of a request body.
pub async fn next_chunk(body: &mut Incoming) -> Result<Option<Bytes>, RpcError> {
    loop {
        match body.frame().await {
            None => return Ok(None),
            Some(Err(e)) => {
                return Err(RpcError::new(
                    Code::Canceled,
                    format!("reading request: {e}"),
                ))
            }
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    return Ok(Some(d));
                }
            }
        }
    }
}

/// Reads a whole body, refusing more than `limit` bytes.
pub async fn read_body(body: &mut Incoming, limit: usize) -> Result<Bytes, RpcError> {
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = next_chunk(body).await? {
        if buf.len() + chunk.len() > limit {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("request body exceeds the limit of {limit} bytes"),
            ));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// Most bytes of an unread request body swallowed before an early error answer.
const DRAIN_LIMIT: usize = 16 * 1024 * 1024;

/// Reads and discards what is left of a request body (bounded in size and time), so an early
/// error answer reaches a client that is still sending instead of a connection reset.
pub async fn drain(body: &mut Incoming) {
    let mut seen = 0usize;
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        while let Ok(Some(c)) = next_chunk(body).await {
            seen += c.len();
            if seen > DRAIN_LIMIT {
                break;
            }
        }
    })
    .await;
}

/// Decodes `%XX` and `+` in a query component.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = |c: u8| (c as char).to_digit(16);
                match (hex(b[i + 1]), hex(b[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 3;
                        continue;
                    }
                    _ => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn parse_query(q: Option<&str>) -> HashMap<String, String> {
    let mut m = HashMap::new();
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        m.entry(percent_decode(k))
            .or_insert_with(|| percent_decode(v));
    }
    m
}

/// Whether `headers` carry the sandbox's access token (always, when it has none).
pub fn token_ok(state: &Shared, headers: &HeaderMap) -> bool {
    match state.access_token() {
        None => true,
        Some(t) => headers
            .get("x-access-token")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| ct_eq(v.as_bytes(), t.as_bytes())),
    }
}

/// Constant-time comparison, for tokens and signatures.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
