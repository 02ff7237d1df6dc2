//! envd's HTTP/1.1 server on port 49983: the routes, the Connect RPC table, auth and CORS.
//! Handlers answer with `reply` and read with `request`; neither imports this module.

use crate::connect::{Code, RpcError, MAX_MESSAGE_BYTES};
use crate::reply::{empty, http_error, rpc_err, stream_error, Resp, UNAUTHORIZED};
use crate::request::{drain, parse_query, read_body, token_ok, Ctx};
use crate::state::{Shared, UserError};
use crate::{files_http, fs_rpc, process_rpc, sys_http};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use hyper::body::Incoming;
use std::convert::Infallible;

/// How a Connect RPC takes its request.
#[derive(Clone, Copy)]
enum Call {
    /// One message (an envelope for streaming RPCs), read whole first.
    Message(fn(Ctx, Bytes) -> BoxFuture<'static, Resp>),
    /// The request body itself: a client stream.
    Body(fn(Ctx, Incoming) -> BoxFuture<'static, Resp>),
}

/// One Connect RPC: its procedure name, whether its response is a stream (which decides the
/// content type it takes and how it fails), and its handler.
struct Rpc {
    name: &'static str,
    streaming: bool,
    call: Call,
}

/// Every Connect RPC envd serves: the one list of their names.
const RPCS: &[Rpc] = &[
    Rpc {
        name: "process.Process/Start",
        streaming: true,
        call: Call::Message(|c, d| Box::pin(process_rpc::start(c, d))),
    },
    Rpc {
        name: "process.Process/Connect",
        streaming: true,
        call: Call::Message(|c, d| Box::pin(process_rpc::connect_(c, d))),
    },
    Rpc {
        name: "process.Process/StreamInput",
        streaming: true,
        call: Call::Body(|c, b| Box::pin(process_rpc::stream_input(c, b))),
    },
    Rpc {
        name: "process.Process/List",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(process_rpc::list(c, d))),
    },
    Rpc {
        name: "process.Process/SendInput",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(process_rpc::send_input(c, d))),
    },
    Rpc {
        name: "process.Process/SendSignal",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(process_rpc::send_signal(c, d))),
    },
    Rpc {
        name: "process.Process/CloseStdin",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(process_rpc::close_stdin(c, d))),
    },
    Rpc {
        name: "process.Process/Update",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(process_rpc::update(c, d))),
    },
    Rpc {
        name: "filesystem.Filesystem/Stat",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(fs_rpc::stat_rpc(c, d))),
    },
    Rpc {
        name: "filesystem.Filesystem/MakeDir",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(fs_rpc::make_dir_rpc(c, d))),
    },
    Rpc {
        name: "filesystem.Filesystem/Move",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(fs_rpc::move_rpc(c, d))),
    },
    Rpc {
        name: "filesystem.Filesystem/ListDir",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(fs_rpc::list_dir_rpc(c, d))),
    },
    Rpc {
        name: "filesystem.Filesystem/Remove",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(fs_rpc::remove_rpc(c, d))),
    },
    Rpc {
        name: "filesystem.Filesystem/WatchDir",
        streaming: true,
        call: Call::Message(|c, d| Box::pin(fs_rpc::watch_dir(c, d))),
    },
    Rpc {
        name: "filesystem.Filesystem/CreateWatcher",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(fs_rpc::create_watcher_rpc(c, d))),
    },
    Rpc {
        name: "filesystem.Filesystem/GetWatcherEvents",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(fs_rpc::get_watcher_events(c, d))),
    },
    Rpc {
        name: "filesystem.Filesystem/RemoveWatcher",
        streaming: false,
        call: Call::Message(|c, d| Box::pin(fs_rpc::remove_watcher(c, d))),
    },
];

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
    let Some(rpc) = RPCS.iter().find(|r| r.name == rpc) else {
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
    };
    if method != Method::POST {
        drain(&mut body).await;
        return http_error(405, "Connect RPCs must use POST");
    }
    let streaming = rpc.streaming;
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
    match rpc.call {
        Call::Body(f) => f(ctx, body).await,
        Call::Message(f) => {
            // Envelope framing adds 5 bytes to a message.
            match read_body(&mut body, MAX_MESSAGE_BYTES + 5).await {
                Ok(data) => f(ctx, data).await,
                Err(e) => fail(&e),
            }
        }
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
    fn every_rpc_is_listed_once() {
        let mut names: Vec<_> = RPCS.iter().map(|r| r.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), RPCS.len());
    }

    #[test]
    fn query_decoding() {
        let q = parse_query(Some("path=%2Fhome%2Fuser%2Fa+b.txt&username=&x&bad=%zz%4"));
        assert_eq!(q["path"], "/home/user/a b.txt");
        assert_eq!(q["username"], "");
        assert_eq!(q["x"], "");
        assert_eq!(q["bad"], "%zz%4");
    }
}
