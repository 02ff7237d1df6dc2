"""E2B's public ports through the unmodified SDK (2.63): any port a sandbox listens on is
reached through the edge by `Host: get_host(port)` or the routing headers, HTTP upgrades
(WebSocket's handshake) pass through, `allowPublicTraffic: false` makes the edge require the
traffic access token, and `maskRequestHost` sets the Host header the sandbox sees."""

import http.client
import socket
import time
import urllib.parse

import pytest
from e2b import Sandbox

from conftest import TEMPLATE
from test_sdk import api


def serve_http(sbx, port, body):
    """A one-line HTTP server in the sandbox (netcat, one connection at a time: callers retry
    the moment between two): reads the request's head, keeps it in /tmp/req-<port>.txt, then
    answers `body`. It answers only after reading, as servers do: a response sent before the
    request arrived could end the connection before the request was delivered."""
    f = f"/tmp/resp-{port}"
    sbx.commands.run(
        f"while :; do rm -f {f}; mkfifo {f}; "
        f"cat {f} | nc -l -N {port} | {{ : > /tmp/req-{port}.tmp; "
        f"while IFS= read -r l; do printf '%s\\n' \"$l\" >> /tmp/req-{port}.tmp; "
        f"[ \"$l\" = $'\\r' ] && break; done; "
        f"mv /tmp/req-{port}.tmp /tmp/req-{port}.txt; "
        f"printf 'HTTP/1.1 200 OK\\r\\nContent-Length: {len(body)}\\r\\n"
        f"Connection: close\\r\\n\\r\\n{body}' > {f}; cat > /dev/null; }}; done",
        background=True)


def edge(cube, headers, path="/"):
    u = urllib.parse.urlparse(cube.sandbox_url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        c.request("GET", path, headers=headers)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def until_served(cube, headers, timeout=30):
    """The first 200 (the server in the sandbox may take a moment to listen)."""
    deadline = time.time() + timeout
    while True:
        st, body = edge(cube, headers)
        if st == 200 or time.time() > deadline:
            return st, body
        time.sleep(0.1)


def test_any_listening_port_is_reached_by_host_and_by_headers(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        serve_http(sbx, 8000, "hello from 8000")
        host = sbx.get_host(8000)
        assert host.startswith(f"8000-{sbx.sandbox_id}."), host
        assert until_served(cube, {"Host": host}) == (200, b"hello from 8000")
        st, body = until_served(cube, {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"})
        assert (st, body) == (200, b"hello from 8000")
        # A port nothing listens on: E2B's answer, not a hang.
        st, body = edge(cube, {"Host": sbx.get_host(8009)})
        assert st == 502 and b"port is not open" in body, body
        # Public by default: the detail says so, and no token was needed above.
        _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert d["network"] == {"allowPublicTraffic": True}
    finally:
        sbx.kill()


def test_http_upgrade_passes_through_the_edge(cube):
    """An Upgrade (what a WebSocket handshake is) is answered 101 by the sandbox, and bytes
    then flow both ways through the edge unchanged."""
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        sbx.commands.run(
            "rm -f /tmp/up; mkfifo /tmp/up; cat /tmp/up | nc -l 8001 | { "
            "while IFS= read -r l; do l=${l%$'\\r'}; [ -z \"$l\" ] && break; done; "
            "printf 'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: echo\\r\\nConnection: Upgrade\\r\\n\\r\\n'; "
            "cat; } > /tmp/up", background=True)
        u = urllib.parse.urlparse(cube.sandbox_url)
        deadline = time.time() + 30
        while True:
            s = socket.create_connection((u.hostname, u.port), timeout=30)
            s.sendall(f"GET /ws HTTP/1.1\r\nHost: {sbx.get_host(8001)}\r\nConnection: Upgrade\r\n"
                      "Upgrade: echo\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    break
                head += chunk
            if head.startswith(b"HTTP/1.1 101") or time.time() > deadline:
                break
            s.close()
            time.sleep(0.2)
        assert head.startswith(b"HTTP/1.1 101"), head
        rest = head.split(b"\r\n\r\n", 1)[1]
        for msg in (b"ping\n", b"second message\n"):
            s.sendall(msg)
            got = rest
            while len(got) < len(msg):
                got += s.recv(4096)
            assert got == msg
            rest = b""
        s.close()
    finally:
        sbx.kill()


def test_private_ports_need_the_traffic_access_token(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=120, network={"allow_public_traffic": False})
    try:
        _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert d["network"] == {"allowPublicTraffic": False}
        token = sbx.traffic_access_token
        assert token
        serve_http(sbx, 8000, "private")
        host = sbx.get_host(8000)
        with_token = {"Host": host, "e2b-traffic-access-token": token}
        assert until_served(cube, with_token) == (200, b"private")
        st, body = edge(cube, {"Host": host})
        assert st == 403 and b"traffic access token" in body, body
        st, _ = edge(cube, {"Host": host, "e2b-traffic-access-token": "0" * len(token)})
        assert st == 403
        # Another sandbox's token does not open it.
        other = Sandbox.create(TEMPLATE, timeout=60)
        try:
            st, _ = edge(cube, {"Host": host, "e2b-traffic-access-token": other.traffic_access_token})
            assert st == 403
        finally:
            other.kill()
        # envd keeps its own token: the SDK still works.
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()


def test_mask_request_host_sets_the_host_the_sandbox_sees(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=120, network={"mask_request_host": "localhost:${PORT}"})
    try:
        _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert d["network"] == {"allowPublicTraffic": True, "maskRequestHost": "localhost:${PORT}"}
        serve_http(sbx, 8000, "masked")
        assert until_served(cube, {"Host": sbx.get_host(8000)}) == (200, b"masked")
        # The server files the request once its connection has ended.
        req = sbx.commands.run("for i in $(seq 100); do [ -e /tmp/req-8000.txt ] && break; sleep 0.1; "
                               "done; cat /tmp/req-8000.txt").stdout
        hosts = [line for line in req.splitlines() if line.lower().startswith("host:")]
        assert hosts == ["Host: localhost:8000"] or hosts == ["host: localhost:8000"], req
    finally:
        sbx.kill()


@pytest.mark.parametrize("mask", ["a\r\nX-Evil: 1", "h" * 300, "bad host"],
                         ids=["header-injection", "too-long", "space"])
def test_bad_mask_request_host_is_refused(cube, mask):
    st, body, _ = api(cube, "POST", "/v2/sandboxes",
                      {"templateID": TEMPLATE, "network": {"maskRequestHost": mask}})
    assert st == 400 and "maskRequestHost" in body["message"], body


def test_a_refused_request_does_not_wake_a_paused_sandbox(cube):
    from test_lifecycle import wait_state
    sbx = Sandbox.create(TEMPLATE, timeout=4, network={"allow_public_traffic": False},
                         lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        wait_state(sbx.sandbox_id, "paused", timeout=60)
        host = sbx.get_host(8000)
        st, _ = edge(cube, {"Host": host})
        assert st == 403
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        # With the token the request wakes it (nothing listens on 8000: E2B's 502 after that).
        st, body = edge(cube, {"Host": host, "e2b-traffic-access-token": sbx.traffic_access_token})
        assert st == 502 and b"port is not open" in body, body
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
    finally:
        sbx.kill()
