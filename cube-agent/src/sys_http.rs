//! `GET /health`, `POST /init`, `GET /envs`, `GET /metrics`.

use crate::reply::{self, http_error, Resp, UNAUTHORIZED};
use crate::request;
use crate::state::Shared;
use crate::version::ENVD_VERSION;
use http::{HeaderMap, HeaderValue};
use hyper::body::Incoming;
use std::collections::HashMap;
use std::time::SystemTime;

fn with_version(mut r: Resp) -> Resp {
    r.headers_mut()
        .insert("x-envd-version", HeaderValue::from_static(ENVD_VERSION));
    r
}

/// `GET /health`: 204 once serving. With `?warm`, 503 while start-up work (the interpreter's
/// pre-started worker) is still running — what a node waits for before pooling a sandbox.
pub fn health(state: &Shared, query: &HashMap<String, String>) -> Resp {
    if query.contains_key("warm") && state.warming.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        return with_version(reply::empty(503));
    }
    with_version(reply::empty(204))
}

/// `POST /init`: the node's settings for this sandbox (the init contract's HTTP transport).
pub async fn init(state: &Shared, headers: &HeaderMap, body: &mut Incoming) -> Resp {
    let raw = match request::read_body(body, cube_init::MAX_HTTP_BODY).await {
        Ok(b) => b,
        Err(e) => return http_error(413, e.message),
    };
    let init = match cube_init::HttpInit::parse(&raw) {
        Ok(i) => i,
        Err(e) => return http_error(400, e.to_string()),
    };
    // Once a token is set, only its holder may re-initialise (e.g. rotate it on resume).
    if let Some(cur) = state.access_token() {
        let given = headers.get("x-access-token").and_then(|v| v.to_str().ok());
        let ok = given.is_some_and(|g| request::ct_eq(g.as_bytes(), cur.as_bytes()))
            || init
                .access_token
                .as_deref()
                .is_some_and(|t| request::ct_eq(t.as_bytes(), cur.as_bytes()));
        if !ok {
            return http_error(401, UNAUTHORIZED);
        }
    }
    if let Err(e) = state.apply_init(init) {
        return http_error(500, e);
    }
    with_version(reply::empty(204))
}

pub fn envs(state: &Shared) -> Resp {
    let env = state.session().env_vars;
    reply::json_response(200, &serde_json::json!(env))
}

/// `GET /logs?after=<seq>&limit=<n>` (Cube's, for the node): journal entries from `after` on,
/// and the `next` seq to ask from.
pub fn logs(state: &Shared, query: &HashMap<String, String>) -> Resp {
    let num = |k: &str, default: u64| match query.get(k) {
        None => Some(default),
        Some(v) => v.parse::<u64>().ok(),
    };
    let (Some(after), Some(limit)) = (num("after", 0), num("limit", 500)) else {
        return http_error(400, "after and limit must be non-negative integers");
    };
    let limit = limit.clamp(1, 1000) as usize;
    let (entries, next) = state.processes.journal.since(after, limit);
    reply::json_response(200, &serde_json::json!({"next": next, "entries": entries}))
}

fn read_cpu() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let line = s.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 4 {
        return None;
    }
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some((v.iter().take(8).sum(), idle))
}

fn meminfo() -> HashMap<String, u64> {
    let mut m = HashMap::new();
    for l in std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
    {
        let mut it = l.split_whitespace();
        if let (Some(k), Some(v)) = (it.next(), it.next()) {
            if let Ok(v) = v.parse::<u64>() {
                m.insert(k.trim_end_matches(':').to_string(), v * 1024);
            }
        }
    }
    m
}

pub async fn metrics(state: &Shared) -> Resp {
    let cur = read_cpu();
    let pct = {
        let mut prev = state.cpu_sample.lock().unwrap_or_else(|p| p.into_inner());
        let pct = match (*prev, cur) {
            (Some((pt, pi)), Some((t, i))) if t > pt => {
                let dt = (t - pt) as f64;
                let di = i.saturating_sub(pi) as f64;
                ((dt - di) / dt * 100.0).clamp(0.0, 100.0)
            }
            _ => 0.0,
        };
        *prev = cur;
        pct
    };
    let mem = meminfo();
    let total = mem.get("MemTotal").copied().unwrap_or(0);
    let avail = mem.get("MemAvailable").copied().unwrap_or(0);
    let used = total.saturating_sub(avail);
    let cache = mem.get("Cached").copied().unwrap_or(0) + mem.get("Buffers").copied().unwrap_or(0);
    // SAFETY: statvfs fills a zeroed struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers.
    let (disk_total, disk_used) = if unsafe { libc::statvfs(c"/".as_ptr(), &mut st) } == 0 {
        let f = st.f_frsize as u64;
        let total = st.f_blocks as u64 * f;
        (total, total.saturating_sub(st.f_bfree as u64 * f))
    } else {
        (0, 0)
    };
    // SAFETY: sysconf is always safe.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1);
    let ts = crate::pjson::unix_secs(SystemTime::now());
    reply::json_response(
        200,
        &serde_json::json!({
            "ts": ts,
            "cpu_count": cpus,
            "cpu_used_pct": (pct * 100.0).round() / 100.0,
            "mem_total": total,
            "mem_used": used,
            "mem_cache": cache,
            "mem_total_mib": total / (1024 * 1024),
            "mem_used_mib": used / (1024 * 1024),
            "disk_used": disk_used,
            "disk_total": disk_total,
        }),
    )
}
