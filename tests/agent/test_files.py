"""sbx.files.* (envd /files HTTP routes and filesystem.Filesystem RPCs) through the real SDK."""

from __future__ import annotations

import datetime
import io
import os
import pwd
import stat
import urllib.request
import uuid

import pytest
from e2b import FileType, InvalidArgumentException, NotFoundException, SandboxException
from e2b.exceptions import FileNotFoundException

from agentlib import give

ALL_BYTES = bytes(range(256)) * 64


def owner(p) -> str:
    return pwd.getpwuid(os.stat(p).st_uid).pw_name


def test_write_read_text(sbx, wd, test_user):
    p = wd / "a.txt"
    info = sbx.files.write(str(p), "hello \u00e9\n")
    assert info.path == str(p)
    assert info.name == "a.txt"
    assert info.type == FileType.FILE
    assert p.read_bytes() == "hello \u00e9\n".encode()
    assert owner(p) == test_user, "files written without user= belong to the default user"
    assert sbx.files.read(str(p)) == "hello \u00e9\n"


def test_overwrite_truncates(sbx, wd):
    p = wd / "o.txt"
    sbx.files.write(str(p), "a much longer first version")
    sbx.files.write(str(p), "short")
    assert sbx.files.read(str(p)) == "short"


def test_write_read_bytes(sbx, wd):
    p = wd / "b.bin"
    sbx.files.write(str(p), ALL_BYTES)
    assert p.read_bytes() == ALL_BYTES
    assert bytes(sbx.files.read(str(p), format="bytes")) == ALL_BYTES


def test_empty_file(sbx, wd):
    p = wd / "empty"
    sbx.files.write(str(p), b"")
    assert p.exists() and p.stat().st_size == 0
    assert sbx.files.read(str(p)) == ""


def test_read_stream(sbx, wd):
    p = wd / "big.bin"
    data = os.urandom(2 * 1024 * 1024 + 17)
    p.write_bytes(data)
    os.chmod(p, 0o644)
    got = b"".join(sbx.files.read(str(p), format="stream"))
    assert got == data


def test_write_stream_from_file_object_and_iterable(sbx, wd):
    # File-like objects and iterables go as application/octet-stream, streamed.
    data = os.urandom(1024 * 1024 + 3)
    p1 = wd / "from-io.bin"
    sbx.files.write(str(p1), io.BytesIO(data))
    assert p1.read_bytes() == data
    p2 = wd / "from-iter.bin"
    sbx.files.write(str(p2), (data[i : i + 65536] for i in range(0, len(data), 65536)))
    assert p2.read_bytes() == data


def test_octet_stream_explicit(sbx, wd):
    p = wd / "oct.txt"
    info = sbx.files.write(str(p), "via octet", use_octet_stream=True)
    assert info.path == str(p)
    assert p.read_text() == "via octet"


def test_gzip_upload_and_download(sbx, wd):
    p = wd / "gz.txt"
    text = "compress me " * 1000
    sbx.files.write(str(p), text, gzip=True)
    assert p.read_text() == text
    assert sbx.files.read(str(p), gzip=True) == text


def test_write_creates_parent_dirs(sbx, wd, test_user):
    p = wd / "x" / "y" / "z.txt"
    sbx.files.write(str(p), "deep")
    assert p.read_text() == "deep"
    assert owner(wd / "x") == test_user


def test_write_files_several(sbx, wd):
    entries = [
        {"path": str(wd / "m1.txt"), "data": "one"},
        {"path": str(wd / "sub" / "m2.bin"), "data": b"\x00two"},
        {"path": str(wd / "m3.txt"), "data": "three"},
    ]
    infos = sbx.files.write_files(entries)
    assert sorted(i.path for i in infos) == sorted(e["path"] for e in entries)
    assert (wd / "m1.txt").read_text() == "one"
    assert (wd / "sub" / "m2.bin").read_bytes() == b"\x00two"
    assert (wd / "m3.txt").read_text() == "three"


def test_relative_path_is_under_home(sbx, test_user):
    name = f"rel-{uuid.uuid4().hex[:8]}.txt"
    home = pwd.getpwnam(test_user).pw_dir
    try:
        info = sbx.files.write(name, "rel")
        assert info.path == os.path.join(home, name)
        assert open(os.path.join(home, name)).read() == "rel"
        assert sbx.files.read(name) == "rel"
        assert sbx.files.read("~/" + name) == "rel"
    finally:
        try:
            os.unlink(os.path.join(home, name))
        except FileNotFoundError:
            pass


def test_write_as_root(sbx, wd):
    p = wd / "root.txt"
    sbx.files.write(str(p), "r", user="root")
    assert os.stat(p).st_uid == 0


def test_read_missing(sbx, wd):
    with pytest.raises(FileNotFoundException):
        sbx.files.read(str(wd / "nope"))


def test_read_directory_is_invalid(sbx, wd):
    with pytest.raises(InvalidArgumentException):
        sbx.files.read(str(wd))


def test_user_cannot_read_or_overwrite_root_file(sbx, wd):
    p = wd / "secret"
    p.write_text("s3cret")
    os.chown(p, 0, 0)
    p.chmod(0o600)
    with pytest.raises(Exception) as ei:
        sbx.files.read(str(p))
    assert "s3cret" not in str(ei.value)
    with pytest.raises(Exception):
        sbx.files.write(str(p), "pwned")
    assert p.read_text() == "s3cret"
    # The same via a symlink the user controls.
    link = wd / "link"
    os.symlink(p, link)
    os.lchown(link, pwd.getpwnam("user").pw_uid, pwd.getpwnam("user").pw_gid)
    with pytest.raises(Exception):
        sbx.files.read(str(link))
    assert sbx.files.read(str(p), user="root") == "s3cret"


def test_list_depth(sbx, wd):
    (wd / "d1" / "d2" / "d3").mkdir(parents=True)
    (wd / "f0").write_text("0")
    (wd / "d1" / "f1").write_text("1")
    (wd / "d1" / "d2" / "f2").write_text("2")
    one = {e.path: e for e in sbx.files.list(str(wd))}
    assert set(one) == {str(wd / "d1"), str(wd / "f0")}
    assert one[str(wd / "d1")].type == FileType.DIR
    assert one[str(wd / "f0")].type == FileType.FILE
    assert one[str(wd / "f0")].name == "f0"
    assert one[str(wd / "f0")].size == 1
    two = {e.path for e in sbx.files.list(str(wd), depth=2)}
    assert two == {str(wd / "d1"), str(wd / "f0"), str(wd / "d1" / "f1"), str(wd / "d1" / "d2")}
    three = {e.path for e in sbx.files.list(str(wd), depth=3)}
    assert str(wd / "d1" / "d2" / "f2") in three and str(wd / "d1" / "d2" / "d3") in three
    assert str(wd / "d1" / "d2" / "d3" / "x") not in three
    with pytest.raises(InvalidArgumentException):
        sbx.files.list(str(wd), depth=0)


def test_list_missing_and_not_a_dir(sbx, wd):
    with pytest.raises(FileNotFoundException):
        sbx.files.list(str(wd / "missing"))
    (wd / "file").write_text("x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.list(str(wd / "file"))


def test_exists(sbx, wd):
    (wd / "here").write_text("x")
    assert sbx.files.exists(str(wd / "here")) is True
    assert sbx.files.exists(str(wd)) is True
    assert sbx.files.exists(str(wd / "not-here")) is False


def test_get_info_file(sbx, wd, test_user):
    p = wd / "info.txt"
    before = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=5)
    sbx.files.write(str(p), "12345")
    os.chmod(p, 0o640)
    i = sbx.files.get_info(str(p))
    assert i.name == "info.txt"
    assert i.path == str(p)
    assert i.type == FileType.FILE
    assert i.size == 5
    assert stat.S_IMODE(i.mode) == 0o640
    assert i.permissions.endswith("rw-r-----"), i.permissions
    assert i.owner == test_user
    assert i.group == test_user
    assert i.symlink_target is None
    mt = i.modified_time
    if mt.tzinfo is None:
        mt = mt.replace(tzinfo=datetime.timezone.utc)
    assert before <= mt <= datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=5)


def test_get_info_dir_and_symlink(sbx, wd):
    d = wd / "adir"
    d.mkdir()
    assert sbx.files.get_info(str(d)).type == FileType.DIR
    (wd / "target").write_text("t")
    os.symlink(wd / "target", wd / "sl")
    i = sbx.files.get_info(str(wd / "sl"))
    assert i.type == FileType.SYMLINK
    assert i.symlink_target == str(wd / "target")


def test_get_info_missing(sbx, wd):
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(str(wd / "missing"))


def test_metadata_roundtrip(sbx, wd):
    p = wd / "meta.txt"
    info = sbx.files.write(str(p), "m", metadata={"owner-id": "42", "kind": "note"})
    assert info.metadata in (None, {"owner-id": "42", "kind": "note"})
    assert os.getxattr(p, "user.e2b.owner-id") == b"42"
    assert sbx.files.get_info(str(p)).metadata == {"owner-id": "42", "kind": "note"}
    # Set out of band, seen by list too.
    os.setxattr(p, "user.e2b.extra", b"yes")
    os.setxattr(p, "user.unrelated", b"no")
    listed = {e.name: e for e in sbx.files.list(str(wd))}
    assert listed["meta.txt"].metadata == {"owner-id": "42", "kind": "note", "extra": "yes"}


def test_rename(sbx, wd):
    (wd / "old").write_text("content")
    i = sbx.files.rename(str(wd / "old"), str(wd / "new"))
    assert i.path == str(wd / "new")
    assert i.name == "new"
    assert not (wd / "old").exists()
    assert (wd / "new").read_text() == "content"
    with pytest.raises(FileNotFoundException):
        sbx.files.rename(str(wd / "old"), str(wd / "new2"))


def test_remove_file_and_tree(sbx, wd):
    (wd / "f").write_text("x")
    sbx.files.remove(str(wd / "f"))
    assert not (wd / "f").exists()
    (wd / "t" / "u").mkdir(parents=True)
    (wd / "t" / "u" / "v").write_text("x")
    give(wd / "t")
    sbx.files.remove(str(wd / "t"))
    assert not (wd / "t").exists()
    with pytest.raises(FileNotFoundException):
        sbx.files.remove(str(wd / "t"))


def test_make_dir(sbx, wd, test_user):
    d = wd / "nd" / "nested"
    assert sbx.files.make_dir(str(d)) is True
    assert d.is_dir()
    assert owner(d) == test_user
    assert sbx.files.make_dir(str(d)) is False


def test_make_dir_over_file_fails(sbx, wd):
    (wd / "afile").write_text("x")
    with pytest.raises(SandboxException):
        sbx.files.make_dir(str(wd / "afile" / "sub"))


def test_download_url_without_token(sbx, wd):
    p = wd / "dl.txt"
    p.write_text("via url")
    os.chmod(p, 0o644)
    url = sbx.download_url(str(p))
    assert url.startswith(os.environ.get("E2B_SANDBOX_URL", "http://localhost:49983") + "/files?")
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.read() == b"via url"


def test_upload_url_without_token(sbx, wd):
    p = wd / "ul.txt"
    url = sbx.upload_url(str(p))
    boundary = "cubeboundary" + uuid.uuid4().hex
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"ul.txt\"\r\n"
        f"Content-Type: application/octet-stream\r\n\r\nuploaded\r\n--{boundary}--\r\n"
    ).encode()
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    assert p.read_text() == "uploaded"


def test_get_host_debug(sbx):
    assert sbx.get_host(8080) == "localhost:8080"


def test_not_found_exceptions_are_not_found(sbx, wd):
    # The SDK maps envd's not_found on every filesystem RPC the same way.
    for call in (
        lambda: sbx.files.get_info(str(wd / "x")),
        lambda: sbx.files.list(str(wd / "x")),
        lambda: sbx.files.remove(str(wd / "x")),
    ):
        with pytest.raises(NotFoundException):
            call()


def test_disk_full_is_not_enough_space(sbx, wd):
    import subprocess

    from e2b import NotEnoughSpaceException

    mnt = wd / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0777", "cube-sdk-test", str(mnt)], check=True)
    try:
        with pytest.raises(NotEnoughSpaceException):
            sbx.files.write(str(mnt / "big.bin"), b"x" * (2 << 20))
        with pytest.raises(NotEnoughSpaceException):
            sbx.files.write(str(mnt / "big2.bin"), io.BytesIO(b"y" * (2 << 20)))
        # The agent is fine afterwards and small writes still work.
        for f in mnt.iterdir():
            f.unlink()
        sbx.files.write(str(mnt / "small.txt"), "ok")
        assert (mnt / "small.txt").read_text() == "ok"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_filesystem_rpcs_respect_user_rights(sbx, wd):
    """Every filesystem operation runs with the requesting user's rights, not the agent's (root)."""
    name = f"cube-sdk-{uuid.uuid4().hex[:8]}"
    locked = wd / "locked"  # root-owned, 0755: readable, not writable by `user`
    locked.mkdir()
    (locked / "f").write_text("root's")
    private = wd / "private"  # root-owned, 0700
    private.mkdir(mode=0o700)
    (private / "g").write_text("hidden")
    try:
        with pytest.raises(SandboxException):
            sbx.files.write(f"/root/{name}", "x")
        assert not os.path.exists(f"/root/{name}")
        with pytest.raises(SandboxException):
            sbx.files.make_dir(str(locked / "sub"))
        assert not (locked / "sub").exists()
        with pytest.raises(SandboxException):
            sbx.files.remove(str(locked / "f"))
        assert (locked / "f").exists()
        with pytest.raises(SandboxException):
            sbx.files.rename(str(locked / "f"), str(wd / "stolen"))
        assert (locked / "f").exists() and not (wd / "stolen").exists()
        with pytest.raises(SandboxException):
            sbx.files.list(str(private))
        with pytest.raises(SandboxException):
            sbx.files.read(str(private / "g"))
        with pytest.raises(SandboxException):
            sbx.files.watch_dir(str(private))
        # Reading what the user may read still works, and root may do everything.
        assert [e.name for e in sbx.files.list(str(locked))] == ["f"]
        assert [e.name for e in sbx.files.list(str(private), user="root")] == ["g"]
        assert sbx.files.make_dir(str(locked / "sub"), user="root") is True
    finally:
        if os.path.exists(f"/root/{name}"):
            os.unlink(f"/root/{name}")
