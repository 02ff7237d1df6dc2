"""The OpenAPI property suite's stack: tests/e2e's single-host Cube on the namespace runtime,
started by that suite's own code (tests/stack.py), with its template and an API key."""

import os

import pytest

import stack

HERE = os.path.dirname(os.path.abspath(__file__))
e2e = stack.e2e_suite()
TEMPLATE = e2e.TEMPLATE


@pytest.fixture(scope="session")
def cube():
    yield from e2e._stack("namespace")
