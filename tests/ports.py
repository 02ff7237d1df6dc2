"""Ports for the daemons a test starts (the Python side of cube-testkit's `reserve_port`).

Binding port 0 and closing hands out a port from the kernel's ephemeral range, which any
outgoing connection may take before the daemon binds it. These lie below that range (the kernel
never picks them), were free when picked, and are held against every other test process, Rust or
Python, by a lock file in /tmp/cube-test-ports for the rest of this process's life."""

import fcntl
import os
import socket

LOCKS = "/tmp/cube-test-ports"
_held = []  # the lock files' descriptors: held until the process exits


def reserve_port():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    lo, hi = max(low - 8000, 1024), low
    if hi <= lo + 100:
        raise RuntimeError(f"ip_local_port_range starts at {low}: no room below it")
    os.makedirs(LOCKS, exist_ok=True)
    try:
        os.chmod(LOCKS, 0o1777)
    except PermissionError:
        pass
    span = hi - lo
    start = (os.getpid() * 2654435761 + len(_held) * 7919) % span
    for k in range(span):
        port = lo + (start + k * 7) % span
        try:
            fd = os.open(f"{LOCKS}/{port}", os.O_CREAT | os.O_WRONLY, 0o666)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # another test process holds it
            continue
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            os.close(fd)  # something outside the tests listens there
            continue
        finally:
            s.close()
        _held.append(fd)
        return port
    raise RuntimeError(f"no free port in {lo}..{hi}")
