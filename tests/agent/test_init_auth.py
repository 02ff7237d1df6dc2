"""POST /init (env vars, default user/workdir, access token, newer-wins) and what it enforces:
X-Access-Token on every non-exempt route, v1 URL signatures on /files. Each test uses its own agent
(these settings are agent-wide)."""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import urllib.error
import urllib.request
import uuid

import pytest
from e2b import AuthenticationException
from e2b.sandbox.signature import get_signature

from agentlib import Client, post_init, sdk_for

TOKEN = "tok-" + uuid.uuid4().hex


def http(url: str, data: bytes | None = None, headers: dict | None = None, method: str | None = None):
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_init_is_204_with_version(private_agent):
    r = post_init(private_agent.port, envVars={"A": "1"})
    assert r.status == 204, r.body
    v = r.header("x-envd-version")
    assert v and re.fullmatch(r"\d+\.\d+\.\d+", v), r.headers


def test_init_env_vars_reach_commands(private_agent, wd):
    port = private_agent.port
    assert post_init(port, envVars={"CUBE_INIT_A": "from-init", "CUBE_SHARED": "init"}).status == 204
    sbx = sdk_for(port)
    r = sbx.commands.run('printf "%s|%s" "$CUBE_INIT_A" "$CUBE_SHARED"', envs={"CUBE_SHARED": "req"})
    assert r.stdout == "from-init|req", "request envs override /init envs"
    envs = Client(port).request("GET", "/envs")
    assert envs.status == 200 and envs.content_type == "application/json"
    assert envs.json().get("CUBE_INIT_A") == "from-init"
    # A later /init replaces the set.
    assert post_init(port, envVars={"CUBE_INIT_B": "b"}).status == 204
    r = sbx.commands.run('printf "%s|%s" "${CUBE_INIT_A-unset}" "$CUBE_INIT_B"')
    assert r.stdout == "unset|b"
    # And PTYs see them too.
    assert Client(port).request("GET", "/envs").json().get("CUBE_INIT_B") == "b"


def test_init_default_user_and_workdir(private_agent, wd):
    port = private_agent.port
    assert post_init(port, defaultUser="root", defaultWorkdir=str(wd)).status == 204
    sbx = sdk_for(port)
    r = sbx.commands.run("id -un; pwd")
    assert r.stdout.split() == ["root", str(wd)]
    assert post_init(port, defaultUser="user").status == 204
    assert sbx.commands.run("id -un").stdout.strip() == "user"


def test_access_token_enforced(private_agent, wd):
    port = private_agent.port
    assert post_init(port, accessToken=TOKEN).status == 204

    anon = sdk_for(port)
    with pytest.raises(AuthenticationException):
        anon.commands.run("true")
    with pytest.raises(AuthenticationException):
        anon.files.list(str(wd))
    with pytest.raises(AuthenticationException):
        anon.files.write(str(wd / "x"), "x")
    with pytest.raises(AuthenticationException):
        anon.files.read("/etc/hostname")
    assert anon.is_running() is True, "/health is exempt from the token"
    assert not (wd / "x").exists()

    wrong = sdk_for(port, "wrong-" + TOKEN)
    with pytest.raises(AuthenticationException):
        wrong.commands.run("true")

    ok = sdk_for(port, TOKEN)
    assert ok.commands.run("echo authed").stdout == "authed\n"
    ok.files.write(str(wd / "t.txt"), "with token")
    assert ok.files.read(str(wd / "t.txt")) == "with token"
    assert ok.files.exists(str(wd / "t.txt"))

    c = Client(port)
    for method, path, body, hdrs in [
        ("GET", "/envs", None, {}),
        ("GET", "/metrics", None, {}),
        # The process log names every command run: as private as the processes themselves.
        ("GET", "/logs", None, {}),
        ("POST", "/process.Process/List", b"{}", {"Content-Type": "application/json"}),
        ("POST", "/filesystem.Filesystem/Stat", b'{"path":"/"}', {"Content-Type": "application/json"}),
        ("GET", "/files?path=/etc/hostname", None, {}),
    ]:
        r = c.request(method, path, body, hdrs)
        assert r.status == 401, (path, r.status, r.body)
        assert r.content_type == "application/json", (path, r.headers)
        j = r.json()
        assert j.get("code") in (401, "unauthenticated"), (path, j)
        assert j.get("message"), (path, j)
        r = c.request(method, path, body, {**hdrs, "X-Access-Token": TOKEN})
        assert r.status == 200, (path, r.status, r.body)
    assert c.request("GET", "/health").status == 204


def test_newer_init_wins(private_agent):
    port = private_agent.port
    now = datetime.datetime.now(datetime.timezone.utc)
    assert post_init(port, accessToken=TOKEN, timestamp=now.isoformat().replace("+00:00", "Z")).status == 204
    older = (now - datetime.timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
    # A stale /init (e.g. a delayed retry) must not replace the token.
    post_init(port, token=TOKEN, accessToken="stale-" + TOKEN, timestamp=older)
    assert sdk_for(port, TOKEN).commands.run("true").exit_code == 0
    with pytest.raises(AuthenticationException):
        sdk_for(port, "stale-" + TOKEN).commands.run("true")


def test_signed_download_and_upload_urls(private_agent, wd):
    port = private_agent.port
    assert post_init(port, accessToken=TOKEN).status == 204
    sbx = sdk_for(port, TOKEN)
    p = wd / "signed.txt"
    p.write_text("signed content")
    os.chmod(p, 0o644)

    url = sbx.download_url(str(p))
    assert "signature=v1_" in url
    assert http(url) == (200, b"signed content")

    url_exp = sbx.download_url(str(p), use_signature_expiration=120)
    assert "signature_expiration=" in url_exp
    assert http(url_exp) == (200, b"signed content")

    # Expired, tampered, wrong operation, other path: all refused.
    expired = get_signature(str(p), "read", None, TOKEN, -30)
    u = f"http://127.0.0.1:{port}/files?path={p}&signature={expired['signature']}&signature_expiration={expired['expiration']}"
    assert http(u)[0] == 401
    assert http(url.replace("signature=v1_", "signature=v1_A"))[0] == 401
    write_sig = get_signature(str(p), "write", None, TOKEN)["signature"]
    assert http(f"http://127.0.0.1:{port}/files?path={p}&signature={write_sig}")[0] == 401
    other = get_signature("/etc/shadow", "read", None, TOKEN)["signature"]
    assert http(f"http://127.0.0.1:{port}/files?path={p}&signature={other}")[0] == 401
    assert http(f"http://127.0.0.1:{port}/files?path={p}")[0] == 401

    # Signed for user root: the username is part of the signature.
    url_root = sbx.download_url(str(p), user="root")
    assert "username=root" in url_root
    assert http(url_root) == (200, b"signed content")

    # A URL signed for the default user stays that user: an Authorization header naming root
    # does not lift it to a root-only file.
    secret = wd / "root-only.txt"
    secret.write_text("root only")
    os.chown(secret, 0, 0)
    os.chmod(secret, 0o600)
    as_default = sbx.download_url(str(secret))
    basic_root = {"Authorization": "Basic " + base64.b64encode(b"root:").decode()}
    status, body = http(as_default, headers=basic_root)
    assert status != 200 and b"root only" not in body, (status, body)
    assert http(sbx.download_url(str(secret), user="root"), headers=basic_root) == (200, b"root only")

    # Upload through a signed URL, no token header.
    up = wd / "uploaded.txt"
    uurl = sbx.upload_url(str(up))
    boundary = "b" + uuid.uuid4().hex
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"uploaded.txt\"\r\n"
        f"Content-Type: application/octet-stream\r\n\r\nup!\r\n--{boundary}--\r\n"
    ).encode()
    status, resp = http(uurl, body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}, "POST")
    assert status == 200, resp
    assert json.loads(resp)[0]["path"] == str(up)
    assert up.read_text() == "up!"
    # A read signature does not allow writing.
    status, _ = http(url, body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}, "POST")
    assert status == 401


def test_unknown_basic_user_is_401(private_agent):
    c = Client(private_agent.port)
    r = c.request("GET", "/files?path=/etc/hostname&username=no-such-user-xyz")
    assert r.status == 401, (r.status, r.body)
    import base64

    r = c.unary(
        "process.Process/List",
        {},
        {"Authorization": "Basic " + base64.b64encode(b"no-such-user-xyz:").decode()},
    )
    assert r.status == 401 and r.json().get("code") == "unauthenticated", (r.status, r.body)


def test_init_bad_body(private_agent):
    c = Client(private_agent.port)
    r = c.request("POST", "/init", b"{not json", {"Content-Type": "application/json"})
    assert 400 <= r.status < 500, (r.status, r.body)
    r = c.request("POST", "/init", b'{"timestamp": 12, "envVars": "x"}', {"Content-Type": "application/json"})
    assert 400 <= r.status < 500, (r.status, r.body)
    assert c.request("GET", "/health").status == 204
