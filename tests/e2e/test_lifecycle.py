"""E2B lifecycle through the unmodified SDK (2.63): pause at the timeout instead of kill,
resume by traffic through the edge, refresh, idempotent creates, `startedAfter`, and options
Cube does not implement refused by name (never accepted and ignored)."""

import datetime
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import SandboxException, ServiceBusyException

from conftest import PROCESS_NAMES, TEMPLATE
from test_sdk import api, live_ids


def wait_state(sandbox_id, state, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if Sandbox.get_info(sandbox_id).state.value == state:
            return
        time.sleep(0.1)
    pytest.fail(f"{sandbox_id} did not become {state} in {timeout} s "
                f"(it is {Sandbox.get_info(sandbox_id).state.value})")


def edge_health(cube, sandbox_id):
    req = urllib.request.Request(cube.sandbox_url + "/health",
                                 headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_on_timeout_pause_keeps_the_sandbox_and_connect_resumes_it(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=3, lifecycle={"on_timeout": "pause"})
    try:
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": False}
        sbx.files.write("/tmp/kept.txt", "still here")
        pid = sbx.commands.run("sleep 900 >/dev/null 2>&1 & echo $!").stdout.strip()
        # At its timeout it is paused, not killed, and stays listed as paused.
        wait_state(sbx.sandbox_id, "paused", timeout=60)
        st, detail, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert st == 200 and detail["pauseMode"] == "full", detail
        assert detail["lifecycle"] == {"autoResume": False, "onTimeout": "pause"}
        # Its timeout no longer runs: it is kept for the paused retention (days, not seconds).
        end = datetime.datetime.fromisoformat(detail["endAt"].replace("Z", "+00:00"))
        assert end > datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
        paused = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()]
        assert sbx.sandbox_id in paused
        # Without autoResume, traffic does not wake it.
        assert edge_health(cube, sbx.sandbox_id) == 502
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        back = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert back.files.read("/tmp/kept.txt") == "still here"
        assert back.commands.run(f"kill -0 {pid} && echo alive").stdout == "alive\n"
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
    finally:
        sbx.kill()


def test_auto_resume_serves_the_request_that_finds_it_paused(cube):
    resumes0 = metric(cube.api_metrics_url, "cube_edge_auto_resumes_total")
    sbx = Sandbox.create(TEMPLATE, timeout=3,
                         lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert Sandbox.get_info(sbx.sandbox_id).lifecycle == {"on_timeout": "pause",
                                                             "auto_resume": True}
        sbx.files.write("/tmp/a.txt", "before the pause")
        wait_state(sbx.sandbox_id, "paused", timeout=60)
        # The SDK's next call goes through the edge: it is served, not failed.
        t0 = time.monotonic()
        assert sbx.files.read("/tmp/a.txt") == "before the pause"
        print(f"first request to the auto-paused sandbox: {(time.monotonic() - t0) * 1000:.1f} ms")
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
        # Resumed by traffic, it got its own create timeout (3 s) again, not a default.
        _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        end = datetime.datetime.fromisoformat(d["endAt"].replace("Z", "+00:00"))
        assert end < datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=4)
        sbx.set_timeout(120)
        assert sbx.commands.run("echo awake").stdout == "awake\n"
        assert metric(cube.api_metrics_url, "cube_edge_auto_resumes_total") == resumes0 + 1
        # Paused again at its (new) timeout.
        sbx.set_timeout(1)
        wait_state(sbx.sandbox_id, "paused", timeout=60)
        # Many requests at once find it paused: every one is served, it is resumed once.
        results = []

        def health():
            results.append(edge_health(cube, sbx.sandbox_id))

        threads = [threading.Thread(target=health) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [204] * 6, results
        assert metric(cube.api_metrics_url, "cube_edge_auto_resumes_total") == resumes0 + 2
    finally:
        sbx.kill()


def test_refresh_extends_and_never_shortens(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        def end():
            _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
            return datetime.datetime.fromisoformat(d["endAt"].replace("Z", "+00:00"))

        e0 = end()
        st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/refreshes", {"duration": 5})
        assert st == 204, body
        assert end() == e0
        st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/refreshes", {"duration": 3600})
        assert st == 204, body
        assert end() > e0 + datetime.timedelta(minutes=50)
        for bad in ({"duration": 3601}, {"duration": -1}, {"duration": "x"}, {"duration": 5, "x": 1}):
            st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/refreshes", bad)
            assert st == 400 and body["code"] == 400, (bad, body)
        st, _, _ = api(cube, "POST", "/sandboxes/inotthere000/refreshes", {"duration": 5})
        assert st == 404
    finally:
        sbx.kill()


def test_idempotency_key_makes_one_sandbox(cube):
    key = "k-" + uuid.uuid4().hex
    tag = uuid.uuid4().hex[:8]
    ids = []

    def create():
        ids.append(Sandbox.create(TEMPLATE, timeout=60, metadata={"idem": tag},
                                  idempotency_key=key).sandbox_id)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(ids) == 4 and len(set(ids)) == 1, ids
        listed = Sandbox.list(query=SandboxQuery(metadata={"idem": tag})).next_items()
        assert [s.sandbox_id for s in listed] == ids[:1]
        # A later retry with the key: the same sandbox. The key with another request: 409.
        assert Sandbox.create(TEMPLATE, timeout=60, metadata={"idem": tag},
                              idempotency_key=key).sandbox_id == ids[0]
        with pytest.raises(SandboxException) as e:
            Sandbox.create(TEMPLATE, timeout=61, metadata={"idem": tag}, idempotency_key=key)
        assert "409" in str(e.value)
    finally:
        Sandbox.kill(ids[0])


def test_started_after_filters_the_listing(cube):
    tag = uuid.uuid4().hex[:8]
    a = Sandbox.create(TEMPLATE, timeout=60, metadata={"sa": tag})
    try:
        time.sleep(0.05)
        cut = datetime.datetime.now(datetime.timezone.utc)
        time.sleep(0.05)
        b = Sandbox.create(TEMPLATE, timeout=60, metadata={"sa": tag})
        try:
            got = Sandbox.list(query=SandboxQuery(metadata={"sa": tag}, started_after=cut)).next_items()
            assert [s.sandbox_id for s in got] == [b.sandbox_id]
            every = Sandbox.list(query=SandboxQuery(metadata={"sa": tag})).next_items()
            assert sorted(s.sandbox_id for s in every) == sorted([a.sandbox_id, b.sandbox_id])
            st, body, _ = api(cube, "GET", "/v2/sandboxes?startedAfter=yesterday")
            assert st == 400 and "startedAfter" in body["message"]
            st, body, _ = api(cube, "GET", "/v2/sandboxes?frobnicate=1")
            assert st == 400 and "frobnicate" in body["message"]
        finally:
            b.kill()
    finally:
        a.kill()


@pytest.mark.parametrize("opts,named", [
    ({"network": {"egress_proxy": {"address": "127.0.0.1:1080"}}}, "network.egressProxy"),
    ({"network": {"https_ports": [8443]}}, "network.httpsPorts"),
    ({"mcp": {"github": {"githubPersonalAccessToken": "x"}}}, "mcp"),
], ids=["egressProxy", "httpsPorts", "mcp"])
def test_options_cube_does_not_implement_are_refused_by_name(cube, opts, named):
    before = live_ids(cube)
    with pytest.raises(SandboxException) as e:
        Sandbox.create(TEMPLATE, timeout=60, **opts)
    assert "400" in str(e.value) and named in str(e.value), str(e.value)
    assert live_ids(cube) == before


def test_unknown_and_unimplemented_request_fields_are_refused(cube):
    before = live_ids(cube)
    st, body, _ = api(cube, "POST", "/v2/sandboxes", {"templateID": TEMPLATE, "frobnicate": 1})
    assert st == 400 and "frobnicate" in body["message"], body
    st, body, _ = api(cube, "POST", "/v2/sandboxes", {"templateID": TEMPLATE,
                                                      "volumeMounts": [{"name": "v", "path": "/v"}]})
    assert st == 400 and "volumeMounts" in body["message"], body
    assert live_ids(cube) == before
    sbx = Sandbox.create(TEMPLATE, timeout=60, allow_internet_access=False)
    try:
        _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert d["allowInternetAccess"] is False
        assert d["lifecycle"] == {"autoResume": False, "onTimeout": "kill"}
        st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/pause", {"x": 1})
        assert st == 400 and "x" in body["message"]
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
        st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/pause", {"memory": "no"})
        assert st == 400 and "memory" in body["message"], body
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
        st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/timeout", {"timeout": 60, "y": 2})
        assert st == 400 and "y" in body["message"]
    finally:
        sbx.kill()


def freezer_of(cube, sandbox_id):
    """(control file, frozen, thawed) of the sandbox's freezer cgroup on the host: freezing it
    makes its agent stop answering without the sandbox knowing."""
    with open(os.path.join(cube.root, "data", "sandboxes", sandbox_id, "state.json")) as f:
        key = json.load(f)["body"]["key"]
    parent = "cube-" + os.path.basename(cube.root)[len("cube-e2e-"):]
    v1 = f"/sys/fs/cgroup/freezer/{parent}/{key}/freezer.state"
    if os.path.exists(v1):
        return v1, "FROZEN", "THAWED"
    return f"/sys/fs/cgroup/{parent}/{key}/cgroup.freeze", "1", "0"


def test_strict_pause_is_refused_while_the_agent_does_not_answer(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    ctl, frozen, thawed = freezer_of(cube, sbx.sandbox_id)
    try:
        sbx.files.write("/tmp/strict.txt", "kept")
        with open(ctl, "w") as f:
            f.write(frozen)
        # requireHealthyGuest: 503 (the SDK's ServiceBusyException), and it keeps running.
        with pytest.raises(ServiceBusyException) as e:
            sbx.pause(strict=True)
        assert "does not answer" in str(e.value), str(e.value)
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
        with open(ctl, "w") as f:
            f.write(thawed)
        assert sbx.pause(strict=True) is True
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        back = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert back.files.read("/tmp/strict.txt") == "kept"
        st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/pause",
                          {"requireHealthyGuest": "yes"})
        assert st == 400 and "requireHealthyGuest" in body["message"], body
    finally:
        try:
            with open(ctl, "w") as f:
                f.write(thawed)
        except OSError:
            pass
        sbx.kill()


def test_v2_fork_route(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        sbx.files.write("/home/user/f.txt", "forked")
        st, body, _ = api(cube, "POST", f"/v2/sandboxes/{sbx.sandbox_id}/fork", {"count": 1, "timeout": 60})
        assert st == 201 and len(body) == 1 and "sandbox" in body[0], body
        child = body[0]["sandbox"]["sandboxID"]
        try:
            c = Sandbox.connect(child, timeout=60)
            assert c.files.read("/home/user/f.txt") == "forked"
        finally:
            Sandbox.kill(child)
        st, body, _ = api(cube, "POST", f"/v2/sandboxes/{sbx.sandbox_id}/fork", {"count": 1, "z": 1})
        assert st == 400 and "z" in body["message"]
    finally:
        sbx.kill()


def sleeping(sbx):
    """Whether a `sleep` runs in the sandbox (by name: pids start again in a restarted one)."""
    return "sleep" in sbx.commands.run(PROCESS_NAMES).stdout.split()


def test_a_filesystem_only_pause_restarts_the_sandbox_from_its_disk(cube):
    """`pause(mode="filesystem")` (E2B's memory: false): the sandbox's processes end and only
    its disk is kept; it is reported so, traffic does not restart it, and `connect` starts it
    afresh: its files are there, its processes and what only memory held (/tmp) are not, and
    it is initialised as at its create (env vars, the SDK's access token)."""
    sbx = Sandbox.create(TEMPLATE, timeout=300, envs={"CUBE_WHO": "kept"},
                         lifecycle={"on_timeout": "pause"})
    try:
        sbx.files.write("/home/user/on-disk.txt", "kept")
        sbx.commands.run("echo only-in-memory > /tmp/mem.txt")
        sbx.commands.run("sleep 900", background=True)
        assert sleeping(sbx)
        assert sbx.pause(mode="filesystem") is True
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        st, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert st == 200 and d["pauseMode"] == "filesystem", d
        # Traffic through the edge does not restart it.
        assert edge_health(cube, sbx.sandbox_id) == 502
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        back = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
        assert back.files.read("/home/user/on-disk.txt") == "kept"
        r = back.commands.run("cat /tmp/mem.txt 2>/dev/null || echo no-tmp; echo $CUBE_WHO")
        assert r.stdout == "no-tmp\nkept\n", r.stdout
        assert not sleeping(back)
        _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert "pauseMode" not in d, d
    finally:
        sbx.kill()


def test_connect_with_a_reboot_drops_a_full_pause_s_memory(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=300)
    try:
        sbx.files.write("/home/user/on-disk.txt", "kept")
        sbx.commands.run("sleep 900", background=True)
        assert sleeping(sbx)
        sbx.pause()
        _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert d["pauseMode"] == "full", d
        back = Sandbox.connect(sbx.sandbox_id, timeout=120, on_resume="reboot")
        assert back.files.read("/home/user/on-disk.txt") == "kept"
        assert not sleeping(back)
        # On a running sandbox a reboot changes nothing.
        back.commands.run("sleep 900", background=True)
        again = Sandbox.connect(sbx.sandbox_id, timeout=120, on_resume="reboot")
        assert sleeping(again)
    finally:
        sbx.kill()


def test_auto_pause_without_memory_at_the_timeout(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=3,
                         lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        sbx.files.write("/home/user/on-disk.txt", "kept")
        sbx.commands.run("sleep 900", background=True)
        assert sleeping(sbx)
        wait_state(sbx.sandbox_id, "paused", timeout=60)
        _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert d["pauseMode"] == "filesystem", d
        back = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert back.files.read("/home/user/on-disk.txt") == "kept"
        assert not sleeping(back)
    finally:
        sbx.kill()
    # Not with autoResume: traffic would have to restart it.
    st, body, _ = api(cube, "POST", "/sandboxes", {"templateID": TEMPLATE, "timeout": 60,
                                                   "autoPause": True, "autoPauseMemory": False,
                                                   "autoResume": {"enabled": True}})
    assert st == 400 and "autoPauseMemory" in body["message"], body
