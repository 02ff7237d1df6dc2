"""A sandbox's history through the unmodified SDK (2.63): the metrics its node samples (every
SAMPLE_INTERVAL_MS here, 5 s by default), and its log (the node's lifecycle events and the
agent's process starts and exits), read through the SDK's own API client for
`/v2/sandboxes/{id}/logs` and `/sandboxes/{id}/logs`. Both outlive the sandbox."""

import datetime
import time

import pytest
from e2b import Sandbox
from e2b.api.client.api.sandboxes import (
    get_sandboxes_sandbox_id_logs,
    get_v_2_sandboxes_sandbox_id_logs,
)
from e2b.api.client.models import LogLevel, LogsDirection
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig
from e2b import CommandExitException

from conftest import SAMPLE_INTERVAL_MS, TEMPLATE
from test_sdk import api

INTERVAL = SAMPLE_INTERVAL_MS / 1000


def cmd_of(e):
    return e.fields.additional_properties.get("cmd", "")


def logs_v2(sandbox_id, **q):
    res = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(
        sandbox_id, client=get_api_client(ConnectionConfig()), **q)
    assert res.status_code == 200, (res.status_code, res.content)
    return res.parsed.logs


def logs_until(sandbox_id, what, pred, timeout=20):
    """The sandbox's log once some entry satisfies `pred` (the node pulls the agent's log on
    each read, so this is quick)."""
    def ready():
        entries = logs_v2(sandbox_id)
        return entries if any(pred(e) for e in entries) else None
    return wait_for(what, ready, timeout)


def wait_for(what, fn, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout} s")


def test_metrics_are_a_history_sampled_on_the_node_and_outlive_the_sandbox(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    sid = sbx.sandbox_id
    try:
        def four():
            m = sbx.get_metrics()
            return m if len(m) >= 4 else None
        ms = wait_for("4 samples", four)
        ts = [m.timestamp for m in ms]
        assert ts == sorted(ts) and len(set(ts)) == len(ts), ts
        # Taken by the node's sampler, about one interval apart (a burst of on-demand samples
        # would be closer together).
        gaps = [(b - a).total_seconds() for a, b in zip(ts, ts[1:])]
        assert max(gaps) >= INTERVAL * 0.5, gaps
        for m in ms:
            assert m.cpu_count == 2 and 0 < m.mem_used <= m.mem_total, m
        # A window (whole seconds, as the SDK sends them) selects part of the history.
        t_mid = ts[len(ts) // 2]
        later = sbx.get_metrics(start=t_mid.replace(microsecond=0))
        assert 0 < len(later) <= len(sbx.get_metrics())
        assert all(m.timestamp >= t_mid.replace(microsecond=0) for m in later)
        assert sbx.get_metrics(end=ts[0] - datetime.timedelta(seconds=2)) == []
        # Paused: the history stays and does not grow (nothing is sampled).
        assert sbx.pause() is True
        kept = Sandbox.get_metrics(sid)
        assert len(kept) >= len(ms)
        time.sleep(INTERVAL * 4)
        assert len(Sandbox.get_metrics(sid)) == len(kept), "sampled while paused"
        back = Sandbox.connect(sid, timeout=120)
        wait_for("a sample after the resume",
                 lambda: len(Sandbox.get_metrics(sid)) > len(kept))
        n = len(Sandbox.get_metrics(sid))
        back.kill()
        # Killed: the history is still there (the node keeps it for its retention).
        after = Sandbox.get_metrics(sid)
        assert len(after) >= n, (len(after), n)
    finally:
        Sandbox.kill(sid)


def test_logs_record_the_lifecycle_and_the_agents_processes(cube):
    # A secure sandbox: the node pulls its agent's log with the sandbox's access token.
    sbx = Sandbox.create(TEMPLATE, timeout=120, secure=True)
    sid = sbx.sandbox_id
    try:
        assert sbx.commands.run("echo logged-ok").stdout == "logged-ok\n"
        with pytest.raises(CommandExitException):
            sbx.commands.run("sh -c 'exit 3'")
        entries = logs_until(sid, "the exit of `exit 3`", lambda x: (
            x.message == "Process exited" and x.fields["exitCode"] == "3"))
        msgs = [e.message for e in entries]
        assert msgs[0] == "Sandbox created", msgs
        assert entries[0].fields["template"] == TEMPLATE
        started = [e for e in entries if e.message == "Process started"]
        assert any("echo logged-ok" in e.fields["cmd"] for e in started), started
        # What it wrote is there too, by stream, and search finds it.
        out = [e for e in entries if e.fields.additional_properties.get("stream") == "stdout"]
        assert any(e.message == "logged-ok\n" for e in out), out
        assert [e.message for e in logs_v2(sid, search="logged-ok")] == ["logged-ok\n"]
        assert all(e.fields["logger"] == "process" and int(e.fields["pid"]) > 1 for e in started)
        # Oldest first, and times that go forward.
        times = [e.timestamp for e in entries]
        assert times == sorted(times)
        # level=warn keeps the failed exit only; search is a case-sensitive substring.
        warn = logs_v2(sid, level=LogLevel.WARN)
        assert [(e.message, e.fields["exitCode"]) for e in warn] == [("Process exited", "3")]
        assert warn[0].level == LogLevel.WARN
        assert [e.message for e in logs_v2(sid, search="created")] == ["Sandbox created"]
        assert logs_v2(sid, search="CREATED") == []
        # Backward: newest first, from a cursor; forward from a cursor; a limit.
        newest = logs_v2(sid, direction=LogsDirection.BACKWARD, limit=2)
        assert [e.timestamp for e in newest] == sorted(times, reverse=True)[:2]
        cursor = int(entries[1].timestamp.timestamp() * 1000)
        fwd = logs_v2(sid, cursor=cursor)
        assert fwd and all(e.timestamp >= entries[1].timestamp.replace(microsecond=(
            entries[1].timestamp.microsecond // 1000) * 1000) for e in fwd)
        assert len(fwd) < len(entries) + 1
        back = logs_v2(sid, cursor=cursor, direction=LogsDirection.BACKWARD)
        assert back and back[0].timestamp <= entries[1].timestamp
        assert len(logs_v2(sid, limit=1)) == 1
        assert logs_v2(sid, limit=0) == []
        # v1: the same entries, each also as a JSON line.
        v1 = get_sandboxes_sandbox_id_logs.sync_detailed(
            sid, client=get_api_client(ConnectionConfig()))
        assert v1.status_code == 200
        assert [e.message for e in v1.parsed.log_entries][:len(msgs)] == msgs
        assert '"msg":"Sandbox created"' in v1.parsed.logs[0].line
        # Pause and resume are in the log; after the kill, the log is still there.
        assert sbx.pause() is True
        Sandbox.connect(sid, timeout=120)
        sbx.kill()
        final = [e.message for e in logs_v2(sid)]
        assert final[-3:] == ["Sandbox paused", "Sandbox resumed", "Sandbox killed"], final
    finally:
        Sandbox.kill(sid)


def test_a_restored_agent_does_not_carry_the_templates_log(cube):
    """Agents restored from one template remember what ran before the snapshot: a new sandbox's
    log starts at its own create."""
    a = Sandbox.create(TEMPLATE, timeout=60)
    b = Sandbox.create(TEMPLATE, timeout=60)
    try:
        a.commands.run("echo only-in-a")
        logs_until(a.sandbox_id, "a's process", lambda e: "only-in-a" in cmd_of(e))
        b.commands.run("true")
        entries = logs_until(b.sandbox_id, "b's process", lambda e: e.message == "Process exited")
        assert not any("only-in-a" in cmd_of(e) for e in entries), entries
        assert entries[0].message == "Sandbox created"
    finally:
        a.kill()
        b.kill()


@pytest.mark.parametrize("query,want", [
    ("direction=sideways", "direction"),
    ("level=loud", "level"),
    ("limit=1001", "limit"),
    ("limit=-1", "limit"),
    ("cursor=soon", "cursor"),
])
def test_bad_log_queries_get_a_clear_400(cube, query, want):
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        st, body, _ = api(cube, "GET", f"/v2/sandboxes/{sbx.sandbox_id}/logs?{query}")
        assert st == 400 and body["code"] == 400 and want in body["message"], body
    finally:
        sbx.kill()


def test_logs_of_unknown_sandboxes_are_404(cube):
    for path in ("/v2/sandboxes/nosuchsandbox0/logs", "/sandboxes/nosuchsandbox0/logs",
                 "/sandboxes/nosuchsandbox0/metrics"):
        st, body, _ = api(cube, "GET", path)
        assert st == 404 and body["code"] == 404, (path, body)
