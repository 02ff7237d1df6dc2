//! The sandbox edge (:3001): routes each request to a sandbox's port and proxies it with
//! streaming bodies both ways (envd's Connect streams must flow unbuffered).
//!
//! Routing order: `E2b-Sandbox-Id` + `E2b-Sandbox-Port` headers, then `Host:
//! <port>-<id>.<domain>`, then `X-Access-Token` (old SDKs that send no routing headers).

use crate::master::Master;
use crate::metrics::Metrics;
use crate::ratelimit::{Class, RateLimiter};
use crate::sandbox_cache::{Answer, Key, SandboxCache};
use bytes::Bytes;
use cube_proto::master::v1 as pb;
use cube_proto::now_ms;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket};

pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port (e2b_code_interpreter's JUPYTER_PORT).
pub const INTERPRETER_PORT: u16 = 49999;
const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// The sandbox's traffic access token (the create response's `trafficAccessToken`): what the
/// code interpreter SDK sends on every call to 49999, where it sends the envd token on
/// `/execute` only. A one-way function of the envd token, so holding it opens the
/// interpreter's routes through the edge but not envd.
pub fn traffic_token(envd_token: &str) -> Option<String> {
    use sha2::{Digest, Sha256};
    if envd_token.is_empty() {
        return None;
    }
    let mut h = Sha256::new();
    h.update(b"cube traffic access token\0");
    h.update(envd_token.as_bytes());
    Some(hex::encode(&h.finalize()[..24]))
}

/// Whether `path` reaches the agent's `/init` however it is spelled (`//init`, `/init/`,
/// `/./init`, `/%69nit`): the agent's router ignores empty segments.
pub fn is_init(path: &str) -> bool {
    let mut segs: Vec<String> = Vec::new();
    for raw in path.split('/') {
        let seg = percent_encoding::percent_decode_str(raw)
            .decode_utf8_lossy()
            .to_ascii_lowercase();
        match seg.as_str() {
            "" | "." => {}
            ".." => {
                segs.pop();
            }
            _ => segs.push(seg),
        }
    }
    segs.len() == 1 && segs[0] == "init"
}

type Body = BoxBody<Bytes, hyper::Error>;

fn json_response(status: StatusCode, v: serde_json::Value) -> Response<Body> {
    let body = Full::new(Bytes::from(v.to_string()))
        .map_err(|never| match never {})
        .boxed();
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn not_found(id: &str) -> Response<Body> {
    json_response(
        StatusCode::BAD_GATEWAY,
        serde_json::json!({"sandboxId": id, "message": "The sandbox was not found", "code": 502}),
    )
}

fn port_closed(id: &str) -> Response<Body> {
    json_response(
        StatusCode::BAD_GATEWAY,
        serde_json::json!({"sandboxId": id, "message": "The sandbox is running but port is not open", "code": 502}),
    )
}

/// Where a request goes, before asking the master.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    Sandbox {
        id: String,
        port: u16,
    },
    /// Routing headers that cannot name a sandbox port (a client bug: 400, not a 502).
    BadPort(String),
    AccessToken(String),
    None,
}

/// Sandbox ids are `[a-z0-9]{1,64}`.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Parses `<port>-<id>.<domain>` (the left-most label, split on the first `-`).
pub fn parse_host(host: &str) -> Option<(String, u16)> {
    let label = host.split('.').next()?;
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    if id.is_empty()
        || !id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return None;
    }
    Some((id.to_string(), port))
}

pub fn route(headers: &hyper::HeaderMap) -> Route {
    let h = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    if let Some(id) = h("e2b-sandbox-id") {
        let port = match h("e2b-sandbox-port") {
            None => ENVD_PORT,
            Some(p) => match p.trim().parse::<u16>() {
                Ok(p) if p != 0 => p,
                _ => return Route::BadPort(p),
            },
        };
        return Route::Sandbox { id, port };
    }
    if let Some((id, port)) = h("host").as_deref().and_then(parse_host) {
        return Route::Sandbox { id, port };
    }
    if let Some(t) = h("x-access-token") {
        return Route::AccessToken(t);
    }
    Route::None
}

/// What every edge connection shares.
#[derive(Clone)]
pub struct Edge {
    /// Resends a call while the master restarts (for look-ups the edge has no answer for).
    pub master: Master,
    /// One try: for refreshing an answer the edge can fall back on.
    pub master_once: Master,
    pub cache: Arc<SandboxCache>,
    pub metrics: Arc<Metrics>,
    /// Per client address, for look-ups the cache cannot answer.
    pub limiter: Arc<RateLimiter>,
}

/// Serves the edge until the listener fails.
pub async fn serve(listener: TcpListener, edge: Edge) -> std::io::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await?;
        // envd streams small frames (process output, keepalives): without this, Nagle holds
        // each one until the client's delayed ACK (~40 ms).
        let _ = stream.set_nodelay(true);
        let edge = edge.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let edge = edge.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(req, edge, peer.ip()).await) }
            });
            // Upgrades: WebSocket (e2b-desktop's VNC, any app in the sandbox) passes through.
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .with_upgrades()
                .await
            {
                tracing::debug!(%peer, error = %e, "edge connection ended");
            }
        });
    }
}

/// Why a look-up gave no sandbox.
enum Miss {
    NotFound,
    /// The client address is over its look-up rate; retry after this long.
    Limited(Duration),
    /// The master cannot be reached (restarting) and the edge never saw this sandbox.
    Unavailable,
}

/// The sandbox for a route: from the cache when fresh (found or known missing), else from the
/// master (then cached), if the client address is within its look-up rate. While the master is
/// unreachable, a sandbox the edge has routed to before keeps being routed by that last answer
/// (its traffic does not depend on the master), and one it never saw waits for the master's
/// return up to cube-api's retry budget.
async fn lookup(edge: &Edge, key: Key, client: IpAddr) -> Result<pb::SandboxInfo, Miss> {
    match edge.cache.get(&key) {
        // Past its end the master may have paused or killed it since: ask again.
        Some(Answer::Found(info)) if info.end_at_ms <= now_ms() => {}
        Some(Answer::Found(info)) => {
            edge.metrics
                .edge_lookups
                .with_label_values(&["cache"])
                .inc();
            return Ok(info);
        }
        Some(Answer::Missing) => {
            edge.metrics
                .edge_lookups
                .with_label_values(&["cache_missing"])
                .inc();
            return Err(Miss::NotFound);
        }
        None => {}
    }
    // A sandbox this edge has served before is refreshed whatever the address's rate: a flood
    // of guesses from the same address must not cut off the client's real sandboxes.
    let stale = edge.cache.last_found(&key);
    let allowed = if stale.is_some() {
        Ok(())
    } else {
        edge.limiter.check(&client.to_string(), Class::EdgeLookup)
    };
    if let Err(wait) = allowed {
        edge.metrics
            .rate_limited
            .with_label_values(&["edge_lookup"])
            .inc();
        return Err(Miss::Limited(wait));
    }
    edge.metrics
        .edge_lookups
        .with_label_values(&["master"])
        .inc();
    let generation = edge.cache.generation();
    let mut master = if stale.is_some() {
        edge.master_once.clone()
    } else {
        edge.master.clone()
    };
    let r = match &key {
        Key::Id(id) => {
            master
                .get_sandbox(pb::SandboxRef {
                    team_id: String::new(),
                    sandbox_id: id.clone(),
                })
                .await
        }
        Key::Token(t) => {
            master
                .resolve_access_token(pb::ResolveAccessTokenRequest {
                    access_token: t.clone(),
                })
                .await
        }
    };
    match r {
        Ok(info) => {
            let info = info.into_inner();
            edge.cache.insert(generation, key, info.clone());
            Ok(info)
        }
        Err(s) if s.code() == tonic::Code::Unavailable => match stale {
            Some(info) => {
                edge.metrics
                    .edge_lookups
                    .with_label_values(&["stale"])
                    .inc();
                Ok(info)
            }
            None => Err(Miss::Unavailable),
        },
        Err(s) => {
            if s.code() == tonic::Code::NotFound {
                edge.cache.insert_missing(generation, key);
            }
            Err(Miss::NotFound)
        }
    }
}

async fn handle(req: Request<Incoming>, edge: Edge, client: IpAddr) -> Response<Body> {
    let m = edge.metrics.clone();
    let (result, resp) = handle_inner(req, edge, client).await;
    m.edge_requests.with_label_values(&[result]).inc();
    resp
}

fn forbidden(msg: &str) -> Response<Body> {
    json_response(
        StatusCode::FORBIDDEN,
        serde_json::json!({"code": 403, "message": msg}),
    )
}

fn unavailable() -> Response<Body> {
    let mut r = json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        serde_json::json!({"code": 503, "message": "cube-master is unreachable (restarting?); retry shortly"}),
    );
    r.headers_mut().insert(
        hyper::header::RETRY_AFTER,
        hyper::header::HeaderValue::from_static("1"),
    );
    r
}

fn limited(wait: Duration) -> Response<Body> {
    let mut r = json_response(
        StatusCode::TOO_MANY_REQUESTS,
        serde_json::json!({"code": 429, "message": "too many sandbox look-ups from this address; retry later"}),
    );
    let secs = crate::ratelimit::retry_after_secs(wait);
    if let Ok(v) = hyper::header::HeaderValue::from_str(&secs.to_string()) {
        r.headers_mut().insert(hyper::header::RETRY_AFTER, v);
    }
    r
}

/// Requests to the code interpreter must carry the sandbox's envd token (`X-Access-Token`) or
/// its traffic token; the interpreter then sees the envd token either way (it checks it like
/// envd does). False = refuse.
fn authorize_interpreter(headers: &mut hyper::HeaderMap, info: &pb::SandboxInfo) -> bool {
    if info.access_token.is_empty() {
        return true;
    }
    let given = |n: &str| headers.get(n).map(|v| v.as_bytes().to_vec());
    let envd_ok = given("x-access-token").is_some_and(|v| ct_eq(&v, info.access_token.as_bytes()));
    let traffic_ok = traffic_token(&info.access_token)
        .is_some_and(|t| given(TRAFFIC_TOKEN_HEADER).is_some_and(|v| ct_eq(&v, t.as_bytes())));
    if !envd_ok && !traffic_ok {
        return false;
    }
    if let Ok(v) = hyper::header::HeaderValue::from_str(&info.access_token) {
        headers.insert("x-access-token", v);
    }
    true
}

/// Whether the request carries the sandbox's traffic access token.
fn has_traffic_token(headers: &hyper::HeaderMap, info: &pb::SandboxInfo) -> bool {
    traffic_token(&info.access_token).is_some_and(|t| {
        headers
            .get(TRAFFIC_TOKEN_HEADER)
            .is_some_and(|v| ct_eq(v.as_bytes(), t.as_bytes()))
    })
}

/// Constant-time comparison (token checks must not leak a prefix through timing).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn handle_inner(
    mut req: Request<Incoming>,
    edge: Edge,
    client: IpAddr,
) -> (&'static str, Response<Body>) {
    let route = route(req.headers());
    // /init carries the access token and env; only the node may call it.
    let envd = matches!(route, Route::AccessToken(_))
        || matches!(route, Route::Sandbox { port, .. } if port == ENVD_PORT);
    if envd && is_init(req.uri().path()) {
        return (
            "forbidden",
            forbidden("/init is not reachable through the edge"),
        );
    }
    let found = match route {
        // An id that cannot exist is not worth a master round trip (nor a log line).
        Route::Sandbox { id, .. } if !valid_id(&id) => {
            return (
                "not_found",
                not_found(&id.chars().take(64).collect::<String>()),
            )
        }
        Route::Sandbox { id, port } => lookup(&edge, Key::Id(id.clone()), client)
            .await
            .map(|info| (info, port))
            .map_err(|m| (m, id)),
        Route::AccessToken(t) if t.len() > 512 => return ("not_found", not_found("")),
        Route::AccessToken(t) => lookup(&edge, Key::Token(t), client)
            .await
            .map(|info| (info, ENVD_PORT))
            .map_err(|m| (m, String::new())),
        Route::BadPort(p) => {
            let shown: String = p.chars().take(16).collect();
            return (
                "bad_request",
                json_response(
                    StatusCode::BAD_REQUEST,
                    serde_json::json!({"code": 400, "message": format!("invalid E2b-Sandbox-Port {shown:?}")}),
                ),
            );
        }
        Route::None => return ("not_found", not_found("")),
    };
    let (info, port) = match found {
        Ok(f) => f,
        Err((Miss::NotFound, id)) => return ("not_found", not_found(&id)),
        Err((Miss::Limited(wait), _)) => return ("rate_limited", limited(wait)),
        Err((Miss::Unavailable, _)) => return ("master_unavailable", unavailable()),
    };
    if info.state != "running" && !info.auto_resume {
        return ("not_found", not_found(&info.sandbox_id));
    }
    // The checks below read what a resume does not change (tokens, settings): they come first,
    // so a request that would be refused does not wake a paused sandbox.
    if port == INTERPRETER_PORT
        && req.uri().path() != "/health"
        && !authorize_interpreter(req.headers_mut(), &info)
    {
        return (
            "unauthorized",
            json_response(
                StatusCode::UNAUTHORIZED,
                serde_json::json!({"code": 401, "message": "unauthorized access, please provide a valid access token"}),
            ),
        );
    }
    // A sandbox created with allowPublicTraffic false: its ports need the traffic access token
    // (envd's port has envd's own token; the interpreter's was checked above).
    if info.private_ports
        && port != ENVD_PORT
        && port != INTERPRETER_PORT
        && !has_traffic_token(req.headers(), &info)
    {
        return (
            "forbidden",
            forbidden(&format!(
                "sandbox {} does not allow public traffic: send its traffic access token in the {TRAFFIC_TOKEN_HEADER} header",
                info.sandbox_id
            )),
        );
    }
    // An autoResume sandbox past its end is about to be paused: the request resumes it (which,
    // under the master's lock, extends it instead), rather than racing the pause.
    let due = info.auto_resume && info.end_at_ms <= now_ms();
    let info = if info.state == "running" && !due {
        info
    } else {
        match auto_resume(&edge, &info.sandbox_id).await {
            Some(i) => i,
            None => return ("not_found", not_found(&info.sandbox_id)),
        }
    };
    if !info.mask_request_host.is_empty() {
        let host = info.mask_request_host.replace("${PORT}", &port.to_string());
        match hyper::header::HeaderValue::from_str(&host) {
            Ok(v) => {
                req.headers_mut().insert(hyper::header::HOST, v);
            }
            Err(_) => return ("not_found", not_found(&info.sandbox_id)),
        }
    }
    let Ok(agent) = info.agent_address.parse::<SocketAddr>() else {
        return ("not_found", not_found(&info.sandbox_id));
    };
    let target = SocketAddr::new(agent.ip(), port);
    match proxy(req, target, &info.host_interface, &edge.metrics).await {
        Ok(r) => ("proxied", r),
        Err(e) => {
            tracing::debug!(sandbox = %info.sandbox_id, %target, error = %e, "edge proxy failed");
            // The cached address may be stale (killed by the reaper, not through this API).
            edge.cache.invalidate(&info.sandbox_id);
            ("port_closed", port_closed(&info.sandbox_id))
        }
    }
}

/// Longest a request waits for its paused sandbox to be resumed (a pause or resume already
/// under way must end first; a microVM resume from disk can take seconds).
const AUTO_RESUME_WAIT: Duration = Duration::from_secs(60);

/// Resumes a paused sandbox that asked to be resumed by traffic (`autoResume`), so that the
/// request that found it paused is served, not failed. Concurrent requests all ask: the master
/// resumes once and answers the others that it is running. None = gone, or not resumable.
async fn auto_resume(edge: &Edge, id: &str) -> Option<pb::SandboxInfo> {
    let deadline = tokio::time::Instant::now() + AUTO_RESUME_WAIT;
    loop {
        let mut master = edge.master.clone();
        let r = master
            .connect_sandbox(pb::ConnectSandboxRequest {
                team_id: String::new(),
                sandbox_id: id.to_string(),
                // The sandbox's own create timeout.
                timeout_s: 0,
                reboot: false,
            })
            .await;
        // Whatever happened, what the edge knew of this sandbox is stale.
        edge.cache.invalidate(id);
        match r {
            Ok(r) => {
                let r = r.into_inner();
                if r.resumed {
                    edge.metrics.edge_auto_resumes.inc();
                    tracing::info!(sandbox = %id, "sandbox resumed by traffic");
                }
                return r.sandbox;
            }
            // Pausing or resuming right now: wait for that to end.
            Err(s)
                if s.code() == tonic::Code::FailedPrecondition
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(s) => {
                tracing::warn!(sandbox = %id, error = %s.message(), "auto-resume failed");
                return None;
            }
        }
    }
}

/// Counts body bytes as they stream past, without buffering.
fn counted<B>(body: B, counter: prometheus::IntCounter) -> Body
where
    B: hyper::body::Body<Data = Bytes, Error = hyper::Error> + Send + Sync + 'static,
{
    body.map_frame(move |f| {
        if let Some(d) = f.data_ref() {
            counter.inc_by(d.len() as u64);
        }
        f
    })
    .boxed()
}

async fn proxy(
    mut req: Request<Incoming>,
    target: SocketAddr,
    iface: &str,
    metrics: &Metrics,
) -> Result<Response<Body>, Box<dyn std::error::Error + Send + Sync>> {
    let sock = if target.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if !iface.is_empty() {
        // Without the switch every sandbox has the same address behind its own interface.
        sock.bind_device(Some(iface.as_bytes()))?;
    }
    let stream = tokio::time::timeout(Duration::from_secs(5), sock.connect(target)).await??;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "edge upstream connection ended");
        }
    });
    let to = metrics.edge_bytes.with_label_values(&["to_sandbox"]);
    let from = metrics.edge_bytes.with_label_values(&["from_sandbox"]);
    let client_upgrade = req
        .headers()
        .contains_key(hyper::header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let mut resp = sender
        .send_request(req.map(|b| counted(b, to.clone())))
        .await?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client) = client_upgrade {
            // Both sides switched (the client once it reads this 101): splice them.
            let upstream = hyper::upgrade::on(&mut resp);
            let from = from.clone();
            tokio::spawn(async move {
                match tokio::try_join!(client, upstream) {
                    Ok((c, u)) => {
                        let (mut c, mut u) = (TokioIo::new(c), TokioIo::new(u));
                        match tokio::io::copy_bidirectional(&mut c, &mut u).await {
                            Ok((up, down)) => {
                                to.inc_by(up);
                                from.inc_by(down);
                            }
                            Err(e) => tracing::debug!(error = %e, "edge upgraded connection ended"),
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "edge upgrade failed"),
                }
            });
        }
    }
    Ok(resp.map(|b| counted(b, from)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_in_every_spelling() {
        for p in [
            "/init",
            "//init",
            "/init/",
            "/./init",
            "/%69nit",
            "/INIT",
            "/x/../init",
            "///init//",
        ] {
            assert!(is_init(p), "{p}");
        }
        for p in [
            "/",
            "/initx",
            "/init/x",
            "/files",
            "/x/init",
            "/%2e%2e/files",
        ] {
            assert!(!is_init(p), "{p}");
        }
    }

    #[test]
    fn traffic_tokens() {
        assert_eq!(traffic_token(""), None);
        let t = traffic_token("tok").unwrap();
        assert_eq!(t.len(), 48);
        assert!(!t.contains("tok"));
        assert_ne!(traffic_token("tok2"), Some(t.clone()));
        let info = pb::SandboxInfo {
            access_token: "tok".into(),
            ..Default::default()
        };
        let mut h = hyper::HeaderMap::new();
        assert!(!authorize_interpreter(&mut h, &info));
        h.insert("x-access-token", "nope".parse().unwrap());
        assert!(!authorize_interpreter(&mut h, &info));
        h.insert(TRAFFIC_TOKEN_HEADER, t.parse().unwrap());
        assert!(authorize_interpreter(&mut h, &info));
        // The interpreter is handed the envd token.
        assert_eq!(h.get("x-access-token").unwrap(), "tok");
        let mut h = hyper::HeaderMap::new();
        h.insert("x-access-token", "tok".parse().unwrap());
        assert!(authorize_interpreter(&mut h, &info));
    }

    #[test]
    fn host_parsing() {
        assert_eq!(
            parse_host("49983-iabc123.localhost:3001"),
            Some(("iabc123".into(), 49983))
        );
        assert_eq!(parse_host("localhost:3001"), None);
        assert_eq!(parse_host("x-abc.d"), None);
        assert_eq!(parse_host("80-a_b.d"), None);
    }

    #[test]
    fn routing_order() {
        let mut h = hyper::HeaderMap::new();
        h.insert("host", "8080-ihost.example".parse().unwrap());
        h.insert("x-access-token", "tok".parse().unwrap());
        assert_eq!(
            route(&h),
            Route::Sandbox {
                id: "ihost".into(),
                port: 8080
            }
        );
        h.insert("e2b-sandbox-id", "ihdr".parse().unwrap());
        h.insert("e2b-sandbox-port", "49999".parse().unwrap());
        assert_eq!(
            route(&h),
            Route::Sandbox {
                id: "ihdr".into(),
                port: 49999
            }
        );
        for bad in ["abc", "70000", "-1", "", "0"] {
            h.insert("e2b-sandbox-port", bad.parse().unwrap());
            assert_eq!(route(&h), Route::BadPort(bad.into()));
        }
        let mut t = hyper::HeaderMap::new();
        t.insert("x-access-token", "tok".parse().unwrap());
        assert_eq!(route(&t), Route::AccessToken("tok".into()));
        assert_eq!(route(&hyper::HeaderMap::new()), Route::None);
    }
}
