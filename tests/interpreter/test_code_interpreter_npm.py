"""The npm `@e2b/code-interpreter` SDK (pinned in tests/e2e_npm/npm/code-interpreter-*/) against the
same stack as the Python SDK tests. The cases live in ci_test.cjs; each becomes a test here."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
NPM_DIR = os.path.join(HERE, "..", "e2e_npm")
sys.path.insert(0, NPM_DIR)
import npm_cases  # noqa: E402
VERSIONS = sorted(d.split("-", 2)[2] for d in os.listdir(os.path.join(NPM_DIR, "npm"))
                  if d.startswith("code-interpreter-"))
CASES = ["one_plus_one", "state_and_env", "streaming_callbacks", "errors", "chart_png", "contexts",
         "timeout"]


@pytest.fixture(scope="module", params=VERSIONS)
def npm_run(request, cube):
    try:
        pkg = os.path.join(npm_cases.installed(f"code-interpreter-{request.param}"), "@e2b",
                           "code-interpreter")
        env = {**os.environ, "CUBE_CI_JS": pkg, "E2B_API_URL": cube.api_url,
               "E2B_SANDBOX_URL": cube.sandbox_url, "E2B_API_KEY": cube.api_key}
        return request.param, npm_cases.run_cases(os.path.join(HERE, "ci_test.cjs"), env)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.mark.parametrize("case", CASES)
def test_npm_code_interpreter(npm_run, case):
    version, results = npm_run
    r = results.get(case)
    assert r is not None, f"@e2b/code-interpreter {version}: case {case} did not run"
    assert r["status"] == "pass", f"@e2b/code-interpreter {version}: {r['detail']}"
