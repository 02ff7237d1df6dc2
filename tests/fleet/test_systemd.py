"""The units under real systemd: a container booted with `systemd-nspawn --boot` (systemd as its
PID 1, this machine's own files below a throwaway overlay, its own network namespace) is
installed with docs/install.md's `--single-host` command, exactly as the docs say; then through
`systemctl`: the three units start and are active (Type=notify: only after READY=1), restart on
failure (SIGKILL of the main process), stop cleanly, and a sandbox keeps running across
`systemctl restart cubelet`, a killed cubelet and an upgrade (install.sh again with new binaries).

The container shares this host's cgroup hierarchies (bound at /run/hostcg, cubelet's
`[cgroup] root`): this host mounts cgroup v1 controllers, which nspawn would show read-only.
Needs root and systemd-nspawn (Debian's systemd-container). ~1-2 minutes."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from doc_commands import REPO, install_command

UID = f"{os.getpid() % 100000}"
NAME = f"cubesd{UID}"
BASE = f"/var/tmp/cube-systemd-{UID}"
CGROUP_PARENT = f"cube-sd{UID}"
DATA_DIR = f"/var/lib/cube-sd{UID}"
TEMPLATE = "sdmini"
PROGRAMS = "sh,bash,cat,echo,ls,sleep,mkdir,rm,id,env,touch,sync,true,false,head,grep"
UNITS = ("cube-master", "cube-api", "cubelet")
# Host services this machine has installed that the container must not start as well.
MASKED = ("postgresql.service", "postgresql@.service", "docker-registry.service",
          "console-getty.service", "ssh.service", "cron.service")


def need(what, ok):
    if ok:
        return
    msg = f"tests/fleet/test_systemd.py needs {what}"
    if os.environ.get("CUBE_REQUIRE_PRIV") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


def run(*args, check=True, timeout=300):
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def wait(pred, what, timeout=60.0):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last})")


def bins():
    tgt = os.environ.get("CARGO_TARGET_DIR")
    if not tgt:
        pytest.fail("CARGO_TARGET_DIR must point at the cargo target dir with the debug binaries")
    d = os.path.join(tgt, "debug")
    agent = os.environ.get("CUBE_AGENT_BIN") or os.path.join(d, "cube-agent")
    for b in ("cubelet", "cube-master", "cube-api", "cubectl"):
        if not os.path.exists(os.path.join(d, b)):
            pytest.fail(f"{d}/{b} missing: cargo build -p {b}")
    if not os.path.exists(agent):
        pytest.fail(f"{agent} missing")
    return d, agent


class Container:
    def __init__(self):
        self.proc = None
        self.leader = None

    def sh(self, cmd, check=True, timeout=300):
        """`cmd` (a shell line) inside the container, in all its namespaces."""
        return run("nsenter", "-t", str(self.leader), "-a", "--", "sh", "-c", cmd,
                   check=check, timeout=timeout)

    def show(self, unit, prop):
        return self.sh(f"systemctl show {unit} -p {prop} --value").stdout.strip()

    def main_pid(self, unit):
        return int(self.show(unit, "MainPID"))

    def active(self, unit):
        return self.show(unit, "ActiveState") == "active"


def boot(bin_dir, agent_dir):
    upper, work, root = (os.path.join(BASE, d) for d in ("upper", "work", "root"))
    for d in (upper, work, root):
        os.makedirs(d)
    units = os.path.join(upper, "etc/systemd/system")
    os.makedirs(units)
    for u in MASKED:
        os.symlink("/dev/null", os.path.join(units, u))
    # The container's /dev is its own: the loop devices cubelet's XFS image needs.
    os.makedirs(os.path.join(upper, "etc/tmpfiles.d"))
    with open(os.path.join(upper, "etc/tmpfiles.d/cube-loop.conf"), "w") as f:
        f.write("c /dev/loop-control 0660 root disk - 10:237\n")
        for i in range(64):
            f.write(f"b /dev/loop{i} 0660 root disk - 7:{i}\n")
    run("mount", "-t", "overlay", "overlay", "-o",
        f"lowerdir=/,upperdir={upper},workdir={work}", root)
    c = Container()
    log = open(os.path.join(BASE, "console.log"), "w")
    binds = {REPO, bin_dir, agent_dir}
    # API_VFS_WRITABLE: cubelet mounts bpffs, writes /proc/sys. The extra system calls and all
    # capabilities: cubelet makes namespaces, loop mounts, BPF programs and nftables rules.
    c.proc = subprocess.Popen(
        ["systemd-nspawn", "-D", root, "--boot", "--register=no", "--keep-unit", "-M", NAME,
         "--private-network", "--capability=all",
         "--system-call-filter=bpf perf_event_open @mount @privileged",
         "--bind=/sys/fs/cgroup:/run/hostcg", *[f"--bind-ro={b}" for b in sorted(binds)],
         "systemd.unit=basic.target"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=dict(os.environ, SYSTEMD_NSPAWN_API_VFS_WRITABLE="1"), start_new_session=True)

    def leader():
        kids = run("pgrep", "-P", str(c.proc.pid), check=False).stdout.split()
        return int(kids[0]) if kids else None

    c.leader = wait(leader, "the container's PID 1", 30)
    wait(lambda: c.sh("systemctl is-system-running", check=False).stdout.strip()
         in ("running", "degraded"), "systemd in the container to finish booting", 120)
    assert c.sh("cat /proc/1/comm").stdout.strip() == "systemd"
    # A host has an address on some uplink: the node's connections to its sandboxes take their
    # source address from it (a private network has only loopback).
    c.sh("ip link add uplink0 type veth peer name uplink1 && ip addr add 10.251.0.1/24 dev uplink0"
         " && ip link set uplink0 up && ip link set uplink1 up")
    return c


def kill_sandboxes():
    """SIGKILLs whatever runs in the node's sandbox cgroups (made on this host's hierarchies)."""
    for pid in sandbox_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def teardown(c):
    # Sandboxes outlive their cubelet by design (KillMode=process): end them first, so that the
    # container shuts down at once.
    kill_sandboxes()
    if c and c.proc and c.proc.poll() is None:
        c.proc.send_signal(signal.SIGTERM)   # nspawn: a clean shutdown of the container
        try:
            c.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            # The container's PID 1: the kernel ends everything in its PID namespace with it.
            if c.leader:
                try:
                    os.kill(c.leader, signal.SIGKILL)
                except OSError:
                    pass
            c.proc.wait(timeout=30)
    run("umount", "-l", os.path.join(BASE, "root"), check=False)
    for h in os.listdir("/sys/fs/cgroup"):
        top = os.path.join("/sys/fs/cgroup", h, CGROUP_PARENT)
        if os.path.isdir(top):
            for d, _, _ in sorted(os.walk(top), key=lambda x: -len(x[0])):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
    shutil.rmtree(BASE, ignore_errors=True)


def sandbox_pids():
    pids = set()
    top = os.path.join("/sys/fs/cgroup/pids", CGROUP_PARENT)
    if not os.path.isdir(top):
        return pids
    for d, _, files in os.walk(top):
        if "cgroup.procs" in files:
            with open(os.path.join(d, "cgroup.procs")) as f:
                pids.update(int(x) for x in f.read().split())
    return pids


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_units_under_systemd_start_restart_stop_and_keep_sandboxes():
    need("root", os.geteuid() == 0)
    need("systemd-nspawn (apt-get install systemd-container)", shutil.which("systemd-nspawn"))
    need("systemd (/lib/systemd/systemd)", os.path.exists("/lib/systemd/systemd"))
    bin_dir, agent = bins()
    shutil.rmtree(BASE, ignore_errors=True)
    c = None
    try:
        t0 = time.time()
        c = boot(bin_dir, os.path.dirname(agent))
        extra = os.path.join(BASE, "upper/etc/cube-test-extra.toml")
        with open(extra, "w") as f:
            f.write(f"""
[cgroup]
root = "/run/hostcg"
parent = "{CGROUP_PARENT}"
[switch]
pin_root = "/run/cube-bpf"
[sandbox]
max_sandboxes = 8
tmp_size_mib = 16
ready_timeout_ms = 20000
""")
        # docs/install.md's single-host command, as written, plus what this machine needs.
        doc = install_command("--single-host").argv
        assert "/opt/cube/bin" in doc, doc
        args = [bin_dir if a == "/opt/cube/bin" else a for a in doc]
        install = " ".join(args) + (f" --agent {agent} --runtime namespace --loop-size-gib 4 "
                                    f"--data-dir {DATA_DIR} --node-id {NAME} "
                                    "--cubelet-extra /etc/cube-test-extra.toml")
        c.sh(f"cd {REPO} && {install}")
        # Started by install.sh through systemctl; active means READY=1 came (Type=notify).
        for u in UNITS:
            wait(lambda u=u: c.active(u), f"{u} active", 90)
            assert c.show(u, "Type") == "notify"
        # A template, built with cubelet stopped (a clean stop: not failed).
        c.sh("systemctl stop cubelet")
        assert c.show("cubelet", "ActiveState") == "inactive"
        assert c.show("cubelet", "Result") == "success"
        c.sh(f"cubelet host-root /var/tmp/hostroot --programs {PROGRAMS} >/dev/null && "
             f"cubelet --config /etc/cube/cubelet.toml build-template {TEMPLATE} "
             "--dir /var/tmp/hostroot >/dev/null")
        c.sh("systemctl start cubelet")
        assert c.active("cubelet")
        key = c.sh("cubectl apikey create --name sd").stdout.strip()
        assert key

        def api(method, path, body=None):
            data = f"--data '{json.dumps(body)}'" if body is not None else ""
            out = c.sh(f"curl -sS -m 60 -X {method} -H 'X-API-Key: {key}' "
                       f"-H 'content-type: application/json' {data} -w '\\n%{{http_code}}' "
                       f"http://127.0.0.1:3000{path}").stdout
            text, _, code = out.rpartition("\n")
            assert 200 <= int(code) < 300, f"{method} {path}: {code} {text}"
            return json.loads(text) if text.strip() else None

        wait(lambda: TEMPLATE in c.sh("cubectl --json nodes").stdout, "the node with the template")
        sb = api("POST", "/sandboxes", {"templateID": TEMPLATE, "timeout": 600})["sandboxID"]
        pids = wait(sandbox_pids, "the sandbox's processes")

        def still_running(why):
            assert pids <= sandbox_pids(), f"the sandbox's processes died {why}"
            wait(lambda: api("GET", f"/sandboxes/{sb}")["state"] == "running",
                 f"the sandbox listed running {why}")

        # systemctl restart cubelet (KillMode=process): the sandbox stays.
        before = c.main_pid("cubelet")
        c.sh("systemctl restart cubelet")
        assert c.active("cubelet") and c.main_pid("cubelet") != before
        still_running("across systemctl restart cubelet")

        # Restart=on-failure: each daemon SIGKILLed comes back by itself.
        for u in UNITS:
            pid, restarts = c.main_pid(u), int(c.show(u, "NRestarts"))
            c.sh(f"kill -9 {pid}")
            wait(lambda u=u, pid=pid: c.active(u) and c.main_pid(u) not in (0, pid),
                 f"{u} restarted by systemd", 60)
            assert int(c.show(u, "NRestarts")) == restarts + 1
        still_running("after cubelet was killed and restarted")

        # An upgrade: install.sh again with new binaries restarts the running units on them.
        new = "/var/tmp/new-bin"
        c.sh(f"mkdir -p {new} && for b in cubelet cube-master cube-api cubectl; do "
             f"cp {bin_dir}/$b {new}/$b && printf '\\0upgrade\\0' >> {new}/$b; done")
        c.sh(f"cd {REPO} && " + install.replace(f"--bin-dir {bin_dir}", f"--bin-dir {new}"))
        for u in UNITS:
            wait(lambda u=u: c.active(u), f"{u} active after the upgrade", 90)
            exe = c.sh(f"sha256sum /proc/{c.main_pid(u)}/exe").stdout.split()[0]
            want = c.sh(f"sha256sum {new}/{u}").stdout.split()[0]
            assert exe == want, f"{u} does not run the new binary"
        still_running("across the upgrade")
        assert sha(os.path.join(bin_dir, "cubelet")) != c.sh(
            f"sha256sum {new}/cubelet").stdout.split()[0]

        # A clean stop of everything: inactive, not failed.
        api("DELETE", f"/sandboxes/{sb}")
        c.sh("systemctl stop cube-compute.target cube-control.target")
        for u in UNITS:
            wait(lambda u=u: c.show(u, "ActiveState") == "inactive", f"{u} stopped", 60)
            assert c.show(u, "Result") == "success", u
        print(f"systemd test body took {time.time() - t0:.1f}s")
    finally:
        if c and c.leader:
            # What the daemons logged, for a failure.
            r = c.sh("journalctl -u cube-master -u cube-api -u cubelet --no-pager -o cat "
                     "| grep -v IFLA_INET6_CONF | tail -40", check=False)
            print(r.stdout)
        teardown(c)
