"""E2B secrets (`/secrets`) with the unmodified SDK (2.63): create, list (paged), get by id or
name, update (a new version), delete, per team; values are write-only (never in a response)
and bad input is refused by name."""

import json
import subprocess
import uuid

import pytest
from e2b import Secret
from e2b.exceptions import SecretException, SecretNotFoundException

from test_sdk import api

VALUE = "s3cr3t-value-"


def _name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _no_value(resp, value):
    """No secret value anywhere in a (parsed) response."""
    assert value not in json.dumps(resp), resp


@pytest.fixture
def made(cube):
    """Secrets created by a test, destroyed after it."""
    ids = []
    yield ids
    for i in ids:
        try:
            Secret.destroy(i)
        except Exception:
            pass


def test_create_get_update_and_values_are_never_returned(cube, made):
    name = _name("api-key")
    value = VALUE + uuid.uuid4().hex
    info = Secret.create(name, value, metadata={"env": "prod"})
    made.append(info.secret_id)
    assert info.secret_id.startswith("sec_")
    assert info.name == name
    assert info.version == 1
    assert info.metadata == {"env": "prod"}
    assert info.created_at == info.updated_at
    assert info.created_at.tzinfo is not None

    # A name is unique in the team: 409.
    with pytest.raises(SecretException) as e:
        Secret.create(name, "other")
    assert str(e.value).startswith("409"), e.value
    assert not isinstance(e.value, SecretNotFoundException)

    # By id and by name.
    for ref in (info.secret_id, name):
        got = Secret.get_info(ref)
        assert (got.secret_id, got.name, got.version, got.metadata) == \
            (info.secret_id, name, 1, {"env": "prod"})
    assert Secret.exists(name) and Secret.exists(info.secret_id)

    # An update is the next version; metadata is replaced when given, kept when not.
    value2 = VALUE + uuid.uuid4().hex
    up = Secret.update(name, value2, metadata={"team": "ml"})
    assert (up.secret_id, up.version, up.metadata) == (info.secret_id, 2, {"team": "ml"})
    assert up.updated_at >= info.updated_at and up.created_at == info.created_at
    value3 = VALUE + uuid.uuid4().hex
    up = Secret.update(info.secret_id, value3)
    assert (up.version, up.metadata) == (3, {"team": "ml"})
    assert Secret.get_info(name).version == 3

    # No read (nor write) surface returns a value.
    for method, path, body in (
        ("GET", f"/secrets/{info.secret_id}", None),
        ("GET", f"/secrets/{name}", None),
        ("GET", "/secrets", None),
        ("POST", f"/secrets/{info.secret_id}", {"value": value}),
    ):
        status, resp, _ = api(cube, method, path, body)
        assert status == 200, (method, path, status, resp)
        for v in (value, value2, value3):
            _no_value(resp, v)
    status, resp, _ = api(cube, "POST", "/secrets", {"name": _name("raw"), "value": value})
    assert status == 201, resp
    made.append(resp["secretID"])
    assert set(resp) == {"secretID", "name", "currentVersion", "metadata", "createdAt",
                         "updatedAt"}
    assert resp["metadata"] == {} and resp["currentVersion"] == 1
    _no_value(resp, value)


def test_list_pages(cube, made):
    tag = uuid.uuid4().hex[:6]
    mine = []
    for i in range(3):
        s = Secret.create(f"page-{tag}-{i}", VALUE + str(i))
        made.append(s.secret_id)
        mine.append(s.secret_id)
    # Other tests' secrets may be there too: drain pages of two, in creation order.
    pager = Secret.list(limit=2)
    pages = []
    while pager.has_next:
        pages.append(pager.next_items())
    assert all(1 <= len(p) <= 2 for p in pages), pages
    assert len(pages) >= 2
    seen = [s.secret_id for p in pages for s in p]
    assert len(seen) == len(set(seen))
    assert [i for i in seen if i in mine] == mine
    # The raw list: x-next-token, and never a value.
    status, resp, headers = api(cube, "GET", "/secrets?limit=2")
    assert status == 200 and len(resp) == 2
    token = headers.get("x-next-token")
    assert token
    status, resp2, _ = api(cube, "GET", f"/secrets?limit=2&nextToken={token}")
    assert status == 200
    assert not {s["secretID"] for s in resp} & {s["secretID"] for s in resp2}
    for s in resp + resp2:
        assert "value" not in s
        _no_value(s, VALUE)
    for bad in ("0", "101", "x"):
        status, resp, _ = api(cube, "GET", f"/secrets?limit={bad}")
        assert status == 400 and "limit" in resp["message"], resp
    status, resp, _ = api(cube, "GET", "/secrets?nextToken=garbage")
    assert status == 400, resp


def test_delete_then_not_found(cube):
    name = _name("gone")
    info = Secret.create(name, VALUE)
    status, resp, _ = api(cube, "DELETE", f"/secrets/{info.secret_id}")
    assert status == 204, resp
    with pytest.raises(SecretNotFoundException):
        Secret.get_info(info.secret_id)
    with pytest.raises(SecretNotFoundException):
        Secret.get_info(name)
    with pytest.raises(SecretNotFoundException):
        Secret.update(name, "v")
    assert not Secret.exists(name)
    assert Secret.destroy(name) is False
    status, resp, _ = api(cube, "DELETE", f"/secrets/{info.secret_id}")
    assert status == 404 and resp["code"] == 404, resp
    # Destroy by name works as well, and frees the name.
    again = Secret.create(name, VALUE)
    assert again.secret_id != info.secret_id
    assert Secret.destroy(name) is True
    assert not Secret.exists(again.secret_id)


def test_another_team_sees_nothing(cube, made):
    info = Secret.create(_name("mine"), VALUE)
    made.append(info.secret_id)
    other = subprocess.run(
        cube.cubectl + ["apikey", "create", "--name", "e2e-other", "--team",
                        f"other-{uuid.uuid4().hex[:6]}"],
        check=True, capture_output=True, text=True).stdout.strip()
    for ref in (info.secret_id, info.name):
        with pytest.raises(SecretNotFoundException):
            Secret.get_info(ref, api_key=other)
        with pytest.raises(SecretNotFoundException):
            Secret.update(ref, "x", api_key=other)
        assert Secret.destroy(ref, api_key=other) is False
    assert Secret.list(api_key=other).next_items() == []
    # The same name in the other team is its own secret.
    theirs = Secret.create(info.name, VALUE, api_key=other)
    assert theirs.secret_id != info.secret_id
    assert Secret.get_info(info.name).secret_id == info.secret_id
    assert Secret.destroy(theirs.secret_id, api_key=other)
    assert Secret.get_info(info.secret_id).version == 1


BAD_CREATES = [
    ("empty-name", {"name": "", "value": "v"}, "name"),
    ("open-brace", {"name": "a{b", "value": "v"}, "name"),
    ("close-brace", {"name": "a}b", "value": "v"}, "name"),
    ("control-char", {"name": "a\nb", "value": "v"}, "name"),
    ("id-prefix", {"name": "sec_taken", "value": "v"}, "name"),
    ("long-name", {"name": "n" * 257, "value": "v"}, "name"),
    ("name-not-string", {"name": 7, "value": "v"}, "name"),
    ("no-name", {"value": "v"}, "name"),
    ("no-value", {"name": "ok-name"}, "value"),
    ("empty-value", {"name": "ok-name", "value": ""}, "value"),
    ("long-value", {"name": "ok-name", "value": "v" * (64 * 1024 + 1)}, "value"),
    ("metadata-not-string", {"name": "ok-name", "value": "v", "metadata": {"k": 1}},
     "metadata.k"),
    ("long-metadata-value", {"name": "ok-name", "value": "v", "metadata": {"k": "v" * 1025}},
     "metadata"),
    ("many-metadata", {"name": "ok-name", "value": "v",
                       "metadata": {f"k{i}": "v" for i in range(33)}}, "metadata"),
    ("unknown-field", {"name": "ok-name", "value": "v", "bogus": 1}, "bogus"),
]


@pytest.mark.parametrize("body,field", [pytest.param(b, f, id=i) for i, b, f in BAD_CREATES])
def test_bad_input_is_refused_by_name(cube, body, field):
    status, resp, _ = api(cube, "POST", "/secrets", body)
    assert status == 400, (body, status, resp)
    assert resp["code"] == 400 and field in resp["message"], resp
    assert "v" * 100 not in resp["message"]


def test_bad_update_is_refused_by_name(cube, made):
    info = Secret.create(_name("upd"), VALUE)
    made.append(info.secret_id)
    for body, field in (({}, "value"), ({"value": ""}, "value"),
                        ({"value": "v", "name": "x"}, "name"),
                        ({"value": "v", "metadata": "x"}, "metadata")):
        status, resp, _ = api(cube, "POST", f"/secrets/{info.secret_id}", body)
        assert status == 400 and field in resp["message"], (body, resp)
    status, resp, _ = api(cube, "POST", f"/secrets/{info.secret_id}", raw=b"not json")
    assert status == 400, resp
    assert Secret.get_info(info.secret_id).version == 1
