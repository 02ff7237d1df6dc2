"""A real single-host Cube for the e2b SDK: cubelet (namespace runtime, a tiny template built
from host binaries), cube-master and cube-api on held 127.0.0.1 ports, and an API key. The stack
itself is tests/stack.py, shared by every Python suite; this adds the e2e suite's settings.

Binaries come from $CARGO_TARGET_DIR/debug (cube-master, cube-api, cubectl, cubelet); the agent
from $CUBE_AGENT_BIN (default: $CARGO_TARGET_DIR/debug/cube-agent). Needs root (cubelet).
"""

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest

# tests/stack.py, tests/ports.py, tests/microvm_logs.py: shared with the other suites.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stack  # noqa: E402
from stack import PROGRAMS  # noqa: E402,F401  (the suite's tests import it from here)

TEMPLATE = "e2emini"
# A command printing every process's name (one that exits between the glob and `cat` is skipped).
PROCESS_NAMES = "cat /proc/[0-9]*/comm 2>/dev/null || true"
# Sandboxes' DNS server: an address on test_egress.py's test network (nothing answers there
# unless that module's namespace is up).
TEST_RESOLVER = "203.0.113.53"
# The node samples each sandbox this often (production: 5 s), so a test sees a history quickly.
# Not on microvm: each pass is a request to every guest's agent, and where the guest kernel is
# emulated (PVM, nested TCG) that load slows the guests down; its tests read logs on demand.
SAMPLE_INTERVAL_MS = 300


def _fail_on_stack_error(f):
    def wrapped(*a, **kw):
        try:
            return f(*a, **kw)
        except stack.StackError as e:
            pytest.fail(str(e))
    return wrapped


_bin = _fail_on_stack_error(stack.bin_path)
_wait = _fail_on_stack_error(stack.wait)
_port_open = stack.port_open
_cleanup_node = stack.cleanup_node
guest_kernel = _fail_on_stack_error(stack.guest_kernel)


def running_in_master(cube):
    """The ids of the sandboxes the master has running (cubectl sandbox list)."""
    out = subprocess.run(cube.cubectl + ["--json", "sandbox", "list"], check=True,
                         capture_output=True, text=True).stdout
    return {s["id"] for s in json.loads(out) if s.get("state") == "running"}


def running_on_node(cube):
    """How many sandboxes the node runs (its cube_sandboxes gauge)."""
    text = urllib.request.urlopen(cube.cubelet_http + "/metrics", timeout=5).read().decode()
    m = re.search(r'^cube_sandboxes\{state="running"\} (\d+)', text, re.M)
    return int(m.group(1)) if m else 0


# The runtime of the session's stack: every SDK test runs against it. CI runs the suite on
# `namespace` and again on `gvisor` (tests/run.sh).
RUNTIME = os.environ.get("CUBE_E2E_RUNTIME", "namespace")


@pytest.fixture(scope="session")
def cube():
    yield from _stack(RUNTIME)


@pytest.fixture(scope="module")
def cube_microvm():
    """A second stack whose cubelet runs the microvm runtime with the Linux guest kernel."""
    yield from _stack("microvm")


@pytest.fixture(scope="module")
def cube_gvisor(request):
    """A stack whose cubelet runs the gvisor runtime (runsc, systrap platform): the session's
    own when the suite runs on gvisor, else a second one."""
    if RUNTIME == "gvisor":
        yield request.getfixturevalue("cube")
        return
    yield from _stack("gvisor")


# What the master reports for an agent whose version it could not read (never the agent's own;
# a valid version, as the SDKs parse it).
ENVD_FALLBACK = "0.0.1+unread"


@pytest.fixture(scope="module")
def cube_ha():
    """A stack with two cube-masters on one PostgreSQL database (a schema of its own in
    $CUBE_TEST_PG_URL): one leads, the other stands by. cube-api and the cubelet (which
    registers, rather than being polled from a static list) know both."""
    yield from _stack(RUNTIME, masters=2)


def _stack(runtime, api_extra=None, masters=1):
    """The e2e stack on `runtime`; `api_extra`: api.toml tables (tests/security's limits);
    `masters` > 1: that many cube-masters on one PostgreSQL database (see `cube_ha`)."""
    started = int(os.environ.get("CUBE_E2E_STARTED_POOL") or 0)
    if runtime == "microvm":
        started = 1  # one warm shim: the template's snapshot is a Linux boot
    elif runtime == "gvisor" and not started:
        # A cold runsc start is a quarter of a second: keep a few sandboxes started.
        started = 2
    node = {
        "sandbox": {"max_sandboxes": int(os.environ.get("CUBE_E2E_MAX_SANDBOXES", "32"))},
        "network": {"dns_resolver": TEST_RESOLVER, "egress_proxy": "169.254.64.1"},
        "journal": {"sample_interval_ms": 5000 if runtime == "microvm" else SAMPLE_INTERVAL_MS},
    }
    try:
        with stack.stack(stack.host_root_template(TEMPLATE), runtime, tag="e2e",
                         configured_runtime=os.environ.get("CUBE_E2E_CONFIGURED_RUNTIME"),
                         started=started, masters=masters, cubelet=node,
                         master={"default_envd_version": ENVD_FALLBACK}, api=api_extra,
                         dead_node=True) as c:
            yield c
    except stack.StackError as e:
        pytest.fail(str(e))
