//! The microVM init channel, guest end. In a `microvm` sandbox the agent is restored from a
//! template snapshot, so it cannot be told its sandbox's settings before it runs: instead it
//! connects to the host (CID 2) on a vsock port named on the kernel command line
//! (`cube.vsock_init=<port>`), says `redy`, and applies the payload it gets (clock, fresh
//! entropy, env vars, token, default user and workdir). Then it half-closes (the host's
//! acknowledgement) and waits on the connection. A snapshot or pause-to-disk ends every vsock
//! connection (transport reset), so after each restore or resume the read fails, the agent
//! connects again and gets that copy's payload.
//!
//! During a template build the host answers the first `redy` with nothing: that moment (envd
//! bound, start-up work such as the interpreter's pre-started worker done, agent waiting) is
//! where the template snapshot is taken.
//!
//! Payload: `"CUBI"`, version 1 (u32 LE), unix time in ns (u64 LE), 32 bytes of entropy,
//! JSON length (u32 LE), JSON `{env_vars, access_token, default_user, default_workdir,
//! nameservers}` (`nameservers` may be absent: the same version-1 layout).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use crate::state::Shared;
use crate::sys_http::{apply_init, InitUpdate};

pub const MAGIC: &[u8; 4] = b"CUBI";
const HEADER: usize = 52;
/// Largest payload the host sends (one vsock packet).
const MAX_PAYLOAD: usize = 4096;
const HOST_CID: u32 = 2;

#[derive(Debug, Deserialize, PartialEq, Default)]
struct Body {
    #[serde(default)]
    env_vars: HashMap<String, String>,
    #[serde(default)]
    access_token: Option<String>,
    #[serde(default)]
    default_user: String,
    #[serde(default)]
    default_workdir: String,
    #[serde(default)]
    nameservers: Vec<String>,
}

/// Decodes a payload into the update it asks for.
pub fn decode(b: &[u8]) -> Result<InitUpdate, String> {
    if b.len() < HEADER || &b[0..4] != MAGIC {
        return Err("no CUBI header".into());
    }
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    if u32_at(4) != 1 {
        return Err(format!("unknown version {}", u32_at(4)));
    }
    let mut c = [0u8; 8];
    c.copy_from_slice(&b[8..16]);
    let clock_ns = u64::from_le_bytes(c);
    let n = u32_at(48) as usize;
    let json = b
        .get(HEADER..HEADER + n)
        .ok_or_else(|| format!("JSON of {n} bytes is cut short"))?;
    let body: Body = serde_json::from_slice(json).map_err(|e| format!("JSON: {e}"))?;
    let nonempty = |s: String| (!s.is_empty()).then_some(s);
    Ok(InitUpdate {
        env_vars: Some(body.env_vars),
        // Authoritative: a copy made for a sandbox without a token must not keep another's.
        access_token: Some(body.access_token.unwrap_or_default()),
        default_user: nonempty(body.default_user),
        default_workdir: nonempty(body.default_workdir),
        timestamp: (clock_ns > 0).then(|| SystemTime::UNIX_EPOCH + Duration::from_nanos(clock_ns)),
        entropy: Some(b[16..48].to_vec()),
        nameservers: (!body.nameservers.is_empty()).then_some(body.nameservers),
    })
}

/// The port named by `cube.vsock_init=<port>` in a kernel command line.
pub fn port_from_cmdline(cmdline: &str) -> Option<u32> {
    cmdline
        .split_whitespace()
        .find_map(|w| w.strip_prefix("cube.vsock_init="))
        .and_then(|p| p.parse().ok())
}

fn connect(port: u32) -> std::io::Result<std::fs::File> {
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh fd.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: zeroed sockaddr_vm is valid; the fields are set below.
    let mut sa: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    sa.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    sa.svm_port = port;
    sa.svm_cid = HOST_CID;
    // SAFETY: valid address of the right length.
    let r = unsafe {
        libc::connect(
            fd,
            (&sa as *const libc::sockaddr_vm).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(std::fs::File::from(owned))
}

/// Longest wait for start-up work (the interpreter's pre-started worker) before the first
/// `redy`: a template snapshot taken after it holds that work done, but a worker that never
/// comes up must not keep the template from being built.
const MAX_WARM_WAIT: Duration = Duration::from_secs(180);

/// Waits until nothing is warming (what `GET /health?warm` reports), at most `max`.
fn wait_warm(state: &Shared, max: Duration) {
    let t0 = std::time::Instant::now();
    while state.warming.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        if t0.elapsed() >= max {
            tracing::warn!(?max, "still warming; asking for init anyway");
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One round: connect, ask, apply, acknowledge, then block until the connection ends.
fn round(state: &Shared, port: u32) -> Result<(), String> {
    let mut conn = connect(port).map_err(|e| format!("connect to host port {port}: {e}"))?;
    conn.write_all(b"redy").map_err(|e| format!("send: {e}"))?;
    let mut buf = vec![0u8; MAX_PAYLOAD];
    let mut got = 0;
    // The payload is one packet, but a stream may split it: read until it is whole.
    loop {
        let n = conn
            .read(&mut buf[got..])
            .map_err(|e| format!("read payload: {e}"))?;
        if n == 0 {
            return Err(format!("host closed after {got} bytes"));
        }
        got += n;
        if got >= HEADER {
            let len = u32::from_le_bytes([buf[48], buf[49], buf[50], buf[51]]) as usize;
            if got >= HEADER + len {
                break;
            }
            if HEADER + len > MAX_PAYLOAD {
                return Err(format!("payload of {} bytes is too large", HEADER + len));
            }
        }
    }
    let upd = decode(&buf[..got])?;
    apply_init(state, upd)?;
    tracing::info!(port, "init applied from the host");
    // SAFETY: shutdown(2) on the fd `conn` owns.
    unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&conn), libc::SHUT_WR) };
    // Blocks until the host closes or a snapshot / restore resets the transport.
    let mut rest = [0u8; 64];
    while matches!(conn.read(&mut rest), Ok(n) if n > 0) {}
    Ok(())
}

/// Runs the init channel in a thread for the life of the agent.
pub fn spawn(state: Shared, port: u32) {
    let r = std::thread::Builder::new()
        .name("vsock-init".into())
        .spawn(move || {
            // The first `redy` is where a template is snapshotted: have it warm.
            wait_warm(&state, MAX_WARM_WAIT);
            let mut backoff = Duration::from_millis(10);
            loop {
                match round(&state, port) {
                    Ok(()) => backoff = Duration::from_millis(10),
                    Err(e) => {
                        tracing::debug!("vsock init: {e}");
                        std::thread::sleep(backoff);
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                    }
                }
            }
        });
    if let Err(e) = r {
        tracing::error!("vsock init thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(json: &str) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(MAGIC);
        v.extend_from_slice(&1u32.to_le_bytes());
        v.extend_from_slice(&1_700_000_000_000_000_000u64.to_le_bytes());
        v.extend_from_slice(&[7u8; 32]);
        v.extend_from_slice(&(json.len() as u32).to_le_bytes());
        v.extend_from_slice(json.as_bytes());
        v
    }

    #[test]
    fn decodes_what_the_host_sends() {
        let u = decode(&payload(
            r#"{"env_vars":{"A":"1"},"access_token":"tok","default_user":"user","default_workdir":""}"#,
        ))
        .unwrap();
        assert_eq!(u.env_vars.unwrap()["A"], "1");
        assert_eq!(u.access_token.as_deref(), Some("tok"));
        assert_eq!(u.default_user.as_deref(), Some("user"));
        assert_eq!(u.default_workdir, None);
        assert_eq!(u.entropy.unwrap(), vec![7u8; 32]);
        assert_eq!(
            u.timestamp.unwrap(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
        );
        // No token: the copy's token is cleared, not inherited.
        let u = decode(&payload("{}")).unwrap();
        assert_eq!(u.access_token.as_deref(), Some(""));
    }

    #[test]
    fn rejects_bad_payloads() {
        assert!(decode(b"CUBI").is_err());
        let mut p = payload("{}");
        p[4] = 2;
        assert!(decode(&p).unwrap_err().contains("version"));
        let mut p = payload(r#"{"env_vars":{}}"#);
        p.truncate(p.len() - 2);
        assert!(decode(&p).unwrap_err().contains("cut short"));
        assert!(decode(&payload("[")).unwrap_err().contains("JSON"));
        let mut p = payload("{}");
        p[0] = b'X';
        assert!(decode(&p).is_err());
    }

    #[test]
    fn the_first_request_waits_for_warming_work_but_not_forever() {
        let state = crate::state::AgentState::new("root".into(), false);
        state
            .warming
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let s2 = state.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            s2.warming.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        });
        let t0 = std::time::Instant::now();
        wait_warm(&state, Duration::from_secs(10));
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(140), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        t.join().unwrap();
        // Something that never warms up: bounded.
        state
            .warming
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let t0 = std::time::Instant::now();
        wait_warm(&state, Duration::from_millis(100));
        assert!(t0.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn finds_the_port_on_the_command_line() {
        assert_eq!(
            port_from_cmdline("console=ttyS0 cube.vsock_init=1024 quiet\n"),
            Some(1024)
        );
        assert_eq!(port_from_cmdline("console=ttyS0"), None);
        assert_eq!(port_from_cmdline("cube.vsock_init=x"), None);
    }
}
