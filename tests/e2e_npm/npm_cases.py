"""Runs a node script of SDK cases (one JSON line per case: {"case", "status", "detail"}) for the
npm suites here and in tests/interpreter."""

import json
import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
NPM_ROOT = os.environ.get("CUBE_NPM_ROOT", "/var/cache/cube/npm")


def installed(name):
    """The pinned npm dir `name` (tests/e2e_npm/npm/<name>), installed (idempotent, offline once
    cached): returns its node_modules path."""
    if shutil.which("node") is None:
        raise RuntimeError("node is not installed (needs node >= 20.18.1 and npm; see deploy/deps.sh)")
    subprocess.run(["bash", os.path.join(HERE, "install.sh")], check=True,
                   env={**os.environ, "CUBE_NPM_ROOT": NPM_ROOT})
    return os.path.join(NPM_ROOT, name, "node_modules")


def run_cases(script, env, timeout=300):
    """Runs `node script` and returns {case: result}; raises when the script itself crashed."""
    p = subprocess.run(["node", script], env=env, capture_output=True, text=True, timeout=timeout)
    results = {}
    for line in p.stdout.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        results[r["case"]] = r
    if "main" in results or not results:
        raise RuntimeError(f"{os.path.basename(script)} crashed (rc={p.returncode}): "
                           f"{p.stdout[-2000:]} {p.stderr[-2000:]}")
    return results
