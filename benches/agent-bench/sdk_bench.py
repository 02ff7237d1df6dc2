#!/usr/bin/env python3
"""End-to-end latency of `sbx.commands.run("true")` through the real e2b SDK (debug mode) against
cube-agent on 127.0.0.1:49983. Reference numbers only: the SDK adds `bash -l -c` and its own
client overhead, so the agent's target is checked by the Rust `agent-bench`, not here.

    CUBE_AGENT_BIN=... /var/tmp/venv-agent/bin/python benches/agent-bench/sdk_bench.py --iterations 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["E2B_DEBUG"] = "true"
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "agent"))

import agentlib  # noqa: E402

if agentlib.DEBUG_PORT != agentlib.SDK_DEFAULT_PORT:
    os.environ["E2B_SANDBOX_URL"] = f"http://127.0.0.1:{agentlib.DEBUG_PORT}"


def pct(sorted_ms: list[float], q: float) -> float:
    idx = max(1, min(len(sorted_ms), int(-(-q * len(sorted_ms) // 1)))) - 1
    return sorted_ms[idx]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--cmd", default="true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from e2b import Sandbox

    with tempfile.TemporaryDirectory(prefix="cube-sdk-bench-") as tmp:
        agent = agentlib.Agent(agentlib.DEBUG_PORT, Path(tmp)).start()
        try:
            sbx = Sandbox.create(debug=True)
            for _ in range(args.warmup):
                sbx.commands.run(args.cmd)
            samples = []
            for _ in range(args.iterations):
                t0 = time.perf_counter()
                sbx.commands.run(args.cmd)
                samples.append((time.perf_counter() - t0) * 1000)
            rss = agentlib.rss_kib(agent.pid)
        finally:
            agent.stop()

    s = sorted(samples)
    result = {
        "agent_bin": str(agentlib.agent_bin()),
        "cmd": args.cmd,
        "iterations": args.iterations,
        "p50_ms": pct(s, 0.50),
        "p90_ms": pct(s, 0.90),
        "p99_ms": pct(s, 0.99),
        "max_ms": s[-1],
        "mean_ms": statistics.fmean(s),
        "rss_after_kib": rss,
    }
    print(f"| sdk.commands.run({args.cmd!r}) | p50 {result['p50_ms']:.2f} ms | p90 {result['p90_ms']:.2f} ms "
          f"| p99 {result['p99_ms']:.2f} ms | max {result['max_ms']:.2f} ms | agent RSS {rss / 1024:.2f} MiB |")
    out = args.out or REPO / "benches" / "results" / f"agent-sdk-bench-{int(time.time())}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sdk-bench.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
