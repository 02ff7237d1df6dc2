"""The attacker suite's stack: tests/e2e's single-host Cube (namespace runtime, its tiny
template built from host binaries), started by that suite's own code, not a copy of it."""

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("e2e_stack", os.path.join(HERE, "..", "e2e", "conftest.py"))
e2e = importlib.util.module_from_spec(_spec)
sys.modules["e2e_stack"] = e2e
_spec.loader.exec_module(e2e)
TEMPLATE = e2e.TEMPLATE


@pytest.fixture(scope="session")
def cube():
    yield from e2e._stack("namespace")


@pytest.fixture(scope="session")
def probe(tmp_path_factory):
    """escape_probe.c, compiled static (the template has no compiler and no libc to spare)."""
    out = tmp_path_factory.mktemp("probe") / "escape_probe"
    r = subprocess.run(["cc", "-static", "-O2", "-o", str(out), os.path.join(HERE, "escape_probe.c")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"compiling escape_probe.c: {r.stderr}")
    return out.read_bytes()
