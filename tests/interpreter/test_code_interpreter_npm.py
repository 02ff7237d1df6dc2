"""The npm `@e2b/code-interpreter` SDK (pinned in tests/e2e_npm/npm/code-interpreter-*/) against the
same stack as the Python SDK tests. The cases live in ci_test.cjs; each becomes a test here."""

import json
import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
NPM_DIR = os.path.join(HERE, "..", "e2e_npm")
NPM_ROOT = os.environ.get("CUBE_NPM_ROOT", "/var/cache/cube/npm")
VERSIONS = sorted(d.split("-", 2)[2] for d in os.listdir(os.path.join(NPM_DIR, "npm"))
                  if d.startswith("code-interpreter-"))
CASES = ["one_plus_one", "state_and_env", "streaming_callbacks", "errors", "chart_png", "contexts",
         "timeout"]


@pytest.fixture(scope="module", params=VERSIONS)
def npm_run(request, cube):
    if shutil.which("node") is None:
        pytest.fail("node is not installed (needs node >= 20.18.1 and npm; see deploy/deps.sh)")
    subprocess.run(["bash", os.path.join(NPM_DIR, "install.sh")], check=True,
                   env={**os.environ, "CUBE_NPM_ROOT": NPM_ROOT})
    pkg = os.path.join(NPM_ROOT, f"code-interpreter-{request.param}", "node_modules", "@e2b",
                       "code-interpreter")
    env = {**os.environ, "CUBE_CI_JS": pkg, "E2B_API_URL": cube.api_url,
           "E2B_SANDBOX_URL": cube.sandbox_url, "E2B_API_KEY": cube.api_key}
    p = subprocess.run(["node", os.path.join(HERE, "ci_test.cjs")], env=env, capture_output=True,
                       text=True, timeout=300)
    results = {}
    for line in p.stdout.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        results[r["case"]] = r
    if "main" in results or not results:
        pytest.fail(f"ci_test.cjs crashed (rc={p.returncode}): {p.stdout[-2000:]} {p.stderr[-2000:]}")
    return request.param, results


@pytest.mark.parametrize("case", CASES)
def test_npm_code_interpreter(npm_run, case):
    version, results = npm_run
    r = results.get(case)
    assert r is not None, f"@e2b/code-interpreter {version}: case {case} did not run"
    assert r["status"] == "pass", f"@e2b/code-interpreter {version}: {r['detail']}"
