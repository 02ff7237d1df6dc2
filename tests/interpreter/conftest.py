"""Session fixture: a real single-host Cube serving the `code-interpreter-v1` template (see
tests/stack.py, `interpreter_stack`). The first run debootstraps the template's root (minutes,
then cached)."""

import os
import sys

import pytest

# tests/stack.py and tests/microvm_logs.py, shared with the other suites.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stack  # noqa: E402

# The session stack's runtime (as in tests/e2e): CI runs the suite on namespace and on gvisor.
RUNTIME = os.environ.get("CUBE_E2E_RUNTIME", "namespace")


@pytest.fixture(scope="session")
def cube():
    try:
        with stack.interpreter_stack(tag="ci" if RUNTIME == "namespace" else f"ci{RUNTIME[:2]}",
                                     runtime=RUNTIME) as c:
            yield c
    except stack.StackError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def cube_microvm():
    """The same template on a node running Linux microVMs."""
    try:
        with stack.interpreter_stack(tag="civm", runtime="microvm") as c:
            yield c
    except stack.StackError as e:
        pytest.fail(str(e))
