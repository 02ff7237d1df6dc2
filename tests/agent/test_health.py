"""Liveness and the small HTTP routes: /health, /envs, /metrics, CORS, unknown routes."""

from __future__ import annotations

import os


def test_is_running(sbx):
    assert sbx.is_running() is True


def test_health_204(raw):
    r = raw.request("GET", "/health")
    assert r.status == 204
    assert r.body == b""


def test_health_keepalive_reuse(raw):
    # Many requests over one HTTP/1.1 connection, as the SDK's pool does.
    for _ in range(50):
        assert raw.request("GET", "/health").status == 204


def test_envs_is_a_json_object(raw):
    r = raw.request("GET", "/envs")
    assert r.status == 200
    assert r.content_type == "application/json"
    assert isinstance(r.json(), dict)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in r.json().items())


def test_metrics_fields(raw):
    r = raw.request("GET", "/metrics")
    assert r.status == 200
    assert r.content_type == "application/json"
    m = r.json()
    for k in (
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    ):
        assert k in m, (k, m)
    assert m["cpu_count"] == os.cpu_count()
    assert 0 < m["mem_used"] <= m["mem_total"]
    assert abs(m["mem_total_mib"] - m["mem_total"] / 1048576) <= 1
    assert 0 <= m["cpu_used_pct"] <= 100
    assert 0 < m["disk_used"] <= m["disk_total"]


def test_unknown_route_404(raw):
    assert raw.request("GET", "/no-such-route").status == 404
    assert raw.request("GET", "/health").status == 204


def test_cors_allows_all(raw):
    r = raw.request(
        "OPTIONS",
        "/process.Process/Start",
        headers={
            "Origin": "https://example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,connect-protocol-version,x-access-token",
        },
    )
    assert r.status in (200, 204), (r.status, r.body)
    assert r.header("access-control-allow-origin") in ("*", "https://example.com"), r.headers
    r = raw.request("GET", "/health", headers={"Origin": "https://example.com"})
    assert r.header("access-control-allow-origin") in ("*", "https://example.com"), r.headers


def test_logs_journal_of_process_starts_and_exits(sbx, raw):
    """Cube's `GET /logs?after=N` (the node pulls it for the sandbox's log): each process start
    with its command line, each exit with its code, in seq order; `next` resumes."""
    first = raw.request("GET", "/logs?after=0&limit=1000").json()
    start = first["next"]
    try:
        sbx.commands.run("sh -c 'exit 5'")
    except Exception:
        pass
    page = raw.request("GET", f"/logs?after={start}").json()
    mine = page["entries"]
    assert [e["message"] for e in mine] == ["Process started", "Process exited"], mine
    assert "exit 5" in mine[0]["fields"]["cmd"] and mine[0]["fields"]["logger"] == "process"
    assert mine[1]["fields"]["exitCode"] == "5" and mine[1]["level"] == "warn"
    assert mine[0]["fields"]["pid"] == mine[1]["fields"]["pid"]
    assert [e["seq"] for e in mine] == list(range(start, start + 2))
    assert page["next"] == start + 2
    assert raw.request("GET", f"/logs?after={page['next']}").json()["entries"] == []
    assert raw.request("GET", "/logs?after=-1").status == 400
    assert raw.request("GET", "/logs?limit=x").status == 400


def test_logs_journal_has_stdout_and_stderr_bounded_per_process(sbx, raw):
    """What a process writes is in the log (E2B's sandbox logs carry it), each chunk as a
    searchable message with its stream; a chatty process gets 64 chunks and one entry saying
    the rest is not recorded, so it cannot push the other events out of the agent's ring."""
    start = raw.request("GET", "/logs?after=0&limit=1000").json()["next"]
    sbx.commands.run("echo to-out; echo to-err >&2")
    mine = raw.request("GET", f"/logs?after={start}&limit=1000").json()["entries"]
    out = [(e["message"], e["fields"]["stream"]) for e in mine if "stream" in e["fields"]]
    assert ("to-out\n", "stdout") in out and ("to-err\n", "stderr") in out, mine
    assert [e["message"] for e in mine][0] == "Process started"
    assert [e["message"] for e in mine][-1] == "Process exited"
    start = raw.request("GET", "/logs?after=0&limit=1000").json()["next"]
    sbx.commands.run("for i in $(seq 200); do echo line $i; sleep 0.01; done")
    mine = raw.request("GET", f"/logs?after={start}&limit=1000").json()["entries"]
    chunks = [e for e in mine if "stream" in e["fields"]]
    assert len(chunks) == 65, len(chunks)
    assert chunks[-1]["message"].startswith("Further output of process"), chunks[-1]
    assert mine[-1]["message"] == "Process exited"
