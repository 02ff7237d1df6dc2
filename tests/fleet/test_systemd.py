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
import time

import pytest

from doc_commands import REPO, install_command
from nspawn import boot, cgroup_pids, remove_cgroups, require, shutdown, wait

UID = f"{os.getpid() % 100000}"
NAME = f"cubesd{UID}"
BASE = f"/var/tmp/cube-systemd-{UID}"
CGROUP_PARENT = f"cube-sd{UID}"
DATA_DIR = f"/var/lib/cube-sd{UID}"
TEMPLATE = "sdmini"
PROGRAMS = "sh,bash,cat,echo,ls,sleep,mkdir,rm,id,env,touch,sync,true,false,head,grep"
UNITS = ("cube-master", "cube-api", "cubelet")


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


def sandbox_pids():
    return cgroup_pids(CGROUP_PARENT)


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_units_under_systemd_start_restart_stop_and_keep_sandboxes():
    require()
    bin_dir, agent = bins()
    shutil.rmtree(BASE, ignore_errors=True)
    c = None
    try:
        t0 = time.time()
        c = boot(NAME, BASE, binds=(REPO, bin_dir, os.path.dirname(agent)))
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
            print(c.journal(UNITS))   # what the daemons logged, for a failure
        remove_cgroups(CGROUP_PARENT)
        shutdown(c)
        shutil.rmtree(BASE, ignore_errors=True)
