"""A fleet on one machine: three hosts (control + two compute nodes), each a container booted
with `systemd-nspawn --boot` (systemd as its PID 1; tests/fleet/nspawn.py) in a network namespace
of its own, joined by veth links, installed with docs/install.md's commands as written (plus the
test's own values), talking gRPC over mutual TLS. Units are driven with `systemctl`.

Nodes join with one-time tokens. Sandboxes are created through the REST API on both nodes; a
compute node's cubelet is stopped and started and another's is SIGKILLed (systemd restarts it);
then every host is upgraded by re-running install.sh, which restarts the running units on the
new binaries. Sandbox processes must survive all of it, and the API must still serve them.

Binaries: $CARGO_TARGET_DIR/debug (cubelet, cube-master, cube-api, cubectl) and the static agent
$CUBE_AGENT_BIN (default $CARGO_TARGET_DIR/debug/cube-agent). Needs root and systemd-nspawn.
"""

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import time

import pytest

import nspawn
from nspawn import wait
from doc_commands import REPO, install_command

# Run from the checkout by its documented path, executed directly (its execute bit is tested).
INSTALL = "deploy/install.sh"
TEMPLATE = "fleetmini"
PROGRAMS = "sh,bash,cat,echo,ls,sleep,mkdir,rm,id,env,touch,sync,true,false,head,grep"
UID = f"{os.getpid() % 100000}"
CTL_A, NODE_A = "10.250.1.1", "10.250.1.2"
CTL_B, NODE_B = "10.250.2.1", "10.250.2.2"


def sh(*args, ns=None, check=True, env=None, timeout=120):
    cmd = list(args)
    if ns:
        cmd = ["nsenter", f"--net=/run/netns/{ns}", "--"] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Host:
    """One test host: a network namespace, and the container booted in it."""

    def __init__(self, fleet, name):
        self.fleet = fleet
        self.name = name
        self.ns = f"cf{UID}{name}"
        self.c = None

    @property
    def root(self):
        return self.c.root

    def boot(self, binds):
        self.c = nspawn.boot(self.ns, os.path.join(self.fleet.base, self.name), binds=binds,
                             netns=self.ns)

    def start(self, unit):
        """`systemctl start`: returns once the unit is active, which for these Type=notify
        units means it sent READY=1."""
        self.c.sh(f"systemctl start {unit}")
        assert self.c.active(unit), f"{unit} on {self.name} is not active after start"

    def stop(self, unit):
        """`systemctl stop`: the unit must end cleanly (inactive, not failed)."""
        self.c.sh(f"systemctl stop {unit}")
        wait(lambda: self.c.show(unit, "ActiveState") == "inactive", f"{unit} stopped", 60)
        assert self.c.show(unit, "Result") == "success", f"{unit} on {self.name} failed to stop"

    def pid_exe_sha(self, unit):
        return self.c.exe_sha(unit)


class Fleet:
    def __init__(self):
        self.base = f"/var/tmp/cube-fleet-{UID}"
        # Certificates, configs and upgrade binaries for the hosts: bound read-only into each.
        self.xfer = os.path.join(self.base, "xfer")
        self.control = Host(self, "ctl")
        self.nodes = {"a": Host(self, "a"), "b": Host(self, "b")}
        self.api_key = None

    def hosts(self):
        return [self.control, *self.nodes.values()]

    def cubectl(self, *args, tls=True, check=True):
        """cubectl on the control host, with the admin certificate as docs/install.md says."""
        env = ("CUBE_TLS_CA=/etc/cube/pki/ca.pem CUBE_TLS_CERT=/etc/cube/pki/admin.pem "
               "CUBE_TLS_KEY=/etc/cube/pki/admin.key") if tls else ""
        return self.control.c.sh(shlex.join(["cubectl", "--master", "https://127.0.0.1:9090",
                                             *args]), env=env, check=check)

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
    return nspawn.cgroup_pids(cgroup_parent(name))


def install(fleet, host, *args, bin_dir, agent):
    """install.sh on `host`, from the checkout, as root on that host (no --root: it installs
    into the host's / and drives its systemd)."""
    cmd = shlex.join([INSTALL, *args, "--bin-dir", bin_dir, "--agent", agent])
    return host.c.sh(f"cd {shlex.quote(REPO)} && {cmd}", timeout=300)


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
    path = os.path.join(fleet.xfer, f"extra-{name}.toml")
    n = 1 if name == "a" else 2
    with open(path, "w") as f:
        f.write(f"""
[sandbox]
max_sandboxes = 8
tmp_size_mib = 16
ready_timeout_ms = 20000
[cgroup]
root = "{nspawn.HOST_CGROUPS}"
parent = "{cgroup_parent(name)}"
[pools]
network = 1
disks = 0
[switch]
host_pool = "10.239.{n}.0/24"
pin_root = "/run/cube-bpf"
nft_table = "cube_fleet{UID}{name}"
""")
    return path


def teardown(fleet):
    # Kill the sandboxes through the API while it is up, then the hosts, then sweep.
    if fleet.api_key:
        try:
            _, lst = fleet.api("GET", "/sandboxes", check=False)
            for s in lst or []:
                fleet.api("DELETE", f"/sandboxes/{s['sandboxID']}", check=False)
        except Exception:  # noqa: BLE001 - best effort, the sweep below follows
            pass
    for name in fleet.nodes:
        nspawn.remove_cgroups(cgroup_parent(name))
    for h in fleet.hosts():
        if h.c and h.c.leader:
            print(f"--- {h.name}:\n" + h.c.journal(("cube-master", "cube-api", "cubelet"), 15))
        nspawn.shutdown(h.c)
        subprocess.run(["ip", "netns", "del", h.ns], stderr=subprocess.DEVNULL)
    shutil.rmtree(fleet.base, ignore_errors=True)


def test_fleet_install_restart_upgrade():
    nspawn.require()
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
    os.makedirs(fleet.xfer)
    try:
        run_fleet(fleet, bin_dir, agent)
    finally:
        teardown(fleet)


def run_fleet(fleet, bin_dir, agent):
    t0 = time.time()
    setup_network(fleet)
    ctl = fleet.control
    binds = (REPO, bin_dir, os.path.dirname(agent), fleet.xfer)

    # --- control host: CA, certificates, master + api over mutual TLS, started by install.sh.
    ctl.boot(binds)
    install(fleet, ctl, *from_docs("--control", {"10.0.0.1": CTL_A, "/opt/cube/bin": bin_dir}),
            "--extra-san", f"IP:{CTL_B}", bin_dir=bin_dir, agent=agent)
    pki = os.path.join(ctl.root, "etc/cube/pki")
    for f in ("ca.pem", "ca.key", "master.pem", "api.pem", "admin.pem"):
        assert os.path.exists(os.path.join(pki, f)), f
    for u in ("cube-master", "cube-api"):
        wait(lambda u=u: ctl.c.active(u), f"{u} active (READY=1)", 90)
    fleet.api_key = fleet.cubectl("apikey", "create", "--name", "fleet").stdout.strip()
    assert fleet.api_key

    # Without a certificate the master refuses cubectl (mutual TLS is really on).
    assert fleet.cubectl("nodes", tls=False, check=False).returncode != 0

    # --- compute hosts: a certificate each (issued on the control host and copied over), a
    # one-time token each, installed as the docs say; templates built with cubelet stopped.
    for name, ctl_ip, node_ip in (("a", CTL_A, NODE_A), ("b", CTL_B, NODE_B)):
        h = fleet.nodes[name]
        ctl.c.sh(f"cd {shlex.quote(REPO)} && " + shlex.join([INSTALL, *from_docs(
            "--issue-cert", {"node7": f"node-{name}", "IP:10.0.0.7": f"IP:{node_ip}"})]))
        certs = os.path.join(fleet.xfer, f"certs-{name}")
        os.makedirs(certs)
        for src, dst in (("ca.pem", "ca.pem"), (f"node-{name}.pem", "node.pem"),
                         (f"node-{name}.key", "node.key")):
            shutil.copy(os.path.join(pki, src), os.path.join(certs, dst))
        token = fleet.cubectl("join-token", "create").stdout.strip()
        assert token
        extra = node_extra_config(fleet, name)
        h.boot(binds)
        install(fleet, h, *from_docs("--compute", {
                    "https://10.0.0.1:9090": f"https://{ctl_ip}:9090", "TOKEN": token,
                    "10.0.0.7": node_ip, "ca.pem": f"{certs}/ca.pem",
                    "node7.pem": f"{certs}/node.pem", "node7.key": f"{certs}/node.key",
                    "/opt/cube/bin": bin_dir}),
                "--node-id", node_id(name), "--loop-size-gib", "2", "--runtime", "namespace",
                "--cubelet-extra", extra, bin_dir=bin_dir, agent=agent)
        wait(lambda h=h: h.c.active("cubelet"), f"cubelet on {name} active", 90)
        h.stop("cubelet")
        h.c.sh(f"cubelet host-root /var/tmp/hostroot --programs {PROGRAMS} >/dev/null && "
               f"cubelet --config /etc/cube/cubelet.toml build-template {TEMPLATE} "
               "--dir /var/tmp/hostroot >/dev/null")
        h.start("cubelet")
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
    b.stop("cubelet")
    wait(lambda: not fleet.node_ready(node_id("b"), templates=False), "node b not ready",
         timeout=60)
    assert pids["b"] <= sandbox_pids("b"), "sandboxes on b died with their cubelet"
    _, sb = fleet.api("POST", "/sandboxes", {"templateID": TEMPLATE, "timeout": 600})
    ids.append(sb["sandboxID"])
    # --- start it again: it re-registers (saved secret, token already used) and re-adopts.
    b.start("cubelet")
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

    # --- node a's cubelet SIGKILLed: systemd restarts it (Restart=on-failure), sandboxes stay.
    a = fleet.nodes["a"].c
    pid, restarts = a.main_pid("cubelet"), int(a.show("cubelet", "NRestarts"))
    a.sh(f"kill -9 {pid}")
    wait(lambda: a.active("cubelet") and a.main_pid("cubelet") not in (0, pid),
         "cubelet on a restarted by systemd", 60)
    assert int(a.show("cubelet", "NRestarts")) == restarts + 1
    wait(lambda: fleet.node_ready(node_id("a")), "node a ready after its restart", timeout=60)
    assert pids["a"] <= sandbox_pids("a"), "sandboxes on a died with their killed cubelet"

    # --- upgrade: new binaries (same code, one trailing byte so every file differs), install.sh
    # re-run on every host, control first: it restarts the running units on the new binaries.
    # Configs, keys, database and sandboxes stay.
    new_bins = os.path.join(fleet.xfer, "new-bin")
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
    for unit in ("cube-master", "cube-api"):
        wait(lambda u=unit: ctl.c.active(u), f"{unit} active after the upgrade", 90)
        assert ctl.pid_exe_sha(unit) == sha(os.path.join(new_bins, unit))
    for name, ctl_ip, node_ip in (("a", CTL_A, NODE_A), ("b", CTL_B, NODE_B)):
        h = fleet.nodes[name]
        certs = os.path.join(fleet.xfer, f"certs-{name}")
        install(fleet, h, "--compute", "--master", f"https://{ctl_ip}:9090",
                "--advertise", node_ip, "--node-id", node_id(name), "--loop-size-gib", "2",
                "--runtime", "namespace",
                "--tls-ca", f"{certs}/ca.pem", "--tls-cert", f"{certs}/node.pem",
                "--tls-key", f"{certs}/node.key", bin_dir=new_bins, agent=agent)
        wait(lambda h=h: h.c.active("cubelet"), f"cubelet on {name} active after the upgrade", 90)
        assert h.pid_exe_sha("cubelet") == sha(os.path.join(new_bins, "cubelet"))
        wait(lambda n=name: fleet.node_ready(node_id(n)), f"node {name} ready after upgrade",
             timeout=60)
    for p, digest in keep.items():
        assert sha(p) == digest, f"install.sh changed {p} on upgrade"
    for n in fleet.nodes:
        assert before[n] <= sandbox_pids(n), f"sandboxes on {n} did not survive the upgrade"
    _, lst = fleet.api("GET", "/sandboxes")
    listed = {s["sandboxID"]: s["state"] for s in lst}
    for i in ids:
        assert listed.get(i) == "running", (i, listed)
    # The upgraded fleet still creates sandboxes (database and API keys kept).
    fleet.api("POST", "/sandboxes", {"templateID": TEMPLATE, "timeout": 600})

    print(f"fleet test body took {time.time() - t0:.1f}s")
