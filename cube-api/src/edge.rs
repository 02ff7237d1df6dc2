//! The sandbox edge (:3001): routes each request to a sandbox's port and proxies it with
//! streaming bodies both ways (envd's Connect streams must flow unbuffered).
//!
//! Routing order: `E2b-Sandbox-Id` + `E2b-Sandbox-Port` headers, then `Host:
//! <port>-<id>.<domain>`, then `X-Access-Token` (old SDKs that send no routing headers).

use crate::master::Master;
use bytes::Bytes;
use cube_proto::master::v1 as pb;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket};

pub const ENVD_PORT: u16 = 49983;

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
    Sandbox { id: String, port: u16 },
    AccessToken(String),
    None,
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
        let port = h("e2b-sandbox-port")
            .and_then(|p| p.parse().ok())
            .unwrap_or(ENVD_PORT);
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

/// Serves the edge until the listener fails.
pub async fn serve(listener: TcpListener, master: Master) -> std::io::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await?;
        let master = master.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let master = master.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(req, master).await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(%peer, error = %e, "edge connection ended");
            }
        });
    }
}

async fn handle(req: Request<Incoming>, mut master: Master) -> Response<Body> {
    // /init carries the access token and env; only the node may call it.
    if req.uri().path() == "/init" {
        return json_response(
            StatusCode::FORBIDDEN,
            serde_json::json!({"code": 403, "message": "/init is not reachable through the edge"}),
        );
    }
    let (info, port) = match route(req.headers()) {
        Route::Sandbox { id, port } => match master
            .get_sandbox(pb::SandboxRef {
                team_id: String::new(),
                sandbox_id: id.clone(),
            })
            .await
        {
            Ok(r) => (r.into_inner(), port),
            Err(_) => return not_found(&id),
        },
        Route::AccessToken(t) => match master
            .resolve_access_token(pb::ResolveAccessTokenRequest { access_token: t })
            .await
        {
            Ok(r) => (r.into_inner(), ENVD_PORT),
            Err(_) => return not_found(""),
        },
        Route::None => return not_found(""),
    };
    if info.state != "running" {
        return not_found(&info.sandbox_id);
    }
    let Ok(agent) = info.agent_address.parse::<SocketAddr>() else {
        return not_found(&info.sandbox_id);
    };
    let target = SocketAddr::new(agent.ip(), port);
    match proxy(req, target, &info.host_interface).await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(sandbox = %info.sandbox_id, %target, error = %e, "edge proxy failed");
            port_closed(&info.sandbox_id)
        }
    }
}

async fn proxy(
    req: Request<Incoming>,
    target: SocketAddr,
    iface: &str,
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
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "edge upstream connection ended");
        }
    });
    let resp = sender.send_request(req).await?;
    Ok(resp.map(|b| b.boxed()))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut t = hyper::HeaderMap::new();
        t.insert("x-access-token", "tok".parse().unwrap());
        assert_eq!(route(&t), Route::AccessToken("tok".into()));
        assert_eq!(route(&hyper::HeaderMap::new()), Route::None);
    }
}
