"""The attacker suite: as root inside a sandbox, through the real e2b SDK, a program tries what
hostile code would try to reach the host (escape_probe.c: host kernel settings opened for
writing, never written; host memory and keys read; device nodes made and opened; namespaces,
mounts and the other ABIs' system call tables; kernel attack surface such as io_uring, bpf,
perf and keyrings). Every attempt must be refused or get the process killed.

Runtime: `namespace`, the one whose boundary is the host kernel. On `microvm` these calls reach
the guest's own kernel, which is the point of a VM: `test_microvm_boundary.py` tries that
runtime's boundary instead.
"""

import pytest
from e2b import Sandbox

from conftest import RUNTIME, TEMPLATE, detail

# The runtimes this suite runs on (CUBE_E2E_RUNTIME) and the boundary the API must report.
ISOLATION = {"namespace": "shared-kernel", "gvisor": "user-space-kernel"}

SIGSYS = 31

# What each attempt must come to: "refused" (any errno), "killed" (SIGSYS from seccomp),
# "masked" (refused, or opened with nothing to read), or a specific errno.
EXPECT = {
    "open-w /proc/sys/kernel/core_pattern": "refused",
    "open-w /proc/sys/kernel/modprobe": "refused",
    "open-w /proc/sys/vm/panic_on_oom": "refused",
    "open-w /proc/sysrq-trigger": "refused",
    "open-w /sys/kernel/uevent_helper": "refused",
    "read /proc/kcore": "masked",
    "read /proc/keys": "masked",
    "read /proc/timer_list": "masked",
    "list /sys/firmware": "masked",
    "mknod+open block 7:0 (loop)": "refused",
    "mknod+open block 8:0 (disk)": "refused",
    "mknod+open block 254:0 (virtio disk)": "refused",
    "mknod+open char 10:232 (/dev/kvm)": "refused",
    "mknod+open char 10:126 (/dev/userfaultfd)": "refused",
    "mknod+open char 1:1 (/dev/mem)": "refused",
    "unshare(CLONE_NEWUSER|CLONE_NEWNET)": "refused",
    "unshare(CLONE_NEWNS)": "refused",
    # libc falls back to clone() on ENOSYS, where seccomp sees the flags.
    "clone3(CLONE_NEWUSER|CLONE_NEWNET)": "ENOSYS",
    "clone(CLONE_NEWUSER)": "refused",
    "setns(net)": "refused",
    "mount": "refused",
    "x32 mount": "killed",
    "i386 int 0x80": "killed",
    "socket(AF_VSOCK)": "refused",
    "io_uring_setup": "refused",
    "bpf": "refused",
    "perf_event_open": "refused",
    "keyctl": "refused",
    "userfaultfd": "refused",
}

# On gvisor these reach gVisor's Sentry, which answers them itself (its own namespaces,
# keyring and sysrq file; the host kernel never sees the call), and the x32 and i386 system
# call tables do not exist there: an x32 call is ENOSYS, and `int 0x80` is ENOSYS on systrap
# while the ptrace platform's Sentry takes it for its own 64-bit call 20 (writev: EBADF). Either
# way an error, where i386 getpid (what 20 is on the host's i386 table) cannot fail.
SENTRY = ["open-w /proc/sysrq-trigger", "unshare(CLONE_NEWUSER|CLONE_NEWNET)",
          "clone3(CLONE_NEWUSER|CLONE_NEWNET)", "clone(CLONE_NEWUSER)", "keyctl"]
EXPECT_GVISOR = {**EXPECT, **{k: "sentry" for k in SENTRY},
                 "x32 mount": "ENOSYS", "i386 int 0x80": "refused"}
EXPECTED = EXPECT_GVISOR if RUNTIME == "gvisor" else EXPECT

# Capabilities no sandbox process may hold: DAC_READ_SEARCH 2, LINUX_IMMUTABLE 9,
# NET_ADMIN 12, IPC_LOCK 14, SYS_MODULE 16, SYS_RAWIO 17, SYS_PTRACE 19, SYS_ADMIN 21,
# SYS_BOOT 22, SYS_RESOURCE 24, SYS_TIME 25, MKNOD 27, MAC_ADMIN 33, SYSLOG 34, BPF 39,
# PERFMON 38, CHECKPOINT_RESTORE 40.
FORBIDDEN_CAPS = [2, 9, 12, 14, 16, 17, 19, 21, 22, 24, 25, 27, 33, 34, 38, 39, 40]


def run_probe(cube, probe):
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        # The API says what boundary this sandbox has.
        d = detail(cube, sbx.sandbox_id)
        assert (d["runtime"], d["isolation"]) == (RUNTIME, ISOLATION[RUNTIME]), d
        sbx.files.write("/tmp/escape_probe", probe)
        r = sbx.commands.run("chmod 755 /tmp/escape_probe && /tmp/escape_probe", user="root",
                             timeout=120)
        return r.stdout
    finally:
        sbx.kill()


def parse(out):
    got, status = {}, {}
    for line in out.splitlines():
        if line.startswith("status "):
            k, v = line[len("status "):].split(":", 1)
            status[k] = v.strip()
            continue
        for name in EXPECT:
            if line.startswith(name + " "):
                got[name] = line[len(name) + 1:]
    return got, status


def verdict(want, got):
    """None if `got` (the probe's word for one attempt) is what `want` allows."""
    if want == "sentry":
        return None
    if want == "killed":
        return None if got == f"killed {SIGSYS}" else "not killed"
    if want == "ENOSYS":
        return None if got.startswith("errno 38 ") else "not ENOSYS"
    if got.startswith("errno ") or got == f"killed {SIGSYS}":
        return None
    if want == "masked" and got == "empty":
        return None
    return "not refused"


@pytest.mark.timeout(300)
def test_root_in_a_sandbox_cannot_reach_the_host(cube, probe):
    out = run_probe(cube, probe)
    print(out)
    got, status = parse(out)
    missing = sorted(set(EXPECTED) - set(got))
    assert not missing, f"the probe did not report {missing}:\n{out}"
    broken = {n: f"{got[n]} ({why})" for n, want in EXPECTED.items()
              if (why := verdict(want, got[n]))}
    assert not broken, f"escapes that worked: {broken}\n{out}"

    # The state every sandbox process starts in.
    assert status.get("prctl-NoNewPrivs") == "1", status
    if RUNTIME == "namespace":
        assert status.get("NoNewPrivs") == "1", status
        # Our filter; under gvisor the host filter is the Sentry's own, not visible inside.
        assert status.get("Seccomp") == "2", status
    for field in ("CapBnd", "CapEff"):
        caps = int(status[field], 16)
        held = [c for c in FORBIDDEN_CAPS if caps >> c & 1]
        assert not held, f"{field} {status[field]} holds capabilities {held}"


def test_the_probe_tells_a_refusal_from_a_success():
    # The verdicts themselves: an attempt that worked is never taken for a refusal.
    assert verdict("refused", "ok") and verdict("masked", "ok") and verdict("killed", "ok")
    assert verdict("killed", "errno 1 Operation not permitted")
    assert verdict("ENOSYS", "errno 1 Operation not permitted")
    assert verdict("refused", "empty")
    assert verdict("refused", "killed 9")
    # Only the calls the Sentry answers are let through on gvisor; the rest stay refused.
    assert set(SENTRY) < set(EXPECT) and all(EXPECT_GVISOR[k] == EXPECT[k]
                                             for k in EXPECT if k not in SENTRY
                                             and k not in ("x32 mount", "i386 int 0x80"))
    assert verdict("masked", "empty") is None and verdict("refused", "errno 30 x") is None
    assert verdict("refused", f"killed {SIGSYS}") is None


LOG_CAP_BYTES = 8 << 20  # cubelet::sandbox_init::LOG_CAP_BYTES


@pytest.mark.timeout(300)
def test_a_sandbox_cannot_fill_the_host_disk_through_its_init_output(cube):
    import glob
    import os
    import time
    import uuid

    mark = f"cube-flood-{uuid.uuid4().hex}"
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        # Init's stdout, reopened as root: twice the cap at the host's log file. With a user
        # namespace the pipe (the host's) does not even open; then nothing got through.
        r = sbx.commands.run(f"(echo {mark} > /proc/1/fd/1 && head -c {2 * LOG_CAP_BYTES} "
                             "/dev/zero > /proc/1/fd/1) 2>&1; echo rc=$?", user="root",
                             timeout=120)
        if "Permission denied" in r.stdout:
            assert "rc=1" in r.stdout, r.stdout
            for p in glob.glob(os.path.join(cube.root, "data", "sandboxes", "*", "agent.log")):
                with open(p, "rb") as f:
                    assert mark.encode() not in f.read(), p
            return
        assert "rc=0" in r.stdout, r.stdout
        deadline = time.time() + 60
        log = None
        while time.time() < deadline:
            for p in glob.glob(os.path.join(cube.root, "data", "sandboxes", "*", "agent.log")):
                with open(p, "rb") as f:
                    body = f.read()
                if mark.encode() in body and b"dropped]" in body:
                    log = (p, len(body))
            if log:
                break
            time.sleep(0.2)
        assert log, "the flood never reached its end in the sandbox's log"
        assert log[1] <= LOG_CAP_BYTES + 200, log
        # The sandbox still answers.
        assert sbx.commands.run("echo alive").stdout == "alive\n"
    finally:
        sbx.kill()


@pytest.mark.timeout(300)
def test_root_in_a_sandbox_is_not_root_on_the_host(cube):
    import os
    import uuid

    mark = f"cube-owner-{uuid.uuid4().hex}"
    # gVisor's /tmp is a tmpfs in the Sentry's memory: nothing of it is on the host.
    dirs = ["root", "etc", "usr", "home/user"] + ([] if RUNTIME == "gvisor" else ["tmp"])
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        # Root of its own user namespace, which can still write its whole root filesystem.
        r = sbx.commands.run("cat /proc/self/uid_map; id -u; "
                             + "; ".join(f"touch /{d}/{mark}" for d in dirs), user="root")
        inner_map, uid = r.stdout.splitlines()[:2]
        assert uid == "0", r.stdout
        # From the host: the processes that hold the sandbox's root (its init; gVisor's gofer).
        pids = [p for p in os.listdir("/proc") if p.isdigit()
                and os.path.exists(f"/proc/{p}/root/etc/{mark}")]
        assert pids, "no host process has the sandbox's root"
        with open(f"/proc/{pids[0]}/uid_map") as f:
            host_map = f.readline()
        inside, outside, count = (int(x) for x in host_map.split())
        assert inside == 0 and outside != 0 and count >= 65536, host_map
        if RUNTIME != "gvisor":
            # The Sentry shows its own ids; a namespace sandbox sees the host's map.
            assert inner_map.split() == host_map.split(), (inner_map, host_map)
        for p in pids:
            with open(f"/proc/{p}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
            assert "0" not in uids, (p, uids)
        # Through the sandbox's own mounts: owned by its mapped root.
        for d in dirs:
            st = os.stat(f"/proc/{pids[0]}/root/{d}/{mark}")
            assert (st.st_uid, st.st_gid) == (outside, outside), (d, st.st_uid, st.st_gid)
        # And a user's file is the user's mapped id.
        sbx.commands.run(f"touch /home/user/{mark}-user", user="user")
        st = os.stat(f"/proc/{pids[0]}/root/home/user/{mark}-user")
        assert st.st_uid == outside + 1000, st.st_uid
    finally:
        sbx.kill()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("user", ["root", "user"])
def test_ping_works_inside_a_sandbox(cube, ping_probe, user):
    """ICMP echo as ping sends it without a raw socket, for root and for an ordinary user."""
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        sbx.files.write("/tmp/ping_probe", ping_probe)
        sbx.commands.run("chmod 755 /tmp/ping_probe", user="root")
        r = sbx.commands.run("/tmp/ping_probe 127.0.0.1", user=user, timeout=30)
        assert r.stdout.strip() == "reply 0 127.0.0.1 True", (r.stdout, r.stderr)
    finally:
        sbx.kill()
