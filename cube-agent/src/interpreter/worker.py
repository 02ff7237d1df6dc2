# cube-agent's Python worker: one long-lived interpreter per code context.
#
# The agent starts `python3 -c <this file>` with fd 3 = commands (JSON lines, agent -> worker) and
# fd 4 = events (JSON lines, worker -> agent). fd 1/2 are pipes the agent forwards as the current
# execution's stdout/stderr (output of subprocesses and C code); Python-level prints go through
# the event pipe, batched per line. Commands:
#   {"op": "execute", "id": N, "code": "...", "env": {...}, "call_env": {...}}
# Events (all carry "id" of the execution they belong to):
#   {"type": "count", "n": k}                       execution count, before the code runs
#   {"type": "stdout"|"stderr", "text": "..."}
#   {"type": "result", "bundle": {mime: data}, "main": bool}
#   {"type": "error", "name": ..., "value": ..., "traceback": ...}
#   {"type": "done"}
# plus {"type": "ready", "pid": P} once at start. SIGINT interrupts the running code only.
import ast
import base64
import builtins
import io
import json
import linecache
import os
import signal
import sys
import threading
import time
import traceback
import types

if sys.flags.no_site:
    # Started with -S (fast start: site's .pth processing and sitecustomize cost hundreds of ms
    # in a fresh sandbox): put the site directories on the path directly. The user site is added
    # even if it does not exist yet, so `pip install --user` works without a restart.
    import site

    for _p in site.getsitepackages() + [site.getusersitepackages()]:
        if _p not in sys.path:
            sys.path.append(_p)

_EVENTS = os.fdopen(4, "wb", buffering=0)
_COMMANDS = os.fdopen(3, "rb")
os.set_inheritable(3, False)
os.set_inheritable(4, False)
_lock = threading.Lock()
_current = {"id": None}
_executing = False


def _send(obj):
    data = (json.dumps(obj, default=str) + "\n").encode()
    with _lock:
        view = memoryview(data)
        while view:
            n = _EVENTS.write(view)
            view = view[n:]


class _Stream(io.TextIOBase):
    """sys.stdout/sys.stderr: complete lines go out at once, a partial line after 50 ms."""

    def __init__(self, name):
        self.name = name
        self._buf = []
        self._since = None
        self._blk = threading.Lock()

    def writable(self):
        return True

    def isatty(self):
        return False

    @property
    def encoding(self):
        return "utf-8"

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if not s:
            return 0
        with self._blk:
            self._buf.append(s)
            if self._since is None:
                self._since = time.monotonic()
            if "\n" in s:
                text = "".join(self._buf)
                cut = text.rfind("\n") + 1
                self._buf = [text[cut:]] if cut < len(text) else []
                self._since = time.monotonic() if self._buf else None
                self._emit(text[:cut])
        return len(s)

    def _emit(self, text):
        if text and _current["id"] is not None:
            _send({"id": _current["id"], "type": self.name, "text": text})

    def flush(self):
        with self._blk:
            text = "".join(self._buf)
            self._buf = []
            self._since = None
            self._emit(text)

    def flush_if_stale(self, age):
        with self._blk:
            stale = self._since is not None and time.monotonic() - self._since >= age
        if stale:
            self.flush()


_stdout = _Stream("stdout")
_stderr = _Stream("stderr")


def _flusher():
    while True:
        time.sleep(0.05)
        try:
            _stdout.flush_if_stale(0.05)
            _stderr.flush_if_stale(0.05)
        except Exception:
            pass


# --- rich results -------------------------------------------------------------------------

_REPRS = [
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("application/pdf", "_repr_pdf_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
]


def _figure_png(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _is_figure(obj):
    mpl = sys.modules.get("matplotlib.figure")
    return mpl is not None and isinstance(obj, mpl.Figure)


def _bundle(obj):
    """The MIME bundle of an object, like IPython's display formatter."""
    out = {}
    if hasattr(obj, "_repr_mimebundle_"):
        try:
            b = obj._repr_mimebundle_()
            if isinstance(b, tuple):
                b = b[0]
            if isinstance(b, dict):
                out.update(b)
        except Exception:
            pass
    for mime, meth in _REPRS:
        if mime in out:
            continue
        f = getattr(obj, meth, None)
        if f is None or isinstance(obj, type):
            continue
        try:
            v = f()
        except Exception:
            continue
        if isinstance(v, tuple):
            v = v[0]
        if v is None:
            continue
        if isinstance(v, bytes):
            v = base64.b64encode(v).decode()
        out[mime] = v
    if _is_figure(obj) and "image/png" not in out:
        out["image/png"] = _figure_png(obj)
    if "text/plain" not in out:
        try:
            out["text/plain"] = repr(obj)
        except Exception as e:
            out["text/plain"] = f"<repr failed: {type(e).__name__}: {e}>"
    return out


def _result(obj, main):
    _send({"id": _current["id"], "type": "result", "bundle": _bundle(obj), "main": main})


def display(*objs, **_kwargs):
    """IPython's display(): each object becomes a (non-main) result."""
    for o in objs:
        _stdout.flush()
        _result(o, False)


builtins.display = display


def _emit_figures():
    """Every open matplotlib figure becomes a result, then is closed (inline-backend style)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        nums = plt.get_fignums()
    except Exception:
        return
    for n in nums:
        try:
            fig = plt.figure(n)
            _stdout.flush()
            _result(fig, False)
        except Exception as e:
            _send({"id": _current["id"], "type": "stderr", "text": f"figure {n}: {e}\n"})
    try:
        plt.close("all")
    except Exception:
        pass


# matplotlib: `MPLBACKEND=module://cube_inline` makes plt.show() emit the figures as results.
_backend = types.ModuleType("cube_inline")


def _install_backend():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.backend_bases import FigureManagerBase
    except Exception:
        return
    _backend.FigureCanvas = FigureCanvasAgg
    _backend.FigureManager = FigureManagerBase


def _show(*_args, **_kwargs):
    _emit_figures()


def _backend_getattr(name):
    # Resolved lazily: matplotlib is only imported if the user's code imports it.
    if name in ("FigureCanvas", "FigureManager"):
        _install_backend()
        if name in _backend.__dict__:
            return _backend.__dict__[name]
    raise AttributeError(name)


_backend.show = _show
_backend.__getattr__ = _backend_getattr


sys.modules["cube_inline"] = _backend


# --- execution ----------------------------------------------------------------------------

_ns = {"__name__": "__main__", "__builtins__": builtins, "display": display}
_main = types.ModuleType("__main__")
_main.__dict__.update(_ns)
_ns = _main.__dict__
sys.modules["__main__"] = _main
_count = 0
_applied_env = {}


def _apply_env(env, call_env):
    """Sandbox env vars persist; per-call ones are undone afterwards (returns the undo list)."""
    global _applied_env
    for k in list(_applied_env):
        if k not in env and os.environ.get(k) == _applied_env[k]:
            os.environ.pop(k, None)
    for k, v in env.items():
        if _applied_env.get(k) != v:
            os.environ[k] = v
    _applied_env = dict(env)
    undo = []
    for k, v in call_env.items():
        undo.append((k, os.environ.get(k)))
        os.environ[k] = v
    return undo


def _undo_env(undo):
    for k, old in reversed(undo):
        if old is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = old


def _format_error(etype, value, tb, filename):
    # Drop the worker's own frames: the traceback starts at the user's cell.
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(etype, value, tb))
    return text


def _run(code):
    global _count, _executing
    _count += 1
    filename = f"<cell {_count}>"
    _send({"id": _current["id"], "type": "count", "n": _count})
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        tree = ast.parse(code, filename, "exec")
    except SyntaxError as e:
        _send({"id": _current["id"], "type": "error", "name": type(e).__name__,
               "value": str(e), "traceback": "".join(traceback.format_exception_only(type(e), e))})
        return
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    try:
        body = compile(tree, filename, "exec")
        expr = compile(last, filename, "eval") if last is not None else None
    except SyntaxError as e:
        _send({"id": _current["id"], "type": "error", "name": type(e).__name__,
               "value": str(e), "traceback": "".join(traceback.format_exception_only(type(e), e))})
        return
    value = None
    try:
        _executing = True
        try:
            exec(body, _ns)
            if expr is not None:
                value = eval(expr, _ns)
        finally:
            _executing = False
    except BaseException as e:  # KeyboardInterrupt and SystemExit are reported, not fatal
        _executing = False
        _stdout.flush()
        _stderr.flush()
        _emit_figures()
        _send({"id": _current["id"], "type": "error", "name": type(e).__name__, "value": str(e),
               "traceback": _format_error(type(e), e, e.__traceback__, filename)})
        return
    _stdout.flush()
    _stderr.flush()
    _emit_figures()
    if value is None:
        return
    _ns["_"] = value
    if _is_figure(value):
        # Its image was just shown with the other open figures: the main result is its text.
        _send({"id": _current["id"], "type": "result", "main": True,
               "bundle": {"text/plain": repr(value)}})
    else:
        _result(value, True)


def _on_sigint(_sig, _frame):
    # Only user code is interrupted; an interrupt that races the end of a cell is dropped.
    if _executing:
        raise KeyboardInterrupt


# --- bash contexts ------------------------------------------------------------------------
# With CUBE_WORKER_LANG=bash the worker drives one long-lived `bash` (variables, functions and
# the working directory persist). Each cell is eval'd with stdin from /dev/null, then a marker
# line with a per-cell nonce on stdout and stderr tells where the cell's output ends.


class _Bash:
    def __init__(self):
        self.proc = None

    def start(self):
        import subprocess
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, close_fds=True)

    def kill(self):
        if self.proc is not None:
            # bash and whatever it started share the worker's process group: kill all but us.
            me, group = os.getpid(), os.getpgid(0)
            for e in os.listdir("/proc"):
                if not e.isdigit() or int(e) == me:
                    continue
                try:
                    with open(f"/proc/{e}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if int(fields[2]) == group:
                        os.kill(int(e), signal.SIGKILL)
                except (OSError, IndexError, ValueError):
                    pass
            try:
                self.proc.wait(5)
            except Exception:
                pass
            self.proc = None

    def _pump(self, stream, name, marker, result):
        import re
        pat = re.compile(re.escape(marker.encode()) + rb" ?(\d*)\n?$")
        while True:
            line = stream.readline()
            if not line:
                result[name] = None
                return
            m = pat.search(line)
            if m:
                head = line[: m.start()]
                if head:
                    _send({"id": _current["id"], "type": name, "text": head.decode("utf-8", "replace")})
                result[name] = m.group(1).decode()
                return
            _send({"id": _current["id"], "type": name, "text": line.decode("utf-8", "replace")})

    def run(self, code, env, call_env):
        global _count, _executing
        import shlex
        _count += 1
        _send({"id": _current["id"], "type": "count", "n": _count})
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        marker = "__CUBE_CELL_END_" + os.urandom(8).hex()
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()
                          if k.isidentifier())
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in call_env.items() if k.isidentifier())
        delim = "__CUBE_EOF_" + os.urandom(8).hex()
        script = (f"{exports}{prefix} eval \"$(cat <<'{delim}'\n{code}\n{delim}\n)\" </dev/null\n"
                  f"__cube_rc=$?; printf '{marker} %s\\n' \"$__cube_rc\"; printf '{marker}\\n' >&2\n")
        result = {}
        threads = [threading.Thread(target=self._pump, args=(self.proc.stdout, "stdout", marker, result)),
                   threading.Thread(target=self._pump, args=(self.proc.stderr, "stderr", marker, result))]
        for t in threads:
            t.daemon = True
            t.start()
        try:
            _executing = True
            self.proc.stdin.write(script.encode())
            self.proc.stdin.flush()
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(0.05)
        except KeyboardInterrupt:
            _executing = False
            # A non-interactive bash cannot be interrupted cleanly: start a fresh one.
            self.kill()
            for t in threads:
                t.join(1)
            _send({"id": _current["id"], "type": "error", "name": "KeyboardInterrupt",
                   "value": "interrupted; the bash session was restarted", "traceback": ""})
            return
        except OSError as e:
            _executing = False
            self.kill()
            _send({"id": _current["id"], "type": "error", "name": "BashExited", "value": str(e),
                   "traceback": ""})
            return
        finally:
            _executing = False
        rc = result.get("stdout")
        if rc is None:
            self.kill()
            _send({"id": _current["id"], "type": "error", "name": "BashExited",
                   "value": "bash exited (the code ran `exit`?); a new session starts on the next cell",
                   "traceback": ""})
        elif rc not in ("", "0"):
            _send({"id": _current["id"], "type": "error", "name": "ExitCode", "value": rc,
                   "traceback": f"the last command exited with status {rc}"})


_LANG = os.environ.pop("CUBE_WORKER_LANG", "python")
_bash = _Bash() if _LANG == "bash" else None


def main():
    signal.signal(signal.SIGINT, _on_sigint)
    sys.stdout = _stdout
    sys.stderr = _stderr
    sys.stdin = open(os.devnull)
    threading.Thread(target=_flusher, daemon=True).start()
    if _bash is not None:
        _bash.start()
    _send({"type": "ready", "pid": os.getpid()})
    while True:
        line = _COMMANDS.readline()
        if not line:
            return
        try:
            cmd = json.loads(line)
        except ValueError:
            continue
        if cmd.get("op") != "execute":
            continue
        _current["id"] = cmd.get("id")
        undo = []
        try:
            if _bash is not None:
                _bash.run(cmd.get("code", ""), cmd.get("env") or {}, cmd.get("call_env") or {})
            else:
                undo = _apply_env(cmd.get("env") or {}, cmd.get("call_env") or {})
                _run(cmd.get("code", ""))
        except BaseException as e:  # never let the loop die on a worker bug
            _send({"id": _current["id"], "type": "error", "name": type(e).__name__,
                   "value": str(e), "traceback": traceback.format_exc()})
        finally:
            _stdout.flush()
            _stderr.flush()
            _undo_env(undo)
            _send({"id": _current["id"], "type": "done"})
            _current["id"] = None


main()
