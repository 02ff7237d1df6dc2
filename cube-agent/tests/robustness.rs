//! Bad input and abuse: malformed envelopes, oversized bodies, disconnects, fd leaks. The agent
//! must answer every case with a clear error and stay alive.

mod common;
use common::*;
use serde_json::json;
use std::io::Write;

fn agent() -> Agent {
    Agent::spawn(&["--default-user", "root"])
}

fn stream_err(a: &Agent, body: &[u8]) -> serde_json::Value {
    let s = a.stream_raw("process.Process/Start", body, &[]);
    assert_eq!(s.status, 200);
    let (msgs, end) = s.collect();
    assert!(msgs.is_empty(), "no process may start: {msgs:?}");
    end["error"].clone()
}

#[test]
fn malformed_envelopes() {
    let mut a = agent();
    let good = json!({"process": {"cmd": "/bin/true"}}).to_string();
    // Bad flags.
    let mut b = envelope(0x80, good.as_bytes());
    assert_eq!(stream_err(&a, &b)["code"], "invalid_argument");
    b[0] = 0x01;
    assert_eq!(stream_err(&a, &b)["code"], "unimplemented");
    b[0] = 0x02;
    assert_eq!(stream_err(&a, &b)["code"], "invalid_argument");
    // Truncated header, length larger than the body, trailing garbage.
    assert_eq!(stream_err(&a, &[0, 0, 0])["code"], "invalid_argument");
    let mut long = envelope(0, good.as_bytes());
    long[4] = long[4].wrapping_add(50);
    assert_eq!(stream_err(&a, &long)["code"], "invalid_argument");
    let mut extra = envelope(0, good.as_bytes());
    extra.extend_from_slice(b"junk");
    assert_eq!(stream_err(&a, &extra)["code"], "invalid_argument");
    // Invalid JSON, invalid UTF-8, wrong types.
    let e = stream_err(&a, &envelope(0, b"{\"process\":"));
    assert_eq!(e["code"], "invalid_argument");
    assert!(e["message"].as_str().unwrap().contains("JSON"));
    assert_eq!(
        stream_err(&a, &envelope(0, &[0x7b, 0xff, 0xfe, 0x7d]))["code"],
        "invalid_argument"
    );
    assert_eq!(
        stream_err(&a, &envelope(0, br#"{"process":{"cmd":5}}"#))["code"],
        "invalid_argument"
    );
    assert_eq!(
        stream_err(
            &a,
            &envelope(
                0,
                br#"{"process":{"cmd":"/bin/true"},"pty":{"size":{"cols":-1}}}"#
            )
        )["code"],
        "invalid_argument"
    );
    // Declared length beyond the limit.
    assert_eq!(
        stream_err(&a, &[0, 0x7f, 0xff, 0xff, 0xff])["code"],
        "resource_exhausted"
    );
    // Empty body.
    assert_eq!(stream_err(&a, b"")["code"], "invalid_argument");

    // Unary: invalid JSON / UTF-8 / types are 400 invalid_argument.
    for body in [
        &b"{"[..],
        &[0xff, 0xfe][..],
        &br#"{"path": 7}"#[..],
        &b"[1,2]"[..],
    ] {
        let r = a.request(
            "POST",
            "/filesystem.Filesystem/Stat",
            &[("Content-Type", "application/json")],
            body,
        );
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["code"], "invalid_argument");
    }
    // Client streaming with a truncated envelope.
    let s = a.stream_raw("process.Process/StreamInput", &[0, 0, 0, 0, 9, b'{'], &[]);
    let (_, end) = s.collect();
    assert_eq!(end["error"]["code"], "invalid_argument");
    // Unknown methods and the protobuf codec.
    let r = a.unary("process.Process/Nope", &json!({}), &[]);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["code"], "unimplemented");
    let r = a.request(
        "POST",
        "/filesystem.Filesystem/Stat",
        &[("Content-Type", "text/plain")],
        b"{}",
    );
    assert_eq!(r.status, 415);
    let r = a.request(
        "POST",
        "/process.Process/List",
        &[("Content-Type", "application/proto")],
        b"",
    );
    assert_eq!(r.status, 415);
    let r = a.request("GET", "/process.Process/List", &[], b"");
    assert_eq!(r.status, 405);
    a.assert_alive();
}

#[test]
fn oversized_bodies_are_refused_clearly() {
    let mut a = agent();
    let big = vec![b' '; 16 * 1024 * 1024 + 100];
    let r = a.request(
        "POST",
        "/filesystem.Filesystem/Stat",
        &[("Content-Type", "application/json")],
        &big,
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["code"], "resource_exhausted");
    assert!(r.json()["message"].as_str().unwrap().contains("limit"));
    let r = a.request("POST", "/init", &[], &vec![b' '; 2 * 1024 * 1024]);
    assert_eq!(r.status, 413);
    a.assert_alive();
}

#[test]
fn disconnect_burst_leaks_no_fds_and_keeps_processes() {
    let mut a = agent();
    // Warm up so lazily created fds (blocking pool, signal pipes) exist before the baseline.
    let _ = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/true"}}),
            &[],
        )
        .collect();
    wait_for("warm-up process reaped", || {
        a.unary("process.Process/List", &json!({}), &[]).json()["processes"]
            .as_array()
            .unwrap()
            .is_empty()
    });
    let before = a.fd_count();
    let tag = unique("burst");
    for i in 0..20 {
        let mut s = a.stream(
            "process.Process/Start",
            &{
                let mut m = json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo start; sleep 1.5"]}, "stdin": i % 4 == 0, "tag": format!("{tag}-{i}")});
                if i % 5 == 0 {
                    m["pty"] = json!({"size": {"cols": 80, "rows": 24}});
                }
                m
            },
            &[("Keepalive-Ping-Interval", "0.1"), ("Connect-Timeout-Ms", "60000")],
        );
        let _ = s.next().unwrap();
        let sock = s.into_inner();
        // Half of them close abruptly (RST), half politely.
        if i % 2 == 0 {
            use std::os::fd::AsRawFd;
            let l = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            // SAFETY: setsockopt with a valid linger struct on our own socket.
            unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&l as *const libc::linger).cast(),
                    std::mem::size_of::<libc::linger>() as u32,
                );
            }
        }
        drop(sock);
        // And some raw connections that die mid-request.
        let mut raw = a.connect();
        let _ = raw.write_all(b"POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\nContent-Length: 100\r\n\r\n\0\0\0");
        drop(raw);
    }
    let list = a.unary("process.Process/List", &json!({}), &[]).json();
    let running = list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["tag"].as_str().is_some_and(|t| t.starts_with(&tag)))
        .count();
    assert!(
        running >= 15,
        "disconnects must not kill processes ({running} running)"
    );
    wait_for("all burst processes finished", || {
        a.unary("process.Process/List", &json!({}), &[]).json()["processes"]
            .as_array()
            .unwrap()
            .is_empty()
    });
    wait_for("fd count back to baseline", || a.fd_count() <= before);
    a.assert_alive();
    // Still serving.
    let (msgs, _) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/echo", "args": ["alive"]}}),
            &[],
        )
        .collect();
    assert_eq!(output(&msgs, "stdout"), "alive\n");
}

#[test]
fn garbage_http_does_not_hurt() {
    let mut a = agent();
    for junk in [
        &b"\x00\x01\x02\r\n\r\n"[..],
        b"GET / HTTP/9.9\r\n\r\n",
        b"POST /files HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /files?path=%2Ftmp%2Fx HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ] {
        let mut s = a.connect();
        let _ = s.write_all(junk);
        let mut buf = [0u8; 256];
        let _ = std::io::Read::read(&mut s, &mut buf);
    }
    // Chunked request bodies are fine.
    let mut s = a.connect();
    let body = json!({"path": "/"}).to_string();
    write!(s, "POST /filesystem.Filesystem/Stat HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n", body.len(), body).unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(&mut s, &mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains("FILE_TYPE_DIRECTORY"));
    a.assert_alive();
}
