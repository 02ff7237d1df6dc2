#!/usr/bin/env python3
"""interp-bench: `run_code("1+1")` latency on a fresh sandbox, with the real e2b-code-interpreter
SDK against a real single-host Cube (namespace runtime, or --runtime gvisor|microvm; template
code-interpreter-v1).

Target (issue 10): the first run_code("1+1") after Sandbox.create() returns, p50 <= 30 ms.

Starts its own stack (tests/stack.py, `interpreter_stack`; needs root and the debug binaries, see there),
prints a markdown table and writes JSON to --out DIR (default
benches/results/interp-bench-<unix time>/).

    CARGO_TARGET_DIR=... python3 benches/interp-bench/interp_bench.py [--iterations 20]
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests"))

import stack  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def agent_only(args):
    """The agent alone on loopback (no sandbox, no edge, no SDK): fresh agent start -> first
    /execute, and warm /execute round trips. Separates the agent's share from the stack's."""
    import http.client
    import socket
    import subprocess

    agent = os.environ.get("CUBE_AGENT_BIN") or os.path.join(
        os.environ.get("CARGO_TARGET_DIR", ""), "debug", "cube-agent")

    def free():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def execute(port, code):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("POST", "/execute", body=json.dumps({"code": code}),
                  headers={"Content-Type": "application/json"})
        body = c.getresponse().read().decode()
        c.close()
        if '"text":"2"' not in body:
            raise SystemExit(f"unexpected /execute answer: {body}")

    rows = {"agent_start_to_first_execute_ms": [], "first_execute_ms": [], "warm_execute_ms": []}
    for _ in range(args.iterations):
        envd, port = free(), free()
        t0 = time.perf_counter()
        p = subprocess.Popen([agent, "--addr", f"127.0.0.1:{envd}", "--init", "never", "--config",
                              "/nonexistent.toml", "--interpreter-port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if time.perf_counter() - t0 > 30:
                    raise SystemExit("agent did not open the interpreter port")
                time.sleep(0.001)
            t1 = time.perf_counter()
            execute(port, "1+1")
            t2 = time.perf_counter()
            rows["agent_start_to_first_execute_ms"].append((t2 - t0) * 1e3)
            rows["first_execute_ms"].append((t2 - t1) * 1e3)
            for _ in range(5):
                t3 = time.perf_counter()
                execute(port, "1+1")
                rows["warm_execute_ms"].append((time.perf_counter() - t3) * 1e3)
        finally:
            p.terminate()
            p.wait()
    return rows, None


def sdk_stack(args):
    """The real SDK against the real stack: fresh sandbox -> first run_code("1+1")."""
    tag = "ib" if args.runtime == "namespace" else f"ib{args.runtime[:2]}"
    with stack.interpreter_stack(tag=tag, log=lambda m: print(m, file=sys.stderr), runtime=args.runtime) as cube:
        from e2b_code_interpreter import Sandbox

        # One warm-up sandbox: first connections, page cache of the template image.
        s = Sandbox.create()
        s.run_code("1+1")
        s.kill()
        rows = {"create_ms": [], "first_run_code_ms": [], "second_run_code_ms": [], "create_plus_first_ms": []}
        for _ in range(args.iterations):
            t0 = time.perf_counter()
            sbx = Sandbox.create()
            t1 = time.perf_counter()
            ex = sbx.run_code("1+1")
            t2 = time.perf_counter()
            if ex.text != "2":
                raise SystemExit(f"unexpected result {ex!r}")
            sbx.run_code("1+1")
            t3 = time.perf_counter()
            sbx.kill()
            rows["create_ms"].append((t1 - t0) * 1e3)
            rows["first_run_code_ms"].append((t2 - t1) * 1e3)
            rows["second_run_code_ms"].append((t3 - t2) * 1e3)
            rows["create_plus_first_ms"].append((t2 - t0) * 1e3)
        return rows, cube.template_build_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--target-ms", type=float, default=30.0)
    ap.add_argument("--runtime", default="namespace", help="the node's runtime: namespace, gvisor or microvm")
    ap.add_argument("--agent-only", action="store_true",
                    help="measure the agent alone on loopback (no root, no stack, no SDK)")
    args = ap.parse_args()
    out = args.out or os.path.join(REPO, "benches", "results", f"interp-bench-{int(time.time())}")
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    rows, build_s = agent_only(args) if args.agent_only else sdk_stack(args)
    key = "first_execute_ms" if args.agent_only else "first_run_code_ms"

    summary = {
        k: {"p50": statistics.median(v), "p90": pct(v, 90), "min": min(v), "max": max(v), "n": len(v)}
        for k, v in rows.items()
    }
    ok = summary[key]["p50"] <= args.target_ms
    mode = "agent alone on loopback" if args.agent_only else f"fresh sandboxes, {args.runtime} runtime, e2b SDK"
    print(f"\n## interp-bench ({args.iterations} iterations, {mode}; load average {load:.1f})\n")
    print("| metric | p50 ms | p90 ms | min ms | max ms |")
    print("|---|---:|---:|---:|---:|")
    for k, s in summary.items():
        print(f"| {k} | {s['p50']:.1f} | {s['p90']:.1f} | {s['min']:.1f} | {s['max']:.1f} |")
    print(f"\n{key} p50 {summary[key]['p50']:.1f} ms, "
          f"target <= {args.target_ms:.0f} ms: {'PASS' if ok else 'FAIL'}")
    if build_s is not None:
        print(f"template build/reuse: {build_s:.1f} s")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "interp-bench.json"), "w") as f:
        json.dump({"bench": "interp-bench", "mode": "agent-only" if args.agent_only else "sdk-stack",
                   "runtime": None if args.agent_only else args.runtime,
                   "load_average": load, "iterations": args.iterations, "summary": summary,
                   "samples": rows, "target_ms": args.target_ms, "pass": ok,
                   "template_build_s": build_s, "unix_time": int(time.time())}, f, indent=2)
    print(f"wrote {out}/interp-bench.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
