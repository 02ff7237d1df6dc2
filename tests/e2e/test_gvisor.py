"""The official e2b SDK against a Cube node on the gvisor runtime: every sandbox is a runsc
sandbox (gVisor's user-space kernel, systrap platform) over its own reflinked disk, in its own
network namespace on cube-vs, taken from the pre-started pool."""

import json
import urllib.request

from e2b import Sandbox

from conftest import PROCESS_NAMES, TEMPLATE


def detail(cube, sid):
    req = urllib.request.Request(f"{cube.api_url}/sandboxes/{sid}")
    req.add_header("X-API-KEY", cube.api_key)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_gvisor_sandbox_lifecycle_through_the_sdk(cube_gvisor):
    host_kernel = open("/proc/version").read().strip()
    a = Sandbox.create(TEMPLATE, envs={"CUBE_WHO": "first"}, timeout=300)
    try:
        d = detail(cube_gvisor, a.sandbox_id)
        assert (d["runtime"], d["isolation"]) == ("gvisor", "user-space-kernel"), d
        # gVisor's kernel answers, not the host's.
        r = a.commands.run("cat /proc/version; dmesg | head -1; echo $CUBE_WHO",
                           user="root")
        assert len(r.stdout.splitlines()) == 3, (r.stdout, r.stderr)
        release, first_line, who = r.stdout.splitlines()
        assert release != host_kernel, r.stdout
        assert "gVisor" in first_line, r.stdout
        assert who == "first"
        # Users: the default one and root.
        assert a.commands.run("id -un").stdout == "user\n"
        assert a.commands.run("id -u", user="root").stdout == "0\n"
        # Files through envd, and a background process.
        a.files.write("/home/user/note.txt", "kept")
        assert a.files.read("/home/user/note.txt") == "kept"
        a.commands.run("sleep 600", background=True)
        # Pause freezes it where it is; connect thaws it with its processes.
        a.pause()
        assert Sandbox.get_info(a.sandbox_id).state.value == "paused"
        a2 = Sandbox.connect(a.sandbox_id)
        assert "sleep" in a2.commands.run(PROCESS_NAMES).stdout.split()
        assert a2.files.read("/home/user/note.txt") == "kept"
        # A snapshot keeps memory: gVisor's checkpoint with the disk cloned at the same
        # instant. What only memory holds (gVisor's /tmp is its own tmpfs; a process and its
        # listening socket in the Sentry's network stack) continues in the copy; the file
        # written just before it is on the copy's disk (gVisor's page cache flushed first).
        a2.files.write("/home/user/late.txt", "written just before the snapshot")
        a2.commands.run("echo only-in-memory > /tmp/mem.txt")
        # A server whose answer is only in its shell's memory, listening in gVisor's stack.
        a2.commands.run("v=$(cat /tmp/mem.txt); rm /tmp/mem.txt; echo kept > /tmp/mem.txt; "
                        "while true; do echo \"$v\" | nc -l -N 127.0.0.1 8765; done",
                        background=True, timeout=0)
        fetch = ("for i in $(seq 100); do o=$(nc -N 127.0.0.1 8765 </dev/null 2>/dev/null); "
                 "[ -n \"$o\" ] && { echo \"$o\"; break; }; sleep 0.1; done")
        assert a2.commands.run(fetch).stdout == "only-in-memory\n"
        snap = a2.create_snapshot()
        try:
            # The sandbox snapshotted goes on with its processes.
            names = a2.commands.run(PROCESS_NAMES).stdout.split()
            assert "sleep" in names and "nc" in names, names
            a2.files.write("/home/user/after.txt", "after the snapshot")
            f = Sandbox.create(snap.snapshot_id, envs={"CUBE_WHO": "copy"}, timeout=300)
            try:
                assert detail(cube_gvisor, f.sandbox_id)["runtime"] == "gvisor"
                assert f.files.read("/home/user/late.txt") == "written just before the snapshot"
                assert not f.files.exists("/home/user/after.txt")
                assert f.commands.run("cat /tmp/mem.txt").stdout == "kept\n"
                names = f.commands.run(PROCESS_NAMES).stdout.split()
                assert "sleep" in names and "nc" in names, names
                # The server restored with its socket and its memory answers in the copy.
                assert f.commands.run(fetch).stdout == "only-in-memory\n"
                # The copy has its own init: its env var and its own token (the SDK's).
                assert f.commands.run("echo $CUBE_WHO").stdout == "copy\n"
                # The copy was re-initialised with a token of its own.
                if a2._envd_access_token and f._envd_access_token:
                    assert a2._envd_access_token != f._envd_access_token
            finally:
                f.kill()
        finally:
            Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        a.kill()

