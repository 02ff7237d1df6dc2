#!/usr/bin/env python3
"""Probe of the microvm runtime's data path through real cube-shim processes, without cubelet.

What it measures (the agent stand-in test guest, `cube-shim --build-template`):
  * warm shim (spawned ahead, VM shell created, template mapped, jailed): restore request →
    guest running → guest asked for its init over vsock → payload sent → guest acknowledged
    (EOF), p50/p99 — the node-side core of CreateSandbox from a warm pool, minus cubelet's
    bookkeeping (state file writes, pool hand-off);
  * pause to disk / resume from it (through the shim, with a fresh init after resume);
  * N idle 512 MiB sandboxes restored from one snapshot: host MemAvailable drop per sandbox and
    the shims' own accounting (process PSS, guest pages written).
The full path through cubelet is `node-bench --runtime microvm`.

Usage (root): standin-probe.py --shim target/release/cube-shim [--iterations 50] [--idle 500]
Prints a markdown table; writes JSON to --out DIR (default benches/results/standin-probe-<time>).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import shutil

INIT_PORT = 1024


def call(path, op, timeout=60, **kw):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(path)
    req = {"v": 1, "op": op}
    req.update(kw)
    s.sendall((json.dumps(req) + "\n").encode())
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            raise RuntimeError(f"shim closed the connection on {op}")
        buf += chunk
    s.close()
    r = json.loads(buf)
    if "err" in r:
        raise RuntimeError(f"{op}: {r['err']}")
    return r["ok"]


class Responder:
    """Host end of the guest's init channel: answers each "redy" with a fresh payload."""

    def __init__(self, vsock):
        self.path = f"{vsock}_{INIT_PORT}"
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen(4)
        self.acks = []
        self.cv = threading.Condition()
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            c.settimeout(20)
            hello = c.recv(4)
            payload = b"CUBI" + (1).to_bytes(4, "little") + time.time_ns().to_bytes(8, "little")
            payload += os.urandom(32) + (2).to_bytes(4, "little") + b"{}"
            c.sendall(payload)
            while c.recv(4096):
                pass
            c.close()
            with self.cv:
                self.acks.append((time.perf_counter(), hello))
                self.cv.notify_all()

    def wait(self, n, timeout=30):
        end = time.time() + timeout
        with self.cv:
            while len(self.acks) < n:
                left = end - time.time()
                if left <= 0:
                    raise RuntimeError("guest did not take its init")
                self.cv.wait(left)
            return self.acks[n - 1][0]

    def close(self):
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def spawn(shim, work, key, mem, tpl, jail=True):
    sock = os.path.join(work, f"{key}.sock")
    args = [shim, "--vcpus", "1", "--mem-mib", str(mem), "--socket", sock, "--template", tpl]
    if jail:
        args += ["--jail-root", os.path.join(work, "roots", key), "--jail-bind", work]
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(os.path.join(work, f"{key}.log"), "w"),
                         env={"RUST_LOG": "warn"})
    end = time.time() + 30
    while True:
        if p.poll() is not None:
            raise RuntimeError(f"shim exited: {open(os.path.join(work, key + '.log')).read()}")
        try:
            call(sock, "ping", timeout=5)
            return p, sock
        except OSError:
            pass
        if time.time() > end:
            raise RuntimeError("shim did not start")
        time.sleep(0.002)


def wait_idle(sock, timeout=10):
    """Until the guest finished its init round and parked (checkpoint 0xd0e last): a pause
    taken mid-round would cut its vsock connection and it would never ask again."""
    end = time.time() + timeout
    while time.time() < end:
        cps = call(sock, "stats")["checkpoints"]
        if cps and cps[-1] == 0xD0E:
            return
        time.sleep(0.001)
    raise RuntimeError("guest did not settle")


def pct(v, p):
    if not v:
        return 0.0
    v = sorted(v)
    return v[min(len(v) - 1, round((len(v) - 1) * p))]


def meminfo(key):
    for line in open("/proc/meminfo"):
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shim", required=True)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--mem-mib", type=int, default=512)
    ap.add_argument("--out")
    a = ap.parse_args()
    out = a.out or f"benches/results/standin-probe-{int(time.time())}"
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="standin-probe-", dir="/var/tmp")
    os.makedirs(os.path.join(work, "roots"))
    taps, procs = [], []
    try:
        disk = os.path.join(work, "disk.img")
        with open(disk, "wb") as f:
            f.truncate(64 << 10)
        tpl_net = os.path.join(work, "tpl-net")
        tpl = os.path.join(work, "tpl")
        t = time.perf_counter()
        subprocess.run([a.shim, "--vcpus", "1", "--mem-mib", str(a.mem_mib), "--build-template", tpl_net,
                        "--disk", disk, "--net-mac", "02:cb:e0:00:00:02"], check=True, stdout=subprocess.DEVNULL)
        build_ms = (time.perf_counter() - t) * 1e3
        subprocess.run([a.shim, "--vcpus", "1", "--mem-mib", str(a.mem_mib), "--build-template", tpl,
                        "--disk", disk], check=True, stdout=subprocess.DEVNULL)

        # Warm shims: restore → init acknowledged; pause to disk / resume on some.
        lat, restore_us, pause_ms, resume_ms = [], [], [], []
        for i in range(a.iterations):
            key = f"w{i}"
            tap = f"cbp{os.getpid() % 100000}x{i % 4}"
            if tap not in taps:
                subprocess.run(["ip", "tuntap", "add", "dev", tap, "mode", "tap"], check=True)
                taps.append(tap)
            p, sock = spawn(a.shim, work, key, a.mem_mib, tpl_net)
            procs.append(p)
            d = os.path.join(work, f"{key}.img")
            shutil.copyfile(disk, d)
            vs = os.path.join(work, f"{key}.v")
            r = Responder(vs)
            t0 = time.perf_counter()
            rep = call(sock, "restore", snapshot=tpl_net, disk=d, tap=tap, vsock=vs)
            t1 = r.wait(1)
            lat.append((t1 - t0) * 1e3)
            restore_us.append(rep["restore_us"])
            if i < 20:
                wait_idle(sock)
                pdir = os.path.join(work, f"{key}.pause")
                t = time.perf_counter()
                call(sock, "pause_to_disk", dir=pdir)
                pause_ms.append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                call(sock, "resume", dir=pdir, disk=d, tap=tap, vsock=vs)
                r.wait(2)
                resume_ms.append((time.perf_counter() - t) * 1e3)
                shutil.rmtree(pdir, ignore_errors=True)
            call(sock, "stop")
            p.wait(10)
            r.close()
            os.unlink(d)

        # Idle: N sandboxes from one snapshot (no net device: no tap per sandbox needed).
        time.sleep(0.5)
        avail0 = meminfo("MemAvailable:")
        t = time.perf_counter()
        resp = []
        idle_error = None
        print(f"warm: restore→init p50 {pct(lat, .5):.2f} ms p99 {pct(lat, .99):.2f} ms; "
              f"pause p50 {pct(pause_ms, .5):.2f} ms; resume p50 {pct(resume_ms, .5):.2f} ms", flush=True)
        for i in range(a.idle):
            key = f"i{i}"
            try:
                p, sock = spawn(a.shim, work, key, a.mem_mib, tpl)
            except RuntimeError as e:
                # The host's KVM ran out of room for VMs: report how far it got.
                idle_error = f"stopped at sandbox {i}: {e}"
                print(idle_error, file=sys.stderr)
                break
            procs.append(p)
            d = os.path.join(work, f"{key}.img")
            shutil.copyfile(disk, d)
            vs = os.path.join(work, f"{key}.v")
            r = Responder(vs)
            call(sock, "restore", snapshot=tpl, disk=d, vsock=vs)
            r.wait(1)
            resp.append((sock, r))
        idle_s = time.perf_counter() - t
        time.sleep(2)
        avail1 = meminfo("MemAvailable:")
        pss = anon = rss = 0
        for sock, _ in resp:
            s = call(sock, "stats")["stats"]
            pss += s["process_pss_kib"]
            anon += s["guest_anon_kib"]
            rss += s["guest_rss_kib"]
        n = max(1, len(resp))
        for sock, r in resp:
            try:
                call(sock, "stop", timeout=10)
            except Exception:
                pass
            r.close()
        res = {
            "bench": "standin-probe", "unix_time": int(time.time()), "mem_mib": a.mem_mib,
            "template_build_ms": build_ms,
            "warm_restore_to_init_ack_ms": {"n": len(lat), "p50": pct(lat, .5), "p99": pct(lat, .99), "all": lat},
            "shim_restore_us": {"p50": pct(restore_us, .5), "p99": pct(restore_us, .99)},
            "pause_to_disk_ms": {"n": len(pause_ms), "p50": pct(pause_ms, .5), "p99": pct(pause_ms, .99)},
            "resume_to_init_ack_ms": {"n": len(resume_ms), "p50": pct(resume_ms, .5), "p99": pct(resume_ms, .99)},
            "idle": {"sandboxes": len(resp), "requested": a.idle, "error": idle_error, "seconds": idle_s,
                     "mem_available_drop_kib_per_sandbox": (avail0 - avail1) // n,
                     "shim_pss_kib_per_sandbox": pss // n, "guest_written_kib_per_sandbox": anon // n,
                     "pss_beyond_written_kib_per_sandbox": (pss - anon) // n,
                     "guest_rss_kib_per_sandbox": rss // n},
        }
        md = "## standin-probe: microvm data path through cube-shim (agent stand-in guest)\n\n"
        md += "| measure | n | p50 | p99 |\n|---|---|---|---|\n"
        md += f"| warm shim: restore → guest init acknowledged (ms) | {len(lat)} | {pct(lat, .5):.2f} | {pct(lat, .99):.2f} |\n"
        md += f"| shim restore op itself (µs) | {len(restore_us)} | {pct(restore_us, .5)} | {pct(restore_us, .99)} |\n"
        md += f"| pause to disk, {a.mem_mib} MiB guest (ms) | {len(pause_ms)} | {pct(pause_ms, .5):.2f} | {pct(pause_ms, .99):.2f} |\n"
        md += f"| resume from disk → init acknowledged (ms) | {len(resume_ms)} | {pct(resume_ms, .5):.2f} | {pct(resume_ms, .99):.2f} |\n"
        i = res["idle"]
        md += f"\n| idle {a.mem_mib} MiB sandboxes | MemAvailable drop / sandbox KiB | shim PSS / sandbox KiB | guest-written KiB | PSS beyond written KiB |\n|---|---|---|---|---|\n"
        md += f"| {i['sandboxes']} | {i['mem_available_drop_kib_per_sandbox']} | {i['shim_pss_kib_per_sandbox']} | {i['guest_written_kib_per_sandbox']} | {i['pss_beyond_written_kib_per_sandbox']} |\n"
        print(md)
        json.dump(res, open(os.path.join(out, "results.json"), "w"), indent=1)
        open(os.path.join(out, "results.md"), "w").write(md)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in taps:
            subprocess.run(["ip", "link", "del", t], stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
