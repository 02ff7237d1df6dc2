"""Helpers for the cube-agent acceptance suite: running the agent binary, raw HTTP and Connect
framing (independent of the SDK, so that the SDK's own parsing can be checked against ours), and
/proc probes of the agent process."""

from __future__ import annotations

import base64
import datetime
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

# tests/ports.py: ports held for the agents, not bound and closed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ports import reserve_port  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
# The SDK's debug mode talks to localhost:49983. CUBE_AGENT_SDK_PORT moves the shared agent
# elsewhere (then E2B_SANDBOX_URL points the SDK at it, still in debug mode, which the SDK honours
# before its debug URL) so that the suite can run while something else holds 49983.
SDK_DEFAULT_PORT = 49983
DEBUG_PORT = int(os.environ.get("CUBE_AGENT_SDK_PORT", SDK_DEFAULT_PORT))
TEST_USER = "user"  # E2B's default user name


def agent_bin() -> Path:
    """The agent binary: $CUBE_AGENT_BIN, else $CARGO_TARGET_DIR/debug, else target/debug."""
    candidates = []
    if os.environ.get("CUBE_AGENT_BIN"):
        candidates.append(Path(os.environ["CUBE_AGENT_BIN"]))
    if os.environ.get("CARGO_TARGET_DIR"):
        candidates.append(Path(os.environ["CARGO_TARGET_DIR"]) / "debug" / "cube-agent")
    candidates.append(REPO_ROOT / "target" / "debug" / "cube-agent")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(
        "cube-agent binary not found; set CUBE_AGENT_BIN (tried: "
        + ", ".join(str(c) for c in candidates)
        + ")"
    )


def free_port() -> int:
    """A held port for an agent (tests/ports.py), not one bound and closed."""
    return reserve_port()


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------------------------------------
# Connect framing


def envelope(msg, flags: int = 0) -> bytes:
    data = msg if isinstance(msg, (bytes, bytearray)) else json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(data)) + bytes(data)


class FramingError(AssertionError):
    pass


def parse_envelopes(body: bytes) -> list[tuple[int, object]]:
    """Split a Connect streaming body into (flags, json) pairs; strict, as the SDK's reader is."""
    out = []
    i = 0
    while i < len(body):
        if len(body) - i < 5:
            raise FramingError(f"truncated envelope header at {i}: {body[i:]!r}")
        flags, length = struct.unpack(">BI", body[i : i + 5])
        i += 5
        if len(body) - i < length:
            raise FramingError(f"envelope claims {length} bytes, {len(body) - i} left")
        payload = body[i : i + length]
        i += length
        if flags & ~0x02:
            raise FramingError(f"unexpected envelope flags {flags:#x}")
        try:
            out.append((flags, json.loads(payload) if payload else {}))
        except ValueError as e:
            raise FramingError(f"envelope is not JSON: {payload!r}") from e
    return out


def check_stream(envs: list[tuple[int, object]]) -> tuple[list[dict], dict]:
    """Stream must end with exactly one end-stream envelope. Returns (messages, end message)."""
    assert envs, "empty Connect stream (no end-stream envelope)"
    *msgs, last = envs
    assert last[0] == 0x02, f"last envelope is not end-stream: {last}"
    for f, _ in msgs:
        assert f == 0, f"end-stream flag before the end: {envs}"
    return [m for _, m in msgs], last[1]


def b64(s) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def unb64(s: str) -> bytes:
    return base64.b64decode(s)


def basic_user(user: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


# ---------------------------------------------------------------------------------------------
# Raw HTTP


@dataclass
class Response:
    status: int
    headers: dict
    body: bytes

    def header(self, name: str) -> Optional[str]:
        return self.headers.get(name.lower())

    def json(self):
        return json.loads(self.body)

    @property
    def content_type(self) -> str:
        return (self.header("content-type") or "").split(";")[0].strip().lower()


@dataclass
class Client:
    """A tiny HTTP/1.1 client over one keep-alive connection (reopened when the server closes it)."""

    port: int
    host: str = "127.0.0.1"
    timeout: float = 30.0
    default_headers: dict = field(default_factory=dict)
    _conn: Optional[http.client.HTTPConnection] = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self._conn

    def close(self):
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self,
        method: str,
        path: str,
        body: Optional[bytes | Iterable[bytes]] = None,
        headers: Optional[dict] = None,
        chunked: bool = False,
    ) -> Response:
        hdrs = {**self.default_headers, **(headers or {})}
        if chunked:
            body = [body] if isinstance(body, (bytes, bytearray)) else list(body or [])
        for attempt in (0, 1):
            reused = self._conn is not None and self._conn.sock is not None
            conn = self._connection()
            try:
                if chunked:
                    conn.request(method, path, body=iter(body), headers=hdrs, encode_chunked=True)
                else:
                    conn.request(method, path, body=body, headers=hdrs)
                r = conn.getresponse()
                data = r.read()
                break
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                # A server may close an idle keep-alive connection (e.g. after answering an
                # error without reading the body); like any HTTP client, retry once on a new one.
                self.close()
                if attempt or not reused:
                    raise
            except Exception:
                self.close()
                raise
        resp = Response(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
        if (resp.header("connection") or "").lower() == "close":
            self.close()
        return resp

    def unary(self, rpc: str, msg: dict, headers: Optional[dict] = None) -> Response:
        return self.request(
            "POST",
            "/" + rpc,
            json.dumps(msg).encode(),
            {"Content-Type": "application/json", "Connect-Protocol-Version": "1", **(headers or {})},
        )

    def stream(self, rpc: str, msg: dict, headers: Optional[dict] = None):
        """Server-streaming call; returns (response, messages, end message)."""
        r = self.request(
            "POST",
            "/" + rpc,
            envelope(msg),
            {
                "Content-Type": "application/connect+json",
                "Connect-Protocol-Version": "1",
                **(headers or {}),
            },
        )
        assert r.status == 200, f"{rpc}: HTTP {r.status} {r.body[:500]!r}"
        assert r.content_type == "application/connect+json", r.headers
        msgs, end = check_stream(parse_envelopes(r.body))
        return r, msgs, end


def run_cmd(client: Client, cmd: str, headers: Optional[dict] = None, **process):
    """process.Process/Start of `bash -l -c cmd`; returns (stdout bytes, stderr bytes, end event, end msg)."""
    req = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], **process}, "stdin": False}
    _, msgs, end_msg = client.stream("process.Process/Start", req, headers)
    return split_process_events(msgs) + (end_msg,)


def split_process_events(msgs: list[dict]):
    assert msgs and "start" in msgs[0].get("event", {}), f"first event is not start: {msgs[:1]}"
    out, err, end = b"", b"", None
    for m in msgs[1:]:
        ev = m["event"]
        if "data" in ev:
            d = ev["data"]
            out += unb64(d.get("stdout", "")) + unb64(d.get("pty", ""))
            err += unb64(d.get("stderr", ""))
        elif "end" in ev:
            assert end is None, "two end events"
            end = ev["end"]
        else:
            assert "keepalive" in ev, f"unknown process event {m}"
    return out, err, end


def post_init(port: int, token: Optional[str] = None, **fields) -> Response:
    body = {"timestamp": now_rfc3339(), **fields}
    hdrs = {"Content-Type": "application/json"}
    if token:
        hdrs["X-Access-Token"] = token
    c = Client(port)
    try:
        return c.request("POST", "/init", json.dumps(body).encode(), hdrs)
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------
# /proc probes


def children(pid: int, zombies: bool = False) -> list[int]:
    """Live children of pid (or, with zombies=True, only its unreaped zombies)."""
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        # comm may contain spaces and parentheses; fields resume after the last ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and (fields[0] == "Z") == zombies:
            kids.append(int(d))
    return kids


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def wait_until(pred, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


# ---------------------------------------------------------------------------------------------
# The agent process


class Agent:
    """One cube-agent process on 127.0.0.1:port, started as an ordinary (non-PID-1) process."""

    def __init__(self, port: int, workdir: Path, extra_args: Iterable[str] = ()):
        self.port = port
        self.workdir = workdir
        self.extra_args = list(extra_args)
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = workdir / f"agent-{port}.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, wait: float = 15.0) -> "Agent":
        if port_in_use(self.port):
            raise RuntimeError(f"port {self.port} is already in use; another agent running?")
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(self.workdir),
            "CUBE_AGENT_LOG": os.environ.get("CUBE_AGENT_LOG", "info"),
            "RUST_BACKTRACE": "1",
        }
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(agent_bin()), "--addr", f"127.0.0.1:{self.port}", "--init", "never", *self.extra_args],
            cwd=self.workdir,
            env=env,
            stdout=self._log,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
        )
        c = Client(self.port, timeout=2)
        deadline = time.monotonic() + wait
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"agent exited with {self.proc.returncode}: {self.log_tail()}")
                try:
                    if c.request("GET", "/health").status == 204:
                        return self
                except OSError:
                    c.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"agent not healthy after {wait}s: {self.log_tail()}")
                time.sleep(0.02)
        finally:
            c.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self):
        if self.proc is None:
            return
        kids = children(self.proc.pid) if self.alive() else []
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        # Whatever it spawned must not outlive the test run.
        for k in kids + _orphans_of(self.workdir):
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        self.proc = None


def _orphans_of(workdir: Path) -> list[int]:
    """Processes still running with their cwd inside the test tree (spawned commands)."""
    found = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            cwd = os.readlink(f"/proc/{d}/cwd")
        except OSError:
            continue
        if cwd == str(workdir) or cwd.startswith(str(workdir) + "/"):
            found.append(int(d))
    return found


def ensure_user(name: str = TEST_USER) -> None:
    """Create the Unix account the SDK defaults to, if missing (left in place: it is harmless)."""
    if subprocess.run(["id", "-u", name], capture_output=True).returncode == 0:
        return
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    r = subprocess.run([useradd, "-m", "-s", "/bin/bash", name], capture_output=True, text=True)
    # A parallel run may have won the race.
    if r.returncode != 0 and subprocess.run(["id", "-u", name], capture_output=True).returncode != 0:
        raise RuntimeError(f"useradd {name} failed: {r.stderr}")


def sdk_for(port: int, token: Optional[str] = None, asynchronous: bool = False):
    """An SDK Sandbox object bound to the agent on `port`, as `Sandbox.create()`/`connect()` would
    build it from a control-plane answer (sandbox URL override mode, optional envd access token).
    The SDK's debug mode cannot carry a token or another port, so this is how token and signature
    behaviour is exercised through the real SDK code paths."""
    from e2b import AsyncSandbox, Sandbox
    from e2b.connection_config import ConnectionConfig
    from e2b.envd.versions import ENVD_DEBUG_FALLBACK

    headers = {"E2b-Sandbox-Id": "cubetest", "E2b-Sandbox-Port": "49983"}
    if token is not None:
        headers["X-Access-Token"] = token
    cfg = ConnectionConfig(
        debug=False,
        api_key="e2b_0000000000000000000000000000000000000000",
        sandbox_url=f"http://127.0.0.1:{port}",
        extra_sandbox_headers=headers,
    )
    cls = AsyncSandbox if asynchronous else Sandbox
    return cls(
        sandbox_id="cubetest",
        sandbox_domain=None,
        envd_version=ENVD_DEBUG_FALLBACK,
        envd_access_token=token,
        traffic_access_token=None,
        connection_config=cfg,
    )


def give(path, user: str = TEST_USER) -> None:
    """chown -R path to user (the tests create fixtures as root; the SDK acts as `user`)."""
    shutil.chown(path, user, user)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.lchown(os.path.join(root, n), *_ids(user))


def _ids(user: str) -> tuple[int, int]:
    import pwd

    p = pwd.getpwnam(user)
    return p.pw_uid, p.pw_gid
