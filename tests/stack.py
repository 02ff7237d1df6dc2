"""The one single-host Cube that every Python suite and bench starts: cubelet, cube-master(s) and
cube-api on held 127.0.0.1 ports, a template, an API key, and a teardown that leaves nothing.
Daemon configs are built as dicts (`cubelet_config`, `master_config`, `api_config`, which other
tests extend for fleets of their own) and written as TOML by `tomli_w`; every daemon refuses a
key it does not know, so a stale knob fails the stack instead of being ignored.

Binaries come from $CUBE_BIN_DIR, else $CARGO_TARGET_DIR/debug (cubelet, cube-master, cube-api,
cubectl, cube-shim); the agent from $CUBE_AGENT_BIN (default: the same directory). Needs root.
Failures raise `StackError`; pytest fixtures turn it into a test failure.
"""

import contextlib
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import tomli_w

from ports import reserve_port

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# Host programs of the tiny templates built from the host (`cubelet host-root`). dmesg: a failed
# microVM test prints the guest's kernel log (tests/microvm_logs.py); chmod: tests/isolation makes
# its probe executable; nc, mkfifo, mv, seq: the e2e public-port servers.
PROGRAMS = "sh,bash,cat,echo,ls,sleep,mkdir,rm,id,env,touch,sync,true,false,head,grep,dmesg,chmod,nc,mkfifo,mv,seq"
# Each stack's cube-vs host address pool, by runtime (several stacks may be up at once).
POOL_OCTET = {"namespace": 238, "gvisor": 237, "microvm": 239}
HA_POOL_OCTET = 236


class StackError(Exception):
    pass


def e2e_suite():
    """tests/e2e/conftest.py as the module `e2e_stack`, loaded once: the suites that run on
    tests/e2e's single-host Cube start it with that suite's own code, not a copy of it."""
    mod = sys.modules.get("e2e_stack")
    if mod is None:
        here = os.path.dirname(os.path.abspath(__file__))
        spec = importlib.util.spec_from_file_location(
            "e2e_stack", os.path.join(here, "e2e", "conftest.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["e2e_stack"] = mod
        spec.loader.exec_module(mod)
    return mod


def bin_path(name):
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


def agent_bin():
    """The cube-agent to put into templates, checked to run (a half-written binary from a
    concurrent cargo build would only show up as an exec error deep inside cubelet)."""
    agent = os.environ.get("CUBE_AGENT_BIN") or bin_path("cube-agent")
    if not os.path.exists(agent):
        raise StackError(f"CUBE_AGENT_BIN={agent} does not exist")
    v = subprocess.run([agent, "--version"], capture_output=True, text=True)
    if v.returncode != 0 or "cube-agent" not in v.stdout:
        raise StackError(f"{agent} does not run (--version: rc={v.returncode} {v.stderr.strip()!r})")
    return agent, v.stdout.split()[-1]


def wait(pred, what, timeout=30.0, procs=(), interval=0.1):
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
        time.sleep(interval)
    raise StackError(f"timed out waiting for {what}")


def port_open(port, host="127.0.0.1"):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def guest_kernel():
    """The microVM guest kernel: $CUBE_GUEST_KERNEL, else deploy/guest-kernel/out/vmlinux."""
    k = os.environ.get("CUBE_GUEST_KERNEL") or os.path.join(
        REPO, "deploy", "guest-kernel", "out", "vmlinux")
    if not os.path.exists(k):
        raise StackError(f"guest kernel {k} missing: build it with deploy/guest-kernel/build.sh")
    return os.path.abspath(k)


def merge(base, extra):
    """`base` with `extra` merged in, tables recursively (a copy; None in `extra` deletes)."""
    out = dict(base)
    for k, v in (extra or {}).items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def write_toml(path, cfg):
    with open(path, "wb") as f:
        tomli_w.dump(cfg, f)
    return path


def cubelet_config(name, root, grpc_addr, http_addr, agent, extra=None):
    """A test node's cubelet.toml: everything under `root`, its own cgroup parent."""
    return merge({
        "node_id": name,
        "grpc_addr": grpc_addr,
        "http_addr": http_addr,
        "data_dir": f"{root}/data",
        "run_dir": f"{root}/run",
        "cache_dir": f"{root}/cache",
        "agent_binary": agent,
        "storage": {"xfs_loop_image": f"{root}/xfs.img", "xfs_loop_size_gib": 4},
        "sandbox": {"max_sandboxes": 32, "tmp_size_mib": 16, "ready_timeout_ms": 15000},
        "cgroup": {"parent": f"cube-{name}"},
        "pools": {"network": 1, "disks": 0},
        "network": {"switch": "none"},
    }, extra)


def master_config(grpc_addr, database_url, nodes, metrics_addr, extra=None):
    """A test master.toml: fast polls and reaper, so tests see state change quickly."""
    return merge({
        "grpc_addr": grpc_addr,
        "database_url": database_url,
        "nodes": list(nodes),
        "node_poll_interval_ms": 500,
        "reaper_interval_ms": 250,
        "heartbeat_interval_ms": 500,
        "max_timeout_s": 86400,
        "metrics_addr": metrics_addr,
    }, extra)


def api_config(api_addr, edge_addr, master_urls, metrics_addr, extra=None):
    return merge({
        "api_addr": api_addr,
        "edge_addr": edge_addr,
        "master_urls": list(master_urls),
        "metrics_addr": metrics_addr,
    }, extra)


def host_root_template(name, programs=PROGRAMS):
    """A template builder: the tiny template made from host binaries (seconds to build)."""
    def build(cubelet, cfg, root):
        host = os.path.join(root, "hostroot")
        subprocess.run([cubelet, "host-root", host, "--programs", programs], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([cubelet, "--config", cfg, "build-template", name, "--dir", host],
                       check=True, stdout=subprocess.DEVNULL)
    build.template = name
    return build


def script_template(name, script):
    """A template builder: a recipe under deploy/templates (`build.sh --cubelet --config`)."""
    def build(cubelet, cfg, root):
        subprocess.run(["bash", script, "--cubelet", cubelet, "--config", cfg], check=True,
                       stdout=subprocess.DEVNULL)
    build.template = name
    return build


def pg_schema(name):
    """A fresh schema in $CUBE_TEST_PG_URL for `name`; returns (database URL, drop function)."""
    base = os.environ.get("CUBE_TEST_PG_URL")
    if not base:
        raise StackError('CUBE_TEST_PG_URL is not set (export CUBE_TEST_PG_URL="$(deploy/postgres-test.sh)")')
    schema = f"e2e_{name}".replace("-", "_")

    def psql(sql):
        subprocess.run(["psql", base, "-v", "ON_ERROR_STOP=1", "-qc", sql], check=True,
                       stdout=subprocess.DEVNULL)

    psql(f"SET client_min_messages = warning; DROP SCHEMA IF EXISTS {schema} CASCADE; "
         f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options[search_path]={schema}", lambda: psql(
        f"SET client_min_messages = warning; DROP SCHEMA IF EXISTS {schema} CASCADE")


def _metrics(url):
    return urllib.request.urlopen(url + "/metrics", timeout=2).read().decode()


class Cube:
    """A running stack: its URLs, binaries, processes and the API key."""

    def __init__(self):
        self.procs = []


@contextlib.contextmanager
def stack(template_build, runtime="namespace", *, tag="e2e", configured_runtime=None, started=0,
          masters=1, cubelet=None, master=None, api=None, dead_node=False, log=print):
    """Starts a stack on `runtime`, yields a `Cube` (its URLs and key also exported as the E2B_*
    variables while it is up; the previous values come back after), tears it all down.

    template_build: `host_root_template(...)` or `script_template(...)`.
    configured_runtime: what cubelet.toml says (`auto` where the host must make cubelet pick
      `runtime` by itself); the choice is checked from cubelet's log.
    started: pre-started sandboxes of the template (on microvm: warm shims, at least 1).
    masters: > 1 runs that many cube-masters on one PostgreSQL database (a schema of its own in
      $CUBE_TEST_PG_URL); the first leads, the node registers with all of them.
    cubelet, master, api: config tables merged over the defaults.
    dead_node: the master also polls a node that never answers (it must schedule around it).
    """
    if os.geteuid() != 0:
        raise StackError("needs root: cubelet creates namespaces, cgroups and loop mounts")
    cubelet_bin, master_bin, api_bin, cubectl = (
        bin_path(n) for n in ("cubelet", "cube-master", "cube-api", "cubectl"))
    agent, agent_version = agent_bin()
    template = template_build.template
    configured = configured_runtime or runtime
    if configured not in (runtime, "auto"):
        raise StackError(f"configured runtime {configured!r}: want {runtime!r} or 'auto'")
    if runtime == "microvm":
        started = max(started, 1)
    name = f"{tag}{os.getpid()}" + {"microvm": "vm", "gvisor": "gv"}.get(runtime, "") \
        + ("ha" if masters > 1 else "")
    # The switch's node-level state is this stack's own: a host address pool no other test
    # cubelet uses, its own bpffs pin root and masquerade table (removed at teardown).
    octet = HA_POOL_OCTET if masters > 1 else POOL_OCTET.get(runtime, 238)
    host_pool = os.environ.get("CUBE_E2E_HOST_POOL") or f"10.{octet}.{os.getpid() % 254 + 1}.0/24"
    pin_root = f"/tmp/cube-{tag}-bpf-{name}"
    nft_table = f"cube_{tag}_{name}".replace("-", "_")
    root = f"/var/tmp/cube-{tag}-{name}"
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    c = Cube()
    c.root, c.runtime, c.template = root, runtime, template
    c.envd_version = agent_version
    c.api_bin, c.cubelet_bin = api_bin, cubelet_bin
    logs, saved_env, drop_schema = [], {}, None

    def start(args, logname):
        lf = open(os.path.join(root, logname), "w")
        logs.append(lf)
        p = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT)
        c.procs.append(p)
        return p
    c.start = start
    try:
        stripped = os.path.join(root, "cube-agent")
        if subprocess.run(["strip", "-o", stripped, agent]).returncode != 0:
            shutil.copy(agent, stripped)
        g, h = reserve_port(), reserve_port()
        master_ports = [reserve_port() for _ in range(masters)]
        c.master_urls = [f"http://127.0.0.1:{p}" for p in master_ports]
        node = {
            "runtime": configured,
            "network": {"switch": "cube-vs"},
            "switch": {"host_pool": host_pool, "pin_root": pin_root, "nft_table": nft_table},
        }
        if started:
            node["pools"] = {"started": {template: started}}
        if runtime == "microvm":
            node["microvm"] = {"shim_binary": bin_path("cube-shim"), "guest": guest_kernel(),
                               "taps": 2}
        if masters > 1:
            # With several masters the node registers with them (whichever leads answers).
            node["master"] = {"addresses": c.master_urls}
        cfg = write_toml(os.path.join(root, "cubelet.toml"), cubelet_config(
            name, root, f"127.0.0.1:{g}", f"127.0.0.1:{h}", stripped, merge(node, cubelet)))
        t0 = time.time()
        template_build(cubelet_bin, cfg, root)
        c.template_build_s = time.time() - t0
        log(f"template {template} ready in {c.template_build_s:.1f} s")

        pl = start([cubelet_bin, "--config", cfg, "run", "--kill-sandboxes-on-exit"], "cubelet.log")
        wait(lambda: port_open(g), "cubelet gRPC", procs=[pl])
        c.cubelet_http = f"http://127.0.0.1:{h}"
        c.cubelet_grpc = f"127.0.0.1:{g}"
        with open(os.path.join(root, "cubelet.log")) as f:
            chosen = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in f if "runtime selected" in line]
        if not chosen or f'runtime="{runtime}"' not in chosen[0]:
            raise StackError(f"runtime = {configured!r} did not select {runtime!r}: {chosen}")
        log(f"cubelet: {chosen[0].strip()}")
        if started:
            # On microvm the template's snapshot boots the guest once first (minutes where the
            # guest kernel is emulated); creates then restore a warm shim.
            pool = "shim" if runtime == "microvm" else "started"
            ready = f'cube_pool_ready{{pool="{pool}",template="{template}"}} {started}'
            t1 = time.time()
            wait(lambda: ready in _metrics(c.cubelet_http), f"{started} warm {pool} sandboxes",
                 timeout=400, procs=[pl])
            log(f"{pool} pool ready in {time.time() - t1:.1f} s")

        nodes = [f"http://127.0.0.1:{g}"] if masters == 1 else []
        if dead_node:
            c.dead_node = f"http://127.0.0.1:{reserve_port()}"
            nodes.append(c.dead_node)
        extra_keys = {}
        if masters == 1:
            database = f"sqlite://{root}/master.db?mode=rwc"
        else:
            database, drop_schema = pg_schema(name)
            c.pg_base_url = os.environ["CUBE_TEST_PG_URL"]
            # The fleet's keys: every master derives the same access tokens and opens the
            # same secrets.
            extra_keys = {"token_key_file": f"{root}/token.key",
                          "secrets_key_file": f"{root}/secrets.key"}
        c.database_url = database
        c.master_cmds, c.master_procs, c.master_metrics = [], [], []
        for i, mp in enumerate(master_ports):
            metrics = reserve_port()
            mcfg = write_toml(os.path.join(root, f"master{i or ''}.toml"), master_config(
                f"127.0.0.1:{mp}", database, nodes, f"127.0.0.1:{metrics}",
                merge(extra_keys, master)))
            cmd = [master_bin, "--config", mcfg, "run"]
            p = start(cmd, f"master{i or ''}.log")
            c.master_cmds.append(cmd)
            c.master_procs.append(p)
            c.master_metrics.append(f"http://127.0.0.1:{metrics}/metrics")
            if i == 0:
                # The first leads (it starts alone); the others stand by behind it.
                wait(lambda: port_open(mp), "cube-master gRPC", procs=[p])
        c.master_cmd, c.master_proc = c.master_cmds[0], c.master_procs[0]
        c.master_url = ",".join(c.master_urls)
        c.ports = {"cubelet grpc": g, "cubelet http": h}
        c.ports.update({f"master{i} grpc": p for i, p in enumerate(master_ports)})

        ap, ep, metp = reserve_port(), reserve_port(), reserve_port()
        acfg = write_toml(os.path.join(root, "api.toml"), api_config(
            f"127.0.0.1:{ap}", f"127.0.0.1:{ep}", c.master_urls, f"127.0.0.1:{metp}", api))
        pa = start([api_bin, "--config", acfg], "api.log")
        wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{ap}/health", timeout=1).status == 200,
             "cube-api", procs=[pa])
        c.api_metrics_url = f"http://127.0.0.1:{metp}"
        c.api_url = f"http://127.0.0.1:{ap}"
        c.sandbox_url = f"http://127.0.0.1:{ep}"
        c.ports.update({"api": ap, "edge": ep, "api metrics": metp})
        c.cubectl = [cubectl, "--master", c.master_url]
        out = subprocess.run(c.cubectl + ["apikey", "create", "--name", tag], check=True,
                             capture_output=True, text=True)
        c.api_key = out.stdout.strip()
        for k, v in (("E2B_API_URL", c.api_url), ("E2B_SANDBOX_URL", c.sandbox_url),
                     ("E2B_API_KEY", c.api_key)):
            saved_env.setdefault(k, os.environ.get(k))
            os.environ[k] = v
        # The master schedules only onto nodes whose template list it has polled.
        wait(lambda: template in subprocess.run(c.cubectl + ["--json", "nodes"], capture_output=True,
                                                text=True).stdout, "node ready in master")
        yield c
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        stop(c.procs)
        for lf in logs:
            lf.close()
        if drop_schema:
            drop_schema()
        cleanup_node(root, f"cube-{name}")
        subprocess.run(["nft", "delete", "table", "ip", nft_table], stderr=subprocess.DEVNULL)
        subprocess.run(["umount", "-l", pin_root], stderr=subprocess.DEVNULL)
        shutil.rmtree(pin_root, ignore_errors=True)


def stop(procs):
    """Stops processes, newest first: SIGTERM, then SIGKILL after 20 s."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def cleanup_node(root, cgroup_parent):
    """Belt and braces after a failed run: whatever cubelet left in our cgroups, netns and
    mounts; then `root` goes (unless CUBE_E2E_KEEP=1)."""
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
    # Whatever is still mounted under `root`, deepest first: pinned network namespaces, the
    # data directory, and a gVisor sandbox's bundle (its disk, its own namespace's pin).
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f]
    for m in sorted((m for m in mounts if m == root or m.startswith(root + "/")),
                    key=len, reverse=True):
        subprocess.run(["umount", "-l", m], stderr=subprocess.DEVNULL)
    if os.environ.get("CUBE_E2E_KEEP") != "1":
        shutil.rmtree(root, ignore_errors=True)


INTERPRETER_TEMPLATE = "code-interpreter-v1"


def interpreter_stack(tag="ci", log=print, runtime="namespace"):
    """The stack serving `code-interpreter-v1` (deploy/templates/code-interpreter-v1/build.sh,
    whose debootstrap step is cached under $CUBE_TEMPLATE_CACHE, default
    /var/cache/cube/templates), for the code-interpreter suite and its benchmark. Its pre-started
    sandboxes ($CUBE_INTERP_POOL, default 2; one warm shim on microvm) have their Python worker
    running already: that is what makes the first run_code after a create fast."""
    started = 1 if runtime == "microvm" else int(os.environ.get("CUBE_INTERP_POOL", "2"))
    build_sh = os.path.join(REPO, "deploy", "templates", INTERPRETER_TEMPLATE, "build.sh")
    return stack(script_template(INTERPRETER_TEMPLATE, build_sh), runtime, tag=tag,
                 started=started, log=log, cubelet={
                     "storage": {"xfs_loop_size_gib": 8},
                     "sandbox": {"max_sandboxes": 16, "tmp_size_mib": 64},
                     "pools": {"network": 2},
                 })
