//! The code-interpreter server (port 49999 protocol) of the real agent binary, with real
//! `python3` workers: NDJSON streaming, state, contexts, interrupts, auth and bad input.
//! Needs `python3` on the host (any 3.x; numpy/matplotlib are exercised by tests/interpreter).

mod common;

use common::{pid_alive, Agent, TempDir, GENEROUS};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

struct Interp {
    agent: Agent,
    addr: String,
    _dir: TempDir,
}

/// A port held for this test process (cube-testkit), not one bound and closed.
fn free_port() -> u16 {
    cube_testkit::reserve_port()
}

fn start(extra_config: &str) -> Interp {
    let dir = TempDir::new("interp");
    for _ in 0..10 {
        let port = free_port();
        let cfg = dir.path("agent.toml");
        std::fs::write(
            &cfg,
            format!(
                "[interpreter]\nenabled = true\naddress = \"127.0.0.1\"\nport = {port}\n{extra_config}"
            ),
        )
        .unwrap();
        let mut agent = Agent::spawn_cmd(&[
            "{bin}", "--addr", "{addr}", "--init", "never", "--config", &cfg,
        ]);
        let addr = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if TcpStream::connect(&addr).is_ok() {
                return Interp {
                    agent,
                    addr,
                    _dir: dir,
                };
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // Port raced away: the agent logs and keeps envd up; try another.
        let _ = agent.child.kill();
        let _ = agent.child.wait();
    }
    panic!("interpreter port never opened");
}

/// A streamed `/execute` response read line by line.
struct Lines {
    r: BufReader<TcpStream>,
    status: u16,
    pending: Vec<u8>,
    done: bool,
}

fn send(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(GENEROUS)).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    s
}

impl Lines {
    fn open(addr: &str, body: &Value, headers: &[(&str, &str)]) -> Lines {
        let s = send(
            addr,
            "POST",
            "/execute",
            headers,
            body.to_string().as_bytes(),
        );
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let status = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        let mut chunked = false;
        loop {
            let mut l = String::new();
            r.read_line(&mut l).unwrap();
            if l.trim().is_empty() {
                break;
            }
            if l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.contains("chunked") {
                chunked = true;
            }
        }
        let mut me = Lines {
            r,
            status,
            pending: Vec::new(),
            done: false,
        };
        if !chunked {
            let mut rest = Vec::new();
            let _ = me.r.read_to_end(&mut rest);
            me.pending = rest;
            me.done = true;
        }
        me
    }

    fn body_text(&mut self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }

    /// The next NDJSON object, or None at the end of the stream.
    fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(i) = self.pending.iter().position(|b| *b == b'\n') {
                let l: Vec<u8> = self.pending.drain(..=i).collect();
                return Some(serde_json::from_slice(&l).expect("NDJSON line"));
            }
            if self.done {
                assert!(self.pending.is_empty(), "stream ended mid-line");
                return None;
            }
            let mut size = String::new();
            if self.r.read_line(&mut size).unwrap_or(0) == 0 {
                self.done = true;
                continue;
            }
            let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
            if n == 0 {
                self.done = true;
                continue;
            }
            let mut buf = vec![0; n + 2];
            self.r.read_exact(&mut buf).unwrap();
            buf.truncate(n);
            self.pending.extend_from_slice(&buf);
        }
    }

    fn all(mut self) -> Vec<Value> {
        let mut v = Vec::new();
        while let Some(l) = self.next() {
            v.push(l);
        }
        v
    }
}

impl Interp {
    fn exec(&self, body: Value) -> Vec<Value> {
        let l = Lines::open(&self.addr, &body, &[]);
        assert_eq!(l.status, 200);
        let v = l.all();
        assert_eq!(
            v.last(),
            Some(&json!({"type": "end_of_execution"})),
            "every stream ends with end_of_execution: {v:?}"
        );
        v
    }

    fn run(&self, code: &str) -> Vec<Value> {
        self.exec(json!({"code": code, "context_id": null, "language": null, "env_vars": null}))
    }

    fn req(&self, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        let s = send(&self.addr, method, path, &[], body);
        let mut r = BufReader::new(s);
        let mut all = String::new();
        r.read_to_string(&mut all).unwrap();
        let status = all.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = all.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
        (status, body.to_string())
    }

    fn create_context(&self, body: &str) -> Value {
        let (st, b) = self.req("POST", "/contexts", body.as_bytes());
        assert_eq!(st, 200, "{b}");
        serde_json::from_str(&b).unwrap()
    }
}

fn of_type<'a>(v: &'a [Value], t: &str) -> Vec<&'a Value> {
    v.iter().filter(|l| l["type"] == t).collect()
}

fn main_text(v: &[Value]) -> Option<String> {
    v.iter()
        .find(|l| l["type"] == "result" && l["is_main_result"] == true)
        .and_then(|l| l["text"].as_str().map(str::to_string))
}

fn worker_pids(agent_pid: u32) -> Vec<u64> {
    // Workers are children of the agent running `python3 -c`.
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u64>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let after = stat.rsplit(')').next().unwrap_or("");
        let ppid: u32 = after
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if ppid == agent_pid && pid_alive(pid) {
            out.push(pid);
        }
    }
    out
}

#[test]
fn one_plus_one_state_and_execution_count() {
    let i = start("");
    let v = i.run("1+1");
    assert_eq!(
        v[0],
        json!({"type": "number_of_executions", "execution_count": 1})
    );
    assert_eq!(main_text(&v).as_deref(), Some("2"));
    i.run("import math\nx = 40");
    let v = i.run("x += 2\nmath.floor(x)");
    assert_eq!(main_text(&v).as_deref(), Some("42"));
    assert_eq!(v[0]["execution_count"], 3);
    // No trailing expression: no result line.
    let v = i.run("y = 1");
    assert!(of_type(&v, "result").is_empty(), "{v:?}");
    // Strings lose their repr quotes, other results keep their repr.
    assert_eq!(main_text(&i.run("'hi'")).as_deref(), Some("hi"));
    assert_eq!(main_text(&i.run("[1, 'a']")).as_deref(), Some("[1, 'a']"));
}

#[test]
fn fast_start_still_finds_site_packages() {
    for extra in ["", "fast_start = false\n"] {
        let i = start(extra);
        let v = i.run("import sys\n(sys.flags.no_site, any(p.endswith(('site-packages', 'dist-packages')) for p in sys.path))");
        let want = if extra.is_empty() {
            "(1, True)"
        } else {
            "(0, True)"
        };
        assert_eq!(main_text(&v).as_deref(), Some(want), "{extra:?}: {v:?}");
    }
}

#[test]
fn default_context_is_prestarted() {
    let i = start("");
    common::wait_for("the pre-started worker", || {
        !worker_pids(i.agent.pid()).is_empty()
    });
    let (st, b) = i.req("GET", "/contexts", b"");
    assert_eq!(st, 200);
    let list: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["language"], "python");
    // The first cell is served by the pre-started worker, not one started for it.
    assert_served_by_a_prestarted_worker(&i);
}

/// The next cell runs in a worker that was already there (a process identity, not a clock:
/// this machine's timing is no evidence of warmth).
fn assert_served_by_a_prestarted_worker(i: &Interp) {
    let warm = worker_pids(i.agent.pid());
    assert!(!warm.is_empty(), "no pre-started worker");
    let served: u64 = main_text(&i.run("import os\nos.getpid()"))
        .and_then(|p| p.parse().ok())
        .expect("the run's pid");
    assert!(
        warm.contains(&served),
        "run served by {served}, pre-started {warm:?}"
    );
}

/// `/health` answers at once; `/health?warm` only once the pre-started worker has said it is
/// ready (here a python3 that takes a second to start), which is what a node pools on.
#[test]
fn health_warm_waits_for_the_prestarted_worker() {
    let dir = TempDir::new("slowpy");
    let slow = dir.path("slow-python3");
    let real = ["/usr/bin/python3", "/usr/local/bin/python3"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("python3");
    std::fs::write(&slow, format!("#!/bin/sh\nsleep 1\nexec {real} \"$@\"\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&slow, std::fs::Permissions::from_mode(0o755)).unwrap();
    let t = Instant::now();
    let i = start(&format!("python = \"{slow}\"\n"));
    assert_eq!(i.agent.request("GET", "/health", &[], b"").status, 204);
    assert_eq!(i.agent.request("GET", "/health?warm", &[], b"").status, 503);
    common::wait_for("warm", || {
        i.agent.request("GET", "/health?warm", &[], b"").status == 204
    });
    assert!(
        t.elapsed() >= Duration::from_secs(1),
        "warm before python could start"
    );
    // Warm means the worker is there and the first run is served by it.
    assert_served_by_a_prestarted_worker(&i);
}

#[test]
fn output_streams_while_the_cell_runs() {
    let i = start("");
    let mut l = Lines::open(
        &i.addr,
        &json!({"code": "import sys, time\nprint('a', flush=True)\ntime.sleep(1.5)\nprint('b', file=sys.stderr)\nprint('c', end='')"}),
        &[],
    );
    let t0 = Instant::now();
    let mut got = Vec::new();
    while let Some(v) = l.next() {
        got.push((v, t0.elapsed()));
    }
    let streams: Vec<(String, String)> = got
        .iter()
        .filter(|(v, _)| v["type"] == "stdout" || v["type"] == "stderr")
        .map(|(v, _)| {
            assert!(v["timestamp"].as_str().unwrap().ends_with('Z'));
            (
                v["type"].as_str().unwrap().to_string(),
                v["text"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        streams,
        vec![
            ("stdout".into(), "a\n".into()),
            ("stderr".into(), "b\n".into()),
            ("stdout".into(), "c".into())
        ]
    );
    let first = got.iter().find(|(v, _)| v["type"] == "stdout").unwrap().1;
    let last = got.last().unwrap().1;
    assert!(
        first + Duration::from_millis(1000) < last,
        "a was not streamed early: {first:?} vs {last:?}"
    );
    // Subprocess output (the worker's fd 1) is part of the cell's stdout.
    let v =
        i.run("import subprocess\nsubprocess.run(['sh', '-c', 'echo sub; echo err >&2'])\nNone");
    let out: String = of_type(&v, "stdout")
        .iter()
        .map(|l| l["text"].as_str().unwrap())
        .collect();
    let err: String = of_type(&v, "stderr")
        .iter()
        .map(|l| l["text"].as_str().unwrap())
        .collect();
    assert!(out.contains("sub\n") && err.contains("err\n"), "{v:?}");
}

#[test]
fn errors_have_name_value_and_a_user_traceback() {
    let i = start("");
    let v = i.run("def f():\n    raise ValueError('bad value')\nf()");
    let e = of_type(&v, "error");
    assert_eq!(e.len(), 1);
    assert_eq!(e[0]["name"], "ValueError");
    assert_eq!(e[0]["value"], "bad value");
    let tb = e[0]["traceback"].as_str().unwrap();
    assert!(
        tb.contains("<cell") && tb.contains("raise ValueError"),
        "{tb}"
    );
    assert!(
        !tb.contains("_run") && !tb.contains("exec(body"),
        "worker frames leak: {tb}"
    );
    let v = i.run("if True print(1)");
    assert_eq!(of_type(&v, "error")[0]["name"], "SyntaxError");
    // KeyboardInterrupt-free SystemExit is reported, and the context survives it.
    let v = i.run("import sys\nsys.exit(4)");
    assert_eq!(of_type(&v, "error")[0]["name"], "SystemExit");
    assert_eq!(main_text(&i.run("2")).as_deref(), Some("2"));
}

#[test]
fn rich_reprs_and_display_become_mime_results() {
    let i = start("");
    let v = i.run(
        "class H:\n    def _repr_html_(self): return '<b>x</b>'\n    def _repr_json_(self): return {'k': 1}\n    def __repr__(self): return 'H()'\ndisplay('side')\nH()",
    );
    let r = of_type(&v, "result");
    assert_eq!(r.len(), 2, "{v:?}");
    assert_eq!(r[0]["text"], "side");
    assert_eq!(r[0]["is_main_result"], false);
    assert_eq!(r[1]["html"], "<b>x</b>");
    assert_eq!(r[1]["json"], json!({"k": 1}));
    assert_eq!(r[1]["text"], "H()");
    assert_eq!(r[1]["is_main_result"], true);
}

#[test]
fn env_vars_from_init_and_per_call() {
    let i = start("");
    let r = i.agent.request(
        "POST",
        "/init",
        &[("content-type", "application/json")],
        br#"{"envVars":{"SBX":"s1"}}"#,
    );
    assert_eq!(r.status, 204);
    let v = i.exec(json!({"code": "import os\n(os.environ.get('SBX'), os.environ.get('CALL'))", "env_vars": {"CALL": "c1"}}));
    assert_eq!(main_text(&v).as_deref(), Some("('s1', 'c1')"));
    let v = i.run("str(os.environ.get('CALL'))");
    assert_eq!(
        main_text(&v).as_deref(),
        Some("None"),
        "per-call env leaked"
    );
    // Subprocesses see them too.
    let v = i.exec(json!({"code": "import subprocess\nsubprocess.run(['sh','-c','echo $CALL'])\nNone", "env_vars": {"CALL": "sub"}}));
    let out: String = of_type(&v, "stdout")
        .iter()
        .map(|l| l["text"].as_str().unwrap())
        .collect();
    assert_eq!(out, "sub\n");
}

#[test]
fn access_token_guards_every_route_but_health() {
    let i = start("");
    let r = i.agent.request(
        "POST",
        "/init",
        &[("content-type", "application/json")],
        br#"{"accessToken":"tok-1"}"#,
    );
    assert_eq!(r.status, 204);
    let l = Lines::open(&i.addr, &json!({"code": "1"}), &[]);
    assert_eq!(l.status, 401);
    let l = Lines::open(
        &i.addr,
        &json!({"code": "1"}),
        &[("X-Access-Token", "wrong")],
    );
    assert_eq!(l.status, 401);
    let l = Lines::open(
        &i.addr,
        &json!({"code": "1"}),
        &[("X-Access-Token", "tok-1")],
    );
    assert_eq!(l.status, 200);
    assert_eq!(main_text(&l.all()).as_deref(), Some("1"));
    // Every other route too (the edge hands the SDK's traffic-token calls the envd token).
    for (m, p) in [
        ("GET", "/contexts"),
        ("POST", "/contexts"),
        ("DELETE", "/contexts/x"),
        ("POST", "/contexts/x/restart"),
        ("GET", "//contexts/"),
    ] {
        assert_eq!(i.req(m, p, b"{}").0, 401, "{m} {p}");
    }
    let s = send(
        &i.addr,
        "GET",
        "/contexts",
        &[("X-Access-Token", "tok-1")],
        b"",
    );
    let mut all = String::new();
    BufReader::new(s).read_to_string(&mut all).unwrap();
    assert!(all.starts_with("HTTP/1.1 200"), "{all}");
    assert_eq!(i.req("GET", "/health", b"").0, 200);
}

#[test]
fn contexts_are_isolated_and_restart_and_delete() {
    let i = start("");
    let c = i.create_context(r#"{"language":"python","cwd":"/tmp"}"#);
    let id = c["id"].as_str().unwrap().to_string();
    assert_eq!(c["cwd"], "/tmp");
    let v = i.exec(json!({"code": "import os\nonly = 1\nos.getcwd()", "context_id": id}));
    assert_eq!(main_text(&v).as_deref(), Some("/tmp"));
    let v = i.run("only");
    assert_eq!(of_type(&v, "error")[0]["name"], "NameError");
    let (st, b) = i.req("GET", "/contexts", b"");
    assert_eq!(st, 200);
    assert!(b.contains(&id));

    let before = worker_pids(i.agent.pid());
    let (st, _) = i.req("POST", &format!("/contexts/{id}/restart"), b"");
    assert_eq!(st, 204);
    let v = i.exec(json!({"code": "only", "context_id": id}));
    assert_eq!(
        of_type(&v, "error")[0]["name"],
        "NameError",
        "restart kept state"
    );
    assert_eq!(v[0]["execution_count"], 1);
    assert!(
        before.iter().any(|p| !pid_alive(*p)),
        "restart did not replace a worker process"
    );

    let (st, _) = i.req("DELETE", &format!("/contexts/{id}"), b"");
    assert_eq!(st, 204);
    let (st, body) = i.req("DELETE", &format!("/contexts/{id}"), b"");
    assert_eq!((st, body.contains("not found")), (404, true));
    let l = Lines::open(&i.addr, &json!({"code": "1", "context_id": id}), &[]);
    assert_eq!(l.status, 404);
    assert_eq!(
        i.req("POST", &format!("/contexts/{id}/restart"), b"").0,
        404
    );
    common::wait_for("the deleted context's worker to exit", || {
        worker_pids(i.agent.pid()).len() == 1
    });
}

#[test]
fn client_disconnect_interrupts_the_cell() {
    let i = start("");
    i.run("phase = 'before'");
    let mut l = Lines::open(
        &i.addr,
        &json!({"code": "import time\nphase = 'sleeping'\nprint('in', flush=True)\ntime.sleep(600)\nphase = 'after'"}),
        &[],
    );
    assert_eq!(l.next().unwrap()["type"], "number_of_executions");
    // In the sleep (it printed after setting the phase), then the client goes.
    assert_eq!(l.next().unwrap()["text"], "in\n");
    drop(l);
    // The next cell is answered with the state the interrupted one left: had the disconnect not
    // interrupted it, this would wait out the 600 s sleep (past the client's read timeout).
    let v = i.run("phase");
    assert_eq!(main_text(&v).as_deref(), Some("sleeping"));
}

#[test]
fn a_cell_that_ignores_interrupts_loses_its_worker() {
    let i = start("");
    i.run("kept = 1");
    let mut l = Lines::open(
        &i.addr,
        &json!({"code": "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('ignoring', flush=True)\ntime.sleep(600)"}),
        &[],
    );
    assert_eq!(l.next().unwrap()["type"], "number_of_executions");
    // SIGINT is ignored from here on (a disconnect before this would only interrupt the cell).
    assert_eq!(l.next().unwrap()["text"], "ignoring\n");
    drop(l);
    let v = i.run("kept");
    // The worker was killed after the grace period (not waited out: the sleep is 600 s, past
    // the client's read timeout): a fresh one has no state.
    assert_eq!(of_type(&v, "error")[0]["name"], "NameError", "{v:?}");
}

#[test]
fn restart_ends_a_running_cell() {
    let i = start("");
    let c = i.create_context("{}");
    let id = c["id"].as_str().unwrap().to_string();
    let addr = i.addr.clone();
    let idc = id.clone();
    let (running, is_running) = std::sync::mpsc::channel();
    let th = std::thread::spawn(move || {
        let mut l = Lines::open(
            &addr,
            &json!({"code": "import time\nprint('go', flush=True)\ntime.sleep(600)", "context_id": idc}),
            &[],
        );
        let mut v = Vec::new();
        while let Some(x) = l.next() {
            if x["text"] == "go\n" {
                let _ = running.send(());
            }
            v.push(x);
        }
        v
    });
    // Restarted once the cell is in its sleep; the stream ends at the restart (not after the
    // 600 s sleep, which is past the client's read timeout).
    is_running.recv().expect("the cell printed go");
    assert_eq!(
        i.req("POST", &format!("/contexts/{id}/restart"), b"").0,
        204
    );
    let v = th.join().unwrap();
    let e = of_type(&v, "error");
    assert_eq!(e[0]["name"], "UnexpectedEndOfExecution", "{v:?}");
    assert_eq!(v.last().unwrap()["type"], "end_of_execution");
    let v = i.exec(json!({"code": "6*7", "context_id": id}));
    assert_eq!(main_text(&v).as_deref(), Some("42"));
}

#[test]
fn worker_exit_is_reported_and_replaced() {
    let i = start("");
    let v = i.run("import os\nos._exit(9)");
    assert_eq!(of_type(&v, "error")[0]["name"], "UnexpectedEndOfExecution");
    assert_eq!(main_text(&i.run("'again'")).as_deref(), Some("again"));
}

#[test]
fn keepalive_lines_when_configured() {
    let i = start("keepalive_s = 1\n");
    let v = i.run("import time\ntime.sleep(2.6)\n'ok'");
    assert!(of_type(&v, "keepalive").len() >= 2, "{v:?}");
    assert_eq!(main_text(&v).as_deref(), Some("ok"));
    // Off by default (the SDK's read timeout must be able to fire).
    let j = start("");
    let v = j.run("import time\ntime.sleep(1.5)");
    assert!(of_type(&v, "keepalive").is_empty());
}

#[test]
fn bad_requests_get_clear_errors_and_the_agent_survives() {
    let mut i = start("");
    let cases: Vec<(&str, &str, &[u8], u16)> = vec![
        ("POST", "/execute", b"{not json", 400),
        ("POST", "/execute", br#"{"code": 12}"#, 400),
        (
            "POST",
            "/execute",
            br#"{"code":"1","language":"cobol"}"#,
            400,
        ),
        (
            "POST",
            "/execute",
            br#"{"code":"1","context_id":"x","language":"python"}"#,
            400,
        ),
        (
            "POST",
            "/execute",
            br#"{"code":"1","context_id":"nope"}"#,
            404,
        ),
        ("POST", "/contexts", b"[1,2]", 400),
        (
            "POST",
            "/contexts",
            br#"{"cwd":"/definitely/not/here"}"#,
            400,
        ),
        ("POST", "/contexts", br#"{"cwd":"relative"}"#, 400),
        ("DELETE", "/contexts/nope", b"", 404),
        ("GET", "/nothing", b"", 404),
        ("PUT", "/execute", b"", 404),
    ];
    for (m, p, b, want) in cases {
        let (st, body) = i.req(m, p, b);
        assert_eq!(st, want, "{m} {p} {:?}: {body}", String::from_utf8_lossy(b));
        assert!(!body.is_empty(), "{m} {p}: empty error body");
    }
    // A body over the limit is refused, not buffered.
    let big = vec![b'x'; 33 << 20];
    let l = Lines::open(
        &i.addr,
        &Value::String(String::from_utf8(big).unwrap()),
        &[],
    );
    assert_eq!(l.status, 413);
    let mut l = Lines::open(&i.addr, &json!({"code": "1"}), &[]);
    assert!(l.status == 200, "{}", l.body_text());
    i.agent.assert_alive();
    assert_eq!(i.req("GET", "/health", b"").0, 200);
}

#[test]
fn bash_contexts_keep_shell_state() {
    let i = start("");
    let c = i.create_context(r#"{"language":"bash","cwd":"/tmp"}"#);
    assert_eq!(c["language"], "bash");
    let id = c["id"].as_str().unwrap().to_string();
    let run =
        |code: &str, env: Value| i.exec(json!({"code": code, "context_id": id, "env_vars": env}));
    let text = |v: &[Value], t: &str| -> String {
        of_type(v, t)
            .iter()
            .map(|l| l["text"].as_str().unwrap().to_string())
            .collect()
    };
    let v = run("X=5\ncd /\nf() { echo \"f:$1\"; }", Value::Null);
    assert!(of_type(&v, "error").is_empty(), "{v:?}");
    let v = run(
        "echo $X; pwd; f a; echo oops >&2; printf 'no-newline'",
        Value::Null,
    );
    assert_eq!(text(&v, "stdout"), "5\n/\nf:a\nno-newline");
    assert_eq!(text(&v, "stderr"), "oops\n");
    assert_eq!(v[0]["execution_count"], 2);
    let v = run("echo \"$CALL\"; sh -c 'echo $CALL'", json!({"CALL": "c'1"}));
    assert_eq!(text(&v, "stdout"), "c'1\nc'1\n");
    let v = run("echo \"[${CALL-unset}]\"", Value::Null);
    assert_eq!(text(&v, "stdout"), "[unset]\n", "per-call env leaked");
    let v = run("false", Value::Null);
    assert_eq!(of_type(&v, "error")[0]["name"], "ExitCode");
    // Reading stdin gets EOF instead of eating the protocol.
    let v = run("cat; echo after-cat", Value::Null);
    assert_eq!(text(&v, "stdout"), "after-cat\n");
    // `exit` ends the session; the next cell gets a fresh one.
    let v = run("exit 3", Value::Null);
    assert_eq!(of_type(&v, "error")[0]["name"], "BashExited", "{v:?}");
    let v = run("echo \"[${X-gone}]\"", Value::Null);
    assert_eq!(text(&v, "stdout"), "[gone]\n");
    // A client that goes away interrupts the cell: bash and its children are killed, and the
    // next cell gets a fresh session quickly.
    let mut l = Lines::open(
        &i.addr,
        &json!({"code": "echo started; sleep 613.25; echo never", "context_id": id}),
        &[],
    );
    assert_eq!(l.next().unwrap()["type"], "number_of_executions");
    assert_eq!(l.next().unwrap()["text"], "started\n");
    drop(l);
    // Not waited out (613 s is past the client's read timeout), and the child was killed.
    let v = run("echo fresh", Value::Null);
    assert_eq!(text(&v, "stdout"), "fresh\n");
    common::wait_for("the interrupted cell's sleep to be killed", || {
        !common::processes_with_cmdline("sleep\x00613.25\x00")
    });
    // The default bash context is made on first use of language=bash.
    let v = i.exec(json!({"code": "echo hi", "language": "bash"}));
    assert_eq!(text(&v, "stdout"), "hi\n");
}
