"""The two-team security suite's stack: tests/e2e's single-host Cube (runtime from
CUBE_E2E_RUNTIME, `namespace` by default), started by that suite's own code, with a low per-address
edge look-up limit so a flood is cheap to provoke, and one API key per team."""

import os
import subprocess

import pytest

import stack

HERE = os.path.dirname(os.path.abspath(__file__))
e2e = stack.e2e_suite()
TEMPLATE = e2e.TEMPLATE

# Per client address: look-ups the edge cache cannot answer (see cube-api's [rate_limit]).
EDGE_LOOKUP_PER_S = 50
EDGE_LOOKUP_BURST = 100


@pytest.fixture(scope="session")
def cube():
    yield from e2e._stack(e2e.RUNTIME, api_extra={"rate_limit": {
        "edge_lookup_per_s": EDGE_LOOKUP_PER_S, "edge_lookup_burst": EDGE_LOOKUP_BURST}})


@pytest.fixture(scope="session")
def teams(cube):
    """API keys of two teams."""
    keys = {}
    for t in ("team-a", "team-b"):
        out = subprocess.run(cube.cubectl + ["apikey", "create", "--name", t, "--team", t],
                             check=True, capture_output=True, text=True)
        keys[t] = out.stdout.strip()
    return keys["team-a"], keys["team-b"]


@pytest.fixture(scope="session")
def net_probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("net_probe") / "net_probe"
    r = subprocess.run(["cc", "-static", "-O2", "-o", str(out), os.path.join(HERE, "net_probe.c")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"compiling net_probe.c: {r.stderr}")
    return out.read_bytes()
