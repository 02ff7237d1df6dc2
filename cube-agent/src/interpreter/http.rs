//! The HTTP side of the interpreter: routes, auth, and the streaming `/execute` response.

use super::contexts::{self, Cell, Registry};
use super::protocol::{CreateContextRequest, ExecuteRequest, Language, RequestError};
use super::worker::{find_python, SpawnSpec};
use super::InterpreterConfig;
use crate::reply::{empty, json_response, response, Body, Resp};
use crate::request::{drain, read_body};
use crate::state::Shared;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response};
use hyper::body::Incoming;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Longest wait for the pre-started worker to be ready.
pub const PRESTART_READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(150);

/// The interpreter server's state.
pub struct Interpreter {
    pub agent: Shared,
    pub registry: Registry,
    pub cfg: InterpreterConfig,
    python: Option<PathBuf>,
}

impl Interpreter {
    pub fn new(agent: Shared, cfg: InterpreterConfig) -> Arc<Interpreter> {
        let python = match &cfg.python {
            Some(p) => Some(PathBuf::from(p)),
            None => find_python(),
        };
        if python.is_none() {
            tracing::error!("interpreter enabled but no python3 found: /execute will fail");
        }
        Arc::new(Interpreter {
            agent,
            registry: Registry::new(),
            cfg,
            python,
        })
    }

    /// How workers start now: the session's default user, env vars and working directory.
    fn spawn_spec(&self) -> Result<SpawnSpec, String> {
        let python = self
            .python
            .clone()
            .ok_or_else(|| "python3 is not installed in this sandbox".to_string())?;
        let user = self.agent.user_named("").map_err(|e| e.to_string())?;
        let cwd = self.agent.workdir_for(&user);
        Ok(SpawnSpec {
            python,
            fast_start: self.cfg.fast_start,
            cwd,
            env: self.agent.session().env_vars,
            user,
        })
    }

    fn default_cwd(&self) -> PathBuf {
        match self.agent.user_named("") {
            Ok(u) => self.agent.workdir_for(&u),
            Err(_) => PathBuf::from("/"),
        }
    }

    /// Creates the default Python context and starts its worker (ready within
    /// [`PRESTART_READY_TIMEOUT`]).
    pub async fn prestart(&self) {
        let ctx = self
            .registry
            .default_for(Language::Python, self.default_cwd());
        match self.spawn_spec() {
            Ok(spec) => {
                // Ready, not just spawned: the node pools this sandbox once this returns. On a
                // host whose guest kernel mode is emulated (PVM) the first start of Python
                // takes tens of seconds; a template snapshotted before it is cold.
                if let Err(e) = ctx.ensure_ready(&spec, PRESTART_READY_TIMEOUT).await {
                    tracing::warn!("pre-starting the Python context: {e}");
                }
            }
            Err(e) => tracing::warn!("pre-starting the Python context: {e}"),
        }
    }
}

fn text(status: u16, msg: impl Into<String>) -> Resp {
    response(status, "text/plain; charset=utf-8", Bytes::from(msg.into()))
}

fn not_found(id: &str) -> Resp {
    text(404, format!("Context {id} not found"))
}

fn bad_request(e: RequestError) -> Resp {
    text(400, e.to_string())
}

pub async fn handle(st: Arc<Interpreter>, req: Request<Incoming>) -> Result<Resp, Infallible> {
    Ok(route(st, req).await)
}

async fn route(st: Arc<Interpreter>, req: Request<Incoming>) -> Resp {
    let (parts, mut body) = req.into_parts();
    let path = parts.uri.path().trim_end_matches('/').to_string();
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let m = parts.method.clone();
    // Every route but /health needs the envd token, as envd's do: contexts hold the sandbox
    // user's state. The SDK sends it on /execute only; on the other routes it sends the
    // traffic token, which the edge checks and replaces with the envd token.
    if !(m == Method::GET && segs.as_slice() == ["health"])
        && m != Method::OPTIONS
        && !crate::request::token_ok(&st.agent, &parts.headers)
    {
        drain(&mut body).await;
        return json_response(
            401,
            &serde_json::json!({"code": 401, "message": "unauthorized access, please provide a valid access token"}),
        );
    }
    match (m.as_str(), segs.as_slice()) {
        ("GET", ["health"]) => json_response(200, &serde_json::json!("OK")),
        ("POST", ["execute"]) => match read_body(&mut body, st.cfg.max_body_bytes).await {
            Ok(b) => execute(st, &b),
            Err(e) => text(413, e.message),
        },
        ("GET", ["contexts"]) => {
            let list: Vec<_> = st.registry.list().iter().map(|c| c.to_json()).collect();
            json_response(200, &serde_json::Value::Array(list))
        }
        ("POST", ["contexts"]) => match read_body(&mut body, 1 << 20).await {
            Ok(b) => create_context(st, &b),
            Err(e) => text(413, e.message),
        },
        ("DELETE", ["contexts", id]) => {
            if st.registry.remove(id) {
                empty(204)
            } else {
                not_found(id)
            }
        }
        ("POST", ["contexts", id, "restart"]) => {
            let spec = match st.spawn_spec() {
                Ok(s) => s,
                Err(e) => return text(500, e),
            };
            match st.registry.restart(id, &spec).await {
                Ok(true) => empty(204),
                Ok(false) => not_found(id),
                Err(e) => text(500, e.to_string()),
            }
        }
        _ => {
            drain(&mut body).await;
            if m == Method::OPTIONS {
                empty(204)
            } else {
                text(404, format!("no route for {m} {path}"))
            }
        }
    }
}

fn create_context(st: Arc<Interpreter>, body: &[u8]) -> Resp {
    let req = match CreateContextRequest::parse(body) {
        Ok(r) => r,
        Err(e) => return bad_request(e),
    };
    let language = match Language::parse(req.language.as_deref()) {
        Ok(l) => l,
        Err(e) => return bad_request(e),
    };
    let cwd = match req.cwd.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => {
            let p = PathBuf::from(c);
            if !p.is_absolute() || !p.is_dir() {
                return text(
                    400,
                    format!("cwd {c:?} is not an existing absolute directory"),
                );
            }
            p
        }
        None => st.default_cwd(),
    };
    let ctx = st.registry.create(language, cwd);
    // Start the worker now so the first cell in the new context does not pay for it.
    if let Ok(spec) = st.spawn_spec() {
        let c = ctx.clone();
        tokio::spawn(async move {
            if let Err(e) = c.ensure_started(&spec).await {
                tracing::warn!(context = %c.id, "starting worker: {e}");
            }
        });
    }
    json_response(200, &ctx.to_json())
}

fn execute(st: Arc<Interpreter>, body: &[u8]) -> Resp {
    let req = match ExecuteRequest::parse(body) {
        Ok(r) => r,
        Err(e) => return bad_request(e),
    };
    let ctx = match req.context_id.as_deref().filter(|c| !c.is_empty()) {
        Some(id) => match st.registry.get(id) {
            Some(c) => c,
            None => return not_found(id),
        },
        None => match Language::parse(req.language.as_deref()) {
            Ok(l) => st.registry.default_for(l, st.default_cwd()),
            Err(e) => return bad_request(e),
        },
    };
    let spec = match st.spawn_spec() {
        Ok(s) => s,
        Err(e) => return text(500, e),
    };
    let cell = Cell {
        code: req.code,
        env: spec.env.clone(),
        call_env: req.env_vars.unwrap_or_default(),
        keepalive: (st.cfg.keepalive_s > 0).then(|| Duration::from_secs(st.cfg.keepalive_s)),
    };
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(contexts::execute(ctx, spec, cell, tx));
    let mut r = Response::new(Body::Chan(rx));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    r
}

/// Serves the interpreter on `listener` forever.
pub async fn serve(listener: tokio::net::TcpListener, st: Arc<Interpreter>) {
    crate::listen::serve(listener, "interpreter", move |req| handle(st.clone(), req)).await
}
