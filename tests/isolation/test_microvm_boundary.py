"""The attacker suite on the `microvm` runtime. There root in a sandbox is root of the guest's
own kernel, so what the namespace suite refuses (kernel settings, device nodes, namespaces) is
the guest's to do; the boundary is the VMM. Through the real e2b SDK, as root in a microVM:
the kernel is the guest's (not the host's), a guest write to its global kernel settings leaves
the host's untouched, the host's devices are not there to open, and vsock reaches no host service
but the init channel (cube-shim forwards only the ports it serves).
"""

import os

import pytest
from e2b import Sandbox

from conftest import TEMPLATE, detail, e2e


@pytest.fixture(scope="module")
def cube_microvm():
    yield from e2e._stack("microvm")


@pytest.mark.timeout(900)
def test_root_in_a_microvm_owns_only_the_guest(cube_microvm, vsock_probe):
    def host(path):
        with open(path) as f:
            return f.read()

    knob = "/proc/sys/vm/overcommit_ratio"
    host_knob, host_boot = host(knob), host("/proc/sys/kernel/random/boot_id")
    sbx = Sandbox.create(TEMPLATE, timeout=600)
    try:
        d = detail(cube_microvm, sbx.sandbox_id)
        assert (d["runtime"], d["isolation"]) == ("microvm", "hardware-virtualization"), d
        run = lambda cmd: sbx.commands.run(cmd, user="root", timeout=120)
        # Another kernel: its own boot id and release.
        r = run("cat /proc/sys/kernel/random/boot_id /proc/sys/kernel/osrelease")
        boot, release = r.stdout.split()
        assert boot != host_boot.strip() and release != os.uname().release, r.stdout
        # The guest's root may set the guest's kernel settings (a global one, not namespaced on
        # a shared kernel); the host's stays what it was.
        mark = str(int(host_knob) + 17)
        r = run(f"echo {mark} > {knob} && cat {knob}")
        assert r.stdout.strip() == mark, r.stdout
        assert host(knob) == host_knob
        # The host's devices are not there.
        r = run("ls /dev")
        assert "kvm" not in r.stdout.split() and "vhost-vsock" not in r.stdout.split(), r.stdout
        # vsock: the host's other ports and other guests are not reachable.
        sbx.files.write("/tmp/vsock_probe", vsock_probe)
        r = run("chmod +x /tmp/vsock_probe && /tmp/vsock_probe 2 22 2 1234 2 9091 2 49983 1 1234 3 1234 4 1234")
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 7, r.stdout
        for l in lines:
            assert " connected" not in l and ("refused" in l or "socket" in l), lines
    finally:
        sbx.kill()
