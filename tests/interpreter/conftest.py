"""Session fixture: a real single-host Cube serving the `code-interpreter-v1` template (see
stack.py). The first run debootstraps the template's root (minutes, then cached)."""

import os
import sys

import pytest

import stack

# tests/microvm_logs.py, shared with the other suites that start microVM stacks.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The session stack's runtime (as in tests/e2e): CI runs the suite on namespace and on gvisor.
RUNTIME = os.environ.get("CUBE_E2E_RUNTIME", "namespace")


@pytest.fixture(scope="session")
def cube():
    try:
        with stack.cube_stack(tag="ci" if RUNTIME == "namespace" else f"ci{RUNTIME[:2]}",
                              runtime=RUNTIME) as c:
            yield c
    except stack.StackError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def cube_microvm():
    """The same template on a node running Linux microVMs (see stack.cube_stack)."""
    try:
        with stack.cube_stack(tag="civm", runtime="microvm") as c:
            yield c
    except stack.StackError as e:
        pytest.fail(str(e))
