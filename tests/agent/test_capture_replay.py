"""Replays every envd request the official SDKs sent in the captured sessions (the sandbox-edge
port of each capture, code-interpreter calls on 49999 excluded) against a real agent, raw over
HTTP, and checks each answer is one the SDK would accept: status, content type, Connect framing,
and the JSON decoded with the SDK's own codec and message classes."""

from __future__ import annotations

import gzip
import json
import os
import urllib.parse
from pathlib import Path

import pytest
from e2b.envd.client_shared import ENVD_JSON_CODEC
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.process import process_pb

from agentlib import Client, check_stream, envelope, parse_envelopes, post_init

# A copy of /work/shared/reference/e2b-captures lives beside this file so CI needs nothing else.
CAPTURES = Path(os.environ.get("CUBE_E2B_CAPTURES", Path(__file__).parent / "captures"))
LOGS = ["wire-py.log", "wire-2.45.1.log", "wire-2.20.0.log", "wire-js.log", "wire-js213.log"]
# Hop-by-hop and framing headers are rebuilt by our client; everything else is sent as captured.
DROP = {"host", "content-length", "transfer-encoding", "connection"}
# Connect error code -> HTTP status (Connect protocol spec), for unary errors.
CODE_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}
PB = {"process": process_pb, "filesystem": filesystem_pb}


def edge_requests(log: str) -> list[dict]:
    lines = [json.loads(line) for line in (CAPTURES / log).read_text().splitlines() if line.strip()]
    edge_port = min(d["port"] for d in lines) + 1  # 3000/3001, 3010/3011, ...
    out = []
    for d in lines:
        if d["port"] != edge_port:
            continue
        h = {k.lower(): v for k, v in d["headers"].items()}
        if h.get("e2b-sandbox-port") == "49999" or d["path"] in ("/execute", "/contexts"):
            continue  # code-interpreter traffic, not envd
        d["h"] = h
        out.append(d)
    return out


def build_body(d: dict) -> bytes | None:
    if "envelopes" in d:
        return b"".join(envelope(e["msg"], e["flags"]) for e in d["envelopes"])
    if "json" in d:
        return json.dumps(d["json"]).encode()
    if "raw" in d:
        raw = d["raw"]
        return raw.encode("latin-1") if all(ord(c) < 256 for c in raw) else raw.encode()
    return None


def multipart_parts(body: bytes, content_type: str) -> list[tuple[dict, bytes]]:
    boundary = content_type.split("boundary=", 1)[1].strip().strip('"').encode()
    parts = []
    for chunk in body.split(b"--" + boundary)[1:]:
        if chunk.startswith(b"--"):
            break
        head, _, data = chunk[2:].partition(b"\r\n\r\n")
        headers = dict(
            line.split(": ", 1) for line in head.decode().split("\r\n") if ": " in line
        )
        parts.append((headers, data[:-2]))
    return parts


def sdk_decode(rpc_path: str, data: bytes, kind: str):
    pkg, method = rpc_path.strip("/").split("/")
    module = PB[pkg.split(".")[0]]
    return ENVD_JSON_CODEC.decode(data, getattr(module, f"{method}{kind}"))


@pytest.fixture
def home_user_files():
    """The captures write /home/user/a.txt and b.bin: put back whatever was there."""
    saved = {}
    for p in (Path("/home/user/a.txt"), Path("/home/user/b.bin")):
        saved[p] = p.read_bytes() if p.exists() else None
    yield
    for p, content in saved.items():
        if content is None:
            p.unlink(missing_ok=True)
        else:
            p.write_bytes(content)


@pytest.mark.parametrize("log", LOGS)
def test_replay_capture(log, private_agent, home_user_files):
    reqs = edge_requests(log)
    assert reqs, f"no envd requests in {log}"
    token = next((d["h"]["x-access-token"] for d in reqs if "x-access-token" in d["h"]), None)
    assert token, "captures carry an envd access token"
    port = private_agent.port
    assert post_init(port, accessToken=token, defaultUser="user").status == 204

    client = Client(port)
    written: dict[str, bytes] = {}
    problems = []
    for i, d in enumerate(reqs):
        where = f"{log}#{i} {d['method']} {d['path']}"
        headers = {k: v for k, v in d["h"].items() if k not in DROP}
        body = build_body(d)
        query = urllib.parse.urlencode(d["query"], doseq=True, quote_via=urllib.parse.quote)
        url = d["path"] + (f"?{query}" if query else "")
        chunked = d["h"].get("transfer-encoding") == "chunked"
        r = client.request(d["method"], url, body, headers, chunked=chunked and body is not None)
        try:
            check_answer(d, body, r, written)
        except AssertionError as e:
            problems.append(f"{where}: {e}")
    client.close()
    assert not problems, "\n".join(problems)
    assert private_agent.alive()


def check_answer(d, body, r, written):
    path, method = d["path"], d["method"]
    if path == "/health":
        assert r.status == 204, f"status {r.status}"
        return
    if path == "/files" and method == "POST":
        assert r.status == 200, f"status {r.status} {r.body[:300]!r}"
        assert r.content_type == "application/json", r.headers
        entries = r.json()
        assert isinstance(entries, list) and entries, "expected a non-empty list"
        target = d["query"]["path"][0]
        for e in entries:
            assert {"path", "name", "type"} <= set(e), e
            assert e["type"] == "file", e
        assert entries[0]["path"] == target and entries[0]["name"] == os.path.basename(target), entries
        ctype = d["h"].get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            content = multipart_parts(body, ctype)[0][1]
        else:
            content = body
        assert Path(target).read_bytes() == content, "file content differs from the upload"
        written[target] = content
        return
    if path == "/files" and method == "GET":
        assert r.status == 200, f"status {r.status} {r.body[:300]!r}"
        data = r.body
        if (r.header("content-encoding") or "").lower() == "gzip":
            data = gzip.decompress(data)
        target = d["query"]["path"][0]
        assert data == written.get(target, Path(target).read_bytes()), data[:100]
        return
    assert path.startswith(("/process.", "/filesystem.")), f"unexpected capture route {path}"
    if "envelopes" in d:
        assert r.status == 200, f"status {r.status} {r.body[:300]!r}"
        assert r.content_type == "application/connect+json", r.headers
        msgs, end = check_stream(parse_envelopes(r.body))
        assert "error" not in end, end
        decoded = [sdk_decode(path, json.dumps(m).encode(), "Response") for m in msgs]
        if path == "/process.Process/Start":
            first = decoded[0].event.event
            assert first is not None and first.field == "start" and first.value.pid > 0, msgs[0]
            out = b""
            ends = []
            for m in decoded[1:]:
                ev = m.event.event
                if ev.field == "data" and ev.value.output.field == "stdout":
                    out += ev.value.output.value
                elif ev.field == "end":
                    ends.append(ev.value)
            assert len(ends) == 1, msgs
            assert ends[0].exit_code == 0 and ends[0].exited, msgs
            cmd = d["envelopes"][0]["msg"]["process"]["args"][-1]
            assert cmd.startswith("echo ")
            assert out == (cmd[5:] + "\n").encode(), out
        return
    # Unary Connect.
    if r.status == 200:
        assert r.content_type == "application/json", r.headers
        msg = sdk_decode(path, r.body, "Response")
        if path == "/filesystem.Filesystem/ListDir":
            names = {e.name for e in msg.entries}
            for w in written:
                if os.path.dirname(w) == d["json"]["path"]:
                    assert os.path.basename(w) in names, names
            for e in msg.entries:
                assert e.path == os.path.join(d["json"]["path"], e.name)
                assert e.type in (filesystem_pb.FileType.FILE, filesystem_pb.FileType.DIRECTORY, filesystem_pb.FileType.SYMLINK)
        if path == "/filesystem.Filesystem/Stat":
            raise AssertionError(f"Stat of {d['json']['path']} (absent) answered 200")
        return
    assert r.content_type == "application/json", r.headers
    err = r.json()
    assert err.get("code") in CODE_STATUS, err
    assert CODE_STATUS[err["code"]] == r.status, (r.status, err)
    if path == "/filesystem.Filesystem/Stat":
        assert err["code"] == "not_found" and r.status == 404, err
    else:
        raise AssertionError(f"unexpected error {r.status} {err}")
