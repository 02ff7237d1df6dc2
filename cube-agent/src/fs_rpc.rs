//! `filesystem.Filesystem` RPC handlers. Every filesystem access runs with the requesting user's
//! filesystem credentials (see `creds`).

use crate::connect::{self, Code, RpcError};
use crate::creds;
use crate::entry::entry_info;
use crate::pjson::{de_bool, de_opt_u32};
use crate::reply::{self, Resp};
use crate::request::{self, Ctx};
use crate::users::Accounts;
use crate::watch::{self, FsEvent, PolledWatcher, RawWatch, MAX_BUFFERED_EVENTS};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Deserialize, Default)]
struct PathReq {
    #[serde(default)]
    path: String,
    #[serde(default, deserialize_with = "de_opt_u32")]
    depth: Option<u32>,
}

#[derive(Deserialize, Default)]
struct MoveReq {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

struct WatchReq {
    path: String,
    recursive: bool,
    include_entry: bool,
    allow_network_mounts: bool,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WatcherIdReq {
    #[serde(default, alias = "watcher_id")]
    watcher_id: String,
}

// `WatchReq` fields are camelCase on the wire.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WatchReqCamel {
    #[serde(default)]
    path: String,
    #[serde(default, deserialize_with = "de_bool")]
    recursive: bool,
    #[serde(default, alias = "include_entry", deserialize_with = "de_bool")]
    include_entry: bool,
    #[serde(default, alias = "allow_network_mounts", deserialize_with = "de_bool")]
    allow_network_mounts: bool,
}

impl From<WatchReqCamel> for WatchReq {
    fn from(w: WatchReqCamel) -> Self {
        WatchReq {
            path: w.path,
            recursive: w.recursive,
            include_entry: w.include_entry,
            allow_network_mounts: w.allow_network_mounts,
        }
    }
}

fn need_path(p: &str) -> Result<(), RpcError> {
    if p.is_empty() {
        return Err(RpcError::invalid("path must not be empty"));
    }
    if p.contains('\0') {
        return Err(RpcError::invalid("path contains a NUL byte"));
    }
    Ok(())
}

fn io_err(e: std::io::Error, p: &Path) -> RpcError {
    RpcError::from_io(&e, &p.display().to_string())
}

fn stat(p: &Path) -> Result<Value, RpcError> {
    entry_info(p, &Accounts::load()).map_err(|e| io_err(e, p))
}

fn list_dir(root: &Path, depth: u32) -> Result<Vec<Value>, RpcError> {
    let meta = std::fs::metadata(root).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => {
            RpcError::not_found(format!("directory not found: {}", root.display()))
        }
        _ => io_err(e, root),
    })?;
    if !meta.is_dir() {
        return Err(RpcError::invalid(format!(
            "path {} is not a directory",
            root.display()
        )));
    }
    let acc = Accounts::load();
    let mut out = Vec::new();
    fn walk(
        dir: &Path,
        level: u32,
        depth: u32,
        acc: &Accounts,
        out: &mut Vec<Value>,
    ) -> Result<(), RpcError> {
        let rd = std::fs::read_dir(dir).map_err(|e| io_err(e, dir))?;
        let mut names: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        names.sort();
        for p in names {
            let Ok(info) = entry_info(&p, acc) else {
                continue;
            };
            out.push(info);
            // Symlinked directories are listed but not descended into (no loops).
            let is_real_dir = std::fs::symlink_metadata(&p)
                .map(|m| m.is_dir())
                .unwrap_or(false);
            if is_real_dir && level < depth {
                // Unreadable subdirectories are listed but not entered.
                let _ = walk(&p, level + 1, depth, acc, out);
            }
        }
        Ok(())
    }
    walk(root, 1, depth.max(1), &acc, &mut out)?;
    Ok(out)
}

fn make_dir(p: &Path) -> Result<Value, RpcError> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => {
            return Err(RpcError::new(
                Code::AlreadyExists,
                format!("directory already exists: {}", p.display()),
            ))
        }
        Ok(_) => {
            return Err(RpcError::invalid(format!(
                "path already exists but it is not a directory: {}",
                p.display()
            )))
        }
        Err(_) => {}
    }
    std::fs::create_dir_all(p).map_err(|e| io_err(e, p))?;
    stat(p)
}

fn move_(src: &Path, dst: &Path) -> Result<Value, RpcError> {
    std::fs::symlink_metadata(src).map_err(|e| io_err(e, src))?;
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent).map_err(|e| io_err(e, parent))?;
    }
    std::fs::rename(src, dst).map_err(|e| io_err(e, dst))?;
    stat(dst)
}

fn remove(p: &Path) -> Result<(), RpcError> {
    let m = std::fs::symlink_metadata(p).map_err(|e| io_err(e, p))?;
    if m.is_dir() {
        std::fs::remove_dir_all(p).map_err(|e| io_err(e, p))
    } else {
        std::fs::remove_file(p).map_err(|e| io_err(e, p))
    }
}

/// A unary RPC's answer.
fn answer(r: Result<Value, RpcError>) -> Resp {
    match r {
        Ok(v) => reply::rpc_ok(&v),
        Err(e) => reply::rpc_err(&e),
    }
}

/// Runs `f` on a path request's resolved path (and depth, default 1) as the requesting user.
async fn on_path<F>(ctx: &Ctx, body: &[u8], f: F) -> Result<Value, RpcError>
where
    F: FnOnce(&Path, u32) -> Result<Value, RpcError> + Send + 'static,
{
    let req: PathReq = connect::decode_json(body)?;
    need_path(&req.path)?;
    let p = ctx.state.resolve_path(&ctx.user, &req.path);
    let depth = req.depth.unwrap_or(1);
    creds::as_user(&ctx.user, move || f(&p, depth)).await
}

/// `filesystem.Filesystem/Stat`.
pub async fn stat_rpc(ctx: Ctx, body: Bytes) -> Resp {
    answer(on_path(&ctx, &body, |p, _| Ok(json!({"entry": stat(p)?}))).await)
}

/// `filesystem.Filesystem/MakeDir`.
pub async fn make_dir_rpc(ctx: Ctx, body: Bytes) -> Resp {
    answer(on_path(&ctx, &body, |p, _| Ok(json!({"entry": make_dir(p)?}))).await)
}

/// `filesystem.Filesystem/ListDir`.
pub async fn list_dir_rpc(ctx: Ctx, body: Bytes) -> Resp {
    answer(
        on_path(&ctx, &body, |p, depth| {
            Ok(json!({"entries": list_dir(p, depth)?}))
        })
        .await,
    )
}

/// `filesystem.Filesystem/Remove`.
pub async fn remove_rpc(ctx: Ctx, body: Bytes) -> Resp {
    answer(on_path(&ctx, &body, |p, _| remove(p).map(|_| json!({}))).await)
}

/// `filesystem.Filesystem/Move`.
pub async fn move_rpc(ctx: Ctx, body: Bytes) -> Resp {
    let r = async {
        let req: MoveReq = connect::decode_json(&body)?;
        need_path(&req.source)?;
        need_path(&req.destination)?;
        let s = ctx.state.resolve_path(&ctx.user, &req.source);
        let d = ctx.state.resolve_path(&ctx.user, &req.destination);
        creds::as_user(&ctx.user, move || Ok(json!({"entry": move_(&s, &d)?}))).await
    };
    answer(r.await)
}

/// `filesystem.Filesystem/CreateWatcher`.
pub async fn create_watcher_rpc(ctx: Ctx, body: Bytes) -> Resp {
    answer(create_watcher(&ctx, &body).await)
}

/// `filesystem.Filesystem/GetWatcherEvents`: the events since the last call.
pub async fn get_watcher_events(ctx: Ctx, body: Bytes) -> Resp {
    let r = (|| {
        let req: WatcherIdReq = connect::decode_json(&body)?;
        let w =
            ctx.state.watchers.get(&req.watcher_id).ok_or_else(|| {
                RpcError::not_found(format!("watcher {} not found", req.watcher_id))
            })?;
        let events: Vec<Value> =
            std::mem::take(&mut *w.events.lock().unwrap_or_else(|p| p.into_inner()));
        Ok(json!({"events": events}))
    })();
    answer(r)
}

/// `filesystem.Filesystem/RemoveWatcher`.
pub async fn remove_watcher(ctx: Ctx, body: Bytes) -> Resp {
    let r = (|| {
        let req: WatcherIdReq = connect::decode_json(&body)?;
        let w =
            ctx.state.watchers.remove(&req.watcher_id).ok_or_else(|| {
                RpcError::not_found(format!("watcher {} not found", req.watcher_id))
            })?;
        if let Some(t) = w.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
        Ok(json!({}))
    })();
    answer(r)
}

/// Opens an inotify watch as the user, checking the directory and the network-mount rule.
async fn open_watch(ctx: &Ctx, req: &WatchReq) -> Result<watch::Watch, RpcError> {
    need_path(&req.path)?;
    let p = ctx.state.resolve_path(&ctx.user, &req.path);
    let recursive = req.recursive;
    let allow_net = req.allow_network_mounts;
    let raw = creds::as_user(&ctx.user, move || {
        let m = std::fs::metadata(&p).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOENT) => RpcError::not_found(format!("path not found: {}", p.display())),
            _ => io_err(e, &p),
        })?;
        if !m.is_dir() {
            return Err(RpcError::invalid(format!(
                "path {} is not a directory",
                p.display()
            )));
        }
        if !allow_net && watch::is_network_mount(&p).unwrap_or(false) {
            return Err(RpcError::invalid(format!(
                "path {} is on a network mount; set allowNetworkMounts to watch it",
                p.display()
            )));
        }
        RawWatch::new(&p, recursive).map_err(|e| io_err(e, &p))
    })
    .await?;
    raw.attach()
        .map_err(|e| RpcError::internal(format!("attaching watch: {e}")))
}

async fn event_json(ctx_user: &crate::users::User, ev: FsEvent, include_entry: bool) -> Value {
    let mut v = json!({"name": ev.name, "type": ev.kind});
    if include_entry {
        let p = ev.path.clone();
        if let Ok(Ok(e)) = creds::as_user(ctx_user, move || {
            Ok::<_, std::io::Error>(entry_info(&p, &Accounts::load()))
        })
        .await
        {
            v["entry"] = e;
        }
    }
    v
}

fn random_id() -> String {
    let mut b = [0u8; 16];
    // SAFETY: getrandom fills the buffer.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b[..16].copy_from_slice(&t.to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

async fn create_watcher(ctx: &Ctx, body: &[u8]) -> Result<Value, RpcError> {
    let req: WatchReq = connect::decode_json::<WatchReqCamel>(body)?.into();
    let mut w = open_watch(ctx, &req).await?;
    let id = random_id();
    let pw = Arc::new(PolledWatcher {
        events: Mutex::new(Vec::new()),
        task: Mutex::new(None),
    });
    let pw2 = pw.clone();
    let user = ctx.user.clone();
    let include = req.include_entry;
    let task = tokio::spawn(async move {
        while let Ok(Some(batch)) = w.next_batch().await {
            for ev in batch {
                let v = event_json(&user, ev, include).await;
                let mut q = pw2.events.lock().unwrap_or_else(|p| p.into_inner());
                if q.len() >= MAX_BUFFERED_EVENTS {
                    q.remove(0);
                }
                q.push(v);
            }
        }
    });
    *pw.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
    ctx.state.watchers.insert(id.clone(), pw);
    Ok(json!({"watcherId": id}))
}

/// Streaming watch: `start{}`, then events and keepalives until the client leaves.
pub async fn watch_dir(ctx: Ctx, body: Bytes) -> Resp {
    let req: WatchReq = match request::single_envelope::<WatchReqCamel>(&body) {
        Ok(r) => r.into(),
        Err(e) => return reply::stream_error(&e),
    };
    let mut w = match open_watch(&ctx, &req).await {
        Ok(w) => w,
        Err(e) => return reply::stream_error(&e),
    };
    let keepalive = ctx
        .header("keepalive-ping-interval")
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(|s| Duration::from_secs_f64(s.max(0.05)))
        .unwrap_or(Duration::from_secs(90));
    let deadline = ctx.connect_timeout();
    let (tx, resp) = reply::stream_response();
    let user = ctx.user.clone();
    let include = req.include_entry;
    tokio::spawn(async move {
        if tx
            .send(connect::message_envelope(&json!({"start": {}})))
            .await
            .is_err()
        {
            return;
        }
        let mut ka = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        let dl = tokio::time::sleep(deadline.unwrap_or(Duration::from_secs(86400 * 365)));
        tokio::pin!(dl);
        loop {
            tokio::select! {
                batch = w.next_batch() => match batch {
                    Ok(Some(evs)) => {
                        for ev in evs {
                            let v = event_json(&user, ev, include).await;
                            if tx.send(connect::message_envelope(&json!({"filesystem": v}))).await.is_err() {
                                return;
                            }
                        }
                    }
                    Ok(None) => {
                        let _ = tx.send(connect::end_stream_envelope(None)).await;
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(connect::end_stream_envelope(Some(&RpcError::internal(format!("watch failed: {e}"))))).await;
                        return;
                    }
                },
                _ = ka.tick() => {
                    if tx.send(connect::message_envelope(&json!({"keepalive": {}}))).await.is_err() {
                        return;
                    }
                }
                _ = tx.closed() => return,
                _ = &mut dl => {
                    let e = RpcError::new(Code::DeadlineExceeded, "the operation timed out (Connect-Timeout-Ms expired)");
                    let _ = tx.send(connect::end_stream_envelope(Some(&e))).await;
                    return;
                }
            }
        }
    });
    resp
}
