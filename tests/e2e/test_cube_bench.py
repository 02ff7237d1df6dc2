"""benches/cube-bench --quick against the real stack of the e2e fixture: it must finish, leave no
sandbox behind, and write a JSON report with every section measured (or, for routes the server
lacks, marked not available with the HTTP answer), a markdown report and PNG plots.

The binary is $CUBE_BENCH_BIN, else $CARGO_TARGET_DIR/debug/cube-bench (cargo build -p cube-bench).
"""

import json
import math
import os
import subprocess
import urllib.request

import pytest

from conftest import TEMPLATE

SECTIONS = ("create_latency", "create_to_first_command", "throughput", "density",
            "pause_resume", "snapshot_clone")


def _bench_bin():
    b = os.environ.get("CUBE_BENCH_BIN")
    if not b:
        tgt = os.environ.get("CARGO_TARGET_DIR")
        if not tgt:
            pytest.fail("set CUBE_BENCH_BIN or CARGO_TARGET_DIR")
        b = os.path.join(tgt, "debug", "cube-bench")
    if not os.path.exists(b):
        pytest.fail(f"{b} missing: build it (cargo build -p cube-bench)")
    return b


def _live_bench_sandboxes(cube):
    req = urllib.request.Request(cube.api_url + "/v2/sandboxes?limit=100")
    req.add_header("X-API-KEY", cube.api_key)
    with urllib.request.urlopen(req, timeout=30) as r:
        return [s["sandboxID"] for s in json.loads(r.read())
                if (s.get("metadata") or {}).get("cube-bench") == "1"]


def _check_summary(s, where):
    assert s is not None, f"{where}: no successful sample"
    assert s["n"] >= 1, where
    assert 0 < s["min_ms"] <= s["p50_ms"] <= s["p90_ms"] <= s["p95_ms"] <= s["p99_ms"] <= s["max_ms"], (where, s)
    assert s["min_ms"] <= s["avg_ms"] <= s["max_ms"], (where, s)


@pytest.mark.timeout(900)
def test_cube_bench_quick(cube, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, E2B_API_URL=cube.api_url, E2B_SANDBOX_URL=cube.sandbox_url,
               E2B_API_KEY=cube.api_key, CUBE_MASTER_URL=cube.master_url)
    # The fixture's node takes 16 sandboxes: keep create-only and density below that.
    cmd = [_bench_bin(), "--quick", "--density-max", "12", "--max-live", "12",
           "--template", TEMPLATE, "--out", str(out), "--cubectl", cube.cubectl[0]]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, f"rc={r.returncode}\nstderr:\n{r.stderr[-4000:]}"
    assert "== summary ==" in r.stderr

    rep = json.loads((out / "cube-bench.json").read_text())
    assert rep["schema"] == "cube-bench/1"
    assert rep["quick"] is True
    env_ = rep["environment"]
    m = env_["machine"]
    assert m["cores"] >= 1 and m["mem_total_mib"] > 0 and m["cpu_model"]
    assert m["kvm_kind"] in ("VMX", "SVM", "PVM", "none")
    # The bench must have found out which runtime the fixture's node runs.
    assert env_["runtime"] == cube.runtime, env_
    assert env_["versions"]["cube-bench"]
    assert env_["api_local"] is True
    for k in SECTIONS:
        assert isinstance(rep[k]["clock"], str) and len(rep[k]["clock"]) > 20, k

    for k in ("create_latency", "create_to_first_command"):
        sec = rep[k]
        assert sec["available"] is True
        assert [row["concurrency"] for row in sec["rows"]] == [1, 5, 10], k
        for row in sec["rows"]:
            assert row["failures"] == 0, (k, row["errors"])
            assert row["warmup"] == row["concurrency"], k
            _check_summary(row["summary"], f"{k} c={row['concurrency']}")
            assert len(row["samples_ms"]) == row["summary"]["n"] >= max(10, 2 * row["concurrency"])

    tp = rep["throughput"]["rows"]
    assert sorted((t["concurrency"], t["mode"]) for t in tp) == sorted(
        (c, mode) for c in (1, 5, 10) for mode in ("create-delete", "create-only"))
    for t in tp:
        assert t["failures"] == 0, t
        assert t["ok"] > 0 and t["wall_s"] > 0
        assert math.isclose(t["creates_per_s"], t["ok"] / t["wall_s"], rel_tol=1e-6)

    d = rep["density"]
    assert d["available"] is True, d["reason"]
    assert [(row["target"], row["live"]) for row in d["rows"]] == [(12, 12)]
    row = d["rows"][0]
    assert math.isclose(row["delta_mib"], row["mem_available_before_mib"] - row["mem_available_after_mib"],
                        abs_tol=0.01) or row["delta_mib"] == 0
    assert isinstance(row["per_sandbox_mib"], float)

    pr = rep["pause_resume"]
    assert pr["available"] is True, pr["reason"]
    assert [row["dirty_mib"] for row in pr["rows"]] == [0, 8]
    for row in pr["rows"]:
        for op in ("pause", "resume"):
            o = row["ops"][op]
            assert o["failures"] == 0, (row["dirty_mib"], op, o)
            _check_summary(o["summary"], f"{op} dirty={row['dirty_mib']}")

    sc = rep["snapshot_clone"]
    ops = [o for row in sc["rows"] for o in row["ops"].values()]
    assert {k for row in sc["rows"] for k in row["ops"]} == {"snapshot", "clone", "fork"}
    for o in ops:
        # Either measured, or the server said it lacks the route (and the report says so).
        if o["unavailable"] is not None:
            assert "HTTP 404" in o["unavailable"] or "HTTP 501" in o["unavailable"] \
                or "HTTP 405" in o["unavailable"], o
        else:
            assert o["failures"] == 0, o
            _check_summary(o["summary"], "snapshot/clone/fork")
    if not sc["available"]:
        assert "HTTP" in sc["reason"]

    md = (out / "cube-bench.md").read_text()
    for h in ("## Create latency", "## Create → first command", "## Throughput", "## Density",
              "## Pause / resume", "## Snapshot / clone / fork"):
        assert h in md, h
    assert f"Runtime **{cube.runtime}**" in md
    for png in ("create-latency-cdf.png", "first-command-cdf.png", "throughput.png", "density.png",
                "lifecycle-vs-dirty.png"):
        p = out / png
        assert p.exists(), f"{png} missing; stderr:\n{r.stderr[-2000:]}"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png

    assert _live_bench_sandboxes(cube) == [], "cube-bench left sandboxes behind"


def test_cube_bench_bad_settings_fail_cleanly(cube, tmp_path):
    """Missing variables, an https URL and a wrong key are clear errors, not panics or hangs."""
    b = _bench_bin()
    base = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    r = subprocess.run([b, "--quick", "--out", str(tmp_path / "a")], env=base,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "E2B_API_URL is not set" in r.stderr, r.stderr
    r = subprocess.run([b, "--quick", "--out", str(tmp_path / "b")],
                       env=dict(base, E2B_API_URL="https://x", E2B_SANDBOX_URL=cube.sandbox_url,
                                E2B_API_KEY=cube.api_key),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "https is not supported" in r.stderr, r.stderr
    r = subprocess.run([b, "--quick", "--template", TEMPLATE, "--out", str(tmp_path / "c")],
                       env=dict(base, E2B_API_URL=cube.api_url, E2B_SANDBOX_URL=cube.sandbox_url,
                                E2B_API_KEY="e2b_" + "0" * 40),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "HTTP 401" in r.stderr, r.stderr
    assert "panicked" not in r.stderr
