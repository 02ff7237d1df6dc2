"""E2B egress rules through the unmodified SDK (2.63): `network.allowOut` / `denyOut` with IP
addresses and CIDRs, enforced by the node's switch (cube-vs) with E2B's precedence (an allow
beats a deny), domain names and `*.` wildcards admitted by the node's egress proxy (TLS SNI,
HTTP Host; never by connecting to an address directly), `dnsServers`, `update_network`
replacing a running (or paused) sandbox's rules, and what Cube refuses (reserved ranges, names
in denyOut) refused by name. An allow entry never opens the node.

The "internet" is a network namespace this module creates: two hosts (A and B) with an HTTP
server (port 80, answering with the address it was reached on and the Host it saw) and a TLS
stand-in (port 443, answering the ClientHello with the address it was reached on), routed
through the node like any outside address, and a DNS server."""

import os
import socket
import ssl
import subprocess
import time
import urllib.request

import pytest
from e2b import ALL_TRAFFIC, Sandbox
from e2b.exceptions import SandboxException

from conftest import TEMPLATE, TEST_RESOLVER
from test_sdk import api, live_ids

NET = "203.0.113"
A, B, NODE_SIDE = f"{NET}.1", f"{NET}.2", f"{NET}.254"
# The stack's cubelets are configured with this resolver (conftest: network.dns_resolver).
RESOLVER = TEST_RESOLVER
NAME = "svc.cube.test"
WILD = "*.wild.cube.test"
IN_WILD = "x.wild.cube.test"

# The hosts' servers: HTTP on 80 says which address it was reached on and the Host it saw; 443
# answers the first bytes (a TLS ClientHello) with the address only.
HOST_SERVER = r"""
import socket, threading
def one(c, tls):
    try:
        c.settimeout(5)
        data = b""
        while (len(data) < 5) if tls else (b"\r\n\r\n" not in data):
            d = c.recv(4096)
            if not d:
                break
            data += d
        me = c.getsockname()[0]
        if tls:
            c.sendall(f"tls-by {me}\n".encode())
            return
        host = ""
        for line in data.split(b"\r\n")[1:]:
            if line.lower().startswith(b"host:"):
                host = line[5:].strip().decode(errors="replace")
        body = f"served-by {me} host {host}\n".encode()
        c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    except OSError:
        pass
    finally:
        c.close()
def serve(port, tls):
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("0.0.0.0", port))
    l.listen(128)
    while True:
        c, _ = l.accept()
        threading.Thread(target=one, args=(c, tls), daemon=True).start()
threading.Thread(target=serve, args=(443, True), daemon=True).start()
serve(80, False)
"""

# A DNS server for the test network: NAME and names under WILD are A; every other name does
# not exist.
DNS_SERVER = f"""
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("{RESOLVER}", 53))
while True:
    q, peer = s.recvfrom(512)
    if len(q) < 17:
        continue
    i, labels = 12, []
    while i < len(q) and q[i]:
        labels.append(q[i + 1:i + 1 + q[i]].decode(errors="replace")); i += 1 + q[i]
    qtype = struct.unpack(">H", q[i + 1:i + 3])[0]
    question = q[12:i + 5]
    qname = ".".join(labels).lower()
    known = qname == "{NAME}" or qname.endswith(".wild.cube.test")
    answers = b""
    if known and qtype == 1:
        answers = bytes([0xc0, 0x0c]) + struct.pack(">HHIH", 1, 1, 5, 4) + socket.inet_aton("{A}")
    flags = 0x8180 if known else 0x8183
    head = q[:2] + struct.pack(">HHHHH", flags, 1, 1 if answers else 0, 0, 0)
    s.sendto(head + question + answers, peer)
"""


def dns_a(name, server):
    """The A record `server` gives for `name` (None: no answer or none)."""
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + labels + b"\x00\x00\x01\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(1)
        try:
            s.sendto(q, (server, 53))
            r = s.recv(512)
        except OSError:
            return None
    return socket.inet_ntoa(r[-4:]) if r[7] else None


def sh(*cmd, check=True):
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


@pytest.fixture(scope="module")
def inet():
    """Hosts A and B in a namespace of their own behind a veth; the node routes to them (and
    masquerades sandbox traffic, as for any destination). Also a listener on the node's own
    end of the link, which no sandbox may reach."""
    ns = f"cube-eg{os.getpid()}"
    host_if, ns_if = f"ceg{os.getpid() % 100000}h", f"ceg{os.getpid() % 100000}n"
    fwd = open("/proc/sys/net/ipv4/ip_forward").read().strip()
    sh("ip", "netns", "add", ns)
    srv = dns = None
    node_l = None
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{NODE_SIDE}/24", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        x = ["ip", "netns", "exec", ns]
        for a in (A, B, RESOLVER):
            sh(*x, "ip", "addr", "add", f"{a}/24", "dev", ns_if)
        sh(*x, "ip", "link", "set", ns_if, "up")
        sh(*x, "ip", "link", "set", "lo", "up")
        sh(*x, "ip", "route", "add", "default", "via", NODE_SIDE)
        with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
            f.write("1")
        srv = subprocess.Popen(x + ["python3", "-c", HOST_SERVER],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        dns = subprocess.Popen(x + ["python3", "-c", DNS_SERVER],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        node_l = socket.socket()
        node_l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        node_l.bind((NODE_SIDE, 8089))
        # Never accepted: the kernel completes the handshakes (all a probe needs) from the
        # backlog, and nothing holds the socket when the module closes it.
        node_l.listen(64)
        # The servers answer from the node before any sandbox test relies on them.
        for a in (A, B):
            for _ in range(100):
                try:
                    socket.create_connection((a, 80), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                pytest.fail(f"test host {a} does not answer")
        for _ in range(50):
            if dns_a(NAME, RESOLVER) == A:
                break
        else:
            pytest.fail(f"the test resolver does not answer (exit status {dns.poll()})")
        yield ns
    finally:
        for p in (srv, dns):
            if p:
                p.kill()
                p.wait()
        if node_l:
            node_l.close()
        with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
            f.write(fwd)
        sh("ip", "link", "del", host_if, check=False)
        sh("ip", "netns", "del", ns, check=False)


def reaches(sbx, ip, port=80, timeout=30):
    """Whether the sandbox opens a TCP connection to ip:port (2 s to answer)."""
    r = sbx.commands.run(f"nc -z -w 2 {ip} {port} && echo yes || echo no", timeout=timeout)
    return r.stdout.strip() == "yes"


def network_of(cube, sbx):
    _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
    return d["network"]


def test_deny_out_blocks_the_listed_address_only(cube, inet):
    sbx = Sandbox.create(TEMPLATE, timeout=120, network={"deny_out": [A]})
    try:
        assert not reaches(sbx, A), "a denied address was reached"
        assert reaches(sbx, B)
        assert network_of(cube, sbx)["denyOut"] == [f"{A}/32"]
    finally:
        sbx.kill()


def test_deny_all_with_an_allow_list_and_allow_beats_deny(cube, inet):
    only_a = Sandbox.create(TEMPLATE, timeout=120,
                            network={"deny_out": [ALL_TRAFFIC], "allow_out": [A]})
    try:
        assert reaches(only_a, A)
        assert not reaches(only_a, B), "deny-all let another address through"
        net = network_of(cube, only_a)
        assert (net["allowOut"], net["denyOut"]) == ([f"{A}/32"], ["0.0.0.0/0"])
    finally:
        only_a.kill()
    # The same address in both lists, and a deny inside a broader allow: the allow wins (E2B).
    both = Sandbox.create(TEMPLATE, timeout=120,
                          network={"deny_out": [A, f"{NET}.0/25"], "allow_out": [A]})
    try:
        assert reaches(both, A), "allowOut must take precedence over denyOut"
        assert not reaches(both, B)
    finally:
        both.kill()


def test_update_network_replaces_the_rules_of_a_running_and_a_paused_sandbox(cube, inet):
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        assert reaches(sbx, A) and reaches(sbx, B)
        sbx.update_network({"deny_out": [A]})
        assert not reaches(sbx, A), "the update did not hold"
        assert reaches(sbx, B)
        # The update replaces everything: what it omits is cleared.
        sbx.update_network({})
        assert reaches(sbx, A) and reaches(sbx, B)
        assert "denyOut" not in network_of(cube, sbx)
        sbx.update_network({"allow_internet_access": False, "allow_out": [B]})
        assert not reaches(sbx, A) and reaches(sbx, B)
        _, d, _ = api(cube, "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert d["allowInternetAccess"] is False and d["network"]["allowOut"] == [f"{B}/32"]
        # Paused: the update is taken, and holds after the resume.
        sbx.pause()
        Sandbox.update_network(sbx.sandbox_id, {"deny_out": [B]})
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert reaches(sbx, A) and not reaches(sbx, B)
    finally:
        sbx.kill()
    with pytest.raises(SandboxException) as e:
        Sandbox.update_network(sbx.sandbox_id, {})
    assert "not found" in str(e.value).lower(), str(e.value)


@pytest.mark.parametrize("network,named", [
    ({"allow_out": ["*.com"], "deny_out": [ALL_TRAFFIC]}, "*.com"),
    ({"allow_out": ["*"]}, "allowOut entry"),
    ({"deny_out": ["example.com"]}, "denyOut entry"),
    ({"allow_out": [NAME], "dns_servers": ["8.8.8.0/24"]}, "dnsServers"),
    ({"allow_out": ["10.1.2.3"]}, "10.0.0.0/8"),
    ({"allow_out": ["169.254.169.254"]}, "169.254.0.0/16"),
    ({"allow_out": ["1.2.3.4/40"]}, "prefix length"),
    ({"allow_out": ["::1"]}, "no IPv6"),
], ids=["wildcard-tld", "bare-wildcard", "deny-domain", "dns-cidr", "private", "metadata",
        "bad-prefix", "ipv6-allow"])
def test_entries_cube_cannot_enforce_are_refused(cube, inet, network, named):
    before = live_ids(cube)
    with pytest.raises(SandboxException) as e:
        Sandbox.create(TEMPLATE, timeout=60, network=network)
    assert "400" in str(e.value) and named in str(e.value), str(e.value)
    assert live_ids(cube) == before


def test_a_refused_update_leaves_the_rules_as_they_were(cube, inet):
    sbx = Sandbox.create(TEMPLATE, timeout=120, network={"deny_out": [A]})
    try:
        for bad, named in [({"allow_out": ["10.0.0.0/8"]}, "10.0.0.0/8"),
                           ({"deny_out": ["example.com"]}, "denyOut entry"),
                           ({"allow_out": [NAME], "dns_servers": ["::1"]}, "dnsServers")]:
            with pytest.raises(SandboxException) as e:
                sbx.update_network(bad)
            assert "400" in str(e.value) and named in str(e.value), str(e.value)
        assert network_of(cube, sbx)["denyOut"] == [f"{A}/32"]
        assert not reaches(sbx, A) and reaches(sbx, B)
    finally:
        sbx.kill()


def test_an_allow_entry_never_opens_the_node(cube, inet):
    """The node's own address on the test link is a public-looking /32: allowing it (with
    everything else denied) must still not reach a service listening there, as root in the
    sandbox, nor the node's API ports."""
    sbx = Sandbox.create(TEMPLATE, timeout=120,
                         network={"deny_out": [ALL_TRAFFIC], "allow_out": [NODE_SIDE, A]})
    try:
        # The listener is there: the node itself reaches it.
        socket.create_connection((NODE_SIDE, 8089), timeout=2).close()
        assert reaches(sbx, A), "the allow list works at all"
        assert not reaches(sbx, NODE_SIDE, 8089), "an allow entry opened the node"
        api_port = int(cube.api_url.rsplit(":", 1)[1].split("/")[0])
        assert not reaches(sbx, NODE_SIDE, api_port), "an allow entry opened the node's API"
    finally:
        sbx.kill()


def test_a_fork_keeps_its_sources_rules(cube, inet):
    src = Sandbox.create(TEMPLATE, timeout=120, network={"deny_out": [A]})
    try:
        forks = src.fork(count=1, timeout=90)
        try:
            assert len(forks) == 1
            f = forks[0]
            assert network_of(cube, f)["denyOut"] == [f"{A}/32"]
            assert not reaches(f, A) and reaches(f, B)
        finally:
            for f in forks:
                f.kill()
    finally:
        snaps = Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()
        src.kill()
        for sn in snaps:
            Sandbox.delete_snapshot(sn.snapshot_id)


def test_names_resolve_through_the_configured_resolver_only_while_internet_is_on(cube, inet):
    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        conf = sbx.commands.run("cat /etc/resolv.conf").stdout
        assert f"nameserver {RESOLVER}" in conf, conf
        assert reaches(sbx, NAME), f"{NAME} did not resolve (or {A} did not answer)"
        assert not reaches(sbx, "other.cube.test"), "a name the resolver does not know"
        # Deny-all with an allow list: the address is reachable, DNS is not (no resolver
        # when egress is off, so internet-off cannot be tunnelled through DNS).
        sbx.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": [A]})
        assert reaches(sbx, A)
        assert not reaches(sbx, NAME), "DNS answered with egress off"
        sbx.update_network({})
        assert reaches(sbx, NAME)
    finally:
        sbx.kill()


def http_via(sbx, ip, host):
    """What the server says to a request for `host` sent to ip:80 ("" when refused)."""
    r = sbx.commands.run(
        f"printf 'GET / HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' | nc -w 3 {ip} 80; true",
        timeout=30)
    return r.stdout.strip().rsplit("\n", 1)[-1] if r.stdout.strip() else ""


def client_hello(name):
    """The first bytes a TLS client sends, with `name` as the SNI (None: no SNI)."""
    ctx = ssl.create_default_context()
    if name is None:
        ctx.check_hostname = False
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def tls_via(sbx, ip, name):
    """What the TLS stand-in says to a ClientHello for `name` sent to ip:443 ("" refused)."""
    path = f"/tmp/hello-{name or 'none'}"
    sbx.files.write(path, client_hello(name))
    return sbx.commands.run(f"nc -w 3 {ip} 443 < {path}; true", timeout=30).stdout.strip()


def proxy_count(cube, verdict):
    """The node's egress proxy connections with this verdict so far."""
    text = urllib.request.urlopen(cube.cubelet_http + "/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f'cube_egress_proxy_connections_total{{verdict="{verdict}"}}'):
            return int(float(line.split()[-1]))
    return 0


def test_allowed_names_are_reached_by_name_and_only_by_name(cube, inet):
    admitted, refused = proxy_count(cube, "admitted"), proxy_count(cube, "refused")
    sbx = Sandbox.create(TEMPLATE, timeout=120,
                         network={"deny_out": [ALL_TRAFFIC], "allow_out": [NAME, WILD]})
    try:
        assert network_of(cube, sbx)["allowOut"] == sorted([NAME, WILD])
        assert http_via(sbx, A, NAME) == f"served-by {A} host {NAME}"
        assert tls_via(sbx, A, NAME) == f"tls-by {A}"
        # A wildcard is subdomains only.
        assert http_via(sbx, A, IN_WILD) == f"served-by {A} host {IN_WILD}"
        assert http_via(sbx, A, "wild.cube.test") == ""
        # Other names, no name, an address literal: refused, as root, on either protocol.
        assert http_via(sbx, A, "other.cube.test") == ""
        assert http_via(sbx, A, A) == ""
        assert tls_via(sbx, A, "other.cube.test") == ""
        assert tls_via(sbx, A, None) == ""
        # Naming the allowed host while connecting to another address reaches the allowed
        # host's address (the node resolves the name), never the address connected to.
        assert http_via(sbx, B, NAME) == f"served-by {A} host {NAME}"
        assert tls_via(sbx, B, NAME) == f"tls-by {A}"
        # The node counts what its proxy did (5 admitted, 5 refused above; a connection is
        # counted when it ends).
        for _ in range(50):
            if proxy_count(cube, "admitted") - admitted >= 5:
                break
            time.sleep(0.1)
        assert proxy_count(cube, "admitted") - admitted >= 5
        assert proxy_count(cube, "refused") - refused >= 5
        # Without dnsServers the node's resolver answers (deny-all or not): names resolve.
        assert sbx.commands.run(f"nc -z -w 2 {NAME} 80 && echo yes || echo no").stdout.strip() \
            == "yes"
        # The update replaces the names too.
        sbx.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": [IN_WILD]})
        assert http_via(sbx, A, NAME) == ""
        assert http_via(sbx, A, IN_WILD) == f"served-by {A} host {IN_WILD}"
        sbx.update_network({"deny_out": [ALL_TRAFFIC]})
        assert http_via(sbx, A, IN_WILD) == ""
        assert not reaches(sbx, A)
    finally:
        sbx.kill()


def test_dns_servers_choose_what_dns_the_sandbox_may_reach(cube, inet):
    # None: no DNS, and the allowed name still works by name (E2B).
    sbx = Sandbox.create(TEMPLATE, timeout=120, network={
        "deny_out": [ALL_TRAFFIC], "allow_out": [NAME], "dns_servers": []})
    try:
        assert network_of(cube, sbx)["dnsServers"] == []
        resolve = f"nc -z -w 2 {NAME} 80 && echo yes || echo no"
        assert sbx.commands.run(resolve).stdout.strip() == "no", "DNS answered with []"
        assert http_via(sbx, A, NAME) == f"served-by {A} host {NAME}"
        # A server of the user's: all traffic to it is allowed (the test resolver here).
        sbx.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": [NAME],
                            "dns_servers": [RESOLVER]})
        assert sbx.commands.run(resolve).stdout.strip() == "yes"
        assert network_of(cube, sbx)["dnsServers"] == [RESOLVER]
    finally:
        sbx.kill()
    # Without names dnsServers change nothing (E2B): deny-all still has no DNS.
    plain = Sandbox.create(TEMPLATE, timeout=120, network={
        "deny_out": [ALL_TRAFFIC], "allow_out": [B], "dns_servers": [RESOLVER]})
    try:
        assert not reaches(plain, NAME)
        assert reaches(plain, B)
    finally:
        plain.kill()
