//! Readiness probes: a minimal HTTP/1.0 GET against the daemons' health endpoints on loopback
//! (enough for `/health`; no HTTP client library needed).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The HTTP status of `GET path` on `127.0.0.1:port`, or `None` when nothing answers in time.
pub fn http_status(port: u16, path: &str, timeout: Duration) -> Option<u16> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.set_write_timeout(Some(timeout)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = [0u8; 64];
    let mut n = 0;
    while n < buf.len() {
        match s.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(_) => break,
        }
        if buf[..n].contains(&b'\n') {
            break;
        }
    }
    let line = std::str::from_utf8(&buf[..n]).ok()?;
    // "HTTP/1.1 200 OK"
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Whether `GET path` answers 200.
pub fn healthy(port: u16, path: &str) -> bool {
    http_status(port, path, Duration::from_secs(2)) == Some(200)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn reads_status_and_survives_garbage() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            for reply in [
                &b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"[..],
                b"garbage",
            ] {
                let (mut c, _) = l.accept().unwrap();
                // Read the whole request first: closing with unread bytes sends a reset, which
                // can reach the client before the reply does.
                let mut req = Vec::new();
                let mut b = [0u8; 256];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut b) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => req.extend_from_slice(&b[..k]),
                    }
                }
                c.write_all(reply).unwrap();
            }
        });
        assert_eq!(
            http_status(port, "/health", Duration::from_secs(2)),
            Some(200)
        );
        assert_eq!(http_status(port, "/health", Duration::from_secs(2)), None);
        t.join().unwrap();
        // Nothing listening.
        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        assert!(!healthy(free, "/health"));
    }
}
