"""The npm `e2b` SDK (2.51.x and 2.13.x, pinned in npm/e2b-*/) against the real single-host Cube
started by the shared e2e fixture. The cases live in sdk_test.cjs; each becomes a test here, and a
case the SDK version cannot do is skipped with the script's reason."""

import os

import pytest

import npm_cases
from conftest import TEMPLATE

HERE = os.path.dirname(os.path.abspath(__file__))
VERSIONS = sorted(d.split("-", 1)[1] for d in os.listdir(os.path.join(HERE, "npm")) if d.startswith("e2b-"))
CASES = ["create_metadata_envs", "commands", "history", "files", "get_info", "list_filters_paging", "set_timeout",
         "pause_connect", "auto_pause_resume", "refused_network_policy", "kill", "not_found_404",
         "wrong_key_401"]


@pytest.fixture(scope="module", params=VERSIONS)
def npm_run(request, cube):
    try:
        pkg = os.path.join(npm_cases.installed(f"e2b-{request.param}"), "e2b")
        env = {**os.environ, "CUBE_E2B_JS": pkg, "CUBE_TEMPLATE": TEMPLATE,
               "E2B_API_URL": cube.api_url, "E2B_SANDBOX_URL": cube.sandbox_url,
               "E2B_API_KEY": cube.api_key}
        return request.param, npm_cases.run_cases(os.path.join(HERE, "sdk_test.cjs"), env)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.mark.parametrize("case", CASES)
def test_npm_sdk(npm_run, case):
    version, results = npm_run
    r = results.get(case)
    assert r is not None, f"e2b {version}: case {case} did not run"
    if r["status"] == "skip":
        pytest.skip(f"e2b {version}: {r['detail']}")
    assert r["status"] == "pass", f"e2b {version}: {r['detail']}"
