"""sbx.pty.* (pseudo-terminals) through the real SDK."""

from __future__ import annotations

import threading

import pytest
from e2b import CommandExitException, NotFoundException
from e2b.sandbox.commands.command_handle import PtySize

from agentlib import wait_until


class PtyReader:
    """Drains a PTY handle's events in a thread, keeping all output bytes."""

    def __init__(self, handle):
        self.handle = handle
        self.buf = bytearray()
        self.error: Exception | None = None
        self.result = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.result = self.handle.wait(on_pty=self._on)
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def _on(self, data: bytes):
        with self.lock:
            self.buf += data

    def text(self) -> str:
        with self.lock:
            return self.buf.decode(errors="replace")

    def wait_for(self, s: str, timeout: float = 15):
        wait_until(lambda: s in self.text(), timeout=timeout, what=f"{s!r} in pty output")

    def join(self, timeout: float = 15):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "pty stream did not end"


def test_pty_create_send_resize_kill(sbx, wd):
    h = sbx.pty.create(PtySize(rows=24, cols=80), cwd=str(wd))
    r = PtyReader(h)
    try:
        sbx.pty.send_stdin(h.pid, b"echo $((6*7))-marker\n")
        r.wait_for("42-marker")
        sbx.pty.send_stdin(h.pid, b"stty size; tty; echo $TERM; pwd\n")
        r.wait_for("24 80")
        assert "/dev/pts/" in r.text()
        r.wait_for("xterm-256color")
        r.wait_for(str(wd))
        sbx.pty.resize(h.pid, PtySize(rows=33, cols=101))
        sbx.pty.send_stdin(h.pid, b"stty size\n")
        r.wait_for("33 101")
        assert sbx.pty.kill(h.pid) is True
        r.join()
        assert isinstance(r.error, CommandExitException), r.error
    finally:
        sbx.pty.kill(h.pid)


def test_pty_exit_code(sbx):
    h = sbx.pty.create(PtySize(rows=10, cols=40))
    r = PtyReader(h)
    sbx.pty.send_stdin(h.pid, b"exit 7\n")
    r.join()
    assert isinstance(r.error, CommandExitException), r.error
    assert r.error.exit_code == 7


def test_pty_ctrl_c_interrupts(sbx):
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    r = PtyReader(h)
    try:
        sbx.pty.send_stdin(h.pid, b"sleep 100\n")
        # Ctrl-C goes through the terminal's line discipline to the foreground job. Until bash
        # has made `sleep` the foreground job, the interrupt reaches bash instead (and discards
        # the typed-ahead line), so a loaded machine may need another Ctrl-C.
        import time

        time.sleep(0.5)
        for attempt in range(5):
            sbx.pty.send_stdin(h.pid, b"\x03")
            sbx.pty.send_stdin(h.pid, b"echo after-$((1+1))\n")
            try:
                r.wait_for("after-2", timeout=3)
                break
            except AssertionError:
                if attempt == 4:
                    raise
    finally:
        sbx.pty.kill(h.pid)


def test_pty_is_listed_and_user(sbx, test_user):
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    r = PtyReader(h)
    try:
        assert h.pid in [p.pid for p in sbx.commands.list()]
        sbx.pty.send_stdin(h.pid, b"echo who=$(id -un)\n")
        r.wait_for(f"who={test_user}")
    finally:
        sbx.pty.kill(h.pid)
    h2 = sbx.pty.create(PtySize(rows=24, cols=80), user="root")
    r2 = PtyReader(h2)
    try:
        sbx.pty.send_stdin(h2.pid, b"echo who=$(id -un)\n")
        r2.wait_for("who=root")
    finally:
        sbx.pty.kill(h2.pid)


def test_pty_resize_unknown_pid(sbx):
    with pytest.raises(NotFoundException):
        sbx.pty.resize(999_999_96, PtySize(rows=1, cols=1))


def test_pty_disconnect_and_reconnect(sbx):
    h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    pid = h.pid
    try:
        h.disconnect()
        # Still alive after the client went away; a new client attaches with Connect.
        h2 = sbx.pty.connect(pid, timeout=0)
        assert h2.pid == pid
        r = PtyReader(h2)
        sbx.pty.send_stdin(pid, b"echo re-$((40+2))\n")
        r.wait_for("re-42")
    finally:
        sbx.pty.kill(pid)


def test_pty_stream_input(sbx):
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    r = PtyReader(h)
    try:
        sbx.pty.stream_input(h.pid, [b"echo str", b"eam-", b"in\n"])
        r.wait_for("stream-in")
    finally:
        sbx.pty.kill(h.pid)
