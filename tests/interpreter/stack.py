"""A real single-host Cube with the `code-interpreter-v1` template, for the code-interpreter
suite and its benchmark: cubelet (namespace runtime), cube-master and cube-api on free 127.0.0.1
ports, and an API key. Needs root.

Binaries: cubelet, cube-master, cube-api and cubectl from $CUBE_BIN_DIR (default
$CARGO_TARGET_DIR/debug); the agent from $CUBE_AGENT_BIN (default $CARGO_TARGET_DIR/debug/cube-agent).
The template comes from deploy/templates/code-interpreter-v1/build.sh, whose debootstrap step is
cached under $CUBE_TEMPLATE_CACHE (default /var/cache/cube/templates).
"""

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

# tests/ports.py: ports held for the stack, not bound and closed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ports import reserve_port  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD_SH = os.path.join(REPO, "deploy", "templates", "code-interpreter-v1", "build.sh")
TEMPLATE = "code-interpreter-v1"


class StackError(Exception):
    pass


def _bin(name):
    d = os.environ.get("CUBE_BIN_DIR")
    if not d:
        tgt = os.environ.get("CARGO_TARGET_DIR")
        if not tgt:
            raise StackError("set CARGO_TARGET_DIR (or CUBE_BIN_DIR) to where the debug binaries are")
        d = os.path.join(tgt, "debug")
    p = os.path.join(d, name)
    if not os.path.exists(p):
        raise StackError(f"{p} missing: build it (cargo build -p {name})")
    return p


def _wait(pred, what, timeout=30.0, procs=()):
    end = time.time() + timeout
    while time.time() < end:
        for p in procs:
            if p.poll() is not None:
                raise StackError(f"{what}: {p.args[0]} exited with {p.returncode}")
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise StackError(f"timed out waiting for {what}")


def _port_open(port):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Cube:
    def __init__(self):
        self.procs = []


def guest_kernel():
    """The microVM guest kernel: $CUBE_GUEST_KERNEL, else deploy/guest-kernel/out/vmlinux."""
    k = os.environ.get("CUBE_GUEST_KERNEL") or os.path.join(
        REPO, "deploy", "guest-kernel", "out", "vmlinux")
    if not os.path.exists(k):
        raise StackError(f"guest kernel {k} missing: build it with deploy/guest-kernel/build.sh")
    return k


@contextlib.contextmanager
def cube_stack(tag="ci", log=print, runtime="namespace"):
    """Starts the stack, yields a Cube with api_url/sandbox_url/api_key (also exported as the
    E2B_* variables while it is up), and tears everything down.

    With runtime="microvm" the node runs Linux microVMs: the template's snapshot boots the guest
    once and is taken when cube-agent is warm (its Python worker started)."""
    if os.geteuid() != 0:
        raise StackError("needs root: cubelet creates namespaces, cgroups and loop mounts")
    cubelet, master, api, cubectl = (_bin(n) for n in ("cubelet", "cube-master", "cube-api", "cubectl"))
    agent = os.environ.get("CUBE_AGENT_BIN") or _bin("cube-agent")
    v = subprocess.run([agent, "--version"], capture_output=True, text=True)
    if v.returncode != 0 or "cube-agent" not in v.stdout:
        raise StackError(f"{agent} does not run (--version: rc={v.returncode} {v.stderr.strip()!r})")
    name = f"{tag}{os.getpid()}"
    octet = {"microvm": 240, "gvisor": 236}.get(runtime, 239)
    host_pool = f"10.{octet}.{os.getpid() % 254 + 1}.0/24"
    pin_root = f"/tmp/cube-{tag}-bpf-{name}"
    nft_table = f"cube_{tag}_{name}".replace("-", "_")
    root = f"/var/tmp/cube-{tag}-{name}"
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    c = Cube()
    c.root = root
    logs = []
    saved_env = {}
    try:
        stripped = os.path.join(root, "cube-agent")
        if subprocess.run(["strip", "-o", stripped, agent]).returncode != 0:
            shutil.copy(agent, stripped)
        g, h = reserve_port(), reserve_port()
        cfg = os.path.join(root, "cubelet.toml")
        microvm = ""
        if runtime == "microvm":
            microvm = f"""[microvm]
shim_binary = "{_bin('cube-shim')}"
guest = "{guest_kernel()}"
taps = 2
shims_per_template = 1
"""
        with open(cfg, "w") as f:
            f.write(f"""runtime = "{runtime}"
node_id = "{name}"
grpc_addr = "127.0.0.1:{g}"
http_addr = "127.0.0.1:{h}"
data_dir = "{root}/data"
run_dir = "{root}/run"
cache_dir = "{root}/cache"
agent_binary = "{stripped}"
[storage]
xfs_loop_image = "{root}/xfs.img"
xfs_loop_size_gib = 8
[sandbox]
max_sandboxes = 16
tmp_size_mib = 64
ready_timeout_ms = 15000
[cgroup]
parent = "cube-{name}"
[pools]
network = 2
disks = 0
[network]
switch = "cube-vs"
[switch]
host_pool = "{host_pool}"
pin_root = "{pin_root}"
nft_table = "{nft_table}"
[pools.started]
# Pre-started sandboxes of the template: their agent has already started the Python worker,
# which is what makes the first run_code after a create fast.
"{TEMPLATE}" = {1 if runtime == "microvm" else os.environ.get("CUBE_INTERP_POOL", "2")}
{microvm}""")
        t0 = time.time()
        subprocess.run(["bash", BUILD_SH, "--cubelet", cubelet, "--config", cfg], check=True,
                       stdout=subprocess.DEVNULL)
        c.template_build_s = time.time() - t0
        log(f"template {TEMPLATE} ready in {c.template_build_s:.1f} s")

        def start(args, logname):
            lf = open(os.path.join(root, logname), "w")
            logs.append(lf)
            p = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT)
            c.procs.append(p)
            return p

        pl = start([cubelet, "--config", cfg, "run", "--kill-sandboxes-on-exit"], "cubelet.log")
        _wait(lambda: _port_open(g), "cubelet gRPC", procs=[pl])
        if runtime == "microvm":
            # The template's snapshot: a Linux boot plus the Python worker's start.
            ready = f'cube_pool_ready{{pool="shim",template="{TEMPLATE}"}} 1'
            t1 = time.time()
            _wait(lambda: ready in urllib.request.urlopen(f"http://127.0.0.1:{h}/metrics", timeout=2)
                  .read().decode(), "template snapshot and a warm shim", timeout=400, procs=[pl])
            log(f"microVM snapshot and warm shim ready in {time.time() - t1:.1f} s")
        mp = reserve_port()
        mcfg = os.path.join(root, "master.toml")
        with open(mcfg, "w") as f:
            f.write(f"""grpc_addr = "127.0.0.1:{mp}"
database_url = "sqlite://{root}/master.db?mode=rwc"
nodes = ["http://127.0.0.1:{g}"]
node_poll_interval_ms = 500
reaper_interval_ms = 250
max_timeout_s = 86400
metrics_addr = "127.0.0.1:{reserve_port()}"
""")
        pm = start([master, "--config", mcfg, "run"], "master.log")
        _wait(lambda: _port_open(mp), "cube-master gRPC", procs=[pm])
        c.master_url = f"http://127.0.0.1:{mp}"
        ap, ep = reserve_port(), reserve_port()
        acfg = os.path.join(root, "api.toml")
        with open(acfg, "w") as f:
            f.write(f"""api_addr = "127.0.0.1:{ap}"
edge_addr = "127.0.0.1:{ep}"
master_url = "{c.master_url}"
metrics_addr = "127.0.0.1:{reserve_port()}"
""")
        pa = start([api, "--config", acfg], "api.log")
        _wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{ap}/health", timeout=1).status == 200,
              "cube-api", procs=[pa])
        c.api_url = f"http://127.0.0.1:{ap}"
        c.sandbox_url = f"http://127.0.0.1:{ep}"
        c.cubectl = [cubectl, "--master", c.master_url]
        out = subprocess.run(c.cubectl + ["apikey", "create", "--name", tag], check=True,
                             capture_output=True, text=True)
        c.api_key = out.stdout.strip()
        for k, v in (("E2B_API_URL", c.api_url), ("E2B_SANDBOX_URL", c.sandbox_url),
                     ("E2B_API_KEY", c.api_key)):
            saved_env.setdefault(k, os.environ.get(k))
            os.environ[k] = v
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
        _cleanup_node(root, f"cube-{name}")
        subprocess.run(["nft", "delete", "table", "ip", nft_table], stderr=subprocess.DEVNULL)
        subprocess.run(["umount", "-l", pin_root], stderr=subprocess.DEVNULL)
        shutil.rmtree(pin_root, ignore_errors=True)


def _cleanup_node(root, cgroup_parent):
    # After a failed run: whatever cubelet left in our cgroups, netns and mounts.
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
