//! Network isolation through cube-vs, end to end: a real cubelet, real namespace sandboxes and
//! the real eBPF switch in the host namespace. Every address a sandbox tries to reach is one
//! this test creates on the host (a dummy interface) or another sandbox; nothing leaves the
//! machine. Root only.

mod common;

use common::*;
use cube_proto::nodev1 as pb;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::Command;
use std::time::Duration;

/// A veth pair on the host carrying test addresses (no dummy module on every kernel); removed
/// (with them) on drop.
struct Dummy {
    name: String,
}

impl Dummy {
    fn new(tag: char, addrs: &[Ipv4Addr]) -> Dummy {
        let name = format!("cvt{tag}{}", std::process::id() % 100_000);
        let _ = Command::new("ip").args(["link", "del", &name]).output();
        let peer = format!("cvu{tag}{}", std::process::id() % 100_000);
        ip(&["link", "add", &name, "type", "veth", "peer", "name", &peer]);
        let d = Dummy { name };
        for a in addrs {
            ip(&["addr", "add", &format!("{a}/32"), "dev", &d.name]);
        }
        ip(&["link", "set", &d.name, "up"]);
        d
    }
}

impl Drop for Dummy {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .output();
    }
}

fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().unwrap();
    assert!(
        o.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Whether a TCP connection from inside the sandbox to ip:port is established (netcat, 1 s).
async fn sb_can_connect(sb: &pb::Sandbox, ip: Ipv4Addr, port: u16) -> bool {
    let (_, out) = sh(
        sb,
        &format!("if nc -z -w 1 {ip} {port}; then echo open; else echo closed; fi"),
    )
    .await;
    match out.trim() {
        "open" => true,
        "closed" => false,
        o => panic!("unexpected output {o:?}"),
    }
}

/// Whether the host can open a TCP connection to ip:port (1.5 s).
async fn host_can_connect(ip: Ipv4Addr, port: u16) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_millis(1500),
            tokio::net::TcpStream::connect(SocketAddrV4::new(ip, port))
        )
        .await,
        Ok(Ok(_))
    )
}

fn host_addr(sb: &pb::Sandbox) -> Ipv4Addr {
    *agent_addr(sb).ip()
}

fn state_of(c: &Cubelet, id: &str) -> cubelet::node::SandboxState {
    cubelet::state::read(
        &c.data().join("sandboxes").join(id).join("state.json"),
        cubelet::node::STATE_MAGIC,
        cubelet::node::STATE_VERSION,
    )
    .unwrap()
}

async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut b = String::new();
    s.read_to_string(&mut b).await.unwrap();
    b
}

fn metric(body: &str, name: &str, sandbox: &str, dir: &str) -> Option<u64> {
    let want = format!("{name}{{direction=\"{dir}\",sandbox=\"{sandbox}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(want.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

fn routes_to(addr: Ipv4Addr) -> String {
    let o = Command::new("ip")
        .args(["-4", "route", "show", "exact", &format!("{addr}/32")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_are_isolated_policies_enforced_and_state_survives_a_crash() {
    cube_testkit::require_priv!("cubelet::isolation");
    let o = (std::process::id() % 250 + 1) as u8;
    let allowed = Ipv4Addr::new(198, 18, o, 1);
    let other = Ipv4Addr::new(198, 18, o, 2);
    let metadata = Ipv4Addr::new(169, 254, 169, 254);
    let gateway = Ipv4Addr::new(169, 254, 77, 1);
    // The metadata address may already exist on this host (then it is not ours to add).
    let mut addrs = vec![allowed, other];
    let has_md = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["-4", "-o", "addr"])
            .output()
            .unwrap()
            .stdout,
    )
    .contains("169.254.169.254/");
    if !has_md {
        addrs.push(metadata);
    }
    let _dummy = Dummy::new('a', &addrs);
    // A host service every sandbox would love to reach.
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let lport = listener.local_addr().unwrap().port();
    assert!(host_can_connect(allowed, lport).await);

    let mut c = Cubelet::new(
        "iso",
        Opts {
            network_pool: 2,
            ..Default::default()
        },
    );
    let grpc_port: u16 = c.grpc.rsplit(':').next().unwrap().parse().unwrap();
    let mut cl = c.start().await;
    let mut r1 = create_req("iso1");
    // iso1 allow-lists a node address: allow entries come from users and never open the node.
    r1.network = Some(pb::NetworkPolicy {
        internet: true,
        exposed_ports: vec![pb::ExposedPort { port: 8080 }],
        allow_cidrs: vec![format!("{other}/32")],
        ..Default::default()
    });
    let sb1 = cl.create_sandbox(r1).await.unwrap().into_inner();
    let mut r2 = create_req("iso2");
    r2.network = Some(pb::NetworkPolicy {
        internet: false,
        host_services: vec![allowed.to_string()],
        ..Default::default()
    });
    let sb2 = cl.create_sandbox(r2).await.unwrap().into_inner();
    let (h1, h2) = (host_addr(&sb1), host_addr(&sb2));
    let pool: cube_vs::Ipv4Cidr = c.host_pool.parse().unwrap();
    assert!(
        pool.contains(h1) && pool.contains(h2) && h1 != h2,
        "{h1} {h2}"
    );
    assert_eq!(agent_addr(&sb1).port(), 49983);
    assert_eq!(state_of(&c, "iso1").host_addr, Some(h1));
    assert!(
        routes_to(h1).contains(&sb1.host_interface),
        "{}",
        routes_to(h1)
    );
    // The host end carries no address: nothing on the host is reachable "on the link".
    let o = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "dev", &sb1.host_interface])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "");

    // (c) Exposure: the agent and exposed 8080 answer the host; unexposed 8081 does not,
    // although something listens there (the sandbox itself can connect to it).
    let (code, _) = sh(
        &sb1,
        "(nc -lk 8080 </dev/null >/dev/null 2>&1 &); (nc -lk 8081 </dev/null >/dev/null 2>&1 &)",
    )
    .await;
    assert_eq!(code, 0);
    // Both listen once the sandbox itself can connect to them.
    let t = std::time::Instant::now();
    for port in [8081, 8080] {
        while !sb_can_connect(&sb1, Ipv4Addr::LOCALHOST, port).await {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "nothing listens on {port}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert!(host_can_connect(h1, 49983).await);
    assert!(
        host_can_connect(h1, 8080).await,
        "exposed port not reachable"
    );
    assert!(
        !host_can_connect(h1, 8081).await,
        "unexposed port reachable"
    );
    assert!(
        !host_can_connect(h2, 8080).await,
        "8080 is exposed on iso1 only"
    );

    // (a) Host services: a listener the test opened, cubelet's own gRPC, the metadata address,
    // the gateway address. iso1 has internet on, but node-local destinations stay closed.
    for (ip, port) in [
        (allowed, lport),
        (other, lport),
        (allowed, grpc_port),
        (metadata, lport),
        (gateway, grpc_port),
        (gateway, lport),
    ] {
        assert!(
            !sb_can_connect(&sb1, ip, port).await,
            "iso1 reached host service {ip}:{port}"
        );
    }

    // (b) Sandbox to sandbox, both ways, even to the agent port the host can reach.
    assert!(!sb_can_connect(&sb1, h2, 49983).await, "iso1 reached iso2");
    assert!(!sb_can_connect(&sb2, h1, 49983).await, "iso2 reached iso1");
    assert!(
        !sb_can_connect(&sb2, h1, 8080).await,
        "iso2 reached iso1:8080"
    );

    // (d) internet off + a host-service entry: exactly that node address is reachable.
    assert!(
        sb_can_connect(&sb2, allowed, lport).await,
        "allow-listed address blocked"
    );
    assert!(!sb_can_connect(&sb2, other, lport).await);
    assert!(!sb_can_connect(&sb2, metadata, lport).await);

    // SetEgress replaces a running sandbox's rules at once (its host services stay, and a deny
    // beats them); an allow entry inside a reserved range is refused.
    let egress = |allow: &[&str], deny: &[String]| pb::SetEgressRequest {
        sandbox_id: "iso2".into(),
        internet: false,
        allow_cidrs: allow.iter().map(|s| s.to_string()).collect(),
        deny_cidrs: deny.to_vec(),
        ..Default::default()
    };
    let e = cl
        .set_egress(egress(&["10.1.2.3/32"], &[]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("10.0.0.0/8"), "{e:?}");
    // Names need the egress proxy, which this node does not run: refused, rules unchanged;
    // a malformed name is refused as such.
    for (names, code, says) in [
        (
            vec!["api.example.com"],
            tonic::Code::FailedPrecondition,
            "egress proxy",
        ),
        (vec!["*.com"], tonic::Code::InvalidArgument, "wildcard"),
    ] {
        let e = cl
            .set_egress(pb::SetEgressRequest {
                allow_names: names.iter().map(|s| s.to_string()).collect(),
                ..egress(&[], &[])
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{e:?}");
        assert!(e.message().contains(says), "{e:?}");
    }
    assert!(state_of(&c, "iso2").policy.allow_names.is_empty());
    cl.set_egress(egress(&[], &[format!("{allowed}/32")]))
        .await
        .unwrap();
    assert!(
        !sb_can_connect(&sb2, allowed, lport).await,
        "a deny set at run time did not hold"
    );
    cl.set_egress(egress(&[], &[])).await.unwrap();
    assert!(sb_can_connect(&sb2, allowed, lport).await);
    assert!(state_of(&c, "iso2").policy.deny_cidrs.is_empty());

    // Counters per sandbox on /metrics: iso1's blocked attempts were dropped.
    let body = http_get(&c.http, "/metrics").await;
    let drops = metric(&body, "cube_sandbox_net_drops", "iso1", "from_guest")
        .unwrap_or_else(|| panic!("no drop counter for iso1: {body}"));
    assert!(drops > 0);
    assert!(metric(&body, "cube_sandbox_net_packets", "iso1", "to_guest").unwrap() > 0);
    assert!(metric(&body, "cube_sandbox_net_bytes", "iso2", "from_guest").unwrap() > 0);
    assert_eq!(
        sb1.agent_address,
        cl.get_sandbox(pb::SandboxRef {
            sandbox_id: "iso1".into()
        })
        .await
        .unwrap()
        .into_inner()
        .agent_address
    );

    // (e) SIGKILL: enforcement stays (pinned maps, filters on the devices), the sandboxes stay
    // reachable from the host at their addresses.
    c.crash();
    assert!(
        !sb_can_connect(&sb1, allowed, lport).await,
        "fail-open after crash"
    );
    assert!(!sb_can_connect(&sb1, h2, 49983).await);
    assert!(sb_can_connect(&sb2, allowed, lport).await);
    assert!(!sb_can_connect(&sb2, other, lport).await);
    assert!(!host_can_connect(h1, 8081).await);
    let mut cl = c.start().await;
    let g1 = cl
        .get_sandbox(pb::SandboxRef {
            sandbox_id: "iso1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(g1.agent_address, sb1.agent_address, "host address changed");
    assert_eq!(state_of(&c, "iso1").host_addr, Some(h1));
    assert!(!sb_can_connect(&sb1, allowed, lport).await);
    assert!(sb_can_connect(&sb2, allowed, lport).await);
    assert!(host_can_connect(h1, 8080).await);
    assert!(!host_can_connect(h1, 8081).await);
    // The re-adopted addresses are not handed out again.
    let sb3 = cl
        .create_sandbox(create_req("iso3"))
        .await
        .unwrap()
        .into_inner();
    let h3 = host_addr(&sb3);
    assert!(h3 != h1 && h3 != h2, "{h3} reused");
    assert_eq!(sh(&sb3, "echo ok").await.1, "ok\n");

    // (f) Kill: the address, its route and every per-port switch entry go.
    let idx1 = state_of(&c, "iso1").endpoint.unwrap().host_ifindex;
    assert!(!c.switch_has_port(idx1).is_empty());
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "iso1".into(),
    })
    .await
    .unwrap();
    assert_eq!(routes_to(h1), "", "route of a killed sandbox left");
    assert_eq!(c.switch_has_port(idx1), Vec::<String>::new());
    // Its filters went with its interface, and no link pin of that port is left.
    let o = Command::new("ip")
        .args(["link", "show", &sb1.host_interface])
        .output()
        .unwrap();
    assert!(
        !o.status.success(),
        "host interface of a killed sandbox left"
    );
    let pins: Vec<String> = std::fs::read_dir(c.pin_root.join("links"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&format!("{idx1}-")))
                .collect()
        })
        .unwrap_or_default();
    assert!(pins.is_empty(), "{pins:?}");
    assert!(!host_can_connect(h1, 49983).await);
    let body = http_get(&c.http, "/metrics").await;
    assert!(metric(&body, "cube_sandbox_net_drops", "iso1", "from_guest").is_none());
    for id in ["iso2", "iso3"] {
        cl.kill_sandbox(pb::SandboxRef {
            sandbox_id: id.into(),
        })
        .await
        .unwrap();
    }
    c.stop();
    c.assert_clean();
    drop(listener);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_switch_cubelet_warns_loudly_and_still_runs_sandboxes() {
    cube_testkit::require_priv!("cubelet::no_switch");
    let mut c = Cubelet::new(
        "nosw",
        Opts {
            no_switch: true,
            ..Default::default()
        },
    );
    let mut cl = c.start().await;
    let sb = cl
        .create_sandbox(create_req("nosw1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sb.agent_address, "169.254.77.2:49983");
    assert_eq!(sh(&sb, "echo $FOO").await.1, "bar\n");
    assert!(
        c.log().contains("SANDBOXES ARE NOT ISOLATED"),
        "no loud warning: {}",
        c.log()
    );
    assert!(!c.pin_root.join("maps").exists(), "switch state created");
    // Egress rules need a switch to hold: refused, never accepted and ignored.
    let mut r = create_req("nosw2");
    r.network = Some(pb::NetworkPolicy {
        internet: true,
        deny_cidrs: vec!["198.51.100.0/24".into()],
        ..Default::default()
    });
    let e = cl.create_sandbox(r).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    let e = cl
        .set_egress(pb::SetEgressRequest {
            sandbox_id: "nosw1".into(),
            internet: true,
            deny_cidrs: vec!["198.51.100.0/24".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "nosw1".into(),
    })
    .await
    .unwrap();
    c.stop();
    c.assert_clean();
}

/// The pinned switch state is lost while cubelet is down (bpffs unmounted, filters and routes
/// removed): the next cubelet re-binds the running sandbox with the address on record, and
/// enforcement is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_switch_state_is_rebuilt_from_the_sandbox_record() {
    cube_testkit::require_priv!("cubelet::lost_switch_state");
    let o = (std::process::id() % 250 + 1) as u8;
    let host_ip = Ipv4Addr::new(198, 19, o, 1);
    let _dummy = Dummy::new('b', &[host_ip]);
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let lport = listener.local_addr().unwrap().port();
    let mut c = Cubelet::new("lost", Opts::default());
    let mut cl = c.start().await;
    let sb = cl
        .create_sandbox(create_req("lost1"))
        .await
        .unwrap()
        .into_inner();
    let h = host_addr(&sb);
    c.crash();
    let _ = Command::new("tc")
        .args(["qdisc", "del", "dev", &sb.host_interface, "clsact"])
        .output();
    ip(&["route", "del", &format!("{h}/32")]);
    let p = std::ffi::CString::new(c.pin_root.to_str().unwrap()).unwrap();
    // SAFETY: unmount the test cubelet's own bpffs.
    assert_eq!(unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) }, 0);
    let _ = std::fs::remove_dir_all(&c.pin_root);
    assert!(!host_can_connect(h, 49983).await);

    let mut cl = c.start().await;
    let g = cl
        .get_sandbox(pb::SandboxRef {
            sandbox_id: "lost1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(g.agent_address, sb.agent_address);
    assert_eq!(sh(&sb, "echo ok").await.1, "ok\n");
    let o = Command::new("tc")
        .args(["filter", "show", "dev", &sb.host_interface, "ingress"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("bpf"),
        "no filter after re-adoption"
    );
    // Enforcement is back: a host service stays closed.
    assert!(host_can_connect(host_ip, lport).await);
    assert!(!sb_can_connect(&sb, host_ip, lport).await);
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "lost1".into(),
    })
    .await
    .unwrap();
    c.stop();
    c.assert_clean();
}

/// The device program (cgroup v2, here on the hybrid host's unified hierarchy) on its own:
/// a process in a cgroup carrying it opens the allowed devices and nothing else, and cannot
/// make other nodes, even as root with every capability (outside such a cgroup root opens
/// `/dev/loop-control` and makes any node).
#[test]
fn the_device_program_allows_only_the_list() {
    cube_testkit::require_priv!("cubelet::device_program");
    let unified = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .map(std::path::Path::new)
        .find(|p| p.join("cgroup.controllers").exists())
        .expect("a cgroup v2 (unified) hierarchy");
    let cg = unified.join(format!("cube-devtest-{}", std::process::id()));
    let _ = std::fs::remove_dir(&cg);
    std::fs::create_dir(&cg).unwrap();
    let prog = cubelet::cgroup::devices::load(&cubelet::cgroup::devices::rules()).unwrap();
    cubelet::cgroup::devices::attach(&cg, &prog).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "echo $$ > {procs}; \
         for d in /dev/null /dev/zero /dev/urandom; do ( : < $d ) 2>/dev/null && echo ok $d || echo refused $d; done; \
         ( : < /dev/loop-control ) 2>/dev/null && echo ok loop-control || echo refused loop-control; \
         mknod {t}/kvm c 10 232 2>/dev/null && echo ok mknod || echo refused mknod; \
         mknod {t}/null c 1 3 2>/dev/null && echo ok mknod-null || echo refused mknod-null",
        procs = cg.join("cgroup.procs").display(),
        t = dir.path().display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    let _ = std::fs::remove_dir(&cg);
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(
        out,
        "ok /dev/null\nok /dev/zero\nok /dev/urandom\nrefused loop-control\nrefused mknod\nok mknod-null\n",
        "device program verdicts"
    );
}
