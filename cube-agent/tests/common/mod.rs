//! Test harness: spawns the built `cube-agent` on a free loopback port and talks raw HTTP/1.1 to
//! it (a deliberately simple client, so tests see exactly what goes over the wire).

#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const GENEROUS: Duration = Duration::from_secs(30);

pub struct Agent {
    pub child: Child,
    pub addr: String,
}

/// Whether the loopback TCP listener on `port` is a socket of `pid` or of one of its
/// descendants (an agent under `unshare --fork` is a grandchild).
fn listener_owned_by(pid: u32, port: u16) -> bool {
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let inodes: Vec<String> = tcp
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = f.get(1)?.rsplit(':').next()?;
            (u16::from_str_radix(local_port, 16).ok()? == port && *f.get(3)? == "0A")
                .then(|| f.get(9).map(|i| format!("socket:[{i}]")))?
        })
        .collect();
    let mut parents = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // The parent pid is the second field after the parenthesised command name.
        if let Some(pp) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u32>().ok())
        {
            parents.push((p, pp));
        }
    }
    let mut family = vec![pid];
    let mut i = 0;
    while i < family.len() {
        let f = family[i];
        family.extend(parents.iter().filter(|(_, pp)| *pp == f).map(|(p, _)| *p));
        i += 1;
    }
    family.iter().any(|p| {
        std::fs::read_dir(format!("/proc/{p}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .any(|l| inodes.iter().any(|i| l.as_os_str() == i.as_str()))
    })
}

impl Agent {
    pub fn spawn(extra: &[&str]) -> Agent {
        let mut args = vec![
            "{bin}",
            "--addr",
            "{addr}",
            "--init",
            "never",
            "--config",
            "/nonexistent.toml",
        ];
        args.extend_from_slice(extra);
        Self::spawn_cmd(&args)
    }

    /// Spawns `argv` (with `{bin}` and `{addr}` substituted), e.g. under `unshare`.
    pub fn spawn_cmd(argv: &[&str]) -> Agent {
        for _ in 0..20 {
            // Held for this process (cube-testkit); the retry is for anything else there.
            let port = cube_testkit::reserve_port();
            let addr = format!("127.0.0.1:{port}");
            let argv: Vec<String> = argv
                .iter()
                .map(|a| {
                    a.replace("{bin}", env!("CARGO_BIN_EXE_cube-agent"))
                        .replace("{addr}", &addr)
                })
                .collect();
            let mut child = Command::new(&argv[0])
                .args(&argv[1..])
                .env("CUBE_AGENT_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn cube-agent");
            let deadline = Instant::now() + GENEROUS;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break; // port taken: retry with another
                }
                if TcpStream::connect(&addr).is_ok() {
                    // Another test's agent may hold this port (tests run side by side and the
                    // port was free a moment ago): only our own child's listener will do.
                    if listener_owned_by(child.id(), port) {
                        return Agent { child, addr };
                    }
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("cube-agent did not come up");
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails the test if the agent died (e.g. panicked).
    pub fn assert_alive(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "cube-agent exited during the test"
        );
    }

    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(GENEROUS)).unwrap();
        s
    }

    /// One request on a fresh connection (`Connection: close`).
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
        let mut s = self.connect();
        write_request(&mut s, method, path, headers, body);
        let mut r = BufReader::new(s);
        let (status, hdrs) = read_head(&mut r);
        let mut body = Vec::new();
        if header(&hdrs, "transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            while let Some(c) = read_chunk(&mut r) {
                body.extend_from_slice(&c);
            }
        } else if let Some(len) = header(&hdrs, "content-length") {
            let n: usize = len.parse().unwrap();
            body.resize(n, 0);
            r.read_exact(&mut body).unwrap();
        } else {
            r.read_to_end(&mut body).unwrap();
        }
        Resp {
            status,
            headers: hdrs,
            body,
        }
    }

    pub fn unary(&self, method: &str, msg: &Value, headers: &[(&str, &str)]) -> Resp {
        let mut h = vec![
            ("Content-Type", "application/json"),
            ("Connect-Protocol-Version", "1"),
        ];
        h.extend_from_slice(headers);
        self.request(
            "POST",
            &format!("/{method}"),
            &h,
            msg.to_string().as_bytes(),
        )
    }

    /// Opens a server-streaming RPC and returns a reader of response envelopes.
    pub fn stream_raw(&self, method: &str, body: &[u8], headers: &[(&str, &str)]) -> Stream {
        let mut s = self.connect();
        let mut h = vec![
            ("Content-Type", "application/connect+json"),
            ("Connect-Protocol-Version", "1"),
        ];
        h.extend_from_slice(headers);
        write_request(&mut s, "POST", &format!("/{method}"), &h, body);
        let mut r = BufReader::new(s);
        let (status, hdrs) = read_head(&mut r);
        let chunked = header(&hdrs, "transfer-encoding").is_some_and(|v| v.contains("chunked"));
        let mut buf = Vec::new();
        if !chunked {
            // A complete (non-streamed) body, e.g. an immediate error.
            let n: usize = header(&hdrs, "content-length")
                .map(|l| l.parse().unwrap())
                .unwrap_or(0);
            buf.resize(n, 0);
            r.read_exact(&mut buf).unwrap();
        }
        Stream {
            r,
            status,
            headers: hdrs,
            buf,
            done: !chunked,
        }
    }

    pub fn stream(&self, method: &str, msg: &Value, headers: &[(&str, &str)]) -> Stream {
        self.stream_raw(method, &envelope(0, msg.to_string().as_bytes()), headers)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn envelope(flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![flags];
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v
}

fn write_request(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
}

fn read_head(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .expect("status line")
        .parse()
        .unwrap();
    let mut hdrs = Vec::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        let l = l.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            hdrs.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    (status, hdrs)
}

fn read_chunk(r: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let n = usize::from_str_radix(line.trim().split(';').next()?, 16).ok()?;
    if n == 0 {
        let mut end = String::new();
        let _ = r.read_line(&mut end);
        return None;
    }
    let mut buf = vec![0; n + 2];
    r.read_exact(&mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

pub fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

pub struct Stream {
    r: BufReader<TcpStream>,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    buf: Vec<u8>,
    done: bool,
}

impl Stream {
    /// The next envelope `(flags, json)`, or None at the end of the body.
    pub fn next(&mut self) -> Option<(u8, Value)> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if self.buf.len() >= 5 + len {
                    let flags = self.buf[0];
                    let v: Value =
                        serde_json::from_slice(&self.buf[5..5 + len]).expect("envelope JSON");
                    self.buf.drain(..5 + len);
                    return Some((flags, v));
                }
            }
            if self.done {
                assert!(self.buf.is_empty(), "stream ended inside an envelope");
                return None;
            }
            match read_chunk(&mut self.r) {
                Some(c) => self.buf.extend_from_slice(&c),
                None => self.done = true,
            }
        }
    }

    /// Reads everything; returns (messages, end-stream JSON).
    pub fn collect(mut self) -> (Vec<Value>, Value) {
        let mut msgs = Vec::new();
        while let Some((f, v)) = self.next() {
            if f & 2 != 0 {
                assert!(self.next().is_none(), "data after end-stream");
                return (msgs, v);
            }
            msgs.push(v);
        }
        panic!("stream ended without an end-stream envelope; got {msgs:?}");
    }

    pub fn into_inner(self) -> TcpStream {
        self.r.into_inner()
    }
}

pub fn b64(d: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(d)
}

pub fn unb64(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

/// Concatenated stdout/stderr/pty of a list of process events.
pub fn output(msgs: &[Value], kind: &str) -> String {
    let mut out = Vec::new();
    for m in msgs {
        if let Some(d) = m["event"]["data"][kind].as_str() {
            out.extend(unb64(d));
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn end_event(msgs: &[Value]) -> Value {
    msgs.iter()
        .find_map(|m| m["event"].get("end").cloned())
        .unwrap_or_else(|| panic!("no end event in {msgs:?}"))
}

/// Polls `f` until it returns true or the generous deadline passes.
pub fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + GENEROUS;
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for {what}");
}

/// Whether a live process has exactly this command line (`/proc/<pid>/cmdline`, NUL-separated).
pub fn processes_with_cmdline(cmdline: &str) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten().any(|e| {
        e.file_name()
            .to_string_lossy()
            .parse::<u64>()
            .is_ok_and(|pid| {
                pid_alive(pid)
                    && std::fs::read(format!("/proc/{pid}/cmdline"))
                        .is_ok_and(|c| c == cmdline.as_bytes())
            })
    })
}

pub fn pid_alive(pid: u64) -> bool {
    // A zombie still has /proc/<pid>; check its state.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A temp dir removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let p = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self, rel: &str) -> String {
        self.0.join(rel).display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
