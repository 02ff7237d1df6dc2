"""Test hosts with a real systemd: containers booted with `systemd-nspawn --boot` (systemd as
their PID 1), each over this machine's own files under a throwaway overlay, in a network
namespace of their own (or a given one). Daemons are installed and driven in them exactly as on
a host: `deploy/install.sh`, then `systemctl`.

They share this host's cgroup hierarchies, bound at /run/hostcg (cubelet's `[cgroup] root`):
this host mounts cgroup v1 controllers, which nspawn would show read-only."""

import os
import shutil
import signal
import subprocess
import time

import pytest

HOST_CGROUPS = "/run/hostcg"
# Services this machine may have installed that a test host must not start as well.
MASKED = ("postgresql.service", "postgresql@.service", "docker-registry.service",
          "console-getty.service", "ssh.service", "cron.service")


def require():
    """Root and systemd-nspawn, or the test skips (fails under CUBE_REQUIRE_PRIV=1)."""
    for what, ok in (("root", os.geteuid() == 0),
                     ("systemd-nspawn (apt-get install systemd-container)",
                      shutil.which("systemd-nspawn")),
                     ("systemd (/lib/systemd/systemd)", os.path.exists("/lib/systemd/systemd"))):
        if not ok:
            msg = f"tests/fleet needs {what}"
            if os.environ.get("CUBE_REQUIRE_PRIV") == "1":
                pytest.fail(msg)
            pytest.skip(msg)


def run(*args, check=True, timeout=300):
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def wait(pred, what, timeout=60.0, every=0.2):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what} (last: {last})")


class Container:
    """One booted test host. `root` is its merged file tree, readable from here."""

    def __init__(self, name, base):
        self.name = name
        self.base = base
        self.root = os.path.join(base, "root")
        self.proc = None
        self.leader = None

    def sh(self, cmd, check=True, timeout=300, env=""):
        """`cmd` (a shell line) inside the container, in all its namespaces."""
        return run("nsenter", "-t", str(self.leader), "-a", "--", "sh", "-c",
                   f"{env} {cmd}" if env else cmd, check=check, timeout=timeout)

    def show(self, unit, prop):
        return self.sh(f"systemctl show {unit} -p {prop} --value").stdout.strip()

    def main_pid(self, unit):
        return int(self.show(unit, "MainPID"))

    def active(self, unit):
        return self.show(unit, "ActiveState") == "active"

    def exe_sha(self, unit):
        return self.sh(f"sha256sum /proc/{self.main_pid(unit)}/exe").stdout.split()[0]

    def journal(self, units, lines=40):
        us = " ".join(f"-u {u}" for u in units)
        return self.sh(f"journalctl {us} --no-pager -o cat | grep -v IFLA_INET6_CONF "
                       f"| tail -{lines}", check=False).stdout


def boot(name, base, binds=(), netns=None, uplink="10.251.0.1/24"):
    """Boots a container named `name` with its overlay under `base`; `binds` are bound
    read-only at the same paths; `netns` (a /run/netns name) is its network, else a private
    one with an `uplink` address (a host has an address on some link: a node's connections to
    its sandboxes take their source address from it)."""
    upper, work, root = (os.path.join(base, d) for d in ("upper", "work", "root"))
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
    with open(os.path.join(upper, "etc/hostname"), "w") as f:
        f.write(name + "\n")
    run("mount", "-t", "overlay", "overlay", "-o",
        f"lowerdir=/,upperdir={upper},workdir={work}", root)
    c = Container(name, base)
    log = open(os.path.join(base, "console.log"), "w")
    net = [f"--network-namespace-path=/run/netns/{netns}"] if netns else ["--private-network"]
    # API_VFS_WRITABLE: cubelet mounts bpffs and writes /proc/sys. The extra system calls and
    # all capabilities: cubelet makes namespaces, loop mounts, BPF programs, nftables rules.
    c.proc = subprocess.Popen(
        ["systemd-nspawn", "-D", root, "--boot", "--register=no", "--keep-unit", "-M", name,
         *net, "--capability=all",
         "--system-call-filter=bpf perf_event_open @mount @privileged",
         f"--bind=/sys/fs/cgroup:{HOST_CGROUPS}", *[f"--bind-ro={b}" for b in sorted(set(binds))],
         "systemd.unit=basic.target"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=dict(os.environ, SYSTEMD_NSPAWN_API_VFS_WRITABLE="1"), start_new_session=True)

    try:
        c.leader = wait(lambda: leader(c.proc.pid), f"{name}: the container's PID 1", 30)
        state = {}

        def booted():
            r = c.sh("systemctl is-system-running", check=False)
            state["last"] = (r.stdout + r.stderr).strip()
            return state["last"] in ("running", "degraded")

        try:
            wait(booted, f"{name}: systemd to finish booting", 120)
        except AssertionError as e:
            jobs = c.sh("systemctl list-jobs --no-pager", check=False).stdout
            raise AssertionError(f"{e}; systemctl is-system-running said {state.get('last')!r}; "
                                 f"jobs:\n{jobs}\nconsole:\n{tail(log.name)}") from None
        assert c.sh("cat /proc/1/comm").stdout.strip() == "systemd"
    except BaseException:
        # The caller never gets the container, so nothing else would stop it.
        shutdown(c)
        raise
    if not netns:
        c.sh(f"ip link add uplink0 type veth peer name uplink1 && ip addr add {uplink} dev "
             "uplink0 && ip link set uplink0 up && ip link set uplink1 up")
    return c


def leader(nspawn_pid):
    """The container's PID 1: the child of `nspawn_pid` in a PID namespace other than ours.
    Not merely its first child: nspawn's short-lived outer child (in our PID namespace) shows
    up there first, and a leader taken from it is gone a moment later."""
    ours = os.readlink("/proc/self/ns/pid")
    for kid in run("pgrep", "-P", str(nspawn_pid), check=False).stdout.split():
        try:
            if os.readlink(f"/proc/{kid}/ns/pid") != ours:
                return int(kid)
        except OSError:
            pass
    return None


def tail(path, n=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return str(e)


def cgroup_pids(parent):
    """Every process in the cgroups under `parent` (on this host's hierarchies)."""
    pids = set()
    top = os.path.join("/sys/fs/cgroup/pids", parent)
    if not os.path.isdir(top):
        return pids
    for d, _, files in os.walk(top):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    pids.update(int(x) for x in f.read().split())
            except OSError:
                pass
    return pids


def remove_cgroups(parent):
    """SIGKILLs what runs under `parent` (sandboxes outlive cubelet by design) and removes it."""
    for _ in range(3):
        pids = cgroup_pids(parent)
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.3)
    for h in os.listdir("/sys/fs/cgroup"):
        top = os.path.join("/sys/fs/cgroup", h, parent)
        if os.path.isdir(top):
            for d, _, _ in sorted(os.walk(top), key=lambda x: -len(x[0])):
                try:
                    os.rmdir(d)
                except OSError:
                    pass


def shutdown(c):
    """Stops the container (its systemd shuts down), else kills its PID 1 (and with it every
    process in its PID namespace), and removes its overlay."""
    if c is None:
        return
    if c.proc and c.proc.poll() is None:
        c.proc.send_signal(signal.SIGTERM)
        try:
            c.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            for pid in (c.leader, c.proc.pid):
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            c.proc.wait(timeout=30)
    run("umount", "-l", c.root, check=False)
    shutil.rmtree(c.base, ignore_errors=True)
