"""`cube-bench soak` (issue 21): create / use / kill cycles against a throwaway `cubectl up`
install while each daemon in turn is SIGKILLed and `cubectl up` restarts it, then the node and
the master are checked for leaks. It brings up its own stack (namespace runtime), so the gvisor
pass of tests/run.sh leaves it out."""

import json
import os
import random
import shutil
import socket
import subprocess
import tempfile

import pytest

from conftest import PROGRAMS, _bin
from test_cube_bench import _bench_bin
from test_cube_bench_runtimes import _leftovers


def _free_ports(n):
    """A base port with the n ports from it free on 127.0.0.1 (cubectl up uses a run of them)."""
    for _ in range(200):
        base = random.randint(24000, 30000)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    pytest.fail("no run of free ports")


@pytest.mark.timeout(900)
def test_soak_with_each_daemon_killed_leaks_nothing():
    agent = os.environ.get("CUBE_AGENT_BIN") or _bin("cube-agent")
    cubectl = _bin("cubectl")
    root = tempfile.mkdtemp(prefix="cube-soak-", dir="/var/tmp")
    dd = os.path.join(root, "dd")
    env = {k: v for k, v in os.environ.items()
           if k not in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "CUBE_MASTER_URL",
                        "CUBE_DATA_DIR")}
    try:
        host = os.path.join(root, "hostroot")
        subprocess.run([_bin("cubelet"), "host-root", host, "--programs", PROGRAMS], check=True,
                       stdout=subprocess.DEVNULL)
        up = subprocess.run([cubectl, "--json", "up", "--data-dir", dd, "--runtime", "namespace",
                             "--api-port", str(_free_ports(8)), "--pool", "2", "--xfs-size-gib", "4",
                             "--base-dir", host, "--agent", agent],
                            env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stderr[-4000:]
        u = json.loads(up.stdout)
        env.update(E2B_API_URL=u["apiUrl"], E2B_SANDBOX_URL=u["sandboxUrl"], E2B_API_KEY=u["apiKey"])
        out = os.path.join(root, "soak.json")
        r = subprocess.run([_bench_bin(), "soak", "--cycles", "1000", "--concurrency", "8",
                            "--kill-every", "250", "--data-dir", dd, "--cubectl", cubectl,
                            "--out", out, "--max-failed-pct", "5", "--request-timeout-s", "30"],
                           env=env, capture_output=True, text=True, timeout=800)
        print(r.stdout)
        assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        rep = json.loads(open(out).read())
        assert rep["schema"] == "cube-bench-soak/1"
        assert [(k["daemon"], k["restarted"]) for k in rep["kills"]] == [
            ("cube-master", True), ("cube-api", True), ("cubelet", True)], rep["kills"]
        assert rep["ops"]["use"] == 1000, rep["ops"]
        assert rep["leaked"] == [] and rep["orphans"] == 0 and rep["non_final_rows"] == 0, rep
        assert rep["keepers"] == 2 and rep["keepers_lost"] == [], rep
        assert rep["failed_outside_kill_windows"] == 0, rep["failures"]
        # A master or cubelet restart is invisible to clients (cube-api resends to the master,
        # the master to the node); only cube-api's own death is seen (one instance here).
        api = next(k for k in rep["kills"] if k["daemon"] == "cube-api")
        seen = [f for f in rep["failures"]
                if not (api["killed_at_s"] <= f["at_s"] <= api["ready_at_s"] + 5)]
        assert not seen, seen
        inv = {x["resource"]: x for x in rep["inventory"]}
        assert inv["veths (cvh*)"]["before"] > 0 and "cube-vs map cvs_ports" in inv, inv
    finally:
        subprocess.run([cubectl, "down", "--purge", "--data-dir", dd], env=env,
                       capture_output=True, timeout=300)
        procs, mounts = _leftovers(root)
        for m in mounts:
            subprocess.run(["umount", "-l", m])
        shutil.rmtree(root, ignore_errors=True)
        assert not procs, procs
