"""Wire-level envd behaviour the SDKs rely on but do not expose directly: keepalive events,
server-side deadlines reported in the end-stream message, tags, absent `stdin` meaning true,
client-streaming StreamInput, WatchDir's start event."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

from agentlib import Client, b64, check_stream, envelope, parse_envelopes, split_process_events

STREAM = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}


def test_keepalive_events(raw):
    _, msgs, end = raw.stream(
        "process.Process/Start",
        {"process": {"cmd": "/bin/sleep", "args": ["2.5"]}, "stdin": False},
        {"Keepalive-Ping-Interval": "1"},
    )
    kinds = [next(iter(m["event"])) for m in msgs]
    assert kinds[0] == "start" and kinds[-1] == "end", kinds
    assert kinds.count("keepalive") >= 1, kinds
    assert "error" not in end


def test_server_deadline_in_end_stream(raw):
    # Not enforced, the 30 s sleep would end normally: no deadline error in the end-stream.
    r = raw.request(
        "POST",
        "/process.Process/Start",
        envelope({"process": {"cmd": "/bin/sleep", "args": ["30"]}, "stdin": False}),
        {**STREAM, "Connect-Timeout-Ms": "700"},
    )
    assert r.status == 200 and r.content_type == "application/connect+json"
    msgs, end = check_stream(parse_envelopes(r.body))
    assert next(iter(msgs[0]["event"])) == "start"
    assert end.get("error", {}).get("code") == "deadline_exceeded", end


def test_tag_selector(raw):
    tag = f"tag-{time.monotonic_ns()}"
    result = {}

    def run():
        c = Client(raw.port)
        _, msgs, end = c.stream(
            "process.Process/Start",
            {"process": {"cmd": "/bin/sleep", "args": ["30"]}, "tag": tag, "stdin": False},
        )
        result["msgs"], result["end"] = msgs, end
        c.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    info = None
    while time.monotonic() < deadline and info is None:
        procs = raw.unary("process.Process/List", {}).json().get("processes", [])
        info = next((p for p in procs if p.get("tag") == tag), None)
        time.sleep(0.05)
    assert info, "tagged process not listed with its tag"
    assert info["config"]["cmd"] == "/bin/sleep"
    r = raw.unary("process.Process/SendSignal", {"process": {"tag": tag}, "signal": "SIGNAL_SIGKILL"})
    assert r.status == 200, r.body
    t.join(10)
    assert not t.is_alive()
    _, _, end_ev = split_process_events(result["msgs"])
    assert end_ev is not None, result
    assert end_ev.get("exitCode", 0) != 0 or not end_ev.get("exited", False), end_ev


def test_absent_stdin_means_open_stdin(raw):
    # StartRequest.stdin absent => true (back-compat): cat must wait for input until CloseStdin.
    out = {}
    tag = f"cat-{time.monotonic_ns()}"

    def run():
        c = Client(raw.port)
        _, msgs, _ = c.stream("process.Process/Start", {"process": {"cmd": "/bin/cat"}, "tag": tag})
        out["msgs"] = msgs
        c.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.3)
    pid = wait_pid(raw, tag)
    assert t.is_alive(), "cat exited: stdin was not left open"
    r = raw.unary("process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": b64("ping\n")}})
    assert r.status == 200, r.body
    r = raw.unary("process.Process/CloseStdin", {"process": {"pid": pid}})
    assert r.status == 200, r.body
    t.join(10)
    assert not t.is_alive()
    stdout, _, end = split_process_events(out["msgs"])
    assert stdout == b"ping\n" and end.get("exitCode", 0) == 0


def test_stream_input_client_streaming(raw):
    out = {}
    tag = f"cat-{time.monotonic_ns()}"

    def run():
        c = Client(raw.port)
        _, msgs, _ = c.stream(
            "process.Process/Start", {"process": {"cmd": "/bin/cat"}, "stdin": True, "tag": tag}
        )
        out["msgs"] = msgs
        c.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    pid = wait_pid(raw, tag)
    body = envelope({"start": {"process": {"pid": pid}}})
    for chunk in ("a", "bc", "def\n"):
        body += envelope({"data": {"input": {"stdin": b64(chunk)}}})
    body += envelope({"keepalive": {}})

    def pieces():
        # Chunked and split mid-envelope, as a streaming client may send it.
        for k in range(0, len(body), 7):
            yield body[k : k + 7]
            time.sleep(0.005)

    conn = http.client.HTTPConnection("127.0.0.1", raw.port, timeout=10)
    conn.request("POST", "/process.Process/StreamInput", body=pieces(), headers=STREAM, encode_chunked=True)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.status == 200, data
    assert resp.getheader("content-type", "").startswith("application/connect+json")
    msgs, end = check_stream(parse_envelopes(data))
    assert "error" not in end, end
    raw.unary("process.Process/CloseStdin", {"process": {"pid": pid}})
    t.join(10)
    stdout, _, _ = split_process_events(out["msgs"])
    assert stdout == b"abcdef\n"


def test_watchdir_starts_with_start_event(raw, wd):
    s = socket.create_connection(("127.0.0.1", raw.port), timeout=10)
    body = envelope({"path": str(wd)})
    s.sendall(
        b"POST /filesystem.Filesystem/WatchDir HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\n"
        b"Connect-Protocol-Version: 1\r\nConnect-Timeout-Ms: 5000\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    # First chunk: the start{} envelope, sent before any filesystem event happens.
    s.settimeout(5)
    data = b""
    while True:
        data += s.recv(4096)
        if b"\r\n" in data:
            size = int(data.split(b"\r\n", 1)[0], 16)
            payload = data.split(b"\r\n", 1)[1]
            if len(payload) >= size:
                break
    env = payload[:size]
    flags, msg = parse_envelopes(env[: 5 + int.from_bytes(env[1:5], "big")])[0]
    assert flags == 0 and "start" in msg, msg
    (wd / "evt").write_text("x")
    s.close()


def wait_pid(raw, tag: str) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        procs = raw.unary("process.Process/List", {}).json().get("processes", [])
        for p in procs:
            if p.get("tag") == tag:
                return p["pid"]
        time.sleep(0.05)
    raise AssertionError(f"process tagged {tag} never listed")


def test_unary_error_shape(raw, wd):
    r = raw.unary("filesystem.Filesystem/Stat", {"path": str(wd / "missing")})
    assert r.status == 404 and r.content_type == "application/json"
    j = json.loads(r.body)
    assert j["code"] == "not_found" and j["message"]
    r = raw.unary("filesystem.Filesystem/MakeDir", {"path": str(wd)})
    assert r.status == 409 and r.json()["code"] == "already_exists", r.body


def test_binary_stdout_is_exact(raw):
    from agentlib import run_cmd

    out, err, end, _ = run_cmd(raw, "printf '\\x00\\x01\\xfe\\xff'; head -c 65536 /dev/zero | tr '\\0' '\\377' >&2")
    assert out == b"\x00\x01\xfe\xff"
    assert err == b"\xff" * 65536
    assert end.get("exitCode", 0) == 0 and end.get("exited") is True
    assert end.get("status") == "exit status 0", end


def test_exit_status_strings(raw):
    from agentlib import run_cmd

    _, _, end, _ = run_cmd(raw, "exit 3")
    assert end.get("exitCode") == 3 and end.get("status") == "exit status 3", end
    _, _, end, _ = run_cmd(raw, "kill -KILL $$")
    assert end.get("status") == "signal: killed", end
    assert end.get("exitCode", 0) == -1, end
