"""`cube-bench --runtime namespace,gvisor`: each runtime measured on a throwaway `cubectl up`
stack of its own (namespace and gVisor both run on this host), the results side by side with
the isolation each gives, and every stack taken down after it. It brings up its own stacks, so
the gvisor pass of tests/run.sh leaves it out (it covers gvisor already)."""

import json
import os
import shutil
import subprocess
import tempfile

import pytest

from conftest import PROGRAMS, _bin
from test_cube_bench import _bench_bin


def _leftovers(root):
    """Processes whose command line names `root`, and mounts under it."""
    procs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if root in cmd:
            procs.append(f"{pid}: {cmd}")
    mounts = [l.split()[4] for l in open("/proc/self/mountinfo") if l.split()[4].startswith(root)]
    return procs, mounts


@pytest.mark.timeout(1500)
def test_cube_bench_measures_runtimes_side_by_side():
    agent = os.environ.get("CUBE_AGENT_BIN") or _bin("cube-agent")
    root = tempfile.mkdtemp(prefix="cube-bench-rt-", dir="/var/tmp")
    try:
        host = os.path.join(root, "hostroot")
        subprocess.run([_bin("cubelet"), "host-root", host, "--programs", PROGRAMS], check=True,
                       stdout=subprocess.DEVNULL)
        out = os.path.join(root, "out")
        env = {k: v for k, v in os.environ.items()
               if k not in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "CUBE_MASTER_URL")}
        cmd = [_bench_bin(), "--runtime", "namespace,gvisor", "--quick", "--concurrency", "1",
               "--samples", "3", "--density-max", "4", "--dirty-mib", "8", "--reps", "1",
               "--base-dir", host, "--agent", agent, "--pool", "2", "--xfs-size-gib", "4",
               "--cubectl", _bin("cubectl"), "--out", out]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1400)
        assert r.returncode == 0, f"rc={r.returncode}\nstderr:\n{r.stderr[-6000:]}"

        cmp_ = json.loads(open(os.path.join(out, "runtimes.json")).read())
        assert cmp_["schema"] == "cube-bench-runtimes/1"
        rows = cmp_["runtimes"]
        assert [(x["runtime"], x["isolation"]) for x in rows] == [
            ("namespace", "shared-kernel"), ("gvisor", "user-space-kernel")], rows
        for x in rows:
            assert x["error"] is None, x
            for k in ("create_p50_ms", "first_command_p50_ms", "peak_creates_per_s",
                      "pause_p50_ms", "resume_p50_ms", "snapshot_p50_ms", "clone_p50_ms"):
                assert x[k] is not None and x[k] > 0, (x["runtime"], k, x)
            assert x["dirty_mib"] == 8 and x["density_live"] == 4, x
            # Each runtime's own full report, measured on a node of that runtime; the headline
            # numbers are its numbers (4 sandboxes are too few for MemAvailable to be more
            # than noisy: only that it was read is checked).
            rep = json.loads(open(os.path.join(x["dir"], "cube-bench.json")).read())
            assert rep["environment"]["runtime"] == x["runtime"]
            assert rep["environment"]["isolation"] == x["isolation"]
            assert x["idle_mib_per_sandbox"] == rep["density"]["rows"][-1]["per_sandbox_mib"]
            assert x["create_p50_ms"] == rep["create_latency"]["rows"][0]["summary"]["p50_ms"]
            pause = [r for r in rep["pause_resume"]["rows"] if r["dirty_mib"] == 8][0]
            assert x["pause_p50_ms"] == pause["ops"]["pause"]["summary"]["p50_ms"]
            assert os.path.dirname(x["dir"]) == out
        md = open(os.path.join(out, "runtimes.md")).read()
        assert "| namespace | shared-kernel |" in md and "| gvisor | user-space-kernel |" in md, md
        assert md in r.stdout
        # Every stack is down and purged.
        assert not os.path.exists(os.path.join(out, "stacks")), os.listdir(os.path.join(out, "stacks"))
        procs, mounts = _leftovers(root)
        assert not procs and not mounts, (procs, mounts)
    finally:
        for p in _leftovers(root)[1]:
            subprocess.run(["umount", "-l", p], stderr=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)


def test_cube_bench_refuses_an_unknown_runtime(tmp_path):
    r = subprocess.run([_bench_bin(), "--runtime", "namespace,kvm", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unknown runtime \"kvm\"" in r.stderr, r.stderr
