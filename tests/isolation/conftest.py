"""The attacker suite's stack: tests/e2e's single-host Cube (on the runtime CUBE_E2E_RUNTIME
names, `namespace` by default; its tiny template built from host binaries), started by that
suite's own code, not a copy of it."""

import json
import os
import subprocess
import urllib.request

import pytest

import stack

HERE = os.path.dirname(os.path.abspath(__file__))
e2e = stack.e2e_suite()
TEMPLATE = e2e.TEMPLATE
RUNTIME = e2e.RUNTIME


@pytest.fixture(scope="session")
def cube():
    yield from e2e._stack(e2e.RUNTIME)


def detail(cube, sid):
    """The API's sandbox detail (runtime, isolation, ...)."""
    req = urllib.request.Request(f"{cube.api_url}/sandboxes/{sid}")
    req.add_header("X-API-KEY", cube.api_key)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def compile_probe(tmp_path_factory, name):
    """A C probe of this directory, compiled static (the templates have no compiler and no
    libc to spare); its bytes."""
    out = tmp_path_factory.mktemp(name) / name
    r = subprocess.run(["cc", "-static", "-O2", "-o", str(out), os.path.join(HERE, f"{name}.c")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"compiling {name}.c: {r.stderr}")
    return out.read_bytes()


@pytest.fixture(scope="session")
def probe(tmp_path_factory):
    return compile_probe(tmp_path_factory, "escape_probe")


@pytest.fixture(scope="session")
def ping_probe(tmp_path_factory):
    return compile_probe(tmp_path_factory, "ping_probe")


@pytest.fixture(scope="session")
def vsock_probe(tmp_path_factory):
    return compile_probe(tmp_path_factory, "vsock_probe")
