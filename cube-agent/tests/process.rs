//! `process.Process` over the Connect protocol: framing, events, timeouts, keepalive, PTY, stdin,
//! signals, tags, users.

mod common;
use common::*;
use serde_json::json;
use std::time::Duration;

fn root_agent() -> Agent {
    Agent::spawn(&["--default-user", "root"])
}

#[test]
fn run_echo_streams_start_data_end() {
    let mut a = root_agent();
    let s = a.stream(
        "process.Process/Start",
        &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo hi; echo oops >&2; exit 3"]}, "stdin": false}),
        &[("Connect-Timeout-Ms", "60000"), ("Keepalive-Ping-Interval", "50")],
    );
    assert_eq!(s.status, 200);
    assert_eq!(
        header(&s.headers, "content-type"),
        Some("application/connect+json")
    );
    let (msgs, end) = s.collect();
    assert!(
        msgs[0]["event"]["start"]["pid"].as_u64().unwrap() > 0,
        "first event must be start: {msgs:?}"
    );
    assert_eq!(output(&msgs, "stdout"), "hi\n");
    assert_eq!(output(&msgs, "stderr"), "oops\n");
    let e = end_event(&msgs);
    assert_eq!(e["exitCode"], 3);
    assert_eq!(e["exited"], true);
    assert_eq!(e["status"], "exit status 3");
    assert_eq!(end, json!({}));
    a.assert_alive();
}

#[test]
fn envs_cwd_and_init_env_vars() {
    let mut a = root_agent();
    let dir = TempDir::new("cube-agent-cwd");
    let r = a.request(
        "POST",
        "/init",
        &[("Content-Type", "application/json")],
        br#"{"envVars":{"SANDBOX_VAR":"s","OVER":"init"}}"#,
    );
    assert_eq!(r.status, 204);
    let (msgs, _) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo $SANDBOX_VAR $OVER $REQ $HOME; pwd"], "envs": {"REQ": "r", "OVER": "req"}, "cwd": dir.0.display().to_string()}}),
            &[],
        )
        .collect();
    assert_eq!(
        output(&msgs, "stdout"),
        format!("s req r /root\n{}\n", dir.0.display())
    );
    a.assert_alive();
}

#[test]
fn timeout_kills_process_and_ends_with_deadline_exceeded() {
    let mut a = root_agent();
    let mut s = a.stream(
        "process.Process/Start",
        &json!({"process": {"cmd": "/bin/sleep", "args": ["60"]}}),
        &[("Connect-Timeout-Ms", "300")],
    );
    let (_, first) = s.next().unwrap();
    let pid = first["event"]["start"]["pid"].as_u64().unwrap();
    let (_, end) = s.collect();
    assert_eq!(end["error"]["code"], "deadline_exceeded");
    wait_for("timed-out process to die", || !pid_alive(pid));
    a.assert_alive();
}

#[test]
fn keepalive_events_at_requested_interval() {
    let mut a = root_agent();
    let (msgs, end) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/sleep", "args": ["1.2"]}}),
            &[("Keepalive-Ping-Interval", "0.2")],
        )
        .collect();
    let n = msgs
        .iter()
        .filter(|m| m["event"].get("keepalive").is_some())
        .count();
    assert!(n >= 2, "expected keepalives, got {msgs:?}");
    assert_eq!(end_event(&msgs)["exitCode"], 0);
    assert_eq!(end, json!({}));
    a.assert_alive();
}

#[test]
fn stdin_send_close_and_default_on() {
    let mut a = root_agent();
    // `stdin` absent means true.
    let mut s = a.stream(
        "process.Process/Start",
        &json!({"process": {"cmd": "/bin/cat"}, "tag": unique("cat")}),
        &[],
    );
    let (_, first) = s.next().unwrap();
    let pid = first["event"]["start"]["pid"].as_u64().unwrap();
    let r = a.unary(
        "process.Process/SendInput",
        &json!({"process": {"pid": pid}, "input": {"stdin": b64(b"abc\n")}}),
        &[],
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let r = a.unary(
        "process.Process/CloseStdin",
        &json!({"process": {"pid": pid}}),
        &[],
    );
    assert_eq!(r.status, 200);
    let (msgs, _) = s.collect();
    assert_eq!(output(&msgs, "stdout"), "abc\n");
    assert_eq!(end_event(&msgs)["exitCode"], 0);

    // stdin:false: input is refused with a clear error, and the process sees EOF.
    let mut s = a.stream(
        "process.Process/Start",
        &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "cat; sleep 0.5"]}, "stdin": false}),
        &[],
    );
    let (_, first) = s.next().unwrap();
    let pid = first["event"]["start"]["pid"].as_u64().unwrap();
    let r = a.unary(
        "process.Process/SendInput",
        &json!({"process": {"pid": pid}, "input": {"stdin": b64(b"x")}}),
        &[],
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["code"], "failed_precondition");
    let (msgs, _) = s.collect();
    assert_eq!(end_event(&msgs)["exitCode"], 0);
    a.assert_alive();
}

#[test]
fn stream_input_client_streaming() {
    let mut a = root_agent();
    let mut s = a.stream(
        "process.Process/Start",
        &json!({"process": {"cmd": "/bin/cat"}, "stdin": true}),
        &[],
    );
    let pid = s.next().unwrap().1["event"]["start"]["pid"]
        .as_u64()
        .unwrap();
    let mut body = envelope(
        0,
        json!({"start": {"process": {"pid": pid}}})
            .to_string()
            .as_bytes(),
    );
    for part in ["one ", "two ", "three\n"] {
        body.extend(envelope(
            0,
            json!({"data": {"input": {"stdin": b64(part.as_bytes())}}})
                .to_string()
                .as_bytes(),
        ));
    }
    body.extend(envelope(0, json!({"keepalive": {}}).to_string().as_bytes()));
    let (msgs, end) = a
        .stream_raw("process.Process/StreamInput", &body, &[])
        .collect();
    assert_eq!(msgs, vec![json!({})]);
    assert_eq!(end, json!({}));
    a.unary(
        "process.Process/CloseStdin",
        &json!({"process": {"pid": pid}}),
        &[],
    );
    let (msgs, _) = s.collect();
    assert_eq!(output(&msgs, "stdout"), "one two three\n");
    a.assert_alive();
}

#[test]
fn pty_io_and_resize() {
    let mut a = root_agent();
    let mut s = a.stream(
        "process.Process/Start",
        &json!({"process": {"cmd": "/bin/sh", "envs": {"PS1": "$ "}}, "pty": {"size": {"cols": 80, "rows": 24}}}),
        &[],
    );
    let pid = s.next().unwrap().1["event"]["start"]["pid"]
        .as_u64()
        .unwrap();
    let r = a.unary(
        "process.Process/Update",
        &json!({"process": {"pid": pid}, "pty": {"size": {"cols": 123, "rows": 45}}}),
        &[],
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let r = a.unary(
        "process.Process/SendInput",
        &json!({"process": {"pid": pid}, "input": {"pty": b64(b"tty; stty size; exit 5\n")}}),
        &[],
    );
    assert_eq!(r.status, 200);
    let (msgs, _) = s.collect();
    let out = output(&msgs, "pty");
    assert!(out.contains("/dev/pts/"), "{out:?}");
    assert!(out.contains("45 123"), "{out:?}");
    assert_eq!(end_event(&msgs)["exitCode"], 5);
    // CloseStdin is not for PTY processes.
    a.assert_alive();
}

#[test]
fn signals_tags_list_and_connect() {
    let mut a = root_agent();
    let tag = unique("sleeper");
    let mut s = a.stream(
        "process.Process/Start",
        &json!({"process": {"cmd": "/bin/sleep", "args": ["60"]}, "tag": tag}),
        &[],
    );
    let pid = s.next().unwrap().1["event"]["start"]["pid"]
        .as_u64()
        .unwrap();
    let list = a.unary("process.Process/List", &json!({}), &[]).json();
    let item = list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .expect("listed")
        .clone();
    assert_eq!(item["tag"], tag.as_str());
    assert_eq!(item["config"]["cmd"], "/bin/sleep");

    // A second stream attached by tag sees the start event with the same pid.
    let mut c = a.stream(
        "process.Process/Connect",
        &json!({"process": {"tag": tag}}),
        &[],
    );
    assert_eq!(c.next().unwrap().1["event"]["start"]["pid"], pid);

    let r = a.unary(
        "process.Process/SendSignal",
        &json!({"process": {"tag": tag}, "signal": "SIGNAL_SIGTERM"}),
        &[],
    );
    assert_eq!(r.status, 200);
    let (msgs, _) = s.collect();
    let e = end_event(&msgs);
    assert_eq!(e["exited"], false);
    assert_eq!(e["status"], "signal: terminated");
    let (cmsgs, _) = c.collect();
    assert_eq!(end_event(&cmsgs)["status"], "signal: terminated");

    // Gone now.
    let r = a.unary(
        "process.Process/SendSignal",
        &json!({"process": {"pid": pid}, "signal": 9}),
        &[],
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["code"], "not_found");
    let (_, end) = a
        .stream(
            "process.Process/Connect",
            &json!({"process": {"pid": pid}}),
            &[],
        )
        .collect();
    assert_eq!(end["error"]["code"], "not_found");
    let r = a.unary(
        "process.Process/SendSignal",
        &json!({"process": {"tag": "x"}, "signal": "SIGNAL_SIGHUP"}),
        &[],
    );
    assert_eq!(r.status, 400);
    a.assert_alive();
}

#[test]
fn client_disconnect_does_not_kill() {
    let mut a = root_agent();
    let dir = TempDir::new("cube-agent-bg");
    let marker = dir.path("done");
    let mut s = a.stream(
        "process.Process/Start",
        &json!({"process": {"cmd": "/bin/sh", "args": ["-c", format!("sleep 1; echo ok > {marker}")]}}),
        &[],
    );
    let pid = s.next().unwrap().1["event"]["start"]["pid"]
        .as_u64()
        .unwrap();
    drop(s.into_inner());
    std::thread::sleep(Duration::from_millis(100));
    let list = a.unary("process.Process/List", &json!({}), &[]).json();
    assert!(list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["pid"] == pid));
    wait_for("background command to finish", || {
        std::fs::read_to_string(&marker).is_ok_and(|s| s == "ok\n")
    });
    wait_for("process to leave the list", || {
        let l = a.unary("process.Process/List", &json!({}), &[]).json();
        !l["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == pid)
    });
    assert!(
        !pid_alive(pid),
        "finished child must be reaped, not a zombie"
    );
    a.assert_alive();
}

#[test]
fn runs_as_requested_user() {
    cube_testkit::require_priv!("cube-agent runs_as_requested_user");
    let mut a = root_agent();
    let (msgs, _) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "id -un; id -u; echo $USER; pwd"]}}),
            &[("Authorization", &format!("Basic {}", b64(b"nobody:")))],
        )
        .collect();
    let out = output(&msgs, "stdout");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "nobody");
    assert_eq!(lines[1], "65534");
    assert_eq!(lines[2], "nobody");

    // Unknown user: unauthenticated.
    let (_, end) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/true"}}),
            &[(
                "Authorization",
                &format!("Basic {}", b64(b"no-such-user-xyz:")),
            )],
        )
        .collect();
    assert_eq!(end["error"]["code"], "unauthenticated");
    let r = a.unary(
        "process.Process/List",
        &json!({}),
        &[(
            "Authorization",
            &format!("Basic {}", b64(b"no-such-user-xyz:")),
        )],
    );
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["code"], "unauthenticated");
    a.assert_alive();
}

#[test]
fn start_errors_are_clean() {
    let mut a = root_agent();
    let (_, end) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/no/such/binary"}}),
            &[],
        )
        .collect();
    assert_eq!(end["error"]["code"], "not_found");
    let (_, end) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": ""}}),
            &[],
        )
        .collect();
    assert_eq!(end["error"]["code"], "invalid_argument");
    let (_, end) = a.stream("process.Process/Start", &json!({}), &[]).collect();
    assert_eq!(end["error"]["code"], "invalid_argument");
    let (_, end) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/true", "cwd": "/no/such/dir"}}),
            &[],
        )
        .collect();
    assert_eq!(end["error"]["code"], "not_found");
    a.assert_alive();
}

#[test]
fn slow_client_gets_all_output_and_background_children_do_not_hold_the_end() {
    let mut a = root_agent();
    // More output than the per-stream queue holds: the process must wait for the client, and
    // nothing may be lost at the end.
    let mut s = a.stream(
        "process.Process/Start",
        &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "head -c 12000000 /dev/zero; echo tail >&2"]}}),
        &[],
    );
    let _ = s.next().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let (msgs, end) = s.collect();
    let total: usize = msgs
        .iter()
        .filter_map(|m| m["event"]["data"]["stdout"].as_str())
        .map(|d| unb64(d).len())
        .sum();
    assert_eq!(total, 12_000_000);
    assert_eq!(output(&msgs, "stderr"), "tail\n");
    assert_eq!(end_event(&msgs)["exitCode"], 0);
    assert_eq!(end, json!({}));

    // A background grandchild keeps stdout open; the end event must still come when the shell
    // exits (held for the grandchild's 100 s, the stream would pass the client's read timeout).
    let (msgs, _) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 100 & echo hi"]}}),
            &[],
        )
        .collect();
    assert_eq!(output(&msgs, "stdout"), "hi\n");
    assert_eq!(end_event(&msgs)["exitCode"], 0);
    a.assert_alive();
}
