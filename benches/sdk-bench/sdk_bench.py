#!/usr/bin/env python3
"""SDK-observed control-plane benchmark: the official Python `e2b` SDK against a running Cube.

Measures (targets from issue 6, namespace runtime):
  create_c1         Sandbox.create() latency at concurrency 1: p50 <= 25 ms, p95 <= 50 ms
  create_run_c1     Sandbox.create() + commands.run("echo hi"): p50 <= 40 ms
  creates_per_s_c16 sandboxes created per second by 16 concurrent clients: >= 100/s
  list_1000         GET /v2/sandboxes (the SDK's first page) with N live sandboxes: p95 <= 20 ms
  edge_health       GET /health through the edge (envd round trip without the agent's work)
  egress            (issue 19) create p50 with a 20-entry denyOut within 1 ms of create without
                    one (interleaved, same run), and with 20 allowOut names (the node's egress
                    proxy gets them); update_network (PUT /sandboxes/{id}/network) <= 5 ms
  snapshot          (issue 25) create_snapshot() of a sandbox with a background process and
                    --snapshot-dirty-mib MiB written to /dev/shm (memory), and Sandbox.create() from each
                    snapshot (on gvisor both keep memory: checkpoint and restore; on namespace
                    the filesystem only); report

Uses E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (as printed by deploy/dev-up.sh), or starts a
private stack with --local-stack (the tests/e2e fixture: needs root and CARGO_TARGET_DIR with the
binaries under debug/ — point it at a dir whose debug/ holds release builds for real numbers).
Prints a markdown table and writes JSON to --out (default benches/results/sdk-bench-<unix>/).
"""

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(ms):
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p95_ms": pct(ms, 95), "mean_ms": statistics.fmean(ms),
            "max_ms": max(ms)}


def killer():
    # Kills are not measured; a pool keeps them off the measured path.
    return cf.ThreadPoolExecutor(max_workers=4)


def bench_create(Sandbox, template, n, run_cmd):
    ms, kills = [], killer()
    for _ in range(n):
        t0 = time.perf_counter()
        s = Sandbox.create(template, timeout=120)
        if run_cmd:
            r = s.commands.run("echo hi")
            assert r.stdout == "hi\n", r
        ms.append((time.perf_counter() - t0) * 1000)
        kills.submit(s.kill)
    kills.shutdown(wait=True)
    return summary(ms)


def bench_throughput(Sandbox, template, total, conc):
    def one(_):
        t0 = time.perf_counter()
        s = Sandbox.create(template, timeout=120)
        return s, (time.perf_counter() - t0) * 1000
    with cf.ThreadPoolExecutor(max_workers=conc) as ex:
        # Warm the SDK's per-thread clients so the wall time is creates only.
        t0 = time.perf_counter()
        res = list(ex.map(one, range(total)))
        wall = time.perf_counter() - t0
        list(ex.map(lambda x: x[0].kill(), res))
    out = summary([r[1] for r in res])
    out.update({"concurrency": conc, "creates": total, "wall_s": wall, "creates_per_s": total / wall})
    return out


def bench_list(api_url, key, Sandbox, template, n_sandboxes, n_requests, conc):
    """Fills the account to n_sandboxes (raw REST, concurrently), then times GET /v2/sandboxes."""
    created = []
    h = {"X-API-Key": key}
    with httpx.Client(headers=h, timeout=120) as c:
        have = len(c.get(api_url + "/v2/sandboxes?limit=100").json())

        def mk(_):
            r = httpx.post(api_url + "/v2/sandboxes", headers=h, timeout=120,
                           json={"templateID": template, "timeout": 900, "metadata": {"bench": "list"}})
            r.raise_for_status()
            return r.json()["sandboxID"]
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(max_workers=conc) as ex:
            created = list(ex.map(mk, range(max(0, n_sandboxes - have))))
        fill_s = time.perf_counter() - t0
        try:
            ms = []
            for _ in range(n_requests):
                t = time.perf_counter()
                r = c.get(api_url + "/v2/sandboxes")
                ms.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200 and len(r.json()) == 100, (r.status_code, len(r.json()))
            # The same call through the SDK (first page) for reference.
            sdk = []
            for _ in range(min(n_requests, 50)):
                t = time.perf_counter()
                Sandbox.list().next_items()
                sdk.append((time.perf_counter() - t) * 1000)
        finally:
            with cf.ThreadPoolExecutor(max_workers=conc) as ex:
                list(ex.map(lambda i: c.delete(api_url + f"/sandboxes/{i}"), created))
    out = summary(ms)
    out.update({"sandboxes": n_sandboxes, "fill_s": fill_s, "fill_per_s": len(created) / fill_s if created else None,
                "sdk_first_page": summary(sdk)})
    return out


def uncached_edge(cube):
    """A second cube-api on the local stack's master with the edge cache off (for before/after)."""
    import stack
    from ports import reserve_port
    ap, ep, mp = reserve_port(), reserve_port(), reserve_port()
    cfg = stack.write_toml(os.path.join(cube.root, "api-nocache.toml"), stack.api_config(
        f"127.0.0.1:{ap}", f"127.0.0.1:{ep}", cube.master_urls, f"127.0.0.1:{mp}",
        {"edge_cache_ttl_ms": 0}))
    p = cube.start([cube.api_bin, "--config", cfg], "api-nocache.log")
    stack.wait(lambda: stack.port_open(ep), "uncached cube-api", procs=[p])
    return f"http://127.0.0.1:{ep}"


def bench_edge(Sandbox, template, sandbox_url, n, uncached_url=None):
    s = Sandbox.create(template, timeout=120)
    try:
        if uncached_url:
            with httpx.Client(timeout=30) as c:
                nc = []
                for _ in range(n):
                    t = time.perf_counter()
                    r = c.get(uncached_url + "/health", headers={"E2b-Sandbox-Id": s.sandbox_id})
                    nc.append((time.perf_counter() - t) * 1000)
                    assert r.status_code == 204, r.status_code
        with httpx.Client(timeout=30) as c:
            ms = []
            for _ in range(n):
                t = time.perf_counter()
                r = c.get(sandbox_url + "/health", headers={"E2b-Sandbox-Id": s.sandbox_id})
                ms.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 204, r.status_code
            run = []
            for _ in range(min(n, 100)):
                t = time.perf_counter()
                s.commands.run("true")
                run.append((time.perf_counter() - t) * 1000)
    finally:
        s.kill()
    out = summary(ms)
    out["commands_run_true"] = summary(run)
    if uncached_url:
        out["uncached"] = summary(nc)
    return out


def bench_auto_resume(Sandbox, template, sandbox_url, api_url, key, n):
    """A sandbox created with `on_timeout: pause` + `auto_resume`, paused at its timeout, then
    one request through the edge: the time until that request is answered (it resumes the
    sandbox and is served). `n` rounds on one sandbox."""
    s = Sandbox.create(template, timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True})
    ms = []
    try:
        with httpx.Client(timeout=120) as c:
            for _ in range(n):
                deadline = time.time() + 120
                while True:
                    r = c.get(f"{api_url}/sandboxes/{s.sandbox_id}", headers={"X-API-KEY": key})
                    if r.json().get("state") == "paused":
                        break
                    if time.time() > deadline:
                        raise RuntimeError("the sandbox was not paused at its timeout")
                    time.sleep(0.05)
                t = time.perf_counter()
                r = c.get(sandbox_url + "/health", headers={"E2b-Sandbox-Id": s.sandbox_id})
                ms.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 204, r.status_code
                # Resumed by traffic it has its own 2 s timeout again: it pauses once more.
    finally:
        s.kill()
    return summary(ms)


# 20 public /32s (TEST-NET-2/3): nothing listens there, only the rule count matters.
EGRESS_20 = [f"198.51.100.{i}" for i in range(1, 11)] + [f"203.0.113.{i}" for i in range(1, 11)]
# 20 names for the egress proxy (10 exact, 10 wildcards), with everything else denied.
NAMES_20 = [f"api{i}.bench.test" for i in range(10)] + [f"*.cdn{i}.bench.test" for i in range(10)]


def bench_egress(Sandbox, template, n):
    """Creates with no policy, a 20-entry policy and 20 allowed names, interleaved so all see
    the same machine; then `update_network` on one sandbox, alternating two 20-entry policies."""
    plain, ruled, named, kills = [], [], [], killer()
    modes = [(plain, {}), (ruled, {"network": {"deny_out": EGRESS_20}}),
             (named, {"network": {"allow_out": NAMES_20, "deny_out": ["0.0.0.0/0"]}})]
    for i in range(3 * n):
        out, opts = modes[i % 3]
        t0 = time.perf_counter()
        s = Sandbox.create(template, timeout=120, **opts)
        out.append((time.perf_counter() - t0) * 1000)
        kills.submit(s.kill)
    kills.shutdown(wait=True)
    s = Sandbox.create(template, timeout=120)
    up = []
    try:
        for i in range(n):
            pol = {"deny_out": EGRESS_20} if i % 2 else {"allow_out": EGRESS_20, "deny_out": ["0.0.0.0/0"]}
            t0 = time.perf_counter()
            s.update_network(pol)
            up.append((time.perf_counter() - t0) * 1000)
    finally:
        s.kill()
    return {"create_plain": summary(plain), "create_20_rules": summary(ruled),
            "create_20_names": summary(named), "update_network": summary(up)}


def bench_snapshot(Sandbox, template, n, dirty_mib):
    """`n` snapshots of one sandbox (a background `sleep`, `dirty_mib` MiB in /dev/shm), then a
    sandbox created from each; whether the copies kept the process is reported too."""
    s = Sandbox.create(template, timeout=600)
    snaps, take, made, kept, kills = [], [], [], 0, killer()
    try:
        s.commands.run("sleep 3600", background=True, timeout=0)
        if dirty_mib:
            s.commands.run(f"head -c {dirty_mib}M /dev/urandom > /dev/shm/dirty")
        for _ in range(n):
            t0 = time.perf_counter()
            snaps.append(s.create_snapshot().snapshot_id)
            take.append((time.perf_counter() - t0) * 1000)
        for sid in snaps:
            t0 = time.perf_counter()
            c = Sandbox.create(sid, timeout=120)
            made.append((time.perf_counter() - t0) * 1000)
            kept += "sleep" in c.commands.run("cat /proc/[0-9]*/comm 2>/dev/null || true").stdout.split()
            kills.submit(c.kill)
        kills.shutdown(wait=True)
    finally:
        s.kill()
        for sid in snaps:
            try:
                Sandbox.delete_snapshot(sid)
            except Exception:
                pass
    return {"dirty_mib": dirty_mib, "snapshot": summary(take), "create_from_snapshot": summary(made),
            "copies_with_the_process": kept, "copies": len(snaps)}


def measure(a, Sandbox, cube, stack):
    """Every selected measurement against the stack the E2B_* variables point at."""
    only = set(filter(None, a.only.split(",")))
    want = lambda k: not only or k in only  # noqa: E731
    api_url, key = os.environ["E2B_API_URL"], os.environ["E2B_API_KEY"]
    R = {}
    # Warm-up (connections, template cache); its detail says which runtime and boundary it got.
    s = Sandbox.create(a.template, timeout=30)
    try:
        r = httpx.get(f"{api_url}/sandboxes/{s.sandbox_id}", headers={"X-API-KEY": key}, timeout=30)
        d = r.json() if r.status_code == 200 else {}
        R["runtime"], R["isolation"] = d.get("runtime", "?"), d.get("isolation", "?")
    finally:
        s.kill()
    if want("create"):
        R["create_c1"] = bench_create(Sandbox, a.template, a.creates, False)
    if want("create_run"):
        R["create_run_c1"] = bench_create(Sandbox, a.template, a.creates, True)
    if want("throughput"):
        R["creates_c16"] = bench_throughput(Sandbox, a.template, a.throughput_creates, a.concurrency)
    if want("list") and a.list_sandboxes > 0:
        R["list_1000"] = bench_list(api_url, key, Sandbox, a.template, a.list_sandboxes, a.list_requests,
                                    a.concurrency)
    if want("edge"):
        unc = uncached_edge(cube) if (a.edge_compare and stack is not None) else None
        R["edge_health"] = bench_edge(Sandbox, a.template, os.environ["E2B_SANDBOX_URL"], a.edge_requests, unc)
    if want("auto_resume") and a.auto_resumes > 0:
        R["auto_resume"] = bench_auto_resume(Sandbox, a.template, os.environ["E2B_SANDBOX_URL"], api_url, key,
                                             a.auto_resumes)
    if want("egress") and a.egress_rounds > 0:
        R["egress"] = bench_egress(Sandbox, a.template, a.egress_rounds)
    if want("snapshot") and a.snapshots > 0:
        R["snapshot"] = bench_snapshot(Sandbox, a.template, a.snapshots, a.snapshot_dirty_mib)
    return R


def rows_of(R):
    """(metric, value, unit, target) for what R holds."""
    rows = []
    if "create_c1" in R:
        c = R["create_c1"]
        rows += [("Sandbox.create() p50, c=1", c["p50_ms"], "ms", "<= 25"),
                 ("Sandbox.create() p95, c=1", c["p95_ms"], "ms", "<= 50")]
    if "create_run_c1" in R:
        rows.append(('create + commands.run("echo hi") p50', R["create_run_c1"]["p50_ms"], "ms", "<= 40"))
    if "creates_c16" in R:
        c = R["creates_c16"]
        rows += [("creates/s at concurrency 16", c["creates_per_s"], "/s", ">= 100"),
                 ("create p95 at concurrency 16", c["p95_ms"], "ms", "")]
    if "list_1000" in R:
        c = R["list_1000"]
        rows += [(f"GET /v2/sandboxes p95 ({c['sandboxes']} sandboxes)", c["p95_ms"], "ms", "<= 20"),
                 ("GET /v2/sandboxes p50", c["p50_ms"], "ms", ""),
                 ("SDK Sandbox.list() first page p95", c["sdk_first_page"]["p95_ms"], "ms", "")]
    if "edge_health" in R:
        c = R["edge_health"]
        rows += [("edge GET /health p50", c["p50_ms"], "ms", ""),
                 ("edge GET /health p95", c["p95_ms"], "ms", ""),
                 ('commands.run("true") p50', c["commands_run_true"]["p50_ms"], "ms", "")]
        if "uncached" in c:
            rows += [("edge GET /health p50, cache off", c["uncached"]["p50_ms"], "ms", ""),
                     ("edge GET /health p95, cache off", c["uncached"]["p95_ms"], "ms", "")]
    if "auto_resume" in R:
        c = R["auto_resume"]
        rows += [("first edge request to an auto-paused sandbox p50", c["p50_ms"], "ms", "<= 100"),
                 ("first edge request to an auto-paused sandbox max", c["max_ms"], "ms", "")]
    if "egress" in R:
        c = R["egress"]
        d = c["create_20_rules"]["p50_ms"] - c["create_plain"]["p50_ms"]
        rows += [("create p50, no egress rules", c["create_plain"]["p50_ms"], "ms", ""),
                 ("create p50, 20 denyOut entries", c["create_20_rules"]["p50_ms"], "ms", ""),
                 ("create p50 cost of 20 rules", d, "ms", "<= 1"),
                 ("create p50, 20 allowOut names (deny-all)", c["create_20_names"]["p50_ms"], "ms", ""),
                 ("create p50 cost of 20 names",
                  c["create_20_names"]["p50_ms"] - c["create_plain"]["p50_ms"], "ms", "<= 1"),
                 ("update_network p50 (20 entries)", c["update_network"]["p50_ms"], "ms", "<= 5"),
                 ("update_network p95", c["update_network"]["p95_ms"], "ms", "")]
    if "snapshot" in R:
        c = R["snapshot"]
        rows += [(f"create_snapshot() p50 ({c['dirty_mib']} MiB dirty in /dev/shm)", c["snapshot"]["p50_ms"], "ms", ""),
                 ("create_snapshot() max", c["snapshot"]["max_ms"], "ms", ""),
                 ("Sandbox.create(snapshot) p50", c["create_from_snapshot"]["p50_ms"], "ms", ""),
                 ("Sandbox.create(snapshot) max", c["create_from_snapshot"]["max_ms"], "ms", ""),
                 ("copies that kept the background process",
                  c["copies_with_the_process"], f"of {c['copies']}", "")]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--template", default=os.environ.get("CUBE_BENCH_TEMPLATE", "base"))
    ap.add_argument("--creates", type=int, default=60, help="samples at concurrency 1")
    ap.add_argument("--throughput-creates", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--list-sandboxes", type=int, default=1000, help="0 skips the list benchmark")
    ap.add_argument("--list-requests", type=int, default=200)
    ap.add_argument("--edge-requests", type=int, default=500)
    ap.add_argument("--auto-resumes", type=int, default=10,
                    help="pause-at-timeout / resume-by-request rounds (0 skips them)")
    ap.add_argument("--egress-rounds", type=int, default=40,
                    help="creates with and without a 20-entry policy, and updates (0 skips them)")
    ap.add_argument("--snapshots", type=int, default=5, help="snapshot rounds (0 skips them)")
    ap.add_argument("--snapshot-dirty-mib", type=int, default=64,
                    help="MiB the snapshotted sandbox writes to /dev/shm (memory) first")
    ap.add_argument("--only", default="",
                    help="comma list of: create,create_run,throughput,list,edge,auto_resume,egress,snapshot")
    ap.add_argument("--local-stack", action="store_true", help="start a private stack (tests/e2e fixture)")
    ap.add_argument("--runtime", default="",
                    help="with --local-stack: comma list of node runtimes (namespace,gvisor,microvm), each "
                         "measured on its own stack, one after another, and reported side by side")
    ap.add_argument("--edge-compare", action="store_true",
                    help="with --local-stack: also time the edge with its sandbox cache off")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.runtime and not a.local_stack:
        sys.exit("--runtime needs --local-stack (a running stack has the runtime its node has)")

    conftest = None
    if a.local_stack:
        sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))
        sys.path.insert(0, os.path.join(REPO, "tests"))
        os.environ.setdefault("CUBE_E2E_MAX_SANDBOXES", str(max(a.list_sandboxes, a.throughput_creates) + 16))
        import conftest  # noqa: E402
        a.template = conftest.TEMPLATE
    runtimes = [r for r in a.runtime.split(",") if r] or [conftest.RUNTIME if conftest else ""]
    import e2b

    res = {"sdk": f"e2b {e2b.__version__}" if hasattr(e2b, "__version__") else "e2b", "template": a.template,
           "unix_time": int(time.time()), "by_runtime": {}}
    for rt in runtimes:
        stack, cube = None, None
        if conftest is not None:
            stack = conftest._stack(rt)
            cube = next(stack)
        for v in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
            if not os.environ.get(v):
                sys.exit(f"{v} is not set (run deploy/dev-up.sh and export what it prints, or --local-stack)")
        from e2b import Sandbox  # after the env is set: the SDK reads it per call
        try:
            res["by_runtime"][rt or "server"] = {"api_url": os.environ["E2B_API_URL"],
                                                 "results": measure(a, Sandbox, cube, stack)}
        finally:
            if stack is not None:
                stack.close()
    first = next(iter(res["by_runtime"].values()))
    res["api_url"], res["results"] = first["api_url"], first["results"]

    names = list(res["by_runtime"])
    table = {}
    for rt in names:
        for name, v, unit, target in rows_of(res["by_runtime"][rt]["results"]):
            table.setdefault(name, {"unit": unit, "target": target})[rt] = v
    iso = lambda r: res["by_runtime"][r]["results"].get("isolation", "")  # noqa: E731
    print(f"\n{res['sdk']}, template {a.template}\n")
    print("| metric | " + " | ".join(f"{r} ({iso(r)})" if iso(r) else r for r in names) + " | target |")
    print("|---|" + "---:|" * len(names) + "---|")
    for name, row in table.items():
        vals = " | ".join(f"{row[r]:.1f} {row['unit']}" if r in row else "-" for r in names)
        print(f"| {name} | {vals} | {row['target']} |")
    out = a.out or os.path.join(REPO, "benches", "results", f"sdk-bench-{res['unix_time']}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sdk-bench.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"\nJSON: {os.path.join(out, 'sdk-bench.json')}")


if __name__ == "__main__":
    main()
