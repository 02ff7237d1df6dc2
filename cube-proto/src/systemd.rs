//! systemd readiness notification (`Type=notify`), written as the datagram itself: a daemon
//! sends `READY=1` to `$NOTIFY_SOCKET` once its listeners are bound. Without `NOTIFY_SOCKET`
//! (not started by systemd) every call is a no-op.

use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `"READY=1"`) to systemd; `Ok(false)` when not run under systemd.
pub fn notify(state: &str) -> std::io::Result<bool> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(false);
    };
    let sock = UnixDatagram::unbound()?;
    let bytes = path.as_encoded_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        // A leading '@' names a socket in the abstract namespace.
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), &path)?;
    }
    Ok(true)
}

/// Tells systemd the daemon is ready; a failure is logged by the caller's choice, never fatal.
pub fn notify_ready() -> std::io::Result<bool> {
    notify(&format!("READY=1\nMAINPID={}", std::process::id()))
}

/// Tells systemd the daemon is shutting down (so `systemctl` shows "deactivating").
pub fn notify_stopping() -> std::io::Result<bool> {
    notify("STOPPING=1")
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test touches NOTIFY_SOCKET (process-wide), so the cases run in sequence inside it.
    #[test]
    fn sends_ready_to_path_and_abstract_sockets() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify");
        let l = UnixDatagram::bind(&p).unwrap();
        std::env::set_var("NOTIFY_SOCKET", &p);
        assert!(notify_ready().unwrap());
        let mut buf = [0u8; 256];
        let n = l.recv(&mut buf).unwrap();
        let msg = std::str::from_utf8(&buf[..n]).unwrap();
        assert!(msg.starts_with("READY=1\nMAINPID="), "{msg}");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("cube-notify-test-{}", std::process::id());
        let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let l2 = UnixDatagram::bind_addr(&a).unwrap();
        std::env::set_var("NOTIFY_SOCKET", format!("@{name}"));
        assert!(notify_stopping().unwrap());
        let n = l2.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");

        std::env::set_var("NOTIFY_SOCKET", d.path().join("nobody-listens"));
        assert!(notify_ready().is_err());
        std::env::remove_var("NOTIFY_SOCKET");
        assert!(!notify_ready().unwrap());
    }
}
