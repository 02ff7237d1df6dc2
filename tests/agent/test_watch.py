"""files.watch_dir: sync (CreateWatcher + GetWatcherEvents polling) and async (WatchDir stream)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from e2b import AsyncSandbox, FilesystemEventType, SandboxException
from e2b.exceptions import FileNotFoundException

from agentlib import give


def poll_events(handle, pred, timeout=10.0):
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += handle.get_new_events()
        if pred(seen):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"events never matched; got {seen}")


def kinds(events, name):
    return {e.type for e in events if e.name == name}


def test_watch_sync_create_write_remove_rename(sbx, wd):
    h = sbx.files.watch_dir(str(wd))
    try:
        sbx.files.write(str(wd / "w.txt"), "1")
        ev = poll_events(h, lambda s: FilesystemEventType.CREATE in kinds(s, "w.txt"))
        assert all(not e.name.startswith("/") for e in ev), "names are relative to the watched dir"
        with open(wd / "w.txt", "a") as f:
            f.write("more")
        poll_events(h, lambda s: FilesystemEventType.WRITE in kinds(s, "w.txt"))
        os.rename(wd / "w.txt", wd / "w2.txt")
        poll_events(h, lambda s: FilesystemEventType.RENAME in kinds(s, "w.txt"))
        os.chmod(wd / "w2.txt", 0o600)
        poll_events(h, lambda s: FilesystemEventType.CHMOD in kinds(s, "w2.txt"))
        os.unlink(wd / "w2.txt")
        poll_events(h, lambda s: FilesystemEventType.REMOVE in kinds(s, "w2.txt"))
        # Events are drained: once a later event (a sentinel directory's one CREATE) has come,
        # every earlier one has, and a second poll with nothing new is empty.
        os.mkdir(wd / "sentinel")
        poll_events(h, lambda s: FilesystemEventType.CREATE in kinds(s, "sentinel"))
        assert h.get_new_events() == []
    finally:
        h.stop()
    with pytest.raises(SandboxException):
        h.get_new_events()


def test_watch_sync_non_recursive_ignores_subdirs(sbx, wd):
    (wd / "sub").mkdir()
    os.chown(wd / "sub", os.stat(wd).st_uid, os.stat(wd).st_gid)
    h = sbx.files.watch_dir(str(wd))
    try:
        (wd / "sub" / "inner.txt").write_text("x")
        (wd / "top.txt").write_text("x")
        # Events come in order: had inner.txt been watched, its events would be in by now.
        ev = poll_events(h, lambda s: kinds(s, "top.txt"))
        assert not [e for e in ev if "inner" in e.name], ev
    finally:
        h.stop()


def test_watch_sync_recursive_and_entry(sbx, wd):
    (wd / "a" / "b").mkdir(parents=True)
    give(wd / "a")
    h = sbx.files.watch_dir(str(wd), recursive=True, include_entry=True)
    try:
        sbx.files.write(str(wd / "a" / "b" / "deep.txt"), "deep")
        ev = poll_events(h, lambda s: FilesystemEventType.CREATE in kinds(s, "a/b/deep.txt"))
        create = next(e for e in ev if e.name == "a/b/deep.txt" and e.type == FilesystemEventType.CREATE)
        assert create.entry is not None
        assert create.entry.path == str(wd / "a" / "b" / "deep.txt")
    finally:
        h.stop()


def test_watch_sync_recursive_follows_new_dirs(sbx, wd):
    (wd / "a").mkdir()
    h = sbx.files.watch_dir(str(wd), recursive=True)
    try:
        # A directory created after the watch started is watched too.
        (wd / "a" / "newdir").mkdir()
        # The agent watches a new directory before it reports its CREATE.
        poll_events(h, lambda s: FilesystemEventType.CREATE in kinds(s, "a/newdir"))
        (wd / "a" / "newdir" / "f").write_text("x")
        poll_events(h, lambda s: kinds(s, "a/newdir/f"))
    finally:
        h.stop()


def test_watch_missing_dir(sbx, wd):
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir(str(wd / "missing"))


def test_watch_remove_unknown_watcher(sbx, wd):
    h = sbx.files.watch_dir(str(wd))
    h.stop()
    with pytest.raises(SandboxException):
        # Already removed on the agent: a second remove is not_found.
        h._closed = False
        h.stop()


def test_watch_async_stream(agent, wd):
    async def main():
        sbx = await AsyncSandbox.create(debug=True)
        events = []
        got = asyncio.Event()

        def on_event(e):
            events.append(e)
            if e.name == "async.txt" and e.type == FilesystemEventType.CREATE:
                got.set()

        exits = []
        h = await sbx.files.watch_dir(str(wd), on_event=on_event, on_exit=exits.append, timeout=30)
        try:
            await sbx.files.write(str(wd / "async.txt"), "x")
            await asyncio.wait_for(got.wait(), 10)
            # Work through the async client as well while a stream is open.
            r = await sbx.commands.run(f"rm {wd}/async.txt")
            assert r.exit_code == 0
            for _ in range(100):
                if any(e.name == "async.txt" and e.type == FilesystemEventType.REMOVE for e in events):
                    break
                await asyncio.sleep(0.1)
            assert any(e.name == "async.txt" and e.type == FilesystemEventType.REMOVE for e in events), events
        finally:
            await h.stop()

    asyncio.run(main())


def test_watch_async_missing_dir(agent, wd):
    async def main():
        sbx = await AsyncSandbox.create(debug=True)
        with pytest.raises(FileNotFoundException):
            await sbx.files.watch_dir(str(wd / "missing"), on_event=lambda e: None)

    asyncio.run(main())
