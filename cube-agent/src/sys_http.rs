//! `GET /health`, `POST /init`, `GET /envs`, `GET /metrics`.

use crate::server::{self, http_error, Resp};
use crate::state::Shared;
use crate::version::ENVD_VERSION;
use http::{HeaderMap, HeaderValue};
use hyper::body::Incoming;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// Largest `/init` body accepted.
pub const MAX_INIT_BYTES: usize = 1024 * 1024;
/// Clock drift beyond which `/init` sets the clock.
const MAX_CLOCK_DRIFT: Duration = Duration::from_secs(1);
/// Largest entropy seed accepted (the kernel caps a single add anyway).
const MAX_ENTROPY_BYTES: usize = 4096;

fn with_version(mut r: Resp) -> Resp {
    r.headers_mut()
        .insert("x-envd-version", HeaderValue::from_static(ENVD_VERSION));
    r
}

/// `GET /health`: 204 once serving. With `?warm`, 503 while start-up work (the interpreter's
/// pre-started worker) is still running — what a node waits for before pooling a sandbox.
pub fn health(state: &Shared, query: &HashMap<String, String>) -> Resp {
    if query.contains_key("warm") && state.warming.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        return with_version(server::empty(503));
    }
    with_version(server::empty(204))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct InitReq {
    #[serde(default)]
    env_vars: Option<HashMap<String, String>>,
    #[serde(default)]
    access_token: Option<String>,
    #[serde(default)]
    timestamp: Option<String>,
    #[serde(default)]
    default_user: Option<String>,
    #[serde(default)]
    default_workdir: Option<String>,
    /// Base64 bytes to mix into the kernel RNG (a restored snapshot shares its parent's state).
    #[serde(default)]
    entropy: Option<String>,
    /// DNS servers for `/etc/resolv.conf` (Cube's, not envd's; absent = left alone).
    #[serde(default)]
    nameservers: Option<Vec<String>>,
}

pub async fn init(state: &Shared, headers: &HeaderMap, body: &mut Incoming) -> Resp {
    let raw = match server::read_body(body, MAX_INIT_BYTES).await {
        Ok(b) => b,
        Err(e) => return http_error(413, e.message),
    };
    let req: InitReq = if raw.iter().all(|b| b.is_ascii_whitespace()) {
        InitReq::default()
    } else {
        match std::str::from_utf8(&raw)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(t).map_err(|e| e.to_string()))
        {
            Ok(r) => r,
            Err(e) => return http_error(400, format!("invalid /init body: {e}")),
        }
    };
    // Once a token is set, only its holder may re-initialise (e.g. rotate it on resume).
    if let Some(cur) = state.access_token() {
        let given = headers.get("x-access-token").and_then(|v| v.to_str().ok());
        let ok = given.is_some_and(|g| crate::files_http::ct_eq(g.as_bytes(), cur.as_bytes()))
            || req
                .access_token
                .as_deref()
                .is_some_and(|t| crate::files_http::ct_eq(t.as_bytes(), cur.as_bytes()));
        if !ok {
            return http_error(401, "unauthorized access, please provide a valid access token or method signing if supported");
        }
    }
    let ts = match req.timestamp.as_deref().filter(|t| !t.is_empty()) {
        Some(t) => match crate::pjson::parse_rfc3339(t) {
            Ok(t) => Some(t),
            Err(e) => return http_error(400, e),
        },
        None => None,
    };
    // An unknown default user is ignored (with a warning) rather than failing the create path.
    let default_user = match req.default_user.filter(|n| !n.is_empty()) {
        Some(name) if crate::users::lookup(&name).is_none() => {
            tracing::warn!("/init: default user {name:?} does not exist; keeping the current one");
            None
        }
        other => other,
    };
    let entropy = match req.entropy.as_deref().filter(|e| !e.is_empty()) {
        Some(e) => match crate::pjson::unb64(e) {
            Ok(b) => Some(b),
            Err(e) => return http_error(400, format!("invalid entropy: {e}")),
        },
        None => None,
    };
    let upd = InitUpdate {
        env_vars: req.env_vars,
        access_token: req.access_token,
        default_user,
        default_workdir: req.default_workdir,
        timestamp: ts,
        entropy,
        nameservers: req.nameservers.filter(|n| !n.is_empty()),
    };
    if let Err(e) = apply_init(state, upd) {
        return http_error(500, e);
    }
    with_version(server::empty(204))
}

/// What one `/init` (HTTP, or the microVM's vsock init channel) changes, already validated.
#[derive(Debug, Default)]
pub struct InitUpdate {
    pub env_vars: Option<HashMap<String, String>>,
    /// `Some("")` clears the token.
    pub access_token: Option<String>,
    pub default_user: Option<String>,
    pub default_workdir: Option<String>,
    pub timestamp: Option<SystemTime>,
    pub entropy: Option<Vec<u8>>,
    /// Written to `/etc/resolv.conf` (the sandbox's: the agent runs inside its root).
    pub nameservers: Option<Vec<String>>,
}

/// Applies an init: session settings (unless older than the last applied one), the clock (as
/// init only) and entropy.
pub fn apply_init(state: &Shared, upd: InitUpdate) -> Result<(), String> {
    let ts = upd.timestamp;
    {
        let Ok(mut s) = state.session.write() else {
            return Err("state lock poisoned".into());
        };
        // Newer wins: a delayed retry of an older /init must not undo a newer one.
        let stale = matches!((ts, s.last_init), (Some(new), Some(old)) if new < old);
        if stale {
            tracing::info!("ignoring /init older than the last applied one");
        } else {
            if let Some(t) = ts {
                s.last_init = Some(t);
            }
            if let Some(env) = upd.env_vars {
                s.env_vars = env;
            }
            if let Some(tok) = upd.access_token {
                s.access_token = if tok.is_empty() { None } else { Some(tok) };
            }
            if let Some(u) = upd.default_user {
                s.default_user = u;
            }
            if let Some(w) = upd.default_workdir {
                s.default_workdir = if w.is_empty() { None } else { Some(w) };
            }
            if let Some(t) = ts {
                maybe_set_clock(state.is_init, t);
            }
        }
    }
    if let Some(ns) = upd.nameservers {
        write_resolv_conf(Path::new(RESOLV_CONF), &ns)?;
    }
    if let Some(bytes) = upd.entropy {
        if let Err(e) = add_entropy(&bytes[..bytes.len().min(MAX_ENTROPY_BYTES)]) {
            tracing::warn!("could not add entropy: {e}");
        }
    }
    Ok(())
}

const RESOLV_CONF: &str = "/etc/resolv.conf";

/// Replaces `path` with one `nameserver` line per address (atomically: a temporary file renamed
/// over it, so a symlink the template had there is replaced, not followed).
pub fn write_resolv_conf(path: &Path, nameservers: &[String]) -> Result<(), String> {
    let mut text = String::from("# written by cube-agent at init\n");
    for n in nameservers {
        let ip: std::net::IpAddr = n
            .parse()
            .map_err(|_| format!("nameserver {n:?} is not an IP address"))?;
        text.push_str(&format!("nameserver {ip}\n"));
    }
    let tmp = path.with_extension("cube-tmp");
    std::fs::write(&tmp, text)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

/// Sets the realtime clock when it drifted. Only as init: the same agent runs on developer hosts
/// and in the namespace runtime, where the clock is the host's and must not be touched.
fn maybe_set_clock(is_init: bool, t: SystemTime) {
    let now = SystemTime::now();
    let drift = now
        .duration_since(t)
        .or_else(|_| t.duration_since(now))
        .unwrap_or_default();
    if drift <= MAX_CLOCK_DRIFT {
        return;
    }
    if !is_init {
        tracing::info!(
            ?drift,
            "clock drifted, but not init: leaving the clock alone"
        );
        return;
    }
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let ts = libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as _,
    };
    // SAFETY: valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        tracing::warn!(
            "setting the clock failed: {}",
            std::io::Error::last_os_error()
        );
    } else {
        tracing::info!(?drift, "clock set from /init");
    }
}

/// Adds bytes to the kernel entropy pool and credits them (`RNDADDENTROPY`).
pub fn add_entropy(bytes: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/random")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut buf = Vec::with_capacity(8 + bytes.len());
    buf.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    buf.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    buf.extend_from_slice(bytes);
    // Pad so the trailing u32 array is whole.
    while buf.len() % 4 != 0 {
        buf.push(0);
    }
    // SAFETY: the buffer holds a complete rand_pool_info.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, buf.as_ptr()) } != 0 {
        let e = std::io::Error::last_os_error();
        // Without CAP_SYS_ADMIN, still mix the bytes in (uncredited) by writing them.
        use std::io::Write;
        let mut f = f;
        f.write_all(bytes)?;
        return Err(e);
    }
    Ok(())
}

pub fn envs(state: &Shared) -> Resp {
    let env = state.session().env_vars;
    server::json_response(200, &serde_json::json!(env))
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
    server::json_response(200, &serde_json::json!({"next": next, "entries": entries}))
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
    server::json_response(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_is_replaced_and_bad_addresses_refused() {
        let d = std::env::temp_dir().join(format!("cube-agent-resolv-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let target = d.join("elsewhere");
        std::fs::write(&target, "nameserver 127.0.0.53\n").unwrap();
        let p = d.join("resolv.conf");
        let _ = std::fs::remove_file(&p);
        std::os::unix::fs::symlink(&target, &p).unwrap();
        write_resolv_conf(&p, &["203.0.113.53".into(), "2001:db8::53".into()]).unwrap();
        let got = std::fs::read_to_string(&p).unwrap();
        assert!(
            got.contains("nameserver 203.0.113.53\nnameserver 2001:db8::53\n"),
            "{got}"
        );
        // The link was replaced, not followed.
        assert!(!std::fs::symlink_metadata(&p)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read_to_string(&target).unwrap(),
            "nameserver 127.0.0.53\n"
        );
        let e = write_resolv_conf(&p, &["8.8.8.8\nsearch evil".into()]).unwrap_err();
        assert!(e.contains("not an IP address"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
