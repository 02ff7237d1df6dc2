"""A real single-host Cube for the e2b SDK: cubelet (namespace runtime, a tiny template built
from host binaries), cube-master and cube-api on free 127.0.0.1 ports, and an API key.

Binaries come from $CARGO_TARGET_DIR/debug (cube-master, cube-api, cubectl, cubelet); the agent
from $CUBE_AGENT_BIN (default: $CARGO_TARGET_DIR/debug/cube-agent). Needs root (cubelet).
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

# tests/microvm_logs.py, shared with the other suites that start microVM stacks.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ports import reserve_port  # noqa: E402  (tests/ports.py: held, not bind-and-close)

TEMPLATE = "e2emini"
# A command printing every process's name (one that exits between the glob and `cat` is skipped).
PROCESS_NAMES = "cat /proc/[0-9]*/comm 2>/dev/null || true"
# dmesg: a failed microVM test prints the guest's kernel log (tests/microvm_logs.py); chmod:
# tests/isolation makes its probe executable; nc, mkfifo, mv, seq: test_public_ports's servers.
# Sandboxes' DNS server: an address on test_egress.py's test network (nothing answers there
# unless that module's namespace is up).
TEST_RESOLVER = "203.0.113.53"
# The node samples each sandbox this often (production: 5 s), so a test sees a history quickly.
# Not on microvm: each pass is a request to every guest's agent, and where the guest kernel is
# emulated (PVM, nested TCG) that load slows the guests down; its tests read logs on demand.
SAMPLE_INTERVAL_MS = 300
PROGRAMS = "sh,bash,cat,echo,ls,sleep,mkdir,rm,id,env,touch,sync,true,false,head,grep,dmesg,chmod,nc,mkfifo,mv,seq"


def _bin(name):
    tgt = os.environ.get("CARGO_TARGET_DIR")
    if not tgt:
        pytest.fail("CARGO_TARGET_DIR must point at the cargo target dir with the debug binaries")
    p = os.path.join(tgt, "debug", name)
    if not os.path.exists(p):
        pytest.fail(f"{p} missing: build it (cargo build -p {name})")
    return p


def _wait(pred, what, timeout=30.0, procs=()):
    end = time.time() + timeout
    while time.time() < end:
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"{what}: {p.args[0]} exited with {p.returncode}")
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def _port_open(port):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def running_in_master(cube):
    """The ids of the sandboxes the master has running (cubectl sandbox list)."""
    out = subprocess.run(cube.cubectl + ["--json", "sandbox", "list"], check=True,
                         capture_output=True, text=True).stdout
    return {s["id"] for s in json.loads(out) if s.get("state") == "running"}


def running_on_node(cube):
    """How many sandboxes the node runs (its cube_sandboxes gauge)."""
    text = urllib.request.urlopen(cube.cubelet_http + "/metrics", timeout=5).read().decode()
    m = re.search(r'^cube_sandboxes\{state="running"\} (\d+)', text, re.M)
    return int(m.group(1)) if m else 0


class Cube:
    def __init__(self):
        self.procs = []


# The runtime of the session's stack: every SDK test runs against it. CI runs the suite on
# `namespace` and again on `gvisor` (tests/run.sh).
RUNTIME = os.environ.get("CUBE_E2E_RUNTIME", "namespace")


@pytest.fixture(scope="session")
def cube():
    yield from _stack(RUNTIME)


def guest_kernel():
    """The microVM guest kernel: $CUBE_GUEST_KERNEL, else deploy/guest-kernel/out/vmlinux."""
    k = os.environ.get("CUBE_GUEST_KERNEL") or os.path.join(
        os.path.dirname(__file__), "..", "..", "deploy", "guest-kernel", "out", "vmlinux")
    if not os.path.exists(k):
        pytest.fail(f"guest kernel {k} missing: build it with deploy/guest-kernel/build.sh")
    return os.path.abspath(k)


@pytest.fixture(scope="module")
def cube_microvm():
    """A second stack whose cubelet runs the microvm runtime with the Linux guest kernel."""
    yield from _stack("microvm")


@pytest.fixture(scope="module")
def cube_gvisor(request):
    """A stack whose cubelet runs the gvisor runtime (runsc, systrap platform): the session's
    own when the suite runs on gvisor, else a second one."""
    if RUNTIME == "gvisor":
        yield request.getfixturevalue("cube")
        return
    yield from _stack("gvisor")


# What the master reports for an agent whose version it could not read (never the agent's own;
# a valid version, as the SDKs parse it).
ENVD_FALLBACK = "0.0.1+unread"


@pytest.fixture(scope="module")
def cube_ha():
    """A stack with two cube-masters on one PostgreSQL database (a schema of its own in
    $CUBE_TEST_PG_URL): one leads, the other stands by. cube-api and the cubelet (which
    registers, rather than being polled from a static list) know both."""
    yield from _stack(RUNTIME, masters=2)


def _pg_schema(name):
    """A fresh schema in $CUBE_TEST_PG_URL for `name`; returns (database URL, drop function)."""
    base = os.environ.get("CUBE_TEST_PG_URL")
    if not base:
        pytest.fail('CUBE_TEST_PG_URL is not set (export CUBE_TEST_PG_URL="$(deploy/postgres-test.sh)")')
    schema = f"e2e_{name}".replace("-", "_")

    def psql(sql):
        subprocess.run(["psql", base, "-v", "ON_ERROR_STOP=1", "-qc", sql], check=True,
                       stdout=subprocess.DEVNULL)

    psql(f"SET client_min_messages = warning; DROP SCHEMA IF EXISTS {schema} CASCADE; "
         f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options[search_path]={schema}", lambda: psql(
        f"SET client_min_messages = warning; DROP SCHEMA IF EXISTS {schema} CASCADE")


def _stack(runtime, api_extra="", masters=1):
    """A stack on `runtime`; `api_extra` is appended to api.toml (tests/security's limits);
    `masters` > 1: that many cube-masters on one PostgreSQL database (see `cube_ha`)."""
    if os.geteuid() != 0:
        pytest.fail("tests/e2e needs root: cubelet creates namespaces, cgroups and loop mounts")
    cubelet, master, api, cubectl = (_bin(n) for n in ("cubelet", "cube-master", "cube-api", "cubectl"))
    agent = os.environ.get("CUBE_AGENT_BIN") or _bin("cube-agent")
    if not os.path.exists(agent):
        pytest.fail(f"CUBE_AGENT_BIN={agent} does not exist")
    # A half-written binary (a concurrent cargo build) would only show up as an exec error
    # deep inside cubelet: check it runs first.
    v = subprocess.run([agent, "--version"], capture_output=True, text=True)
    if v.returncode != 0 or "cube-agent" not in v.stdout:
        pytest.fail(f"{agent} does not run (--version: rc={v.returncode} {v.stderr.strip()!r})")
    # The runtime written in cubelet.toml: `runtime` itself, or "auto" where the host must make
    # cubelet pick `runtime` by itself (tests/nested on SVM KVM); the choice is checked below.
    configured = os.environ.get("CUBE_E2E_CONFIGURED_RUNTIME", runtime)
    if configured not in (runtime, "auto"):
        pytest.fail(f"CUBE_E2E_CONFIGURED_RUNTIME={configured!r}: want {runtime!r} or 'auto'")
    name = f"e2e{os.getpid()}" + {"microvm": "vm", "gvisor": "gv"}.get(runtime, "") \
        + ("ha" if masters > 1 else "")
    # The switch's node-level state is this test node's own: a host address pool that no other
    # test cubelet uses, its own bpffs pin root and masquerade table (removed at teardown).
    host_pool = os.environ.get("CUBE_E2E_HOST_POOL") or f"10.238.{os.getpid() % 254 + 1}.0/24"
    if runtime == "microvm":
        host_pool = f"10.239.{os.getpid() % 254 + 1}.0/24"
    if runtime == "gvisor":
        host_pool = f"10.237.{os.getpid() % 254 + 1}.0/24"
    if masters > 1:
        host_pool = f"10.236.{os.getpid() % 254 + 1}.0/24"
    pin_root = f"/tmp/cube-e2e-bpf-{name}"
    nft_table = f"cube_e2e_{name}".replace("-", "_")
    root = f"/var/tmp/cube-e2e-{name}"
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    c = Cube()
    c.root = root
    # The version the agent reports (`cube-agent 0.6.4`); the master's fallback for an agent it
    # could not read is set to something else below, so the tests prove the version was read.
    c.envd_version = v.stdout.split()[-1]
    logs = []
    saved_env = {}
    drop_schema = None
    try:
        stripped = os.path.join(root, "cube-agent")
        if subprocess.run(["strip", "-o", stripped, agent]).returncode != 0:
            shutil.copy(agent, stripped)
        g, h = reserve_port(), reserve_port()
        master_ports = [reserve_port() for _ in range(masters)]
        # With several masters the node registers with them (whichever leads answers).
        master_link = "" if masters == 1 else "[master]\naddresses = [" + ", ".join(
            f'"http://127.0.0.1:{p}"' for p in master_ports) + "]\n"
        cfg = os.path.join(root, "cubelet.toml")
        microvm = ""
        if runtime == "microvm":
            # One pre-spawned shim: the template's snapshot is built at start (a Linux boot).
            microvm = f"""[microvm]
shim_binary = "{_bin('cube-shim')}"
guest = "{guest_kernel()}"
taps = 2
shims_per_template = 1
[pools.started]
{TEMPLATE} = 1
"""
        # Pre-started sandboxes (benches set CUBE_E2E_STARTED_POOL to measure creates from a
        # full pool); gvisor always has a few: a cold runsc start is a quarter of a second.
        started = int(os.environ.get("CUBE_E2E_STARTED_POOL") or (2 if runtime == "gvisor" else 0))
        if runtime != "microvm" and started:
            microvm = f"""[pools.started]
{TEMPLATE} = {started}
"""
        with open(cfg, "w") as f:
            f.write(f"""runtime = "{configured}"
node_id = "{name}"
grpc_addr = "127.0.0.1:{g}"
http_addr = "127.0.0.1:{h}"
data_dir = "{root}/data"
run_dir = "{root}/run"
cache_dir = "{root}/cache"
agent_binary = "{stripped}"
[storage]
xfs_loop_image = "{root}/xfs.img"
xfs_loop_size_gib = 4
[sandbox]
max_sandboxes = {os.environ.get("CUBE_E2E_MAX_SANDBOXES", "32")}
tmp_size_mib = 16
ready_timeout_ms = 15000
[cgroup]
parent = "cube-{name}"
[pools]
network = 1
disks = 0
[network]
switch = "cube-vs"
dns_resolver = "{TEST_RESOLVER}"
egress_proxy = "169.254.64.1"
[journal]
sample_interval_ms = {5000 if runtime == "microvm" else SAMPLE_INTERVAL_MS}
[switch]
host_pool = "{host_pool}"
pin_root = "{pin_root}"
nft_table = "{nft_table}"
{microvm}{master_link}""")
        host = os.path.join(root, "hostroot")
        subprocess.run([cubelet, "host-root", host, "--programs", PROGRAMS], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([cubelet, "--config", cfg, "build-template", TEMPLATE, "--dir", host],
                       check=True, stdout=subprocess.DEVNULL)

        def start(args, log):
            lf = open(os.path.join(root, log), "w")
            logs.append(lf)
            p = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT)
            c.procs.append(p)
            return p

        pl = start([cubelet, "--config", cfg, "run", "--kill-sandboxes-on-exit"], "cubelet.log")
        _wait(lambda: _port_open(g), "cubelet gRPC", procs=[pl])
        c.cubelet_http = f"http://127.0.0.1:{h}"
        with open(os.path.join(root, "cubelet.log")) as f:
            chosen = [re.sub(r"\x1b\[[0-9;]*m", "", l) for l in f if "runtime selected" in l]
        if not chosen or f'runtime="{runtime}"' not in chosen[0]:
            pytest.fail(f"runtime = {configured!r} did not select {runtime!r}: {chosen}")
        print(f"cubelet: {chosen[0].strip()}")
        c.cubelet_grpc = f"127.0.0.1:{g}"
        c.runtime = runtime
        if runtime == "microvm":
            # The snapshot build boots the guest once; creates then restore a warm shim.
            ready = f'cube_pool_ready{{pool="shim",template="{TEMPLATE}"}} 1'
            _wait(lambda: ready in urllib.request.urlopen(c.cubelet_http + "/metrics", timeout=2)
                  .read().decode(), "template snapshot and a warm shim", timeout=300, procs=[pl])
        elif started:
            ready = f'cube_pool_ready{{pool="started",template="{TEMPLATE}"}} {started}'
            _wait(lambda: ready in urllib.request.urlopen(c.cubelet_http + "/metrics", timeout=2)
                  .read().decode(), f"{started} pre-started sandboxes", timeout=300, procs=[pl])

        # A second, never-answering node: the master must keep it NotReady and schedule around it.
        dead = reserve_port()
        c.dead_node = f"http://127.0.0.1:{dead}"
        if masters == 1:
            database = f"sqlite://{root}/master.db?mode=rwc"
            shared_keys = ""
        else:
            database, drop_schema = _pg_schema(name)
            c.pg_base_url = os.environ["CUBE_TEST_PG_URL"]
            # The fleet's keys: every master derives the same access tokens and opens the same
            # secrets.
            shared_keys = f'token_key_file = "{root}/token.key"\nsecrets_key_file = "{root}/secrets.key"\n'
        c.database_url = database
        c.master_cmds, c.master_procs, c.master_metrics = [], [], []
        for i, mp in enumerate(master_ports):
            mcfg = os.path.join(root, f"master{i or ''}.toml")
            metrics = reserve_port()
            with open(mcfg, "w") as f:
                f.write(f"""grpc_addr = "127.0.0.1:{mp}"
database_url = "{database}"
nodes = [{'"http://127.0.0.1:%d", ' % g if masters == 1 else ''}"http://127.0.0.1:{dead}"]
node_poll_interval_ms = 500
reaper_interval_ms = 250
heartbeat_interval_ms = 500
max_timeout_s = 86400
default_envd_version = "{ENVD_FALLBACK}"
metrics_addr = "127.0.0.1:{metrics}"
""" + shared_keys)
            cmd = [master, "--config", mcfg, "run"]
            p = start(cmd, f"master{i or ''}.log")
            c.master_cmds.append(cmd)
            c.master_procs.append(p)
            c.master_metrics.append(f"http://127.0.0.1:{metrics}/metrics")
            if i == 0:
                # The first leads (it starts alone); the others stand by behind it.
                _wait(lambda: _port_open(mp), "cube-master gRPC", procs=[p])
        c.master_cmd, c.master_proc = c.master_cmds[0], c.master_procs[0]
        c.master_urls = [f"http://127.0.0.1:{p}" for p in master_ports]
        c.master_url = ",".join(c.master_urls)
        c.ports = {"cubelet grpc": g, "cubelet http": h}
        c.ports.update({f"master{i} grpc": p for i, p in enumerate(master_ports)})

        ap, ep, metp = reserve_port(), reserve_port(), reserve_port()
        acfg = os.path.join(root, "api.toml")
        with open(acfg, "w") as f:
            f.write(f"""api_addr = "127.0.0.1:{ap}"
edge_addr = "127.0.0.1:{ep}"
master_urls = [{", ".join(f'"{u}"' for u in c.master_urls)}]
metrics_addr = "127.0.0.1:{metp}"
""" + api_extra)
        c.api_metrics_url = f"http://127.0.0.1:{metp}"
        c.start = start
        c.api_bin = api
        pa = start([api, "--config", acfg], "api.log")
        _wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{ap}/health", timeout=1).status == 200,
              "cube-api", procs=[pa])
        c.api_url = f"http://127.0.0.1:{ap}"
        c.sandbox_url = f"http://127.0.0.1:{ep}"
        c.ports.update({"api": ap, "edge": ep, "api metrics": metp})
        c.cubectl = [cubectl, "--master", c.master_url]
        out = subprocess.run(c.cubectl + ["apikey", "create", "--name", "e2e"], check=True,
                             capture_output=True, text=True)
        c.api_key = out.stdout.strip()
        # The SDK reads these: point it at this stack while it is up, and back at the previous
        # one (the session's namespace stack) when it goes.
        for k, v in (("E2B_API_URL", c.api_url), ("E2B_SANDBOX_URL", c.sandbox_url),
                     ("E2B_API_KEY", c.api_key)):
            saved_env.setdefault(k, os.environ.get(k))
            os.environ[k] = v
        # The master schedules only onto nodes whose template list it has polled.
        _wait(lambda: TEMPLATE in subprocess.run(c.cubectl + ["--json", "nodes"], capture_output=True,
                                                 text=True).stdout, "node ready in master")
        yield c
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in reversed(c.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for lf in logs:
            lf.close()
        if drop_schema:
            drop_schema()
        _cleanup_node(root, f"cube-{name}")
        subprocess.run(["nft", "delete", "table", "ip", nft_table], stderr=subprocess.DEVNULL)
        subprocess.run(["umount", "-l", pin_root], stderr=subprocess.DEVNULL)
        shutil.rmtree(pin_root, ignore_errors=True)


def _cleanup_node(root, cgroup_parent):
    # Belt and braces after a failed run: whatever cubelet left in our cgroups, netns and mounts.
    for h in ("", "cpu", "memory", "pids", "freezer"):
        d = os.path.join("/sys/fs/cgroup", h, cgroup_parent)
        if not os.path.isdir(d):
            continue
        for e in os.scandir(d):
            if not e.is_dir():
                continue
            try:
                with open(os.path.join(e.path, "freezer.state"), "w") as f:
                    f.write("THAWED")
            except OSError:
                pass
            try:
                for pid in open(os.path.join(e.path, "cgroup.procs")).read().split():
                    try:
                        os.kill(int(pid), 9)
                    except (OSError, ValueError):
                        pass
            except OSError:
                pass
            time.sleep(0.05)
            try:
                os.rmdir(e.path)
            except OSError:
                pass
        try:
            os.rmdir(d)
        except OSError:
            pass
    netns = os.path.join(root, "run", "netns")
    if os.path.isdir(netns):
        for e in os.scandir(netns):
            subprocess.run(["umount", "-l", e.path], stderr=subprocess.DEVNULL)
    subprocess.run(["umount", "-l", os.path.join(root, "data")], stderr=subprocess.DEVNULL)
    if os.environ.get("CUBE_E2E_KEEP") != "1":
        shutil.rmtree(root, ignore_errors=True)
