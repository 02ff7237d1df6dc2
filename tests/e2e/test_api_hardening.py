"""cube-api hardening against the real stack, with raw HTTP: bad input on every route gives an
E2B-shaped JSON error (never a 500 or a hang) and creates nothing; per-key rate limits (429 +
Retry-After); the OpenAPI document; Prometheus metrics; the edge's sandbox cache."""

import errno
import json
import os
import re
import socket
import subprocess
import time
import uuid

import httpx
import pytest

from conftest import TEMPLATE, _wait
from ports import reserve_port

MiB = 1 << 20


def call(cube, method, path, *, body=None, raw=None, key=None, headers=None, base=None):
    h = {"X-API-Key": cube.api_key if key is None else key}
    h.update(headers or {})
    content = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if content is not None:
        h.setdefault("Content-Type", "application/json")
    return httpx.request(method, (base or cube.api_url) + path, content=content, headers=h,
                         timeout=60)


def assert_error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    b = r.json()
    assert set(b) >= {"code", "message"}, b
    assert b["code"] == status and isinstance(b["message"], str) and b["message"], b
    return b


def api_ids(cube):
    """Every sandbox the API lists for this key (all pages)."""
    ids, token = set(), None
    while True:
        r = call(cube, "GET", "/v2/sandboxes?limit=100" + (f"&nextToken={token}" if token else ""))
        assert r.status_code == 200, r.text
        ids |= {s["sandboxID"] for s in r.json()}
        token = r.headers.get("x-next-token")
        if not token:
            return ids


def node_sandboxes(cube):
    """The cubelet's own count of the sandboxes it holds (all states)."""
    text = httpx.get(cube.cubelet_http + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in
               re.finditer(r'^cube_sandboxes\{[^}]*\} (\S+)$', text, re.M))


def metric(text, name, **labels):
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(rf'^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$', text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def baseline(cube):
    return api_ids(cube), node_sandboxes(cube)


@pytest.fixture(scope="module")
def victim(cube, baseline):
    """A running sandbox that the bad requests aim at and must leave untouched."""
    r = call(cube, "POST", "/v2/sandboxes", body={"templateID": TEMPLATE, "timeout": 300})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    yield sid
    call(cube, "DELETE", f"/sandboxes/{sid}")


BIG = b'{"templateID": "' + TEMPLATE.encode() + b'", "metadata": {"k": "' + b"x" * (2 * MiB) + b'"}}'

CREATE_BODIES = [
    (b"{nope", 400), (b"\xff\xfe\x00", 400), (b"[]", 400), (b'"str"', 400), (b"null", 400),
    (b"", 400), (b"   ", 400), (b"{}", 400), (BIG, 413),
]
CREATE_JSON = [
    ({"templateID": TEMPLATE, "timeout": "60"}, 400),
    ({"templateID": TEMPLATE, "timeout": True}, 400),
    ({"templateID": TEMPLATE, "timeout": 1.5}, 400),
    ({"templateID": TEMPLATE, "timeout": [60]}, 400),
    ({"templateID": TEMPLATE, "timeout": -1}, 400),
    ({"templateID": TEMPLATE, "timeout": -(2 ** 63)}, 400),
    ({"templateID": TEMPLATE, "timeout": 0}, 400),
    ({"templateID": TEMPLATE, "timeout": 10 ** 9}, 400),
    ({"templateID": TEMPLATE, "timeout": 2 ** 63}, 400),
    ({"templateID": TEMPLATE, "timeout": 2 ** 64}, 400),
    ({"templateID": TEMPLATE, "timeout": 10 ** 40}, 400),
    ({"templateID": ["x"]}, 400),
    ({"templateID": {"a": 1}}, 400),
    ({"templateID": ""}, 400),
    ({"templateID": None}, 400),
    ({"templateID": "no-such-template"}, 404),
    ({"templateID": "../../etc/passwd"}, 400),
    ({"templateID": TEMPLATE, "metadata": "x"}, 400),
    ({"templateID": TEMPLATE, "metadata": {"a": {"b": 1}}}, 400),
    ({"templateID": TEMPLATE, "metadata": {"a": None}}, 400),
    ({"templateID": TEMPLATE, "envVars": {"A": 1}}, 400),
    ({"templateID": TEMPLATE, "envVars": "A=1"}, 400),
    ({"templateID": TEMPLATE, "allow_internet_access": "yes"}, 400),
]


@pytest.mark.parametrize("path", ["/sandboxes", "/v2/sandboxes"])
def test_bad_create_bodies(cube, baseline, path):
    before_ids, before_node = api_ids(cube), node_sandboxes(cube)
    for raw, status in CREATE_BODIES:
        assert_error(call(cube, "POST", path, raw=raw), status)
    for body, status in CREATE_JSON:
        r = call(cube, "POST", path, body=body)
        assert_error(r, status)
    # A template name of absurd length is refused, not looked up forever.
    r = call(cube, "POST", path, body={"templateID": "t" * 100_000})
    assert r.status_code in (400, 404), r.text
    assert_error(r, r.status_code)
    # Nothing half-created: neither the API nor the node knows a new sandbox.
    assert api_ids(cube) == before_ids
    assert node_sandboxes(cube) == before_node


UNKNOWN_IDS = ["inotthere00000000000", "UPPER", "a-b", "x" * 300, "%C3%A9", "%00", "a%20b",
               "..%2F..%2Fetc"]
ID_ROUTES = [
    ("GET", "/sandboxes/{}", None), ("DELETE", "/sandboxes/{}", None),
    ("POST", "/sandboxes/{}/timeout", {"timeout": 30}), ("POST", "/sandboxes/{}/pause", {}),
    ("POST", "/sandboxes/{}/resume", {"timeout": 30}), ("POST", "/sandboxes/{}/connect", {"timeout": 30}),
    ("POST", "/v2/sandboxes/{}/connect", {"timeout": 30}),
]


@pytest.mark.parametrize("method,path,body", ID_ROUTES)
def test_unknown_ids_are_404(cube, method, path, body):
    for sid in UNKNOWN_IDS:
        r = call(cube, method, path.format(sid), body=body)
        b = assert_error(r, 404)
        assert "doesn't exist" in b["message"] or b["message"] == "Not found", b


def test_bad_bodies_on_a_real_sandbox(cube, victim):
    before = node_sandboxes(cube)
    big = b'{"timeout": 30, "x": "' + b"y" * (2 * MiB) + b'"}'
    for path in (f"/sandboxes/{victim}/timeout",):
        for raw, status in [(b"", 400), (b"[]", 400), (b"{bad", 400), (big, 413)]:
            assert_error(call(cube, "POST", path, raw=raw), status)
        for body in [{"timeout": "x"}, {"timeout": -1}, {"timeout": 0}, {"timeout": 2 ** 64},
                     {"timeout": 10 ** 9}, {"timeout": None}, {}]:
            assert_error(call(cube, "POST", path, body=body), 400)
    for raw, status in [(b"[1]", 400), (b"{bad", 400), (b'"x"', 400), (big, 413)]:
        assert_error(call(cube, "POST", f"/sandboxes/{victim}/pause", raw=raw), status)
    for path in (f"/sandboxes/{victim}/connect", f"/v2/sandboxes/{victim}/connect"):
        for body in [{"timeout": "x"}, {"timeout": -5}, {"timeout": 2 ** 64}]:
            assert_error(call(cube, "POST", path, body=body), 400)
        assert_error(call(cube, "POST", path, raw=b"{bad"), 400)
    # None of that touched the sandbox.
    r = call(cube, "GET", f"/sandboxes/{victim}")
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    assert node_sandboxes(cube) == before


@pytest.mark.parametrize("query", [
    "limit=0", "limit=abc", "limit=101", "limit=-1", "limit=1e3", "state=bogus", "state=running,zzz",
    "order=up", "limit=%FF",
])
def test_bad_list_queries(cube, query):
    for path in ("/v2/sandboxes", "/sandboxes"):
        assert_error(call(cube, "GET", f"{path}?{query}"), 400)


def test_garbage_paging_token(cube):
    # A token that is not the master's shape is a client error, never a 500 or a first page.
    for token in ("%%%garbage%%%", "no-dot", "abc.sbx", "."):
        r = call(cube, "GET", f"/v2/sandboxes?nextToken={token}")
        assert_error(r, 400)
        assert "next token" in r.json()["message"], r.text
    # A well-formed token past every row is an empty page, not an error.
    r = call(cube, "GET", "/v2/sandboxes?nextToken=0.zzzzzzzz")
    assert r.status_code == 200 and r.json() == [], r.text


def test_unknown_routes_and_methods(cube):
    assert_error(call(cube, "GET", "/nope"), 404)
    assert_error(call(cube, "GET", "/v3/sandboxes"), 404)
    r = call(cube, "PUT", "/v2/sandboxes", body={})
    assert_error(r, 405)
    assert "allow" in r.headers
    assert_error(call(cube, "PATCH", "/sandboxes/iabc"), 405)


def test_garbage_auth_headers(cube):
    for path in ("/v2/sandboxes", "/sandboxes/iabc", "/nope"):
        assert_error(call(cube, "GET", path, key=""), 401)
    for key in [b"\xe9\xff\xfe", b"e2b_ 123", b"x" * 10_000, b"e2b_" + b"0" * 40]:
        r = httpx.get(cube.api_url + "/v2/sandboxes", headers=[(b"X-API-Key", key)], timeout=30)
        assert_error(r, 401)
    # A control byte makes the header invalid HTTP: the HTTP layer refuses it (400), no 5xx.
    r = httpx.post(cube.api_url + "/v2/sandboxes", headers=[(b"X-API-Key", b"\x01bad")],
                   content=json.dumps({"templateID": TEMPLATE}), timeout=30)
    assert r.status_code in (400, 401), r.text


def test_garbage_routing_headers_on_api_are_ignored(cube):
    r = call(cube, "GET", "/v2/sandboxes", headers={"E2b-Sandbox-Id": "../../x",
                                                     "E2b-Sandbox-Port": "-1",
                                                     "Host": "49983-zz.example"})
    assert r.status_code == 200, r.text


def _raw_http(port, data):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError as e:
            # The server may refuse mid-way (and may already have closed): an allowed answer.
            if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                raise
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def test_malformed_http_does_not_kill_servers(cube):
    api_port = int(cube.api_url.rsplit(":", 1)[1])
    edge_port = int(cube.sandbox_url.rsplit(":", 1)[1])
    for port in (api_port, edge_port):
        for junk in [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                     b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
                     b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 64]:
            out = _raw_http(port, junk)
            # The edge's E2B "sandbox not found" 502 is its normal answer to an unroutable request.
            ok_5xx = b"HTTP/1.1 502" if port == edge_port else b"-"
            assert not out.startswith(b"HTTP/1.1 5") or out.startswith(ok_5xx), out[:200]
    # Both still serve.
    assert httpx.get(cube.api_url + "/health", timeout=10).status_code == 200
    r = httpx.get(cube.sandbox_url + "/health", headers={"E2b-Sandbox-Id": "inope"}, timeout=10)
    assert r.status_code == 502


def test_edge_garbage_headers(cube, victim):
    def edge(headers):
        return httpx.get(cube.sandbox_url + "/health", headers=headers, timeout=10)
    for port in ("abc", "70000", "-1", ""):
        r = edge({"E2b-Sandbox-Id": victim, "E2b-Sandbox-Port": port})
        assert_error(r, 400)
    for headers in [{"E2b-Sandbox-Id": "UPPER"}, {"E2b-Sandbox-Id": "x" * 5000},
                    {"Host": "garbage"}, {"Host": "99999999-abc.x"},
                    {"X-Access-Token": "t" * 10_000}, {}]:
        r = edge(headers)
        assert r.status_code == 502, (headers, r.text)
        assert r.json()["message"] == "The sandbox was not found"
    r = httpx.get(cube.sandbox_url + "/health", headers=[(b"E2b-Sandbox-Id", b"\xff\xfe")], timeout=10)
    assert r.status_code == 502
    # The victim still answers through the edge.
    assert edge({"E2b-Sandbox-Id": victim, "E2b-Sandbox-Port": "49983"}).status_code == 204


def test_zz_nothing_half_created(cube, baseline, victim):
    """After all the bad requests only the victim was added, on the API and on the node."""
    ids0, node0 = baseline
    assert api_ids(cube) == ids0 | {victim}
    assert node_sandboxes(cube) == node0 + 1


def test_openapi_document_lists_the_routes(cube):
    r = httpx.get(cube.api_url + "/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    for method, path in [("post", "/v2/sandboxes"), ("get", "/v2/sandboxes"), ("post", "/sandboxes"),
                         ("get", "/sandboxes/{id}"), ("delete", "/sandboxes/{id}"),
                         ("post", "/sandboxes/{id}/timeout"), ("post", "/sandboxes/{id}/pause"),
                         ("post", "/sandboxes/{id}/resume"), ("post", "/sandboxes/{id}/connect"),
                         ("post", "/v2/sandboxes/{id}/connect")]:
        assert method in paths[path], (method, path)
        assert "429" in paths[path][method]["responses"]


def test_metrics_requests_and_latency(cube):
    call(cube, "GET", "/v2/sandboxes")
    call(cube, "GET", "/sandboxes/inotthere")
    call(cube, "GET", "/v2/sandboxes", key="")
    t = httpx.get(cube.api_metrics_url + "/metrics", timeout=10).text
    assert metric(t, "cube_api_requests_total", method="GET", route="/v2/sandboxes", status="200") >= 1
    assert metric(t, "cube_api_requests_total", method="GET", route="/sandboxes/:id", status="404") >= 1
    assert metric(t, "cube_api_requests_total", method="GET", route="/v2/sandboxes", status="401") >= 1
    assert metric(t, "cube_api_request_seconds_count", method="GET", route="/v2/sandboxes") >= 2
    # Raw ids never become labels.
    assert "inotthere" not in t


def test_edge_cache_and_invalidation(cube):
    r = call(cube, "POST", "/v2/sandboxes", body={"templateID": TEMPLATE, "timeout": 60})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        m0 = httpx.get(cube.api_metrics_url + "/metrics", timeout=10).text
        for _ in range(10):
            e = httpx.get(cube.sandbox_url + "/health", headers={"E2b-Sandbox-Id": sid}, timeout=10)
            assert e.status_code == 204
        # A file written and read back through the edge: its bytes cross both ways.
        # Random (a compressible body may come back gzipped, fewer bytes than written).
        body = os.urandom(1500)
        hdr = {"E2b-Sandbox-Id": sid, "Accept-Encoding": "identity"}
        if r.json().get("envdAccessToken"):
            hdr["X-Access-Token"] = r.json()["envdAccessToken"]
        w = httpx.post(cube.sandbox_url + "/files?path=/tmp/edge-bytes", content=body,
                       headers={**hdr, "Content-Type": "application/octet-stream"}, timeout=10)
        assert w.status_code == 200, w.text
        g = httpx.get(cube.sandbox_url + "/files?path=/tmp/edge-bytes", headers=hdr, timeout=10)
        assert g.status_code == 200 and g.content == body, g.text
        m1 = httpx.get(cube.api_metrics_url + "/metrics", timeout=10).text
        d = lambda name, **l: metric(m1, name, **l) - metric(m0, name, **l)  # noqa: E731
        # Ten requests within the TTL: at most a couple of master lookups, the rest cached.
        assert d("cube_edge_lookup_total", source="cache") >= 7
        assert d("cube_edge_lookup_total", source="master") <= 3
        assert d("cube_edge_requests_total", result="proxied") >= 10
        # Bytes are counted both ways (the file write sends a body, the read returns one).
        assert d("cube_edge_bytes_total", direction="to_sandbox") >= len(body)
        assert d("cube_edge_bytes_total", direction="from_sandbox") >= len(body)
    finally:
        assert call(cube, "DELETE", f"/sandboxes/{sid}").status_code == 204
    # Killed through the API: the edge forgets it at once (no stale address for the TTL).
    e = httpx.get(cube.sandbox_url + "/health", headers={"E2b-Sandbox-Id": sid}, timeout=10)
    assert e.status_code == 502 and e.json()["message"] == "The sandbox was not found", e.text
    m2 = httpx.get(cube.api_metrics_url + "/metrics", timeout=10).text
    assert metric(m2, "cube_edge_cache_invalidations_total") >= 1


@pytest.fixture(scope="module")
def limited_api(cube):
    """A second cube-api on the same master with tight per-key limits."""
    ap, ep, mp = reserve_port(), reserve_port(), reserve_port()
    cfg = os.path.join(cube.root, f"api-limited-{uuid.uuid4().hex[:6]}.toml")
    with open(cfg, "w") as f:
        f.write(f"""api_addr = "127.0.0.1:{ap}"
edge_addr = "127.0.0.1:{ep}"
master_url = "{cube.master_url}"
metrics_addr = "127.0.0.1:{mp}"
[rate_limit]
create_per_s = 0.5
create_burst = 2
other_per_s = 2.0
other_burst = 3
""")
    log = open(os.path.join(cube.root, "api-limited.log"), "w")
    p = subprocess.Popen([cube.api_bin, "--config", cfg], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: httpx.get(f"http://127.0.0.1:{ap}/health", timeout=1).status_code == 200,
              "limited cube-api", procs=[p])
        yield f"http://127.0.0.1:{ap}", f"http://127.0.0.1:{mp}"
    finally:
        p.terminate()
        p.wait(timeout=20)
        log.close()


def test_rate_limits(cube, limited_api):
    base, metrics_url = limited_api
    other_key = json.loads(subprocess.run(cube.cubectl + ["--json", "apikey", "create", "--name", "rl"],
                                          check=True, capture_output=True, text=True).stdout)["key"]
    # Other routes: a burst of 3, then 429 with Retry-After and the E2B error shape.
    for _ in range(3):
        assert call(cube, "GET", "/v2/sandboxes", base=base).status_code == 200
    r = call(cube, "GET", "/v2/sandboxes", base=base)
    b = assert_error(r, 429)
    assert "rate limit" in b["message"].lower()
    ra = int(r.headers["retry-after"])
    assert 1 <= ra <= 2
    # Per key: another key is not affected; unauthenticated requests are 401, not 429.
    assert call(cube, "GET", "/v2/sandboxes", base=base, key=other_key).status_code == 200
    assert_error(call(cube, "GET", "/v2/sandboxes", base=base, key="e2b_" + "9" * 40), 401)
    # Creates have their own bucket (burst 2): an unknown template costs a token but no sandbox.
    for _ in range(2):
        assert_error(call(cube, "POST", "/v2/sandboxes", base=base, key=other_key,
                          body={"templateID": "no-such-template"}), 404)
    r = call(cube, "POST", "/v2/sandboxes", base=base, key=other_key,
             body={"templateID": "no-such-template"})
    assert_error(r, 429)
    assert int(r.headers["retry-after"]) == 2
    # The other bucket of that key still has tokens.
    assert call(cube, "GET", "/v2/sandboxes", base=base, key=other_key).status_code == 200
    # Waiting Retry-After refills.
    time.sleep(ra)
    assert call(cube, "GET", "/v2/sandboxes", base=base).status_code == 200
    t = httpx.get(metrics_url + "/metrics", timeout=10).text
    assert metric(t, "cube_api_rate_limited_total", **{"class": "create"}) == 1
    assert metric(t, "cube_api_rate_limited_total", **{"class": "other"}) == 1
    assert metric(t, "cube_api_requests_total", route="/v2/sandboxes", status="429") == 2
