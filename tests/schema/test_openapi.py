"""cube-api's OpenAPI document (cube-api/openapi.json, served at /openapi.json) against the API
itself: schemathesis generates requests from the document, valid and invalid, sends them to a
real single-host Cube and checks every answer. It must find nothing: no schema-valid request
refused, no invalid one accepted, no 5xx, no answer the document does not describe.

The run is reproducible: a fixed seed, the examples per operation and the exceptions are in
tests/schema/schemathesis.toml and tests/schema/hooks.py (each with why).
"""

import json
import os
import subprocess
import sys
import tomllib
import urllib.request

import pytest

from conftest import HERE, TEMPLATE

CONFIG = os.path.join(HERE, "schemathesis.toml")
DOCUMENT = os.path.join(HERE, "..", "..", "cube-api", "openapi.json")


def test_schemathesis_finds_nothing(cube, tmp_path):
    with open(CONFIG, "rb") as f:
        config = tomllib.load(f)
    templates = config["dictionaries"]["templates"]["values"]
    assert templates == [TEMPLATE], f"{CONFIG}: creates must name the stack's template {TEMPLATE!r}"
    # The binary serves the document it was built with: a stale one would test an old document.
    served = json.load(urllib.request.urlopen(cube.api_url + "/openapi.json", timeout=10))
    with open(DOCUMENT) as f:
        assert served == json.load(f), "cube-api serves another openapi.json: rebuild it (cargo build -p cube-api)"
    st = os.path.join(os.path.dirname(sys.executable), "st")
    cmd = [st, "--config-file", CONFIG, "run", cube.api_url + "/openapi.json",
           # The document's `servers` is a placeholder: requests go to the stack's API.
           "--url", cube.api_url, "--no-color"]
    env = dict(os.environ, E2B_API_KEY=cube.api_key, PYTHONPATH=HERE, COLUMNS="120")
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    out = r.stdout + r.stderr
    print(out[-3000:])
    if r.returncode != 0:
        pytest.fail(f"schemathesis (rc {r.returncode}, seed {config['seed']}) found problems:\n{out[-20000:]}",
                    pytrace=False)
