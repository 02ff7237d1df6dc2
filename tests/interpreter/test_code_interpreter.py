"""The official e2b-code-interpreter SDK, unchanged, against Cube's code-interpreter template:
cube-api edge -> cubelet sandbox (namespace runtime) -> cube-agent's interpreter on port 49999."""

import base64
import threading
import uuid
import time

import pytest
from e2b import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import Sandbox

from stack import INTERPRETER_TEMPLATE as TEMPLATE


@pytest.fixture
def sbx(cube):
    s = Sandbox.create(timeout=300, envs={"SBX_VAR": "from-create"})
    try:
        yield s
    finally:
        s.kill()


def test_default_template_and_one_plus_one(sbx):
    assert Sandbox.default_template == TEMPLATE
    ex = sbx.run_code("1+1")
    assert ex.error is None
    assert [r.text for r in ex.results] == ["2"]
    assert ex.results[0].is_main_result
    assert ex.execution_count == 1
    assert ex.text == "2"


def test_state_persists_between_calls(sbx):
    sbx.run_code("import math\nx = 40")
    sbx.run_code("def f(v):\n    return v + 1")
    ex = sbx.run_code("x = f(x) + 1\nmath.floor(x + 0.5)")
    assert ex.text == "42"
    assert sbx.run_code("x").text == "42"
    # Strings come back without their repr quotes, as with E2B's Jupyter server.
    assert sbx.run_code("'hello'").text == "hello"
    assert sbx.run_code("y = 1").results == []


def test_stdout_and_stderr_stream_through_callbacks(sbx):
    # The cell prints, then waits for a file that the test writes only once that first line has
    # reached it: buffered to the end, the line would never come and the cell would give up.
    flag = f"/tmp/streamed-{uuid.uuid4().hex[:8]}"
    seen, first = [], threading.Event()

    def on_out(m):
        seen.append(("out", m.line))
        first.set()

    def release():
        if first.wait(60):
            sbx.files.write(flag, "go")

    th = threading.Thread(target=release)
    th.start()
    ex = sbx.run_code(
        "import os, sys, time\nprint('first', flush=True)\n"
        f"for _ in range(600):\n    if os.path.exists({flag!r}): break\n    time.sleep(0.1)\n"
        "else:\n    raise RuntimeError('the first line never reached the client')\n"
        "print('oops', file=sys.stderr)\nprint('second')",
        on_stdout=on_out,
        on_stderr=lambda m: seen.append(("err", m.line)),
    )
    th.join()
    assert ex.error is None, ex.error
    assert seen == [("out", "first\n"), ("err", "oops\n"), ("out", "second\n")]
    assert ex.logs.stdout == ["first\n", "second\n"]
    assert ex.logs.stderr == ["oops\n"]
    # Output of subprocesses (fd 1 of the interpreter) is captured too.
    ex = sbx.run_code("import subprocess\nsubprocess.run(['echo', 'from-child'])\nNone")
    assert "from-child\n" in "".join(ex.logs.stdout)


def test_exceptions_carry_name_value_traceback(sbx):
    errors = []
    ex = sbx.run_code("def g():\n    return undefined_name\ng()", on_error=errors.append)
    assert ex.error is not None
    assert ex.error.name == "NameError"
    assert "undefined_name" in ex.error.value
    assert "g()" in ex.error.traceback and "<cell" in ex.error.traceback
    assert "worker" not in ex.error.traceback  # the interpreter's own frames are hidden
    assert errors and errors[0].name == "NameError"
    ex = sbx.run_code("def broken(:\n    pass")
    assert ex.error.name == "SyntaxError"
    # An error does not lose the context's state.
    sbx.run_code("kept = 7")
    sbx.run_code("1/0")
    assert sbx.run_code("kept").text == "7"


def test_matplotlib_chart_is_a_png_result(sbx):
    ex = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()"
    )
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1
    raw = base64.b64decode(pngs[0])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 5000
    # A figure left open at the end of the cell is shown too, once.
    ex = sbx.run_code("fig, ax = plt.subplots()\nax.bar(['a', 'b'], [3, 5])\n'done'")
    assert [r.text for r in ex.results if r.is_main_result] == ["done"]
    assert len([r for r in ex.results if r.png]) == 1
    assert sbx.run_code("len(plt.get_fignums())").text == "0"


def test_rich_results_dataframe_html_and_display(sbx):
    ex = sbx.run_code("import pandas as pd, numpy as np\npd.DataFrame({'a': np.arange(3)})")
    assert ex.error is None, ex.error
    r = ex.results[0]
    assert r.is_main_result and r.html and "<table" in r.html
    assert "a" in r.text
    ex = sbx.run_code("display('shown')\n3")
    assert [(r.text, r.is_main_result) for r in ex.results] == [("shown", False), ("3", True)]


def test_env_vars_sandbox_and_per_call(sbx):
    ex = sbx.run_code("import os\n(os.environ.get('SBX_VAR'), os.environ.get('CALL_VAR'))",
                      envs={"CALL_VAR": "per-call"})
    assert ex.text == "('from-create', 'per-call')"
    # Per-call variables do not leak into the next call.
    assert sbx.run_code("str(os.environ.get('CALL_VAR'))").text == "None"


def test_contexts_create_list_isolate_restart_remove(sbx):
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    assert sbx.run_code("import os\nos.getcwd()", context=ctx).text == "/tmp"
    sbx.run_code("only_here = 1", context=ctx)
    # The default context does not see it.
    assert sbx.run_code("only_here").error.name == "NameError"
    assert sbx.run_code("only_here", context=ctx).text == "1"
    sbx.restart_code_context(ctx)
    assert sbx.run_code("only_here", context=ctx).error.name == "NameError"
    ex = sbx.run_code("1", context=ctx)
    assert ex.execution_count == 2  # counting restarted with the interpreter
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)
    with pytest.raises(NotFoundException):
        sbx.restart_code_context(ctx.id)


def test_timeout_interrupts_the_cell(sbx):
    sbx.run_code("phase = 'before'")
    # (The sleep outlasts the suite's per-test timeout: nothing here waits it out.)
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\nphase = 'sleeping'\ntime.sleep(900)\nphase = 'after'", timeout=2)
    # The client's timeout closed the stream; the agent interrupted the cell (state kept): the
    # next cell runs at once, on the state the sleep left.
    ex = sbx.run_code("phase")
    assert ex.text == "sleeping"


def test_restart_kills_a_long_run(sbx):
    ctx = sbx.create_code_context()
    out = {}

    def long_run():
        out["ex"] = sbx.run_code("import time\nprint('running', flush=True)\ntime.sleep(900)", context=ctx,
                                 on_stdout=lambda m: out.setdefault("started", True))

    th = threading.Thread(target=long_run)
    th.start()
    deadline = time.monotonic() + 30
    while "started" not in out and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "started" in out
    sbx.restart_code_context(ctx)
    # The run ends with the restart, not with its 900 s sleep.
    th.join(90)
    assert not th.is_alive()
    assert out["ex"].error is not None
    assert out["ex"].error.name == "UnexpectedEndOfExecution"
    assert sbx.run_code("2*21", context=ctx).text == "42"


def test_bad_requests_are_clear_errors(sbx):
    with pytest.raises(SandboxException) as e:
        sbx.run_code("1", language="cobol")
    assert "400" in str(e.value) and "cobol" in str(e.value)
    with pytest.raises(SandboxException):
        sbx.create_code_context(cwd="/does/not/exist")
    # A cell that exits the interpreter reports it; the next cell gets a fresh one.
    ctx = sbx.create_code_context()
    ex = sbx.run_code("import os\nos._exit(3)", context=ctx)
    assert ex.error is not None and ex.error.name == "UnexpectedEndOfExecution"
    assert sbx.run_code("'alive'", context=ctx).text == "alive"


def test_envd_still_works_in_the_template(sbx):
    r = sbx.commands.run("python3 -c 'import numpy, pandas, matplotlib; print(numpy.__name__)'")
    assert r.exit_code == 0 and r.stdout.strip() == "numpy"
    sbx.files.write("/home/user/data.csv", "a,b\n1,2\n3,4\n")
    ex = sbx.run_code("import pandas as pd\nint(pd.read_csv('/home/user/data.csv')['b'].sum())")
    assert ex.text == "6"


def test_bash_language_keeps_shell_state(sbx):
    ex = sbx.run_code("N=20; cd /tmp; echo $((N + 1))", language="bash")
    assert ex.error is None, ex.error
    assert ex.logs.stdout == ["21\n"]
    ex = sbx.run_code("echo \"$N $(pwd) $SBX_VAR\"", language="bash")
    assert ex.logs.stdout == ["20 /tmp from-create\n"]
    ctx = sbx.create_code_context(language="bash")
    assert ctx.language == "bash"
    ex = sbx.run_code("echo \"[${N-unset}]\"; false", context=ctx)
    assert ex.logs.stdout == ["[unset]\n"]
    assert ex.error is not None and ex.error.value == "1"
