"""Snapshots, fork and metrics with the official e2b SDK against a real single-host Cube
(namespace runtime: snapshots capture the filesystem, not memory or processes)."""

import json
import urllib.error
import urllib.request
import uuid

import pytest
from e2b import Sandbox
from e2b.exceptions import NotFoundException, SandboxException

from conftest import TEMPLATE

GONE = "inotthere0000000000000"


def api(cube, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(cube.api_url + path, data=data, method=method)
    req.add_header("X-API-KEY", cube.api_key)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            txt = r.read()
            return r.status, (json.loads(txt) if txt else None), r.headers
    except urllib.error.HTTPError as e:
        txt = e.read()
        return e.code, (json.loads(txt) if txt else None), e.headers


def kill_all(sbxs):
    for s in sbxs:
        try:
            s.kill()
        except Exception:
            pass


def test_snapshot_list_create_from_it_and_delete(cube):
    tag = uuid.uuid4().hex[:8]
    made = []
    snap_ids = []
    try:
        src = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "snap", "tag": tag})
        made.append(src)
        src.files.write("/home/user/before.txt", f"from {tag}")

        snap = src.create_snapshot()
        snap_ids.append(snap.snapshot_id)
        assert snap.snapshot_id.startswith("s") and len(snap.snapshot_id) == 20
        assert snap.names == [snap.snapshot_id]
        named = src.create_snapshot(name=f"named-{tag}")
        snap_ids.append(named.snapshot_id)
        assert named.names == [named.snapshot_id, f"named-{tag}"]
        # The source keeps running and can still be used.
        assert src.commands.run("echo alive").stdout == "alive\n"
        # Written after the snapshot: must not show up in sandboxes made from it.
        src.files.write("/home/user/after.txt", "later")

        listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()]
        assert set(listed) == {snap.snapshot_id, named.snapshot_id}
        assert listed[0] == named.snapshot_id, "newest first"
        by_name = Sandbox.list_snapshots(name=f"named-{tag}").next_items()
        assert [s.snapshot_id for s in by_name] == [named.snapshot_id]
        # Paging with the SDK's paginator (limit 1 → X-Next-Token).
        pager = src.list_snapshots(limit=1)
        first = pager.next_items()
        assert len(first) == 1 and pager.has_next
        second = pager.next_items()
        assert len(second) == 1 and second[0].snapshot_id != first[0].snapshot_id

        # A sandbox from the snapshot id, and one from its name: the file is there.
        for key in (snap.snapshot_id, f"named-{tag}"):
            child = Sandbox.create(key, timeout=60)
            made.append(child)
            assert child.files.read("/home/user/before.txt") == f"from {tag}"
            assert not child.files.exists("/home/user/after.txt")
            info = child.get_info()
            assert info.template_id == (snap.snapshot_id if key == snap.snapshot_id else named.snapshot_id)

        # In use → 409 (and the SDK raises); after the children are gone it deletes.
        st, body, _ = api(cube, "DELETE", f"/templates/{snap.snapshot_id}")
        assert st == 409 and body["code"] == 409 and "in use" in body["message"], body
        kill_all(made[1:])
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        snap_ids.remove(snap.snapshot_id)
        listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()]
        assert listed == [named.snapshot_id]
        # Creating from a deleted snapshot is a 404 like any unknown template.
        st, body, _ = api(cube, "POST", "/v2/sandboxes", {"templateID": snap.snapshot_id})
        assert st == 404 and body["code"] == 404, body
        # Snapshots outlive their source sandbox.
        src.kill()
        child = Sandbox.create(named.snapshot_id, timeout=60)
        made.append(child)
        assert child.files.read("/home/user/before.txt") == f"from {tag}"
    finally:
        kill_all(made)
        for s in snap_ids:
            try:
                Sandbox.delete_snapshot(s)
            except Exception:
                pass


def test_fork_two(cube):
    made = []
    snap_ids = []
    try:
        src = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "fork"})
        made.append(src)
        src.files.write("/home/user/fork.txt", "parent")
        forks = src.fork(count=2, timeout=90)
        assert len(forks) == 2
        for f in forks:
            assert isinstance(f, Sandbox), f
            made.append(f)
        ids = {f.sandbox_id for f in forks}
        assert len(ids) == 2 and src.sandbox_id not in ids
        for f in forks:
            assert f.files.read("/home/user/fork.txt") == "parent"
            # Forks are independent of each other and of the parent.
            f.files.write("/home/user/fork.txt", f.sandbox_id)
            info = f.get_info()
            assert info.metadata == {"suite": "fork"}
            assert 80 < (info.end_at - info.started_at).total_seconds() <= 91
        assert src.files.read("/home/user/fork.txt") == "parent"
        assert {f.files.read("/home/user/fork.txt") for f in forks} == ids
        snap_ids = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()]
        assert len(snap_ids) == 1, "one snapshot per fork call, whatever the count"
        # Bad counts are 400s and make nothing.
        for count in (0, 21, "2"):
            st, body, _ = api(cube, "POST", f"/sandboxes/{src.sandbox_id}/fork", {"count": count})
            assert st == 400 and body["code"] == 400, (count, body)
        again = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()]
        assert again == snap_ids
    finally:
        kill_all(made)
        for s in snap_ids:
            try:
                Sandbox.delete_snapshot(s)
            except Exception:
                pass


def test_metrics(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        sbx.commands.run("i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
        ms = sbx.get_metrics()
        assert len(ms) >= 1
        m = ms[-1]
        assert m.cpu_count == 2
        assert 0.0 <= m.cpu_used_pct <= 100.0
        assert 0 < m.mem_used <= m.mem_total
        assert m.mem_total <= 512 * 1024 * 1024
        assert 0 < m.disk_used < m.disk_total
        # Raw shape, and the many-sandbox form.
        st, body, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}/metrics")
        assert st == 200 and set(body[0]) >= {
            "timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal",
            "memCache", "diskUsed", "diskTotal"}
        st, body, _ = api(cube, "GET", f"/sandboxes/metrics?sandbox_ids={sbx.sandbox_id},{GONE}")
        assert st == 200 and list(body["sandboxes"]) == [sbx.sandbox_id], body
        st, body, _ = api(cube, "GET", "/sandboxes/metrics")
        assert st == 400 and body["code"] == 400
        st, body, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}/metrics?start=abc")
        assert st == 400 and body["code"] == 400
        # A window in the past has no samples.
        st, body, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}/metrics?start=1&end=2")
        assert st == 200 and body == []
        # Paused: the history taken while it ran (test_history.py checks it in detail).
        assert sbx.pause() is True
        assert len(Sandbox.get_metrics(sbx.sandbox_id)) >= len(ms)
    finally:
        sbx.kill()


def test_unknown_ids_404(cube):
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics(GONE)
    with pytest.raises(NotFoundException):
        Sandbox.create_snapshot(GONE)
    with pytest.raises(NotFoundException):
        Sandbox.fork(GONE, count=1)
    assert Sandbox.delete_snapshot("snotthere00000000000") is False
    assert Sandbox.list_snapshots(sandbox_id=GONE).next_items() == []
    with pytest.raises(SandboxException):
        Sandbox.create("snotthere00000000000")
    # A template (not a snapshot) cannot be deleted through the E2B API.
    st, body, _ = api(cube, "DELETE", f"/templates/{TEMPLATE}")
    assert st == 403 and body["code"] == 403, body
    st, body, _ = api(cube, "DELETE", "/templates/..%2Fetc")
    assert st == 404 and body["code"] == 404, body
    st, body, _ = api(cube, "GET", "/snapshots?limit=0")
    assert st == 400 and body["code"] == 400
    st, body, _ = api(cube, "GET", "/snapshots?nextToken=garbage")
    assert st == 400 and body["code"] == 400
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", {"name": "Not Valid!"})
        assert st == 400 and body["code"] == 400, body
        st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", {"name": 5})
        assert st == 400 and body["code"] == 400, body
        assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []
    finally:
        sbx.kill()
