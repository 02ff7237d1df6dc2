"""The official e2b SDK against a Cube node on the gvisor runtime: every sandbox is a runsc
sandbox (gVisor's user-space kernel, systrap platform) over its own reflinked disk, in its own
network namespace on cube-vs, taken from the pre-started pool."""

import json
import os
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


def _sandbox_cgroup(cube, sid):
    """The sandbox's state file body and its cgroup directory for memory on the host."""
    with open(os.path.join(cube.root, "data", "sandboxes", sid, "state.json")) as f:
        body = json.load(f)["body"]
    parent = "cube-" + os.path.basename(cube.root)[len("cube-e2e-"):]
    v1 = f"/sys/fs/cgroup/memory/{parent}/{body['key']}"
    return body, (v1 if os.path.isdir(v1) else f"/sys/fs/cgroup/{parent}/{body['key']}")


def _memory_mib(cg):
    """Anonymous and shared memory charged to the cgroup (gVisor's memory file is a memfd)."""
    stat = {k: int(v) for k, v in (l.split() for l in open(os.path.join(cg, "memory.stat")))}
    if "anon" in stat:
        return (stat["anon"] + stat.get("shmem", 0)) / 2**20
    return (stat.get("total_rss", 0) + stat.get("total_shmem", 0)) / 2**20


def _procs(cg):
    return open(os.path.join(cg, "cgroup.procs")).read().split()


def test_gvisor_pause_saves_memory_to_disk_and_resume_restores_it(cube_gvisor):
    """Pause is `runsc checkpoint`: the sandbox stops and its host memory is released; connect
    restores it in its own namespace with its processes, its memory-only files and a server
    listening in gVisor's network stack."""
    a = Sandbox.create(TEMPLATE, timeout=300)
    try:
        # 12 MiB only in the Sentry's memory (/tmp is its tmpfs), and a server whose answer
        # only its shell's memory holds.
        a.commands.run("head -c 12582912 /dev/urandom > /tmp/blob && "
                       "cat /tmp/blob | md5sum > /tmp/blob.sum")
        want_sum = a.commands.run("cat /tmp/blob.sum").stdout
        a.commands.run("v=only-in-memory; while true; do echo \"$v\" | nc -l -N 127.0.0.1 8766; "
                       "done", background=True, timeout=0)
        fetch = ("for i in $(seq 100); do o=$(nc -N 127.0.0.1 8766 </dev/null 2>/dev/null); "
                 "[ -n \"$o\" ] && { echo \"$o\"; break; }; sleep 0.1; done")
        assert a.commands.run(fetch).stdout == "only-in-memory\n"
        body, cg = _sandbox_cgroup(cube_gvisor, a.sandbox_id)
        running_mib = _memory_mib(cg)
        assert running_mib > 12, running_mib
        assert _procs(cg), "no process in the running sandbox's cgroup"

        a.pause()
        assert Sandbox.get_info(a.sandbox_id).state.value == "paused"
        assert detail(cube_gvisor, a.sandbox_id)["pauseMode"] == "full"
        body, cg = _sandbox_cgroup(cube_gvisor, a.sandbox_id)
        image = body["runtime"]["gvisor"]["paused_image"]
        assert os.path.isfile(os.path.join(image, "checkpoint.img")), os.listdir(image)
        # Nothing of the sandbox runs on the host, and its memory is given back.
        assert body["pid"] == 0 and _procs(cg) == [], (body, _procs(cg))
        assert _memory_mib(cg) < 1, (running_mib, _memory_mib(cg))

        # A snapshot of the sandbox paused to disk keeps its memory too.
        snap = a.create_snapshot()
        try:
            assert Sandbox.get_info(a.sandbox_id).state.value == "paused"
            a2 = Sandbox.connect(a.sandbox_id)
            assert Sandbox.get_info(a.sandbox_id).state.value == "running"
            assert not os.path.exists(image), "the pause image outlived the resume"
            assert a2.commands.run("md5sum < /tmp/blob").stdout == want_sum
            assert a2.commands.run(fetch).stdout == "only-in-memory\n"
            f = Sandbox.create(snap.snapshot_id, timeout=300)
            try:
                assert f.commands.run("md5sum < /tmp/blob").stdout == want_sum
                assert f.commands.run(fetch).stdout == "only-in-memory\n"
            finally:
                f.kill()
            # Paused and resumed again: the image is made afresh each time.
            a2.pause()
            a3 = Sandbox.connect(a.sandbox_id)
            assert a3.commands.run(fetch).stdout == "only-in-memory\n"
        finally:
            Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        a.kill()
    # Killing a sandbox paused to disk leaves nothing of it.
    assert not os.path.exists(os.path.join(cube_gvisor.root, "data", "sandboxes", a.sandbox_id))
