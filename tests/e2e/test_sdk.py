"""The official e2b SDK, unchanged, against Cube (cube-api + cube-master + cubelet)."""

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest
from e2b import Sandbox, SandboxQuery
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

from conftest import ENVD_FALLBACK, TEMPLATE


def api(cube, method, path, body=None, key=None, raw=None):
    """A raw REST call; returns (status, parsed JSON or None, headers)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(cube.api_url + path, data=data, method=method)
    req.add_header("X-API-KEY", key if key is not None else cube.api_key)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            txt = r.read()
            return r.status, (json.loads(txt) if txt else None), r.headers
    except urllib.error.HTTPError as e:
        txt = e.read()
        return e.code, (json.loads(txt) if txt else None), e.headers


def live_ids(cube):
    out = subprocess.run(cube.cubectl + ["--json", "sandbox", "list"], check=True,
                         capture_output=True, text=True).stdout
    return {s["id"] for s in json.loads(out)}


def test_create_run_files_list_info_kill(cube):
    tag = uuid.uuid4().hex[:8]
    sbx = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "e2e", "tag": tag},
                         envs={"CUBE_E2E": "yes"})
    try:
        assert sbx.sandbox_id.startswith("i") and sbx.sandbox_id.isalnum()
        r = sbx.commands.run("echo hi")
        assert r.exit_code == 0 and r.stdout == "hi\n"
        r = sbx.commands.run("echo $CUBE_E2E")
        assert r.stdout.strip() == "yes"
        sbx.files.write("/tmp/e2e.txt", "hello cube")
        assert sbx.files.read("/tmp/e2e.txt") == "hello cube"

        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id == TEMPLATE
        assert info.metadata == {"suite": "e2e", "tag": tag}
        assert info.envd_version == cube.envd_version != ENVD_FALLBACK
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121

        listed = Sandbox.list(query=SandboxQuery(metadata={"tag": tag})).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"tag": "nope" + tag})).next_items() == []
        assert sbx.sandbox_id in live_ids(cube)

        sbx.set_timeout(600)
        info2 = sbx.get_info()
        assert (info2.end_at - info.end_at).total_seconds() > 400
    finally:
        assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    assert sbx.sandbox_id not in live_ids(cube)
    # The edge answers E2B's "sandbox gone" for a killed sandbox.
    assert not sbx.is_running()


def test_expiry_kills_sandbox(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=2)
    assert sbx.commands.run("echo up").stdout == "up\n"
    deadline = time.time() + 20
    while time.time() < deadline and sbx.sandbox_id in live_ids(cube):
        time.sleep(0.25)
    assert sbx.sandbox_id not in live_ids(cube)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    assert not sbx.is_running()


def test_unknown_ids_404(cube):
    with pytest.raises(NotFoundException):
        Sandbox.get_info("inotthere0000000000000")
    assert Sandbox.kill("inotthere0000000000000") is False
    with pytest.raises(NotFoundException):
        Sandbox.set_timeout("inotthere0000000000000", 30)
    st, body, _ = api(cube, "GET", "/sandboxes/inotthere")
    assert st == 404 and body["code"] == 404 and "doesn't exist" in body["message"]


def test_wrong_key_401(cube):
    with pytest.raises(AuthenticationException):
        Sandbox.create(TEMPLATE, api_key="e2b_" + "0" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_" + "1" * 40).next_items()
    st, body, _ = api(cube, "GET", "/v2/sandboxes", key="")
    assert st == 401 and body == {"code": 401, "message": "Missing API key"}
    st, body, _ = api(cube, "GET", "/v2/sandboxes", key="not-a-key")
    assert st == 401 and body["code"] == 401


def test_revoked_key_401(cube):
    out = subprocess.run(cube.cubectl + ["--json", "apikey", "create", "--name", "tmp"], check=True,
                         capture_output=True, text=True).stdout
    k = json.loads(out)
    assert api(cube, "GET", "/v2/sandboxes", key=k["key"])[0] == 200
    subprocess.run(cube.cubectl + ["apikey", "revoke", k["id"]], check=True, capture_output=True)
    assert api(cube, "GET", "/v2/sandboxes", key=k["key"])[0] == 401
    listed = json.loads(subprocess.run(cube.cubectl + ["--json", "apikey", "list"], check=True,
                                       capture_output=True, text=True).stdout)
    row = [x for x in listed if x["id"] == k["id"]][0]
    assert row["revoked"] is True and k["key"] not in json.dumps(listed)


@pytest.mark.parametrize("body,status", [
    ({"templateID": TEMPLATE, "timeout": "60"}, 400),
    ({"templateID": TEMPLATE, "timeout": 0}, 400),
    ({"templateID": TEMPLATE, "timeout": -5}, 400),
    ({"templateID": TEMPLATE, "timeout": 10 ** 9}, 400),
    ({"templateID": 42}, 400),
    ({"templateID": TEMPLATE, "metadata": {"a": 1}}, 400),
    ({"templateID": TEMPLATE, "envVars": ["x"]}, 400),
    ({"timeout": 30}, 400),
    ({"templateID": "no-such-template"}, 404),
    ({"templateID": "Bad Name!"}, 400),
])
def test_bad_create_input(cube, body, status):
    before = live_ids(cube)
    st, resp, _ = api(cube, "POST", "/v2/sandboxes", body)
    assert st == status, resp
    assert resp["code"] == status and isinstance(resp["message"], str) and resp["message"]
    assert live_ids(cube) == before


def test_bad_json_and_sdk_errors(cube):
    st, resp, _ = api(cube, "POST", "/v2/sandboxes", raw=b"{nope")
    assert st == 400 and resp["code"] == 400
    with pytest.raises(SandboxException) as e:
        Sandbox.create("no-such-template")
    assert "404" in str(e.value)
    with pytest.raises(SandboxException) as e:
        Sandbox.create(TEMPLATE, timeout=10 ** 9)
    assert "400" in str(e.value)


def test_pause_conflict_and_connect(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        st, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/pause", {})
        assert st == 204, body
        st2, body, _ = api(cube, "POST", f"/sandboxes/{sbx.sandbox_id}/pause", {})
        assert st2 == 409 and body["code"] == 409
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        st3, body, _ = api(cube, "POST", f"/v2/sandboxes/{sbx.sandbox_id}/connect", {"timeout": 60})
        assert st3 == 201 and body["sandboxID"] == sbx.sandbox_id
        st4, body, _ = api(cube, "POST", f"/v2/sandboxes/{sbx.sandbox_id}/connect", {"timeout": 60})
        assert st4 == 200 and body["sandboxID"] == sbx.sandbox_id
        assert sbx.commands.run("echo back").stdout == "back\n"
    finally:
        sbx.kill()


def test_edge_routing_and_init_refused(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    try:
        def edge(path, headers, method="GET", data=None):
            req = urllib.request.Request(cube.sandbox_url + path, method=method, data=data,
                                         headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()

        tok = sbx._envd_access_token
        # by headers, by Host, by access token
        assert edge("/health", {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"})[0] == 204
        assert edge("/health", {"Host": f"49983-{sbx.sandbox_id}.cube.test"})[0] == 204
        assert edge("/health", {"X-Access-Token": tok})[0] == 204
        st, body = edge("/health", {"E2b-Sandbox-Id": "inope", "E2b-Sandbox-Port": "49983"})
        assert st == 502 and json.loads(body) == {"sandboxId": "inope",
                                                  "message": "The sandbox was not found",
                                                  "code": 502}
        st, _ = edge("/init", {"E2b-Sandbox-Id": sbx.sandbox_id, "Content-Type": "application/json"},
                     method="POST", data=b"{}")
        assert st == 403
        # The agent enforces the per-sandbox token: a wrong one is refused.
        st, _ = edge("/files?path=/tmp/x", {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "wrong"})
        assert st == 401
    finally:
        sbx.kill()


def test_list_paging_and_state_filter(cube):
    tag = uuid.uuid4().hex[:8]
    sbxs = [Sandbox.create(TEMPLATE, timeout=60, metadata={"page": tag}) for _ in range(3)]
    try:
        md = urllib.parse.quote(f"page={tag}")
        seen, token, pages = [], None, 0
        while True:
            q = f"/v2/sandboxes?metadata={md}&limit=2" + (f"&nextToken={token}" if token else "")
            st, body, headers = api(cube, "GET", q)
            assert st == 200
            seen += [s["sandboxID"] for s in body]
            pages += 1
            token = headers.get("x-next-token")
            if not token:
                break
        assert pages == 2 and sorted(seen) == sorted(s.sandbox_id for s in sbxs)
        # SDK paginator over the same filter.
        p = Sandbox.list(query=SandboxQuery(metadata={"page": tag}), limit=1)
        got = []
        while p.has_next:
            got += [s.sandbox_id for s in p.next_items()]
        assert sorted(got) == sorted(seen)
        st, body, _ = api(cube, "GET", f"/v2/sandboxes?metadata={md}&state=paused")
        assert st == 200 and body == []
        st, body, _ = api(cube, "GET", f"/sandboxes?metadata={md}")
        assert st == 200 and len(body) == 3
        assert body[0]["state"] == "running" and body[0]["metadata"] == {"page": tag}
        st, body, _ = api(cube, "GET", f"/v2/sandboxes?metadata={md}&template={TEMPLATE}")
        assert st == 200 and len(body) == 3
        st, body, _ = api(cube, "GET", f"/v2/sandboxes?metadata={md}&template=other")
        assert st == 200 and body == []
        st, body, _ = api(cube, "GET", "/v2/sandboxes?state=bogus")
        assert st == 400 and body["code"] == 400
    finally:
        for s in sbxs:
            s.kill()


def test_nodes_health(cube):
    nodes = json.loads(subprocess.run(cube.cubectl + ["--json", "nodes"], check=True,
                                      capture_output=True, text=True).stdout)
    by_addr = {n["address"]: n for n in nodes}
    assert by_addr[cube.dead_node]["status"] == "not_ready"
    ready = [n for n in nodes if n["status"] == "ready"]
    assert len(ready) == 1 and TEMPLATE in ready[0]["templates"]


def test_cubectl_kill(cube):
    sbx = Sandbox.create(TEMPLATE, timeout=60)
    assert sbx.sandbox_id in live_ids(cube)
    out = subprocess.run(cube.cubectl + ["--json", "sandbox", "kill", sbx.sandbox_id], check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out) == {"id": sbx.sandbox_id, "killed": True}
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    assert not sbx.is_running()
    # Killing again is not an error for the master, but cubectl says it did nothing.
    r = subprocess.run(cube.cubectl + ["sandbox", "kill", sbx.sandbox_id], capture_output=True, text=True)
    assert r.returncode != 0 and "no sandbox" in r.stderr
    killed = json.loads(subprocess.run(cube.cubectl + ["--json", "sandbox", "list", "--state", "killed"],
                                       check=True, capture_output=True, text=True).stdout)
    assert sbx.sandbox_id in {s["id"] for s in killed}


def test_v1_create_and_legacy_resume(cube):
    st, body, _ = api(cube, "POST", "/sandboxes", {"templateID": TEMPLATE, "timeout": 30, "secure": True,
                                                   "autoPause": False})
    assert st == 201, body
    sid = body["sandboxID"]
    try:
        assert body["templateID"] == TEMPLATE and body["envdVersion"] == cube.envd_version != ENVD_FALLBACK
        assert body["envdAccessToken"] and body["clientID"]
        st, detail, _ = api(cube, "GET", f"/sandboxes/{sid}")
        assert st == 200 and detail["envdAccessToken"] == body["envdAccessToken"]
        # Legacy resume of a running sandbox is a conflict.
        st, err, _ = api(cube, "POST", f"/sandboxes/{sid}/resume", {"timeout": 30})
        assert st == 409 and err["code"] == 409
        st, err, _ = api(cube, "POST", f"/sandboxes/{sid}/timeout", {"timeout": 0})
        assert st == 400 and err["message"] == "Timeout must be greater than 0"
    finally:
        assert api(cube, "DELETE", f"/sandboxes/{sid}")[0] == 204
    assert api(cube, "DELETE", f"/sandboxes/{sid}")[0] == 404
