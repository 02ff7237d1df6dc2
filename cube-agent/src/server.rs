//! The HTTP/1.1 server on port 49983: routing, auth, CORS, bodies, and Connect response helpers.

use crate::connect::{self, Code, RpcError, MAX_MESSAGE_BYTES};
use crate::state::{Shared, UserError};
use crate::users::User;
use crate::{files_http, fs_rpc, process_rpc, sys_http};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;

/// Response bodies: a complete buffer, or a stream of chunks each flushed as it comes.
pub enum Body {
    Full(Option<Bytes>),
    Chan(mpsc::Receiver<Bytes>),
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Chan(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Body::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Body::Full(None) => SizeHint::with_exact(0),
            Body::Chan(_) => SizeHint::default(),
        }
    }
}

pub type Resp = Response<Body>;

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

pub fn response(status: u16, content_type: &str, body: Bytes) -> Resp {
    let mut r = Response::new(Body::Full(Some(body)));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if let Ok(v) = HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

pub fn empty(status: u16) -> Resp {
    let mut r = Response::new(Body::Full(None));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r
}

pub fn json_response(status: u16, v: &serde_json::Value) -> Resp {
    response(status, "application/json", Bytes::from(v.to_string()))
}

/// envd's plain-HTTP error body: `{"code": <status>, "message": "…"}`.
pub fn http_error(status: u16, message: impl Into<String>) -> Resp {
    json_response(
        status,
        &serde_json::json!({"code": status, "message": message.into()}),
    )
}

pub fn rpc_ok<T: serde::Serialize>(msg: &T) -> Resp {
    match serde_json::to_vec(msg) {
        Ok(v) => response(200, "application/json", Bytes::from(v)),
        Err(e) => rpc_err(&RpcError::internal(format!("encoding response: {e}"))),
    }
}

pub fn rpc_err(e: &RpcError) -> Resp {
    json_response(e.code.http_status(), &e.to_json())
}

pub fn rpc_result(r: Result<(), RpcError>) -> Resp {
    match r {
        Ok(()) => rpc_ok(&serde_json::json!({})),
        Err(e) => rpc_err(&e),
    }
}

/// A streaming Connect response and the sender that feeds it envelopes.
pub fn stream_response() -> (mpsc::Sender<Bytes>, Resp) {
    let (tx, rx) = mpsc::channel(64);
    let mut r = Response::new(Body::Chan(rx));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    (tx, r)
}

/// A streaming response that fails immediately (200 + end-stream error, as connect-go does).
pub fn stream_error(e: &RpcError) -> Resp {
    let mut r = response(
        200,
        "application/connect+json",
        connect::end_stream_envelope(Some(e)),
    );
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    r
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

fn cors(headers: &mut HeaderMap) {
    headers.insert("access-control-allow-origin", HeaderValue::from_static("*"));
    headers.insert(
        "access-control-allow-methods",
        HeaderValue::from_static("*"),
    );
    headers.insert(
        "access-control-allow-headers",
        HeaderValue::from_static("*"),
    );
    headers.insert(
        "access-control-expose-headers",
        HeaderValue::from_static("*"),
    );
    headers.insert("access-control-max-age", HeaderValue::from_static("7200"));
}

const UNAUTHORIZED: &str =
    "unauthorized access, please provide a valid access token or method signing if supported";

fn token_ok(state: &Shared, headers: &HeaderMap) -> bool {
    match state.access_token() {
        None => true,
        Some(t) => headers
            .get("x-access-token")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| crate::files_http::ct_eq(v.as_bytes(), t.as_bytes())),
    }
}

/// Entry point for every request.
pub async fn handle(state: Shared, req: Request<Incoming>) -> Result<Resp, Infallible> {
    let mut resp = route(state, req).await;
    cors(resp.headers_mut());
    Ok(resp)
}

async fn route(state: Shared, req: Request<Incoming>) -> Resp {
    let (parts, mut body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let method = parts.method.clone();
    if method == Method::OPTIONS {
        return empty(204);
    }
    let query = parse_query(parts.uri.query());
    let headers = parts.headers;

    match (method.as_str(), path.as_str()) {
        ("GET", "/health") => return sys_http::health(&state, &query),
        ("POST", "/init") => return sys_http::init(&state, &headers, &mut body).await,
        _ => {}
    }

    let is_files = path == "/files" && (method == Method::GET || method == Method::POST);
    if !is_files && !token_ok(&state, &headers) {
        drain(&mut body).await;
        return http_error(401, UNAUTHORIZED);
    }

    match (method.as_str(), path.as_str()) {
        ("GET", "/envs") => return sys_http::envs(&state),
        ("GET", "/logs") => return sys_http::logs(&state, &query),
        ("GET", "/metrics") => return sys_http::metrics(&state).await,
        _ => {}
    }

    if is_files {
        return files_http::handle(state, method, headers, query, body).await;
    }
    if method == Method::POST && path == "/files/compose" {
        return files_http::compose(state, headers, body).await;
    }

    let Some(rpc) = path.strip_prefix('/') else {
        drain(&mut body).await;
        return http_error(404, "not found");
    };
    let known = matches!(
        rpc,
        "process.Process/Start"
            | "process.Process/Connect"
            | "process.Process/List"
            | "process.Process/SendInput"
            | "process.Process/StreamInput"
            | "process.Process/SendSignal"
            | "process.Process/CloseStdin"
            | "process.Process/Update"
            | "filesystem.Filesystem/Stat"
            | "filesystem.Filesystem/MakeDir"
            | "filesystem.Filesystem/Move"
            | "filesystem.Filesystem/ListDir"
            | "filesystem.Filesystem/Remove"
            | "filesystem.Filesystem/WatchDir"
            | "filesystem.Filesystem/CreateWatcher"
            | "filesystem.Filesystem/GetWatcherEvents"
            | "filesystem.Filesystem/RemoveWatcher"
    );
    if !known {
        drain(&mut body).await;
        if rpc.starts_with("process.Process/") || rpc.starts_with("filesystem.Filesystem/") {
            // connect-go answers unknown procedures with 404 (clients map it to unimplemented).
            let mut r = rpc_err(&RpcError::new(
                Code::Unimplemented,
                format!("method {rpc} is not implemented"),
            ));
            *r.status_mut() = StatusCode::NOT_FOUND;
            return r;
        }
        return http_error(404, format!("no route for {method} {path}"));
    }
    if method != Method::POST {
        drain(&mut body).await;
        return http_error(405, "Connect RPCs must use POST");
    }
    let streaming = matches!(
        rpc,
        "process.Process/Start"
            | "process.Process/Connect"
            | "process.Process/StreamInput"
            | "filesystem.Filesystem/WatchDir"
    );
    let ctype = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let base = ctype.split(';').next().unwrap_or("").trim();
    let expected = if streaming {
        "application/connect+json"
    } else {
        "application/json"
    };
    if base != expected {
        drain(&mut body).await;
        let e = RpcError::new(
            Code::Unimplemented,
            format!(
                "unsupported content type {base:?}: this method takes {expected} (only the JSON codec is supported)"
            ),
        );
        let mut r = rpc_err(&e);
        *r.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return r;
    }
    let fail = |e: &RpcError| {
        if streaming {
            stream_error(e)
        } else {
            rpc_err(e)
        }
    };

    let user = match state.user_from_auth(
        headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    ) {
        Ok(u) => u,
        Err(e @ UserError::Unknown(_)) | Err(e @ UserError::BadHeader(_)) => {
            drain(&mut body).await;
            return fail(&RpcError::new(Code::Unauthenticated, e.to_string()));
        }
    };
    let ctx = Ctx {
        state,
        user,
        headers,
        query,
    };
    if rpc == "process.Process/StreamInput" {
        return process_rpc::stream_input(ctx, body).await;
    }
    // Envelope framing adds 5 bytes to a message.
    let data = match read_body(&mut body, MAX_MESSAGE_BYTES + 5).await {
        Ok(d) => d,
        Err(e) => return fail(&e),
    };
    match rpc {
        "process.Process/Start" => process_rpc::start(ctx, data).await,
        "process.Process/Connect" => process_rpc::connect_(ctx, data).await,
        "process.Process/List" => process_rpc::list(ctx, data).await,
        "process.Process/SendInput" => process_rpc::send_input(ctx, data).await,
        "process.Process/SendSignal" => process_rpc::send_signal(ctx, data).await,
        "process.Process/CloseStdin" => process_rpc::close_stdin(ctx, data).await,
        "process.Process/Update" => process_rpc::update(ctx, data).await,
        "filesystem.Filesystem/WatchDir" => fs_rpc::watch_dir(ctx, data).await,
        other => fs_rpc::unary(ctx, other, data).await,
    }
}

/// Serves envd on `listener` forever.
pub async fn serve(listener: tokio::net::TcpListener, state: Shared) {
    crate::listen::serve(listener, "envd", move |req| handle(state.clone(), req)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = parse_query(Some("path=%2Fhome%2Fuser%2Fa+b.txt&username=&x&bad=%zz%4"));
        assert_eq!(q["path"], "/home/user/a b.txt");
        assert_eq!(q["username"], "");
        assert_eq!(q["x"], "");
        assert_eq!(q["bad"], "%zz%4");
    }
}
