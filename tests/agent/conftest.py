"""Fixtures: one cube-agent on 127.0.0.1:49983 for the SDK in debug mode (session-wide), private
agents on free ports for tests that change agent-wide state (/init tokens, env vars) or abuse it."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

# Debug mode: the SDK talks to http://localhost:49983 and never calls a control plane.
os.environ["E2B_DEBUG"] = "true"
os.environ.pop("E2B_SANDBOX_URL", None)
os.environ.pop("E2B_API_URL", None)

import agentlib  # noqa: E402
from agentlib import DEBUG_PORT, SDK_DEFAULT_PORT, TEST_USER, Agent, Client  # noqa: E402

if DEBUG_PORT != SDK_DEFAULT_PORT:
    os.environ["E2B_SANDBOX_URL"] = f"http://127.0.0.1:{DEBUG_PORT}"


def pytest_configure(config):
    if os.geteuid() != 0:
        raise pytest.UsageError("the cube-agent SDK suite runs the agent as root: run it as root")


@pytest.fixture(scope="session")
def test_user() -> str:
    agentlib.ensure_user(TEST_USER)
    return TEST_USER


@pytest.fixture(scope="session")
def tree(test_user):
    """Root of everything this run writes; removed at the end."""
    d = Path(tempfile.mkdtemp(prefix="cube-agent-sdk-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def agent(tree, test_user):
    """The debug-mode agent, default user `user`, default workdir set through /init."""
    home = tree / "agent-home"
    home.mkdir()
    workdir = tree / "workdir"
    workdir.mkdir()
    shutil.chown(workdir, test_user, test_user)
    a = Agent(DEBUG_PORT, home, ["--default-user", test_user])
    a.start()
    a.default_workdir = workdir
    r = agentlib.post_init(DEBUG_PORT, defaultUser=test_user, defaultWorkdir=str(workdir))
    assert r.status == 204, f"/init: {r.status} {r.body!r}"
    yield a
    alive = a.alive()
    zombies = []
    if alive:
        # Every command the run started has ended by now: none may be left unreaped.
        try:
            agentlib.wait_until(lambda: not agentlib.children(a.pid, zombies=True), timeout=10)
        except AssertionError:
            zombies = agentlib.children(a.pid, zombies=True)
    a.stop()
    assert alive, f"the agent died during the run; log tail:\n{a.log_tail()}"
    assert not zombies, f"agent left zombie children: {zombies}"


@pytest.fixture
def wd(tree, test_user) -> Path:
    """A fresh directory owned by the default user (the SDK acts as `user` unless told otherwise)."""
    d = tree / "t" / uuid.uuid4().hex[:12]
    d.mkdir(parents=True)
    for p in (d.parent, d):
        shutil.chown(p, test_user, test_user)
    return d


@pytest.fixture
def sbx(agent):
    from e2b import Sandbox

    s = Sandbox.create(debug=True)
    assert s.sandbox_id == "debug_sandbox_id"
    yield s


@pytest.fixture
def raw(agent):
    c = Client(DEBUG_PORT)
    yield c
    c.close()


@pytest.fixture
def private_agent(tree, test_user):
    """A fresh agent on a free port, for tests that set tokens/env vars or misbehave on purpose."""
    home = tree / f"private-{uuid.uuid4().hex[:8]}"
    home.mkdir()
    a = Agent(agentlib.free_port(), home, ["--default-user", test_user])
    a.start()
    yield a
    alive = a.alive()
    a.stop()
    assert alive, f"private agent died; log tail:\n{a.log_tail()}"
