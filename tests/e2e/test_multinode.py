"""Multi-node: cube-master + cube-api on the host and two cubelets, each in its own network
namespace acting as a separate host (reachable from the master only over its veth). Sandboxes are
scheduled across both; one cubelet is killed: its sandboxes are reported lost and new sandboxes go
to the other node. Uses the master's static `nodes` list. Needs root."""

import json
import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

import stack
from conftest import PROGRAMS, TEMPLATE, _bin, _cleanup_node, _wait
from ports import reserve_port

INSTALL = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "install.sh")


def sh(*args, check=True):
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class Host:
    """A cubelet in its own netns, joined to the host by a veth /30."""

    def __init__(self, tag, idx, base):
        self.name = f"{tag}{'ab'[idx]}"
        self.netns = f"cmn-{self.name}"
        self.veth = f"vmn{self.name}"[:15]
        self.host_ip = f"{base}.{4 * idx + 1}"
        self.ns_ip = f"{base}.{4 * idx + 2}"
        self.port = 50051
        self.proc = None
        self.log = None

    @property
    def url(self):
        return f"http://{self.ns_ip}:{self.port}"


def _tcp_open(ns, ip, port):
    r = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "bash", "-c",
                        f"exec 3<>/dev/tcp/{ip}/{port}"], capture_output=True)
    return r.returncode == 0


@pytest.fixture(scope="module")
def fleet():
    if os.geteuid() != 0:
        pytest.fail("the multi-node test needs root (netns, veth, cubelet)")
    cubelet, master, api, cubectl = (_bin(n) for n in ("cubelet", "cube-master", "cube-api", "cubectl"))
    agent = os.environ.get("CUBE_AGENT_BIN") or _bin("cube-agent")
    tag = f"m{os.getpid() % 100000}"
    # A /29 of link addresses unique to this run (two /30 veth links).
    base = f"10.251.{os.getpid() % 250}"
    root = f"/var/tmp/cube-mn-{tag}"
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    hosts = [Host(tag, i, base) for i in range(2)]
    procs, logs = [], []
    try:
        stripped = os.path.join(root, "cube-agent")
        if subprocess.run(["strip", "-o", stripped, agent]).returncode != 0:
            shutil.copy(agent, stripped)
        hostroot = os.path.join(root, "hostroot")
        sh(cubelet, "host-root", hostroot, "--programs", PROGRAMS)
        # The cubelets listen on their hosts' addresses, which the daemons allow only with
        # mutual TLS: a fleet CA, a certificate per node, one for the master and one for clients.
        pki = os.path.join(root, "pki")
        sh("bash", INSTALL, "--make-ca", pki)
        for name, san in [(h.name, f"IP:{h.ns_ip}") for h in hosts] + [("master", "IP:127.0.0.1"),
                                                                        ("client", "IP:127.0.0.1")]:
            sh("bash", INSTALL, "--issue-cert", name, "--pki", pki, "--san", san)

        def tls(name):
            return {"tls": {"ca": f"{pki}/ca.pem", "cert": f"{pki}/{name}.pem",
                            "key": f"{pki}/{name}.key"}}
        for i, h in enumerate(hosts):
            sh("ip", "netns", "add", h.netns)
            sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            sh("ip", "addr", "add", f"{h.host_ip}/30", "dev", h.veth)
            sh("ip", "link", "set", h.veth, "up")
            for cmd in (["ip", "addr", "add", f"{h.ns_ip}/30", "dev", "eth0"],
                        ["ip", "link", "set", "eth0", "up"], ["ip", "link", "set", "lo", "up"]):
                sh("ip", "netns", "exec", h.netns, *cmd)
            d = os.path.join(root, h.name)
            os.makedirs(d)
            h.root = d
            h.cfg = stack.write_toml(os.path.join(d, "cubelet.toml"), stack.cubelet_config(
                h.name, d, f"{h.ns_ip}:{h.port}", f"127.0.0.1:{reserve_port()}", stripped, {
                    "storage": {"xfs_loop_size_gib": 2},
                    "sandbox": {"max_sandboxes": 8},
                    "pools": {"network": 0},
                    **tls(h.name),
                }))
            sh(cubelet, "--config", h.cfg, "build-template", TEMPLATE, "--dir", hostroot)
            # nsenter --net (not `ip netns exec`, which remounts /sys and hides the cgroup tree):
            # the cubelet shares the host's mounts but has only its own network stack.
            h.log = open(os.path.join(d, "cubelet.log"), "w")
            logs.append(h.log)
            h.proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{h.netns}", cubelet, "--config",
                                       h.cfg, "run", "--kill-sandboxes-on-exit"],
                                      stdout=h.log, stderr=subprocess.STDOUT)
            procs.append(h.proc)
            _wait(lambda: _tcp_open(h.netns, h.ns_ip, h.port), f"cubelet {h.name}", procs=[h.proc])

        mp, ap, ep, metp = reserve_port(), reserve_port(), reserve_port(), reserve_port()
        mcfg = stack.write_toml(os.path.join(root, "master.toml"), stack.master_config(
            f"127.0.0.1:{mp}", f"sqlite://{root}/master.db?mode=rwc", [h.url for h in hosts],
            f"127.0.0.1:{reserve_port()}",
            {"node_poll_interval_ms": 300, "node_max_misses": 2, **tls("master")}))
        mlog = open(os.path.join(root, "master.log"), "w")
        logs.append(mlog)
        pm = subprocess.Popen([master, "--config", mcfg, "run"], stdout=mlog, stderr=subprocess.STDOUT)
        procs.append(pm)
        acfg = stack.write_toml(os.path.join(root, "api.toml"), stack.api_config(
            f"127.0.0.1:{ap}", f"127.0.0.1:{ep}", [f"http://127.0.0.1:{mp}"], f"127.0.0.1:{metp}",
            tls("client")))
        alog = open(os.path.join(root, "api.log"), "w")
        logs.append(alog)
        pa = subprocess.Popen([api, "--config", acfg], stdout=alog, stderr=subprocess.STDOUT)
        procs.append(pa)
        _wait(lambda: httpx.get(f"http://127.0.0.1:{ap}/health", timeout=1).status_code == 200,
              "cube-api", procs=[pm, pa])
        os.environ.update(CUBE_TLS_CA=f"{pki}/ca.pem", CUBE_TLS_CERT=f"{pki}/client.pem",
                          CUBE_TLS_KEY=f"{pki}/client.key")
        ctl = [cubectl, "--master", f"http://127.0.0.1:{mp}"]
        _wait(lambda: sh(*ctl, "apikey", "list", check=False).returncode == 0, "cube-master", procs=[pm])
        key = sh(*ctl, "apikey", "create", "--name", "mn").stdout.strip()

        def ready_nodes():
            return [n for n in json.loads(sh(*ctl, "--json", "nodes").stdout)
                    if n["status"] == "ready" and TEMPLATE in n["templates"]]
        _wait(lambda: len(ready_nodes()) == 2, "both nodes ready in the master", timeout=60)
        yield {"api": f"http://127.0.0.1:{ap}", "key": key, "ctl": ctl, "hosts": hosts}
    finally:
        stack.stop(procs)
        for lf in logs:
            lf.close()
        for h in hosts:
            if hasattr(h, "root"):
                _cleanup_node(h.root, f"cube-{h.name}")
            subprocess.run(["ip", "link", "del", h.veth], stderr=subprocess.DEVNULL)
            subprocess.run(["ip", "netns", "del", h.netns], stderr=subprocess.DEVNULL)
        for k in ("CUBE_TLS_CA", "CUBE_TLS_CERT", "CUBE_TLS_KEY"):
            os.environ.pop(k, None)
        if os.environ.get("CUBE_E2E_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)


def _create(f, n):
    ids = []
    for _ in range(n):
        r = httpx.post(f["api"] + "/v2/sandboxes", headers={"X-API-Key": f["key"]},
                       json={"templateID": TEMPLATE, "timeout": 300}, timeout=60)
        assert r.status_code == 201, r.text
        ids.append(r.json()["sandboxID"])
    return ids


def _placement(f, state=None):
    args = [*f["ctl"], "--json", "sandbox", "list"] + (["--state", state] if state else [])
    return {s["id"]: s for s in json.loads(sh(*args).stdout)}


def _node_of(s):
    # The node is reported by id (the cubelet's node_id) or by its address.
    return s.get("node") or s.get("node_id") or s.get("node_address") or ""


def test_schedule_across_nodes_then_lose_one(fleet):
    hosts = fleet["hosts"]
    ids = _create(fleet, 6)
    placed = _placement(fleet)
    nodes = {i: _node_of(placed[i]) for i in ids}
    by_node = {h.name: [i for i in ids if h.name in nodes[i] or h.ns_ip in nodes[i]] for h in hosts}
    assert all(by_node.values()), f"sandboxes not spread over both nodes: {nodes}"
    assert sum(map(len, by_node.values())) == 6, nodes

    # Host A dies without a goodbye (SIGKILL: no kill-sandboxes-on-exit).
    dead, alive = hosts[0], hosts[1]
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(timeout=10)

    def lost():
        rows = _placement(fleet, "lost")
        return all(i in rows for i in by_node[dead.name])
    _wait(lost, "sandboxes of the dead node reported lost", timeout=30)
    # The API no longer lists them as running; the survivors still are.
    r = httpx.get(fleet["api"] + "/v2/sandboxes", headers={"X-API-Key": fleet["key"]}, timeout=30)
    listed = {s["sandboxID"] for s in r.json()}
    assert not listed & set(by_node[dead.name]), listed
    assert set(by_node[alive.name]) <= listed
    nodes_now = {n["id"] if "id" in n else n["address"]: n for n in
                 json.loads(sh(*fleet["ctl"], "--json", "nodes").stdout)}
    assert any(n["status"] != "ready" and (dead.name in json.dumps(n) or dead.ns_ip in json.dumps(n))
               for n in nodes_now.values()), nodes_now

    # New sandboxes all go to the surviving node.
    new = _create(fleet, 3)
    placed = _placement(fleet)
    for i in new:
        n = _node_of(placed[i])
        assert alive.name in n or alive.ns_ip in n, (i, n)
    for i in ids + new:
        httpx.delete(fleet["api"] + f"/sandboxes/{i}", headers={"X-API-Key": fleet["key"]}, timeout=30)
