"""A fleet on one machine: three "hosts" as network namespaces (control + two compute nodes),
each installed by the real deploy/install.sh into its own root, talking gRPC over mutual TLS
across veth links.

The daemons are started with the ExecStart lines of the installed systemd units (systemd is not
PID 1 here) and a NOTIFY_SOCKET this test listens on, so Type=notify readiness is exercised.
Nodes join with one-time tokens. Sandboxes are created through the REST API; then a compute
node is stopped and started, and the binaries are upgraded by re-running install.sh, with
sandboxes running: their processes must survive both, and the API must still serve them.

Binaries: $CARGO_TARGET_DIR/debug (cubelet, cube-master, cube-api, cubectl) and the static agent
$CUBE_AGENT_BIN (default $CARGO_TARGET_DIR/debug/cube-agent). Needs root.
"""

import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time

import pytest

from doc_commands import install_command

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
INSTALL = os.path.join(REPO, "deploy", "install.sh")
TEMPLATE = "fleetmini"
PROGRAMS = "sh,bash,cat,echo,ls,sleep,mkdir,rm,id,env,touch,sync,true,false,head,grep"
UID = f"{os.getpid() % 100000}"
CTL_A, NODE_A = "10.250.1.1", "10.250.1.2"
CTL_B, NODE_B = "10.250.2.1", "10.250.2.2"


def require_root():
    if os.geteuid() == 0:
        return
    msg = "tests/fleet needs root (namespaces, cgroups, loop mounts)"
    if os.environ.get("CUBE_REQUIRE_PRIV") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


def sh(*args, ns=None, check=True, env=None, timeout=120):
    cmd = list(args)
    if ns:
        cmd = ["nsenter", f"--net=/run/netns/{ns}", "--"] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
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
    raise AssertionError(f"timed out waiting for {what} (last error: {last})")


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Host:
    """One network namespace with its install root and daemons."""

    def __init__(self, fleet, name):
        self.fleet = fleet
        self.name = name
        self.ns = f"cf{UID}{name}"
        self.root = os.path.join(fleet.base, name)
        self.procs = {}
        self.logs = []

    def unit_cmd(self, unit):
        path = os.path.join(self.root, "etc/systemd/system", unit)
        with open(path) as f:
            for line in f:
                if line.startswith("ExecStart="):
                    return shlex.split(line[len("ExecStart="):].strip())
        raise AssertionError(f"{path} has no ExecStart")

    def start(self, unit):
        """Starts a unit's ExecStart in this namespace and waits for READY=1 on NOTIFY_SOCKET."""
        sock_path = os.path.join(self.fleet.base, f"notify-{self.name}-{unit}")
        if os.path.exists(sock_path):
            os.unlink(sock_path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(sock_path)
        s.settimeout(1.0)
        log = open(os.path.join(self.root, f"{unit}.log"), "a")
        self.logs.append(log)
        env = dict(os.environ, NOTIFY_SOCKET=sock_path)
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.ns}", "--"] + self.unit_cmd(unit),
                             stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[unit] = p
        try:
            end = time.time() + 120
            while True:
                if p.poll() is not None:
                    raise AssertionError(f"{unit} on {self.name} exited with {p.returncode}; "
                                         f"see {log.name}")
                if time.time() > end:
                    raise AssertionError(f"{unit} on {self.name} sent no READY=1; see {log.name}")
                try:
                    msg = s.recv(4096).decode()
                except socket.timeout:
                    continue
                if "READY=1" in msg.split("\n"):
                    break
        finally:
            s.close()
            os.unlink(sock_path)
        return p

    def stop(self, unit, timeout=60):
        p = self.procs.pop(unit, None)
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def pid_exe_sha(self, unit):
        # nsenter execs the daemon in place: the Popen pid is the daemon's.
        return sha(f"/proc/{self.procs[unit].pid}/exe")


class Fleet:
    def __init__(self):
        self.base = f"/var/tmp/cube-fleet-{UID}"
        self.control = Host(self, "ctl")
        self.nodes = {"a": Host(self, "a"), "b": Host(self, "b")}
        self.api_key = None

    def hosts(self):
        return [self.control, *self.nodes.values()]

    def cubectl(self, *args):
        pki = os.path.join(self.control.root, "etc/cube/pki")
        env = dict(os.environ, CUBE_TLS_CA=f"{pki}/ca.pem", CUBE_TLS_CERT=f"{pki}/admin.pem",
                   CUBE_TLS_KEY=f"{pki}/admin.key")
        exe = os.path.join(self.control.root, "usr/local/bin/cubectl")
        return sh(exe, "--master", "https://127.0.0.1:9090", *args, ns=self.control.ns, env=env)

    def api(self, method, path, body=None, check=True):
        args = ["curl", "-sS", "-m", "60", "-X", method, "-H", f"X-API-Key: {self.api_key}",
                "-H", "content-type: application/json", "-w", "\n%{http_code}",
                f"http://127.0.0.1:3000{path}"]
        if body is not None:
            args += ["--data", json.dumps(body)]
        r = sh(*args, ns=self.control.ns)
        text, _, code = r.stdout.rpartition("\n")
        code = int(code)
        if check and not 200 <= code < 300:
            raise AssertionError(f"{method} {path}: HTTP {code}: {text}")
        return code, (json.loads(text) if text.strip() else None)

    def node_status(self):
        out = self.cubectl("--json", "nodes").stdout
        v = json.loads(out)
        nodes = v if isinstance(v, list) else v.get("nodes", [])
        return {n.get("id"): n for n in nodes}

    def node_ready(self, node_id, templates=True):
        n = self.node_status().get(node_id)
        return bool(n and str(n.get("status")).lower() == "ready"
                    and (not templates or TEMPLATE in n.get("templates", [])))


def node_id(name):
    return f"fleet{UID}{name}"


def cgroup_parent(name):
    return f"cube-fleet{UID}{name}"


def sandbox_pids(name):
    """Every process in the node's sandbox cgroups (cubelet itself is not in them)."""
    pids = set()
    for h in ("", "pids", "memory", "cpu", "freezer"):
        top = os.path.join("/sys/fs/cgroup", h, cgroup_parent(name))
        for d, _, files in os.walk(top):
            if "cgroup.procs" in files:
                try:
                    with open(os.path.join(d, "cgroup.procs")) as f:
                        pids.update(int(x) for x in f.read().split())
                except OSError:
                    pass
    return pids


def install(fleet, host, *args, bin_dir, agent):
    # Executed directly, as the docs say to run it (its execute bit is part of what is tested).
    return sh(INSTALL, *args, "--root", host.root, "--bin-dir", bin_dir, "--agent", agent,
              timeout=300)


def from_docs(flag, subst):
    """The arguments of docs/install.md's `deploy/install.sh FLAG ...` command with its example
    values replaced by this fleet's (`subst`: whole arguments); every example value the test
    knows must be there, so the docs and this test cannot drift apart."""
    argv = install_command(flag).argv[1:]
    missing = [k for k in subst if k not in argv]
    assert not missing, f"docs/install.md's {flag} command lost {missing}: {argv}"
    return [subst.get(a, a) for a in argv]


def setup_network(fleet):
    c = fleet.control.ns
    for h in fleet.hosts():
        sh("ip", "netns", "add", h.ns)
        sh("ip", "-n", h.ns, "link", "set", "lo", "up")
    for name, ctl_ip, node_ip in (("a", CTL_A, NODE_A), ("b", CTL_B, NODE_B)):
        n = fleet.nodes[name].ns
        sh("ip", "-n", c, "link", "add", f"to{name}", "type", "veth", "peer", "name", "toctl",
           "netns", n)
        sh("ip", "-n", c, "addr", "add", f"{ctl_ip}/30", "dev", f"to{name}")
        sh("ip", "-n", n, "addr", "add", f"{node_ip}/30", "dev", "toctl")
        sh("ip", "-n", c, "link", "set", f"to{name}", "up")
        sh("ip", "-n", n, "link", "set", "toctl", "up")
        # The nodes' default route (sandbox egress) goes through the control host.
        sh("ip", "-n", n, "route", "add", "default", "via", ctl_ip)


def node_extra_config(fleet, name):
    path = os.path.join(fleet.base, f"extra-{name}.toml")
    n = 1 if name == "a" else 2
    with open(path, "w") as f:
        f.write(f"""
[sandbox]
max_sandboxes = 8
tmp_size_mib = 16
ready_timeout_ms = 20000
[cgroup]
parent = "{cgroup_parent(name)}"
[pools]
network = 1
disks = 0
[switch]
host_pool = "10.239.{n}.0/24"
pin_root = "/sys/fs/bpf/cube-fleet{UID}{name}"
nft_table = "cube_fleet{UID}{name}"
""")
    return path


def teardown(fleet):
    # Kill the sandboxes through the API while it is up, then stop daemons, then sweep.
    if fleet.api_key and fleet.control.procs.get("cube-api.service"):
        try:
            _, lst = fleet.api("GET", "/sandboxes", check=False)
            for s in lst or []:
                fleet.api("DELETE", f"/sandboxes/{s['sandboxID']}", check=False)
        except Exception:  # noqa: BLE001 - best effort, the sweep below follows
            pass
    for h in fleet.hosts():
        for unit in list(h.procs):
            h.stop(unit, timeout=30)
        for log in h.logs:
            log.close()
    for name in fleet.nodes:
        for _ in range(3):
            pids = sandbox_pids(name)
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.5)
        for h in ("", "pids", "memory", "cpu", "freezer"):
            top = os.path.join("/sys/fs/cgroup", h, cgroup_parent(name))
            for d, _, _ in sorted(os.walk(top), key=lambda t: -len(t[0])):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
        pin = f"/sys/fs/bpf/cube-fleet{UID}{name}"
        subprocess.run(["rm", "-rf", pin], stderr=subprocess.DEVNULL)
    # Mounts under the roots (data dir loop images and whatever cubelet mounted in them),
    # deepest first, then their loop devices.
    with open("/proc/self/mountinfo") as f:
        mps = [ln.split()[4] for ln in f if ln.split()[4].startswith(fleet.base + "/")]
    for mp in sorted(set(mps), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], stderr=subprocess.DEVNULL)
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    for ln in loops.splitlines():
        if fleet.base in ln:
            subprocess.run(["losetup", "-d", ln.split(":")[0]], stderr=subprocess.DEVNULL)
    for h in fleet.hosts():
        subprocess.run(["ip", "netns", "del", h.ns], stderr=subprocess.DEVNULL)
    shutil.rmtree(fleet.base, ignore_errors=True)


def test_fleet_install_restart_upgrade():
    require_root()
    tgt = os.environ.get("CARGO_TARGET_DIR")
    if not tgt:
        pytest.fail("CARGO_TARGET_DIR must point at the cargo target dir with the debug binaries")
    bin_dir = os.path.join(tgt, "debug")
    for b in ("cubelet", "cube-master", "cube-api", "cubectl"):
        if not os.access(os.path.join(bin_dir, b), os.X_OK):
            pytest.fail(f"{bin_dir}/{b} missing (cargo build -p {b})")
    agent = os.environ.get("CUBE_AGENT_BIN") or os.path.join(bin_dir, "cube-agent")
    if not os.access(agent, os.X_OK):
        pytest.fail(f"static agent {agent} missing (set CUBE_AGENT_BIN)")

    fleet = Fleet()
    shutil.rmtree(fleet.base, ignore_errors=True)
    os.makedirs(fleet.base)
    try:
        run_fleet(fleet, bin_dir, agent)
    finally:
        teardown(fleet)


def run_fleet(fleet, bin_dir, agent):
    t0 = time.time()
    setup_network(fleet)
    ctl = fleet.control

    # --- control host: CA, certificates, master + api over mutual TLS.
    install(fleet, ctl, *from_docs("--control", {"10.0.0.1": CTL_A, "/opt/cube/bin": bin_dir}),
            "--extra-san", f"IP:{CTL_B}", bin_dir=bin_dir, agent=agent)
    pki = os.path.join(ctl.root, "etc/cube/pki")
    for f in ("ca.pem", "ca.key", "master.pem", "api.pem", "admin.pem"):
        assert os.path.exists(os.path.join(pki, f)), f
    ctl.start("cube-master.service")
    ctl.start("cube-api.service")
    fleet.api_key = fleet.cubectl("apikey", "create", "--name", "fleet").stdout.strip()
    assert fleet.api_key

    # Without a certificate the master refuses cubectl (mutual TLS is really on).
    exe = os.path.join(ctl.root, "usr/local/bin/cubectl")
    r = sh(exe, "--master", "https://127.0.0.1:9090", "nodes", ns=ctl.ns, check=False,
           env={k: v for k, v in os.environ.items() if not k.startswith("CUBE_TLS_")})
    assert r.returncode != 0

    # --- compute hosts: a certificate each (issued on the control host), a one-time token each.
    for name, ctl_ip, node_ip in (("a", CTL_A, NODE_A), ("b", CTL_B, NODE_B)):
        h = fleet.nodes[name]
        sh(INSTALL, *from_docs("--issue-cert", {"node7": f"node-{name}", "/etc/cube/pki": pki,
                                                "IP:10.0.0.7": f"IP:{node_ip}"}))
        token = fleet.cubectl("join-token", "create").stdout.strip()
        assert token
        install(fleet, h, *from_docs("--compute", {
                    "https://10.0.0.1:9090": f"https://{ctl_ip}:9090", "TOKEN": token,
                    "10.0.0.7": node_ip, "ca.pem": f"{pki}/ca.pem",
                    "node7.pem": f"{pki}/node-{name}.pem", "node7.key": f"{pki}/node-{name}.key",
                    "/opt/cube/bin": bin_dir}),
                "--node-id", node_id(name), "--loop-size-gib", "2", "--runtime", "namespace",
                "--cubelet-extra", node_extra_config(fleet, name), bin_dir=bin_dir, agent=agent)
        cfg = os.path.join(h.root, "etc/cube/cubelet.toml")
        cubelet = os.path.join(h.root, "usr/local/bin/cubelet")
        hostroot = os.path.join(fleet.base, f"hostroot-{name}")
        sh(cubelet, "host-root", hostroot, "--programs", PROGRAMS)
        sh(cubelet, "--config", cfg, "build-template", TEMPLATE, "--dir", hostroot, timeout=300)
        h.start("cubelet.service")
    for name in fleet.nodes:
        wait(lambda n=name: fleet.node_ready(node_id(n)), f"node {name} ready in the master",
             timeout=60)
    print(f"fleet up in {time.time() - t0:.1f}s")

    # --- sandboxes through the API, on both nodes.
    # Two per node whatever the scheduler prefers: cordon the other node meanwhile.
    ids = []
    for name, other in (("a", "b"), ("b", "a")):
        fleet.cubectl("node", "cordon", node_id(other))
        for _ in range(2):
            _, sb = fleet.api("POST", "/sandboxes", {"templateID": TEMPLATE, "timeout": 600})
            ids.append(sb["sandboxID"])
        fleet.cubectl("node", "uncordon", node_id(other))
    pids = {n: sandbox_pids(n) for n in fleet.nodes}
    assert all(pids.values()), f"sandboxes did not land on both nodes: {pids}"

    # --- stop node b: the master notices, sandboxes on b keep running, new ones go to a.
    b = fleet.nodes["b"]
    b.stop("cubelet.service")
    wait(lambda: not fleet.node_ready(node_id("b"), templates=False), "node b not ready",
         timeout=60)
    assert pids["b"] <= sandbox_pids("b"), "sandboxes on b died with their cubelet"
    _, sb = fleet.api("POST", "/sandboxes", {"templateID": TEMPLATE, "timeout": 600})
    ids.append(sb["sandboxID"])
    # --- start it again: it re-registers (saved secret, token already used) and re-adopts.
    b.start("cubelet.service")
    wait(lambda: fleet.node_ready(node_id("b")), "node b ready again", timeout=60)
    assert pids["b"] <= sandbox_pids("b")
    for i in ids:
        _, s = fleet.api("GET", f"/sandboxes/{i}")
        assert s["state"] == "running", s

    # The metrics the dashboard is built on are really exposed by the running daemons.
    scraped = sh("curl", "-fsS", "http://127.0.0.1:9092/metrics", ns=ctl.ns).stdout
    scraped += sh("curl", "-fsS", "http://127.0.0.1:9094/metrics", ns=ctl.ns).stdout
    scraped += sh("curl", "-fsS", "http://127.0.0.1:9093/metrics", ns=fleet.nodes["a"].ns).stdout
    for m in ("cube_master_sandboxes", "cube_master_nodes", "cube_master_sandbox_create_seconds",
              "cube_api_requests_total", "cube_sandboxes", "cube_sandbox_create_seconds",
              "cube_create_phase_seconds"):
        assert f"\n{m}" in scraped or scraped.startswith(m), f"{m} not exposed"
    wait(lambda: 'cube_master_nodes{status="ready"} 2' in sh(
        "curl", "-fsS", "http://127.0.0.1:9092/metrics", ns=ctl.ns).stdout,
        "cube_master_nodes{status=ready} == 2", timeout=20)
    print(f"fleet test body took {time.time() - t0:.1f}s")

    # --- upgrade: new binaries (same code, one trailing byte so every file differs), install.sh
    # re-run on every host, daemons restarted. Configs, keys, database and sandboxes stay.
    new_bins = os.path.join(fleet.base, "new-bin")
    os.makedirs(new_bins)
    for bname in ("cubelet", "cube-master", "cube-api", "cubectl"):
        shutil.copy(os.path.join(bin_dir, bname), os.path.join(new_bins, bname))
        with open(os.path.join(new_bins, bname), "ab") as f:
            f.write(b"\0upgrade-2\0")
    keep = {p: sha(p) for p in (
        os.path.join(ctl.root, "etc/cube/master.toml"), os.path.join(pki, "ca.pem"),
        os.path.join(pki, "master.pem"), os.path.join(fleet.nodes["a"].root, "etc/cube/cubelet.toml"))}
    before = {n: sandbox_pids(n) for n in fleet.nodes}
    install(fleet, ctl, "--control", "--advertise", CTL_A, "--extra-san", f"IP:{CTL_B}",
            bin_dir=new_bins, agent=agent)
    for name, ctl_ip, node_ip in (("a", CTL_A, NODE_A), ("b", CTL_B, NODE_B)):
        h = fleet.nodes[name]
        install(fleet, h, "--compute", "--master", f"https://{ctl_ip}:9090",
                "--advertise", node_ip, "--node-id", node_id(name), "--loop-size-gib", "2",
                "--runtime", "namespace",
                "--tls-ca", f"{pki}/ca.pem", "--tls-cert", f"{pki}/node-{name}.pem",
                "--tls-key", f"{pki}/node-{name}.key", bin_dir=new_bins, agent=agent)
    for p, digest in keep.items():
        assert sha(p) == digest, f"install.sh changed {p} on upgrade"
    # Restart in the order an operator would: control first, then the nodes one by one.
    for unit in ("cube-master.service", "cube-api.service"):
        ctl.stop(unit)
        ctl.start(unit)
        assert ctl.pid_exe_sha(unit) == sha(os.path.join(new_bins, unit.split(".")[0]))
    for name, h in fleet.nodes.items():
        h.stop("cubelet.service")
        h.start("cubelet.service")
        assert h.pid_exe_sha("cubelet.service") == sha(os.path.join(new_bins, "cubelet"))
        wait(lambda n=name: fleet.node_ready(node_id(n)), f"node {name} ready after upgrade",
             timeout=60)
    for n in fleet.nodes:
        assert before[n] <= sandbox_pids(n), f"sandboxes on {n} did not survive the upgrade"
    _, lst = fleet.api("GET", "/sandboxes")
    listed = {s["sandboxID"]: s["state"] for s in lst}
    for i in ids:
        assert listed.get(i) == "running", (i, listed)
    # The upgraded fleet still creates sandboxes (database and API keys kept).
    fleet.api("POST", "/sandboxes", {"templateID": TEMPLATE, "timeout": 600})

    print(f"fleet test body took {time.time() - t0:.1f}s")
