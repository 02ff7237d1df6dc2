"""What a failed microVM test prints, so that the failure explains itself: the kernel log of
every guest still running (cube-agent logs there too, and the kernel reports a process that
crashed or was killed), read through envd; the console of the template's boot (the snapshot
build); the shims' logs; and the end of cubelet's log.

Used by the suites that start a microVM stack (tests/e2e, tests/interpreter):

    with microvm_logs.on_failure(cube_microvm):
        ...
"""

import contextlib
import glob
import json
import os
import subprocess

TAIL = 120


def _tail(text, n=TAIL):
    lines = text.splitlines()
    cut = len(lines) - n
    return ("[... %d lines]\n" % cut if cut > 0 else "") + "\n".join(lines[-n:])


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError as e:
        return f"(unreadable: {e})"


def _running(cube):
    out = subprocess.run(cube.cubectl + ["--json", "sandbox", "list", "--state", "running"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip() or f"cubectl exited {out.returncode}")
    return [r["id"] for r in json.loads(out.stdout or "[]")]


def _guest_log(sid):
    from e2b import Sandbox  # the suite's SDK

    s = Sandbox.connect(sid)
    r = s.commands.run("dmesg 2>&1 || cat /proc/kmsg", user="root", timeout=120)
    return r.stdout + r.stderr


def report(cube):
    """The logs above, as one text (never raises)."""
    parts = []
    try:
        sids = _running(cube)
    except Exception as e:  # noqa: BLE001 - a report must not hide the failure
        sids = []
        parts.append(("running sandboxes", f"(cannot list: {e})"))
    for sid in sids:
        try:
            parts.append((f"guest {sid}: kernel log (dmesg)", _tail(_guest_log(sid), 200)))
        except Exception as e:  # noqa: BLE001
            parts.append((f"guest {sid}: kernel log", f"(unavailable: {e})"))
    root = cube.root
    for p in sorted(glob.glob(os.path.join(root, "**", "*.console.log"), recursive=True)):
        parts.append((f"template boot console {os.path.relpath(p, root)}", _tail(_read(p))))
    for p in sorted(glob.glob(os.path.join(root, "**", "shims", "*.log"), recursive=True)):
        parts.append((f"shim log {os.path.relpath(p, root)}", _tail(_read(p))))
    parts.append(("cubelet.log", _tail(_read(os.path.join(root, "cubelet.log")))))
    return "\n".join(f"----- {title}\n{body}" for title, body in parts)


@contextlib.contextmanager
def on_failure(cube):
    """Prints `report(cube)` when the body raises (before the test's own clean-up kills its
    sandboxes), then lets the failure through."""
    try:
        yield
    except BaseException:
        print("\n===== microVM logs (the test failed)\n" + report(cube), flush=True)
        raise
