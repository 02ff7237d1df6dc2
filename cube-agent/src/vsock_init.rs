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
//! The payload is the init contract's vsock frame (`cube_init::VsockInit`).

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

use crate::state::Shared;
use cube_init::{VsockInit, MAX_VSOCK_FRAME};

const HOST_CID: u32 = 2;

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
    let mut buf = vec![0u8; MAX_VSOCK_FRAME];
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
        if let Some(len) = VsockInit::frame_len(&buf[..got]) {
            if got >= len {
                break;
            }
            if len > MAX_VSOCK_FRAME {
                return Err(format!("payload of {len} bytes is too large"));
            }
        }
    }
    let frame = VsockInit::decode(&buf[..got]).map_err(|e| e.to_string())?;
    state.apply_init(frame.into_init())?;
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
