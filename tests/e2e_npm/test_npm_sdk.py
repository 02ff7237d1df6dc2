"""The npm `e2b` SDK (2.51.x and 2.13.x, pinned in npm/e2b-*/) against the real single-host Cube
started by the shared e2e fixture. The cases live in sdk_test.cjs; each becomes a test here, and a
case the SDK version cannot do is skipped with the script's reason."""

import json
import os
import shutil
import subprocess

import pytest

from conftest import TEMPLATE

HERE = os.path.dirname(os.path.abspath(__file__))
NPM_ROOT = os.environ.get("CUBE_NPM_ROOT", "/var/cache/cube/npm")
VERSIONS = sorted(d.split("-", 1)[1] for d in os.listdir(os.path.join(HERE, "npm")) if d.startswith("e2b-"))
CASES = ["create_metadata_envs", "commands", "files", "get_info", "list_filters_paging", "set_timeout",
         "pause_connect", "kill", "not_found_404", "wrong_key_401"]


@pytest.fixture(scope="module", params=VERSIONS)
def npm_run(request, cube):
    if shutil.which("node") is None:
        pytest.fail("node is not installed (tests/e2e_npm needs node >= 20.18.1 and npm)")
    # Idempotent and offline once the pinned versions are in the cache.
    subprocess.run(["bash", os.path.join(HERE, "install.sh")], check=True,
                   env={**os.environ, "CUBE_NPM_ROOT": NPM_ROOT})
    pkg = os.path.join(NPM_ROOT, f"e2b-{request.param}", "node_modules", "e2b")
    env = {**os.environ, "CUBE_E2B_JS": pkg, "CUBE_TEMPLATE": TEMPLATE,
           "E2B_API_URL": cube.api_url, "E2B_SANDBOX_URL": cube.sandbox_url, "E2B_API_KEY": cube.api_key}
    p = subprocess.run(["node", os.path.join(HERE, "sdk_test.cjs")], env=env, capture_output=True,
                       text=True, timeout=300)
    results = {}
    for line in p.stdout.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        results[r["case"]] = r
    if "main" in results or not results:
        pytest.fail(f"sdk_test.cjs crashed (rc={p.returncode}): {p.stdout[-2000:]} {p.stderr[-2000:]}")
    return request.param, results


@pytest.mark.parametrize("case", CASES)
def test_npm_sdk(npm_run, case):
    version, results = npm_run
    r = results.get(case)
    assert r is not None, f"e2b {version}: case {case} did not run"
    if r["status"] == "skip":
        pytest.skip(f"e2b {version}: {r['detail']}")
    assert r["status"] == "pass", f"e2b {version}: {r['detail']}"
