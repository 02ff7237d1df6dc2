"""The OpenAPI property suite's stack: tests/e2e's single-host Cube on the namespace runtime,
started by that suite's own code (tests/stack.py), with its template and an API key."""

import importlib.util
import os
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
