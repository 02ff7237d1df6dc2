//! `process.Process` RPC handlers (Connect JSON).

use crate::connect::{self, Code, RpcError};
use crate::pjson::{self, de_null_default, de_opt_u32};
use crate::process::{Output, ProcConfig, ProcEvent, Process, Selector, SpawnRequest};
use crate::reply::{self, Resp};
use crate::request::{self, Ctx};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

#[derive(Deserialize, Default)]
struct ConfigIn {
    #[serde(default)]
    cmd: String,
    #[serde(default, deserialize_with = "de_null_default")]
    args: Vec<String>,
    #[serde(default, deserialize_with = "de_null_default")]
    envs: HashMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
}

#[derive(Deserialize, Default, Clone, Copy)]
struct SizeIn {
    #[serde(default, deserialize_with = "de_opt_u32")]
    cols: Option<u32>,
    #[serde(default, deserialize_with = "de_opt_u32")]
    rows: Option<u32>,
}

#[derive(Deserialize, Default)]
struct PtyIn {
    #[serde(default)]
    size: Option<SizeIn>,
}

#[derive(Deserialize, Default)]
struct StartReq {
    #[serde(default)]
    process: Option<ConfigIn>,
    #[serde(default)]
    pty: Option<PtyIn>,
    #[serde(default)]
    tag: Option<String>,
    #[serde(default)]
    stdin: Option<bool>,
}

#[derive(Deserialize, Default)]
struct SelectorIn {
    #[serde(default, deserialize_with = "de_opt_u32")]
    pid: Option<u32>,
    #[serde(default)]
    tag: Option<String>,
}

impl SelectorIn {
    fn to_selector(&self) -> Result<Selector, RpcError> {
        match (&self.pid, &self.tag) {
            (Some(pid), _) => Ok(Selector::Pid(*pid)),
            (None, Some(tag)) => Ok(Selector::Tag(tag.clone())),
            (None, None) => Err(RpcError::invalid("process selector needs a pid or a tag")),
        }
    }
}

fn selector(s: &Option<SelectorIn>) -> Result<Selector, RpcError> {
    s.as_ref()
        .ok_or_else(|| RpcError::invalid("missing process selector"))?
        .to_selector()
}

#[derive(Deserialize, Default)]
struct SelectReq {
    #[serde(default)]
    process: Option<SelectorIn>,
}

#[derive(Deserialize, Default)]
struct InputIn {
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    pty: Option<String>,
}

impl InputIn {
    fn decode(&self) -> Result<(Vec<u8>, bool), RpcError> {
        match (&self.stdin, &self.pty) {
            (Some(s), _) => Ok((pjson::unb64(s).map_err(RpcError::invalid)?, false)),
            (None, Some(p)) => Ok((pjson::unb64(p).map_err(RpcError::invalid)?, true)),
            (None, None) => Ok((Vec::new(), false)),
        }
    }
}

#[derive(Deserialize, Default)]
struct SendInputReq {
    #[serde(default)]
    process: Option<SelectorIn>,
    #[serde(default)]
    input: Option<InputIn>,
}

#[derive(Deserialize, Default)]
struct SendSignalReq {
    #[serde(default)]
    process: Option<SelectorIn>,
    #[serde(default)]
    signal: Option<Value>,
}

#[derive(Deserialize, Default)]
struct UpdateReq {
    #[serde(default)]
    process: Option<SelectorIn>,
    #[serde(default)]
    pty: Option<PtyIn>,
}

#[derive(Deserialize, Default)]
struct StreamInputStart {
    #[serde(default)]
    process: Option<SelectorIn>,
}

#[derive(Deserialize, Default)]
struct StreamInputData {
    #[serde(default)]
    input: Option<InputIn>,
}

#[derive(Deserialize, Default)]
struct StreamInputReq {
    #[serde(default)]
    start: Option<StreamInputStart>,
    #[serde(default)]
    data: Option<StreamInputData>,
}

fn parse_signal(v: &Option<Value>) -> Result<i32, RpcError> {
    match v {
        Some(Value::String(s)) => match s.as_str() {
            "SIGNAL_SIGKILL" | "SIGKILL" => Ok(libc::SIGKILL),
            "SIGNAL_SIGTERM" | "SIGTERM" => Ok(libc::SIGTERM),
            other => Err(RpcError::invalid(format!("unsupported signal {other:?}"))),
        },
        Some(Value::Number(n)) => match n.as_i64() {
            Some(9) => Ok(libc::SIGKILL),
            Some(15) => Ok(libc::SIGTERM),
            _ => Err(RpcError::invalid(format!("unsupported signal {n}"))),
        },
        _ => Err(RpcError::invalid("missing or unspecified signal")),
    }
}

fn event_json(ev: &ProcEvent) -> Value {
    match ev {
        ProcEvent::Data(o) => {
            let (k, b) = match o {
                Output::Stdout(b) => ("stdout", b),
                Output::Stderr(b) => ("stderr", b),
                Output::Pty(b) => ("pty", b),
            };
            json!({"event": {"data": {k: pjson::b64(b)}}})
        }
        ProcEvent::End(e) => {
            let mut end = json!({"exitCode": e.exit_code, "exited": e.exited, "status": e.status});
            if let Some(err) = &e.error {
                end["error"] = json!(err);
            }
            json!({"event": {"end": end}})
        }
    }
}

/// Interval from `Keepalive-Ping-Interval` (seconds), envd's default 90 s otherwise.
fn keepalive_interval(ctx: &Ctx) -> Duration {
    let secs = ctx
        .header("keepalive-ping-interval")
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v > 0.0)
        .unwrap_or(90.0);
    Duration::from_secs_f64(secs.max(0.05))
}

/// Streams a process's events: `start`, data, `end`, with keepalives; ends at `deadline` with
/// `deadline_exceeded`. A client going away just stops the stream.
async fn pump(
    tx: mpsc::Sender<Bytes>,
    proc_: Arc<Process>,
    mut rx: mpsc::Receiver<ProcEvent>,
    keepalive: Duration,
    deadline: Option<tokio::time::Instant>,
) {
    let start = json!({"event": {"start": {"pid": proc_.pid}}});
    if tx.send(connect::message_envelope(&start)).await.is_err() {
        return;
    }
    let mut ka = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
    let far = tokio::time::Instant::now() + Duration::from_secs(86400 * 365);
    let dl = tokio::time::sleep_until(deadline.unwrap_or(far));
    tokio::pin!(dl);
    loop {
        tokio::select! {
            biased;
            ev = rx.recv() => match ev {
                Some(ev) => {
                    let end = matches!(ev, ProcEvent::End(_));
                    if tx.send(connect::message_envelope(&event_json(&ev))).await.is_err() {
                        return;
                    }
                    if end {
                        let _ = tx.send(connect::end_stream_envelope(None)).await;
                        return;
                    }
                }
                None => {
                    let _ = tx.send(connect::end_stream_envelope(Some(&RpcError::internal("process event stream closed")))).await;
                    return;
                }
            },
            _ = &mut dl => {
                let e = RpcError::new(Code::DeadlineExceeded, "the operation timed out (Connect-Timeout-Ms expired)");
                let _ = tx.send(connect::end_stream_envelope(Some(&e))).await;
                return;
            }
            // The client went away: drop our subscription; the process keeps running.
            _ = tx.closed() => return,
            _ = ka.tick() => {
                if tx.send(connect::message_envelope(&json!({"event": {"keepalive": {}}}))).await.is_err() {
                    return;
                }
            }
        }
    }
}

pub async fn start(ctx: Ctx, body: Bytes) -> Resp {
    let req: StartReq = match request::single_envelope(&body) {
        Ok(r) => r,
        Err(e) => return reply::stream_error(&e),
    };
    let Some(cfg) = req.process else {
        return reply::stream_error(&RpcError::invalid("missing process config"));
    };
    if cfg.cmd.is_empty() {
        return reply::stream_error(&RpcError::invalid("process.cmd must not be empty"));
    }
    let cwd = match &cfg.cwd {
        Some(c) if !c.is_empty() => ctx.state.resolve_path(&ctx.user, c),
        _ => {
            // An account whose home does not exist (e.g. `nobody`) still gets to run commands.
            let w = ctx.state.workdir_for(&ctx.user);
            if w.is_dir() {
                w
            } else {
                std::path::PathBuf::from("/")
            }
        }
    };
    let pty = req.pty.map(|p| {
        let s = p.size.unwrap_or_default();
        (
            s.cols.unwrap_or(80).min(u16::MAX as u32) as u16,
            s.rows.unwrap_or(24).min(u16::MAX as u32) as u16,
        )
    });
    let session = ctx.state.session();
    let spawn = SpawnRequest {
        config: ProcConfig {
            cmd: cfg.cmd,
            args: cfg.args,
            envs: cfg.envs,
            cwd: cfg.cwd,
        },
        pty,
        tag: req.tag,
        stdin: req.stdin.unwrap_or(true),
        user: ctx.user.clone(),
        cwd,
        base_env: session.env_vars,
    };
    let (proc_, rx) = match ctx.state.processes.start(spawn) {
        Ok(x) => x,
        Err(e) => return reply::stream_error(&e),
    };
    let timeout = ctx.connect_timeout();
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    if let Some(t) = timeout {
        // The timeout belongs to the process, not to the stream: kill at expiry even if the
        // client has gone away.
        // Weak: a finished process (and its pipe/PTY fds) must not be kept alive until expiry.
        let weak = Arc::downgrade(&proc_);
        tokio::spawn(async move {
            tokio::time::sleep(t).await;
            let Some(p) = weak.upgrade() else { return };
            if !p.has_ended() {
                tracing::info!(pid = p.pid, "command timeout expired; killing");
                let _ = p.signal(libc::SIGKILL);
            }
        });
    }
    let (tx, resp) = reply::stream_response();
    tokio::spawn(pump(tx, proc_, rx, keepalive_interval(&ctx), deadline));
    resp
}

pub async fn connect_(ctx: Ctx, body: Bytes) -> Resp {
    let req: SelectReq = match request::single_envelope(&body) {
        Ok(r) => r,
        Err(e) => return reply::stream_error(&e),
    };
    let p = match selector(&req.process).and_then(|s| ctx.state.processes.get(&s)) {
        Ok(p) => p,
        Err(e) => return reply::stream_error(&e),
    };
    let rx = p.subscribe();
    let deadline = ctx
        .connect_timeout()
        .map(|t| tokio::time::Instant::now() + t);
    let (tx, resp) = reply::stream_response();
    tokio::spawn(pump(tx, p, rx, keepalive_interval(&ctx), deadline));
    resp
}

pub async fn list(ctx: Ctx, body: Bytes) -> Resp {
    if let Err(e) = connect::decode_json::<Value>(&body) {
        return reply::rpc_err(&e);
    }
    let procs: Vec<Value> = ctx
        .state
        .processes
        .list()
        .iter()
        .map(|p| {
            let mut v = json!({"config": p.config, "pid": p.pid});
            if let Some(t) = &p.tag {
                v["tag"] = json!(t);
            }
            v
        })
        .collect();
    reply::rpc_ok(&json!({"processes": procs}))
}

pub async fn send_input(ctx: Ctx, body: Bytes) -> Resp {
    let r = async {
        let req: SendInputReq = connect::decode_json(&body)?;
        let p = ctx.state.processes.get(&selector(&req.process)?)?;
        let (data, to_pty) = req.input.unwrap_or_default().decode()?;
        p.write_stdin(&data, to_pty).await
    }
    .await;
    reply::rpc_result(r)
}

pub async fn send_signal(ctx: Ctx, body: Bytes) -> Resp {
    let r = (|| {
        let req: SendSignalReq = connect::decode_json(&body)?;
        let sig = parse_signal(&req.signal)?;
        let p = ctx.state.processes.get(&selector(&req.process)?)?;
        p.signal(sig)
    })();
    reply::rpc_result(r)
}

pub async fn close_stdin(ctx: Ctx, body: Bytes) -> Resp {
    let r = async {
        let req: SelectReq = connect::decode_json(&body)?;
        let p = ctx.state.processes.get(&selector(&req.process)?)?;
        p.close_stdin().await
    }
    .await;
    reply::rpc_result(r)
}

pub async fn update(ctx: Ctx, body: Bytes) -> Resp {
    let r = (|| {
        let req: UpdateReq = connect::decode_json(&body)?;
        let p = ctx.state.processes.get(&selector(&req.process)?)?;
        if let Some(pty) = req.pty {
            let s = pty.size.unwrap_or_default();
            p.resize(
                s.cols.unwrap_or(80).min(u16::MAX as u32) as u16,
                s.rows.unwrap_or(24).min(u16::MAX as u32) as u16,
            )?;
        }
        Ok(())
    })();
    reply::rpc_result(r)
}

/// Client streaming: a `start{process}` message, then `data{input}` messages, written in order
/// as they arrive.
pub async fn stream_input(ctx: Ctx, body: hyper::body::Incoming) -> Resp {
    let mut target: Option<Arc<Process>> = None;
    let mut reader = connect::EnvelopeReader::new();
    let mut body = body;
    let result: Result<(), RpcError> = async {
        loop {
            while let Some(env) = reader.next_envelope()? {
                if env.flags & connect::FLAG_END_STREAM != 0 {
                    return Ok(());
                }
                let msg: StreamInputReq = connect::decode_json(&env.payload)?;
                if let Some(s) = msg.start {
                    target = Some(ctx.state.processes.get(&selector(&s.process)?)?);
                } else if let Some(d) = msg.data {
                    let p = target.as_ref().ok_or_else(|| {
                        RpcError::invalid("data received before the start message")
                    })?;
                    let (data, to_pty) = d.input.unwrap_or_default().decode()?;
                    p.write_stdin(&data, to_pty).await?;
                }
            }
            match request::next_chunk(&mut body).await? {
                Some(chunk) => reader.push(&chunk),
                None => {
                    if reader.pending() > 0 {
                        return Err(RpcError::invalid("request body ended inside an envelope"));
                    }
                    return Ok(());
                }
            }
        }
    }
    .await;
    let (tx, resp) = reply::stream_response();
    let _ = match result {
        Ok(()) => {
            let _ = tx.try_send(connect::message_envelope(&json!({})));
            tx.try_send(connect::end_stream_envelope(None))
        }
        Err(e) => tx.try_send(connect::end_stream_envelope(Some(&e))),
    };
    resp
}
