"""sbx.commands.* through the real e2b SDK (debug mode) against cube-agent."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    SandboxException,
    TimeoutException,
)

from agentlib import children, wait_until


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_run_stdout_and_exit_zero(sbx):
    r = sbx.commands.run("echo hello")
    assert r.stdout == "hello\n"
    assert r.stderr == ""
    assert r.exit_code == 0
    assert r.error is None


def test_stdout_stderr_and_nonzero_exit(sbx):
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo out; echo err >&2; exit 3")
    e = ei.value
    assert e.exit_code == 3
    assert e.stdout == "out\n"
    assert e.stderr == "err\n"


def test_exit_by_signal_is_an_error(sbx):
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("kill -9 $$")
    assert ei.value.exit_code != 0


def test_large_output_is_streamed_completely(sbx):
    # 3 MiB through base64'd data events; checks ordering and that nothing is dropped.
    r = sbx.commands.run("head -c 3145728 /dev/zero | tr '\\0' 'x'; echo; echo tail >&2")
    assert len(r.stdout) == 3145728 + 1
    assert set(r.stdout[:-1]) == {"x"}
    assert r.stderr == "tail\n"


def test_utf8_split_across_chunks(sbx):
    r = sbx.commands.run("printf 'h\\xc3'; sleep 0.2; printf '\\xa9llo\\n'")
    assert r.stdout == "h\u00e9llo\n"


def test_on_stdout_callbacks_see_incremental_output(sbx):
    # "two" is printed only after a file appears that the test writes once "one" has reached
    # it: an agent that buffered to the end would leave the command waiting, and it gives up.
    flag = f"/tmp/incremental-{uuid.uuid4().hex[:8]}"
    seen, one = [], threading.Event()

    def on_out(s):
        seen.append(s)
        if "one" in s:
            one.set()

    def release():
        if one.wait(60):
            sbx.files.write(flag, "go")

    th = threading.Thread(target=release)
    th.start()
    r = sbx.commands.run(
        f"echo one; for i in $(seq 600); do [ -e {flag} ] && break; sleep 0.1; done; "
        f"[ -e {flag} ] && echo two",
        on_stdout=on_out,
    )
    th.join()
    assert r.exit_code == 0
    assert "".join(seen) == "one\ntwo\n"


def test_envs(sbx):
    r = sbx.commands.run('printf "%s|%s" "$FOO" "$BAR"', envs={"FOO": "bar baz", "BAR": "q=1"})
    assert r.stdout == "bar baz|q=1"


def test_cwd(sbx, wd):
    assert sbx.commands.run("pwd", cwd=str(wd)).stdout.strip() == str(wd)


def test_default_cwd_is_init_workdir(sbx, agent):
    assert sbx.commands.run("pwd").stdout.strip() == str(agent.default_workdir)


def test_missing_cwd_fails(sbx, wd):
    with pytest.raises((SandboxException, CommandExitException)):
        sbx.commands.run("pwd", cwd=str(wd / "does-not-exist"))


def test_default_user_is_user(sbx, test_user):
    r = sbx.commands.run('id -un; echo "$HOME"; echo "$USER"')
    assert r.stdout.split("\n")[:3] == [test_user, f"/home/{test_user}", test_user]


def test_user_root(sbx):
    r = sbx.commands.run('id -u; echo "$HOME"', user="root")
    assert r.stdout.split("\n")[:2] == ["0", "/root"]


def test_user_owns_created_files(sbx, wd, test_user):
    import pwd

    sbx.commands.run(f"touch {wd}/by-user")
    sbx.commands.run(f"touch {wd}/by-root", user="root")
    assert pwd.getpwuid(os.stat(wd / "by-user").st_uid).pw_name == test_user
    assert os.stat(wd / "by-root").st_uid == 0


def test_user_cannot_read_root_only_file(sbx, wd):
    secret = wd / "secret"
    secret.write_text("s3cret")
    os.chown(secret, 0, 0)
    secret.chmod(0o600)
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run(f"cat {secret}")
    assert "s3cret" not in ei.value.stdout
    assert sbx.commands.run(f"cat {secret}", user="root").stdout == "s3cret"


def test_unknown_user_is_rejected(sbx):
    with pytest.raises(AuthenticationException):
        sbx.commands.run("true", user="no-such-user-" + uuid.uuid4().hex[:6])


def test_background_list_and_kill(sbx, wd):
    h = sbx.commands.run("sleep 30", background=True, cwd=str(wd), envs={"TAGME": "1"})
    try:
        assert h.pid > 0
        assert pid_alive(h.pid)
        procs = {p.pid: p for p in sbx.commands.list()}
        assert h.pid in procs, procs
        p = procs[h.pid]
        assert p.cmd == "/bin/bash"
        assert p.args == ["-l", "-c", "sleep 30"]
        assert p.cwd == str(wd)
        assert p.envs.get("TAGME") == "1"
        assert sbx.commands.kill(h.pid) is True
        with pytest.raises(CommandExitException) as ei:
            h.wait()
        assert ei.value.exit_code != 0
        wait_until(lambda: not pid_alive(h.pid), what="killed process to disappear")
        wait_until(lambda: h.pid not in {p.pid for p in sbx.commands.list()}, what="list to drop pid")
        assert sbx.commands.kill(h.pid) is False
    finally:
        sbx.commands.kill(h.pid)


def test_handle_kill(sbx):
    h = sbx.commands.run("sleep 30", background=True)
    assert h.kill() is True
    with pytest.raises(CommandExitException):
        h.wait()


def test_kill_unknown_pid_is_false(sbx):
    assert sbx.commands.kill(999_999_99) is False


def test_stdin_send_and_close(sbx):
    h = sbx.commands.run("cat; echo done", background=True, stdin=True)
    h.send_stdin("abc\n")
    sbx.commands.send_stdin(h.pid, b"\x00\xffdef\n")
    h.close_stdin()
    r = h.wait()
    assert r.stdout.encode("utf-8", "replace").endswith(b"def\ndone\n")
    assert r.stdout.startswith("abc\n")


def test_stream_input(sbx):
    h = sbx.commands.run("wc -c", background=True, stdin=True)
    sbx.commands.stream_input(h.pid, [b"12345", "678", b"90"])
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout.strip() == "10"


def test_stdin_false_gives_eof(sbx):
    # Without stdin the command must not hang waiting for input.
    r = sbx.commands.run("cat; echo eof", timeout=20)
    assert r.stdout == "eof\n"


def test_send_stdin_unknown_pid(sbx):
    with pytest.raises(NotFoundException):
        sbx.commands.send_stdin(999_999_98, "x")


def test_timeout_kills_the_process(sbx, wd):
    marker = wd / "survived"
    h = sbx.commands.run(f"sleep 4; touch {marker}", background=True, timeout=1)
    pid = h.pid
    with pytest.raises(TimeoutException):
        h.wait()
    # The agent, not only the client, must enforce Connect-Timeout-Ms.
    wait_until(lambda: not pid_alive(pid), timeout=10, what="timed-out process to be killed")
    time.sleep(4)
    assert not marker.exists(), "the command outlived its timeout"


def test_timeout_zero_means_no_deadline(sbx):
    r = sbx.commands.run("sleep 1.2; echo ok", timeout=0)
    assert r.stdout == "ok\n"


def test_disconnect_keeps_process_running_and_connect(sbx, wd):
    out = wd / "out"
    h = sbx.commands.run(
        f"for i in 1 2 3 4 5 6; do echo $i; sleep 0.4; done; echo fin > {out}",
        background=True,
    )
    pid = h.pid
    h.disconnect()
    time.sleep(0.3)
    assert pid_alive(pid), "disconnecting must not kill the command"
    h2 = sbx.commands.connect(pid)
    assert h2.pid == pid
    r = h2.wait()
    assert r.exit_code == 0
    assert r.stdout.endswith("6\n"), r.stdout
    assert out.read_text() == "fin\n"


def test_connect_unknown_pid(sbx):
    with pytest.raises(NotFoundException):
        sbx.commands.connect(999_999_97).wait()


def test_two_concurrent_commands(sbx):
    results = {}

    # Each command waits until all four have started: run one after another, the first would
    # wait for the others in vain and fail.
    tag = f"/tmp/concurrent-{uuid.uuid4().hex[:8]}"

    def run(n):
        results[n] = sbx.commands.run(
            f"touch {tag}-{n}; for i in $(seq 600); do [ $(ls {tag}-* | wc -l) -ge 4 ] && break; "
            f"sleep 0.1; done; [ $(ls {tag}-* | wc -l) -ge 4 ] && echo {n}"
        ).stdout

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert results == {i: f"{i}\n" for i in range(4)}, "commands did not run concurrently"


def test_finished_commands_are_reaped(sbx, agent):
    for _ in range(5):
        sbx.commands.run("true")
    wait_until(lambda: not children(agent.pid, zombies=True), what="no zombie children of the agent")
    assert not [p for p in sbx.commands.list() if p.args == ["-l", "-c", "true"]]


def test_explicit_user_user(sbx, test_user):
    assert sbx.commands.run("id -un", user=test_user).stdout.strip() == test_user


def test_async_commands(agent, wd):
    import asyncio

    from e2b import AsyncSandbox

    async def main():
        sbx = await AsyncSandbox.create(debug=True)
        results = await asyncio.gather(*(sbx.commands.run(f"sleep 0.3; echo {i}") for i in range(3)))
        assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]
        with pytest.raises(CommandExitException):
            await sbx.commands.run("exit 4")
        await sbx.files.write(str(wd / "async-w.txt"), "aw")
        assert await sbx.files.read(str(wd / "async-w.txt")) == "aw"

    asyncio.run(main())


def test_many_concurrent_clients(sbx):
    errors, outputs = [], {}

    def worker(w):
        try:
            for i in range(8):
                outputs[(w, i)] = sbx.commands.run(f"echo {w}-{i}", envs={"W": str(w)}).stdout
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(12)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors[:3]
    assert outputs == {(w, i): f"{w}-{i}\n" for w in range(12) for i in range(8)}


def test_large_stdin(sbx):
    h = sbx.commands.run("sha256sum", background=True, stdin=True)
    data = os.urandom(1 << 20)
    for k in range(0, len(data), 64 * 1024):
        h.send_stdin(data[k : k + 64 * 1024])
    h.close_stdin()
    import hashlib

    assert h.wait().stdout.split()[0] == hashlib.sha256(data).hexdigest()
