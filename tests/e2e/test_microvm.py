"""The official e2b SDK against a Cube node on the microvm runtime with the Linux guest: every
sandbox is a KVM microVM restored from the template's memory snapshot (a booted guest kernel
with cube-agent as init), reached through its tap and cube-vs.

On PVM build hosts the guest kernel runs with its `cube_pvm` patch (guest kernel mode is
emulated there, so it is slow but real); on hosts with VMX/SVM the same test runs at full speed.
"""

import json
import time
import urllib.request

import pytest
from e2b import Sandbox

import microvm_logs
from conftest import PROCESS_NAMES, TEMPLATE, TEST_RESOLVER
from test_egress import A, B, inet, reaches  # noqa: F401 (inet is a fixture)
from test_history import cmd_of, logs_until


def detail(cube, sid):
    req = urllib.request.Request(f"{cube.api_url}/sandboxes/{sid}")
    req.add_header("X-API-KEY", cube.api_key)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


# Guest kernel mode is emulated on PVM hosts, and on some of them (AMD, no TSC frequency in CPUID)
# the guest keeps a periodic tick, so one call can take tens of seconds there: every request and
# command gets a deadline well above the SDK's 60 s default (the test checks behaviour, not speed).
SLOW = {"request_timeout": 300}
CMD = {"timeout": 300}


# The fixture boots the guest once to build the template's snapshot.
@pytest.mark.timeout(1200)
def test_linux_microvm_sandbox_lifecycle_through_the_sdk(cube_microvm):
    host_kernel = open("/proc/sys/kernel/osrelease").read().strip()
    a = Sandbox.create(TEMPLATE, envs={"CUBE_WHO": "first"}, timeout=300, **SLOW)
    b = None
    try:
        with microvm_logs.on_failure(cube_microvm):
            d = detail(cube_microvm, a.sandbox_id)
            assert (d["runtime"], d["isolation"]) == ("microvm", "hardware-virtualization"), d
            # Its own kernel (the guest's, not the host's), booted with the init channel.
            r = a.commands.run("cat /proc/sys/kernel/osrelease /proc/cmdline; echo $CUBE_WHO", **CMD)
            lines = r.stdout.splitlines()
            assert lines[0] != host_kernel and lines[0].startswith("6.12"), r.stdout
            assert "cube.vsock_init=" in lines[1], r.stdout
            assert lines[2] == "first", r.stdout
            a.files.write("/home/user/note.txt", "kept across pause")

            # A snapshot of a running microVM holds its memory: a process started before it runs on
            # in sandboxes made from it (the namespace runtime keeps only files).
            # timeout=0: no command timeout (the SDK's default 60 s would have the agent kill
            # it, and on PVM the snapshot and the fork take about that long).
            a.commands.run("sleep 600", background=True, timeout=0)
            # The SDK returns once the process started; it is `sleep` only once its login shell
            # has exec'd it (slow where the guest kernel is emulated), so wait for that first.
            deadline = time.time() + 300
            while "sleep" not in a.commands.run(PROCESS_NAMES, **CMD).stdout.split():
                assert time.time() < deadline, "sleep 600 never started in a"
                time.sleep(0.5)
            snap = a.create_snapshot()
            try:
                f = Sandbox.create(snap.snapshot_id, envs={"CUBE_WHO": "fork"}, timeout=300, **SLOW)
                try:
                    # The master read the fork's envd version from its agent (not its fallback).
                    assert f.get_info().envd_version == cube_microvm.envd_version, f.get_info()
                    assert "sleep" in f.commands.run(PROCESS_NAMES, **CMD).stdout.split()
                    assert f.files.read("/home/user/note.txt") == "kept across pause"
                    assert f.commands.run("echo $CUBE_WHO", **CMD).stdout == "fork\n"
                    # Its log starts at its own create: what the restored agent remembers of
                    # a's commands (it ran them before the snapshot) is not f's.
                    f_log = logs_until(f.sandbox_id, "the fork's own command",
                                       lambda e: "echo $CUBE_WHO" in cmd_of(e), timeout=300)
                    assert not any("osrelease" in cmd_of(e) for e in f_log), f_log
                    assert f_log[0].message == "Sandbox created"
                finally:
                    f.kill()
            finally:
                Sandbox.delete_snapshot(snap.snapshot_id)
            assert a.commands.run("echo $CUBE_WHO", **CMD).stdout == "first\n"

            # A second copy of the same snapshot: its own settings and its own RNG state.
            b = Sandbox.create(TEMPLATE, envs={"CUBE_WHO": "second"}, timeout=300, **SLOW)
            assert b.commands.run("echo $CUBE_WHO", **CMD).stdout == "second\n"
            def rnd(s):
                s.commands.run("head -c 16 /dev/urandom > /tmp/rnd", **CMD)
                return bytes(s.files.read("/tmp/rnd", format="bytes"))
            ra, rb = rnd(a), rnd(b)
            assert len(ra) == 16 and ra != rb
            assert b.commands.run("cat /home/user/note.txt 2>&1 || true", **CMD).stdout != "kept across pause"

            # Pause (guest memory to disk) and connect (restore in the same shim).
            a.pause()
            assert Sandbox.get_info(a.sandbox_id).state.value == "paused"
            a2 = Sandbox.connect(a.sandbox_id, **SLOW)
            assert a2.files.read("/home/user/note.txt") == "kept across pause"
            assert a2.commands.run("echo $CUBE_WHO", **CMD).stdout == "first\n"
    finally:
        a.kill()
        if b is not None:
            b.kill()


@pytest.mark.timeout(900)
def test_linux_microvm_egress_rules_hold_on_its_tap(cube_microvm, inet):
    """E2B's denyOut on a microVM (its tap on the switch), then replaced at run time."""
    sbx = Sandbox.create(TEMPLATE, timeout=300, network={"deny_out": [A]}, **SLOW)
    try:
        with microvm_logs.on_failure(cube_microvm):
            # The init channel gave the restored guest its resolver.
            conf = sbx.commands.run("cat /etc/resolv.conf", **CMD).stdout
            assert f"nameserver {TEST_RESOLVER}" in conf, conf
            assert not reaches(sbx, A, timeout=300), "a denied address was reached"
            assert reaches(sbx, B, timeout=300)
            sbx.update_network({"deny_out": [B]}, **SLOW)
            assert reaches(sbx, A, timeout=300) and not reaches(sbx, B, timeout=300)
    finally:
        sbx.kill()
