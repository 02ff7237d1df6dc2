"""The code-interpreter template on a node running Linux microVMs, with the real
e2b-code-interpreter SDK. The template's snapshot is taken once cube-agent's pre-started Python
worker is up, so every sandbox restored from it starts with a warm interpreter: its first
`run_code` costs a round trip, where a fresh Python worker (a new context) has to start one."""

import time

import pytest
from e2b_code_interpreter import Sandbox

import microvm_logs
from stack import INTERPRETER_TEMPLATE as TEMPLATE


def timed(f):
    t0 = time.perf_counter()
    r = f()
    return r, time.perf_counter() - t0


# The fixture boots the guest and starts Python in it once, for the template's snapshot.
@pytest.mark.timeout(900)
def test_microvm_sandboxes_start_with_the_interpreter_warm(cube_microvm):
    sbx = Sandbox.create(TEMPLATE, timeout=300, request_timeout=300)
    try:
        with microvm_logs.on_failure(cube_microvm):
            info = Sandbox.get_info(sbx.sandbox_id)
            assert info.template_id == TEMPLATE
            warm, warm_s = timed(lambda: sbx.run_code("1+1"))
            assert warm.error is None and warm.text == "2", warm
            # A new context starts a Python worker now, inside this microVM.
            cold, cold_s = timed(lambda: sbx.run_code("1+1", context=sbx.create_code_context()))
            assert cold.error is None and cold.text == "2", cold
            print(f"first run_code {warm_s * 1e3:.0f} ms; new context + run_code {cold_s * 1e3:.0f} ms")
            # Warm means its start-up was paid before the snapshot: far below a fresh start.
            assert warm_s * 3 < cold_s, (warm_s, cold_s)
            # And the state is per sandbox: the template's worker was not shared.
            sbx.run_code("x = 41")
            assert sbx.run_code("x + 1").text == "42"
    finally:
        sbx.kill()
