//! The `microvm` runtime end to end: a real cubelet (gRPC) starting real, jailed cube-shim
//! processes on /dev/kvm, with the shim's `agent_standin` test guest standing in for cube-agent
//! (on PVM hosts Linux cannot boot). What is real: shim processes, cgroups, mount-namespace
//! jail, seccomp, KVM VMs restored from a template snapshot (MAP_PRIVATE), virtio-vsock to the
//! host, virtio-blk on a reflinked disk, virtio-net on a tap from the pool, pause to disk,
//! snapshots as templates, death detection and re-adoption. What stands in: the guest (a CPL3
//! test program that takes its init payload over vsock instead of cube-agent's HTTP /init).
//!
//! Needs the cube-shim binary: `cargo build -p cube-shim` (found next to this test's target
//! directory, or at $CUBE_SHIM_BIN). Compiled with the `microvm` feature (on by default).
#![cfg(feature = "microvm")]

use cube_proto::nodev1 as pb;
use cube_proto::nodev1::node_client::NodeClient;
use cube_shim::protocol::{Reply, SandboxState as ShimState};
use cube_shim::template::{STANDIN_INIT_DATA, STANDIN_INIT_DONE, STANDIN_WOKEN};
use cube_shim::{Client, Op};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const CUBELET: &str = env!("CARGO_BIN_EXE_cubelet");
static SEQ: AtomicU32 = AtomicU32::new(0);

fn shim_binary() -> PathBuf {
    let mut cands: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("CUBE_SHIM_BIN") {
        cands.push(p.into());
    }
    // This test binary lives in <target>/debug/deps/.
    if let Ok(exe) = std::env::current_exe() {
        if let Some(d) = exe.parent().and_then(|p| p.parent()) {
            cands.push(d.join("cube-shim"));
        }
    }
    cands.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/cube-shim"));
    for c in &cands {
        if c.exists() {
            return c.clone();
        }
    }
    panic!("no cube-shim binary (tried {cands:?}): run `cargo build -p cube-shim` or set CUBE_SHIM_BIN");
}

/// A port held for this test process (cube-testkit), not one bound and closed.
fn free_port() -> u16 {
    cube_testkit::reserve_port()
}

struct Node {
    root: PathBuf,
    config: PathBuf,
    grpc: String,
    cgroup_parent: String,
    child: Option<Child>,
}

impl Node {
    /// A cubelet on `runtime = "microvm"` with the stand-in guest, its own dirs, cgroup parent
    /// and ports, an XFS loop data dir (reflinks), and a tiny template `tiny`.
    fn new(tag: &str, shims: u32) -> Node {
        Node::with_shim(tag, shims, &shim_binary())
    }

    fn with_shim(tag: &str, shims: u32, shim: &Path) -> Node {
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let name = format!("m{tag}{}{n}", std::process::id());
        let root = PathBuf::from(format!("/var/tmp/cubelet-mvm-{name}"));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("tpl")).unwrap();
        std::fs::write(root.join("tpl/hello"), b"tiny template\n").unwrap();
        // The stand-in guest does not run the agent; any small file will do as its binary.
        std::fs::write(root.join("agent"), b"#!/bin/sh\n").unwrap();
        let cgroup_parent = format!("cube-mvm-{name}");
        let cfg = format!(
            r#"grpc_addr = "127.0.0.1:{g}"
http_addr = "127.0.0.1:{h}"
data_dir = "{root}/data"
run_dir = "{root}/run"
cache_dir = "{root}/cache"
agent_binary = "{root}/agent"
runtime = "microvm"
[microvm]
shim_binary = "{shim}"
guest = "agent-standin"
taps = 2
[storage]
xfs_loop_image = "{root}/xfs.img"
xfs_loop_size_gib = 2
[sandbox]
default_vcpus = 1
default_memory_mib = 64
# Generous: nested under TCG (tests/nested), one of 200 creates took over 20 s to take its init.
ready_timeout_ms = 60000
[cgroup]
parent = "{cgroup_parent}"
[pools]
network = 0
disks = 2
refill_interval_ms = 50
[pools.started]
tiny = {shims}
[network]
switch = "none"
"#,
            g = free_port(),
            h = free_port(),
            root = root.display(),
            shim = shim.display(),
        );
        let config = root.join("cubelet.toml");
        std::fs::write(&config, &cfg).unwrap();
        let grpc = cfg
            .lines()
            .next()
            .unwrap()
            .split('"')
            .nth(1)
            .unwrap()
            .to_string();
        let node = Node {
            root: root.clone(),
            config,
            grpc: format!("http://{grpc}"),
            cgroup_parent,
            child: None,
        };
        let out = Command::new(CUBELET)
            .arg("--config")
            .arg(&node.config)
            .args(["build-template", "tiny", "--dir"])
            .arg(root.join("tpl"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "build-template: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        node
    }

    fn data(&self) -> PathBuf {
        self.root.join("data")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("cubelet.log")).unwrap_or_default()
    }

    async fn start(&mut self) -> NodeClient<tonic::transport::Channel> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join("cubelet.log"))
            .unwrap();
        self.child = Some(
            Command::new(CUBELET)
                .arg("--config")
                .arg(&self.config)
                .arg("run")
                .arg("--kill-sandboxes-on-exit")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        );
        let t0 = Instant::now();
        loop {
            if let Ok(mut c) = NodeClient::connect(self.grpc.clone()).await {
                if c.node_status(pb::NodeStatusRequest {}).await.is_ok() {
                    return c;
                }
            }
            if let Some(Ok(Some(st))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("cubelet exited at start ({st}): {}", self.log());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "cubelet did not start: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn crash(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signal our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(60) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// cgroups, taps, shim processes and sandbox directories this node could leak.
    fn leftovers(&self) -> Vec<String> {
        let mut v = Vec::new();
        for h in ["", "cpu", "memory", "pids", "freezer"] {
            let d = Path::new("/sys/fs/cgroup")
                .join(h)
                .join(&self.cgroup_parent);
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.path().is_dir() {
                        v.push(format!("cgroup {}", e.path().display()));
                    }
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.root.join("run/taps")) {
            for e in rd.flatten() {
                v.push(format!("tap {:?}", e.file_name()));
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.data().join("sandboxes")) {
            for e in rd.flatten() {
                v.push(format!("dir {}", e.path().display()));
            }
        }
        for pid in shim_pids(&self.root) {
            v.push(format!("shim process {pid}"));
        }
        v
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
        for pid in shim_pids(&self.root) {
            // SAFETY: kill(2) on a shim of this test's node.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(100));
        for h in ["cpu", "memory", "pids", "freezer", ""] {
            let d = Path::new("/sys/fs/cgroup")
                .join(h)
                .join(&self.cgroup_parent);
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    let _ = std::fs::remove_dir(e.path());
                }
            }
            let _ = std::fs::remove_dir(&d);
        }
        if let Ok(rd) = std::fs::read_dir(self.root.join("run/taps")) {
            for e in rd.flatten() {
                let _ = Command::new("ip")
                    .args(["link", "del"])
                    .arg(e.file_name())
                    .output();
            }
        }
        let _ = Command::new("umount").arg("-l").arg(self.data()).status();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Live cube-shim processes whose command line names this node's root.
fn shim_pids(root: &Path) -> Vec<i32> {
    let want = root.to_string_lossy().to_string();
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rfind(')')
            .and_then(|i| stat.get(i + 2..i + 3))
            .map(|s| s == "Z")
            .unwrap_or(true);
        if cmd.contains("cube-shim") && cmd.contains(&want) && !zombie {
            v.push(pid);
        }
    }
    v
}

fn req(id: &str, template: &str) -> pb::CreateSandboxRequest {
    pb::CreateSandboxRequest {
        template: template.into(),
        sandbox_id: id.into(),
        shape: Some(pb::Shape {
            vcpus: 1,
            memory_mib: 64,
            disk_mib: 0,
        }),
        env_vars: [("FOO".to_string(), "bar".to_string())]
            .into_iter()
            .collect(),
        access_token: format!("token-{id}"),
        ..Default::default()
    }
}

fn shim(node: &Node, id: &str) -> Client {
    let c = Client::connect(&node.data().join("sandboxes").join(id).join("shim.sock")).unwrap();
    c.set_timeout(Some(Duration::from_secs(30))).unwrap();
    c
}

/// The init payload the guest holds in its memory (read through the shim).
fn guest_init(c: &mut Client) -> cube_init::VsockInit {
    let words = 64u32;
    let v = match c
        .call(Op::Peek {
            gpa: STANDIN_INIT_DATA,
            count: words,
            stride: None,
        })
        .unwrap()
    {
        Reply::Values { values } => values,
        r => panic!("{r:?}"),
    };
    let bytes: Vec<u8> = v.iter().flat_map(|w| w.to_le_bytes()).collect();
    cube_init::VsockInit::decode(&bytes).unwrap()
}

fn checkpoints(c: &mut Client) -> (ShimState, Vec<u32>, cube_shim::protocol::Stats) {
    match c.call(Op::Stats).unwrap() {
        Reply::Stats {
            state,
            checkpoints,
            stats,
            ..
        } => (state, checkpoints, stats),
        r => panic!("{r:?}"),
    }
}

/// The guest's checkpoints once the last one is `want` (panics after `within`). The host
/// counts an init as taken when the guest shuts the init connection down: it has the payload
/// then (length, magic and entropy checkpoints are already there). The stand-in reports
/// INIT_DONE only once the device's RST answering that shutdown reaches it, which trails the
/// create / resume reply by up to tens of milliseconds (the virtio backend's poll tick).
fn checkpoints_ending(
    c: &mut Client,
    want: u32,
    within: Duration,
) -> (ShimState, Vec<u32>, cube_shim::protocol::Stats) {
    let t0 = Instant::now();
    loop {
        let r = checkpoints(c);
        if r.1.last() == Some(&want) {
            return r;
        }
        assert!(
            t0.elapsed() < within,
            "last checkpoint is not {want:#x} after {within:?}: {:x?} ({:?})",
            r.1,
            r.0
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

async fn get(c: &mut NodeClient<tonic::transport::Channel>, id: &str) -> pb::Sandbox {
    c.get_sandbox(pb::SandboxRef {
        sandbox_id: id.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn microvm_sandboxes_restore_pause_to_disk_fork_fail_and_survive_a_restart() {
    cube_testkit::require_kvm!("microvm_lifecycle");
    cube_testkit::require_priv!("microvm_lifecycle");
    let mut node = Node::new("life", 2);
    let mut c = node.start().await;

    let st = c
        .node_status(pb::NodeStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.runtime, "microvm");
    assert!(
        ["pvm", "hardware"].contains(&st.kvm_kind.as_str()),
        "{}",
        st.kvm_kind
    );
    // The refiller builds the template snapshot and warms two shims for `tiny`.
    let t0 = Instant::now();
    loop {
        let st = c
            .node_status(pb::NodeStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        if st
            .pools
            .iter()
            .any(|p| p.pool == "shim" && p.template == "tiny" && p.ready == 2)
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "pools {:?}\n{}",
            st.pools,
            node.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Create two sandboxes from warm shims.
    let a = c
        .create_sandbox(req("mva", "tiny"))
        .await
        .unwrap()
        .into_inner();
    let b = c
        .create_sandbox(req("mvb", "tiny"))
        .await
        .unwrap()
        .into_inner();
    for s in [&a, &b] {
        assert_eq!(s.runtime, "microvm");
        assert_eq!(s.state, pb::SandboxState::Running as i32);
        assert!(s.from_pool, "{s:?}");
        assert!(
            s.host_interface.starts_with("cbt"),
            "tap {:?}",
            s.host_interface
        );
        assert!(Path::new("/sys/class/net").join(&s.host_interface).exists());
    }
    let (mut sa, mut sb) = (shim(&node, "mva"), shim(&node, "mvb"));
    // Each guest took its own init: env and token delivered, entropy fresh per sandbox.
    let (ia, ib) = (guest_init(&mut sa), guest_init(&mut sb));
    assert_eq!(
        ia.settings.env_vars.get("FOO").map(String::as_str),
        Some("bar")
    );
    assert_eq!(ia.settings.access_token.as_deref(), Some("token-mva"));
    assert_eq!(ib.settings.access_token.as_deref(), Some("token-mvb"));
    assert_ne!(
        ia.entropy, ib.entropy,
        "two sandboxes from one snapshot share RNG state"
    );
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    assert!(
        now_ns - ia.clock_ns < 60_000_000_000,
        "clock {}",
        ia.clock_ns
    );
    let (state, cps, _) = checkpoints_ending(&mut sa, STANDIN_INIT_DONE, Duration::from_secs(5));
    assert_eq!(state, ShimState::Running);
    // Length, magic, first entropy dword (as the guest read them), done.
    let ent0 = u32::from_le_bytes(ia.entropy[..4].try_into().unwrap());
    assert_eq!(
        &cps[cps.len() - 3..],
        &[u32::from_le_bytes(*b"CUBI"), ent0, STANDIN_INIT_DONE],
        "{cps:x?}"
    );

    // The shim is jailed: its root holds only the devices, /proc and the node's directories;
    // it sits in the sandbox's cgroup with the shape's memory limit.
    let pid = match sa.call(Op::Ping).unwrap() {
        Reply::Pong { pid, seccomp, .. } => {
            assert!(seccomp);
            pid
        }
        r => panic!("{r:?}"),
    };
    let mut top: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    top.sort();
    let want: Vec<&str> = if Path::new("/sys/module/kvm_pvm").exists() {
        vec!["dev", "proc", "sys", "var"]
    } else {
        vec!["dev", "proc", "var"]
    };
    assert_eq!(top, want, "jail root");
    assert!(!Path::new(&format!("/proc/{pid}/root/etc")).exists());
    assert!(Path::new(&format!("/proc/{pid}/root/dev/kvm")).exists());
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let mem_line = cg
        .lines()
        .find(|l| l.split(':').nth(1) == Some("memory") || l.starts_with("0::"))
        .unwrap();
    let rel = mem_line.splitn(3, ':').nth(2).unwrap();
    assert!(
        rel.starts_with(&format!("/{}/", node.cgroup_parent)),
        "{cg}"
    );
    let limit_file = if mem_line.starts_with("0::") {
        format!("/sys/fs/cgroup{rel}/memory.max")
    } else {
        format!("/sys/fs/cgroup/memory{rel}/memory.limit_in_bytes")
    };
    let limit: u64 = std::fs::read_to_string(&limit_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(limit, (64 + 128) << 20, "{limit_file}");

    // Pause to disk releases the guest's memory; resume brings it back on the same node,
    // and the guest asks for (and gets) a fresh init.
    let p = c
        .pause_sandbox(pb::PauseSandboxRequest {
            sandbox_id: "mva".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.state, pb::SandboxState::Paused as i32);
    let (state, _, stats) = checkpoints(&mut sa);
    assert_eq!(state, ShimState::PausedToDisk);
    assert_eq!(stats.guest_rss_kib, 0, "{stats:?}");
    let again = c
        .pause_sandbox(pb::PauseSandboxRequest {
            sandbox_id: "mva".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(again.unwrap_err().code(), tonic::Code::FailedPrecondition);
    let r = c
        .resume_sandbox(pb::ResumeSandboxRequest {
            sandbox_id: "mva".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.state, pb::SandboxState::Running as i32);
    let (state, cps, _) = checkpoints(&mut sa);
    assert_eq!(state, ShimState::Running);
    assert!(cps.contains(&STANDIN_WOKEN), "{cps:x?}");
    let ia2 = guest_init(&mut sa);
    assert_ne!(
        ia2.entropy, ia.entropy,
        "a resumed sandbox gets fresh entropy"
    );
    assert_eq!(ia2.settings.access_token.as_deref(), Some("token-mva"));

    // Snapshot of a running sandbox → template; create from it = fork of that sandbox.
    let snap = c
        .snapshot_sandbox(pb::SnapshotSandboxRequest {
            sandbox_id: "mvb".into(),
            template: "forked".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!snap.filesystem_only);
    assert_eq!(
        get(&mut c, "mvb").await.state,
        pb::SandboxState::Running as i32
    );
    let f = c
        .create_sandbox(pb::CreateSandboxRequest {
            from_snapshot: true,
            ..req("mvf", "forked")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(f.template, "forked");
    let mut sf = shim(&node, "mvf");
    let (_, cps, _) = checkpoints_ending(&mut sf, STANDIN_INIT_DONE, Duration::from_secs(5));
    // The fork starts where `mvb` was (idle after its init): it wakes, then takes its own init.
    let woke = cps
        .iter()
        .position(|&x| x == STANDIN_WOKEN)
        .expect("fork woke from idle");
    assert!(woke < cps.len() - 1, "{cps:x?}");
    let iff = guest_init(&mut sf);
    assert_ne!(iff.entropy, ib.entropy);
    assert_eq!(iff.settings.access_token.as_deref(), Some("token-mvf"));

    // A shim that dies is reported: the sandbox becomes FAILED.
    let fpid = match sf.call(Op::Ping).unwrap() {
        Reply::Pong { pid, .. } => pid as i32,
        r => panic!("{r:?}"),
    };
    // SAFETY: kill(2) on the fork's shim.
    unsafe { libc::kill(fpid, libc::SIGKILL) };
    let t0 = Instant::now();
    while get(&mut c, "mvf").await.state != pb::SandboxState::Failed as i32 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "shim death not reported"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        c.kill_sandbox(pb::SandboxRef {
            sandbox_id: "mvf".into()
        })
        .await
        .unwrap()
        .into_inner()
        .existed
    );

    // cubelet crashes and comes back: running shims are re-adopted and still controllable.
    node.crash();
    let mut c = node.start().await;
    let list = c
        .list_sandboxes(pb::ListSandboxesRequest {})
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    let ids: Vec<&str> = list.iter().map(|s| s.sandbox_id.as_str()).collect();
    assert_eq!(ids, vec!["mva", "mvb"], "{}", node.log());
    match shim(&node, "mva").call(Op::Ping).unwrap() {
        Reply::Pong { pid: p2, .. } => assert_eq!(p2, pid, "same shim process"),
        r => panic!("{r:?}"),
    }
    c.pause_sandbox(pb::PauseSandboxRequest {
        sandbox_id: "mva".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.resume_sandbox(pb::ResumeSandboxRequest {
        sandbox_id: "mva".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let ia3 = guest_init(&mut shim(&node, "mva"));
    assert_ne!(ia3.entropy, ia2.entropy);

    for id in ["mva", "mvb"] {
        c.kill_sandbox(pb::SandboxRef {
            sandbox_id: id.into(),
        })
        .await
        .unwrap();
    }
    c.delete_template(pb::DeleteTemplateRequest {
        name: "forked".into(),
        build: String::new(),
    })
    .await
    .unwrap();
    node.stop();
    let left = node.leftovers();
    assert!(left.is_empty(), "leftovers: {left:?}\n{}", node.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_sandboxes_from_one_snapshot_share_its_pages() {
    cube_testkit::require_kvm!("microvm_200_sharing");
    cube_testkit::require_priv!("microvm_200_sharing");
    const N: usize = 200;
    let mut node = Node::new("many", 0);
    let c = node.start().await;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    // At most 8 creates in flight: each spawns a shim now (no warm pool in this test), and
    // more at once only lengthens each spawn on a small CI machine (a shim that does not
    // answer within 10 s fails its create).
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(8));
    for i in 0..N {
        let mut c = c.clone();
        let sem = sem.clone();
        let id = format!("many{i}");
        let sock = node.data().join("sandboxes").join(&id).join("shim.sock");
        tasks.push(tokio::spawn(async move {
            let _p = sem.acquire().await.unwrap();
            let s = c.create_sandbox(req(&id, "tiny")).await?.into_inner();
            // Once it has taken its init, hold the VM (memory stays mapped, as it is): every
            // running shim's virtio backend threads wake every 10 ms (cube-hypervisor's
            // worker tick), and 200 of them in debug builds take both cores of a small CI
            // machine, starving the creates still to come past their 10 s deadlines. Page
            // sharing, what this test measures, is the same paused or running.
            tokio::task::spawn_blocking(move || {
                let mut sh = Client::connect(&sock).unwrap();
                sh.set_timeout(Some(Duration::from_secs(30))).unwrap();
                checkpoints_ending(&mut sh, STANDIN_INIT_DONE, Duration::from_secs(30));
                match sh.call(Op::Pause).unwrap() {
                    Reply::Paused => {}
                    r => panic!("pause {id}: {r:?}"),
                }
            })
            .await
            .unwrap();
            Ok::<_, tonic::Status>(s)
        }));
    }
    for t in tasks {
        let s = t.await.unwrap().unwrap();
        assert_eq!(s.state, pb::SandboxState::Running as i32);
    }
    let create_s = t0.elapsed().as_secs_f64();
    let mut entropies = std::collections::HashSet::new();
    let (mut rss, mut pss, mut private) = (0u64, 0u64, 0u64);
    for i in 0..N {
        let mut s = shim(&node, &format!("many{i}"));
        let init = guest_init(&mut s);
        entropies.insert(init.entropy);
        // Read 16 MiB of the template's memory (one word per page), as a guest reading its
        // page cache or binaries would: those pages come from the snapshot file, shared.
        s.call(Op::Peek {
            gpa: 0x40_0000,
            count: 4096,
            stride: Some(4096),
        })
        .unwrap();
        let (_, _, st) = checkpoints(&mut s);
        rss += st.guest_rss_kib;
        pss += st.guest_pss_kib;
        private += st.guest_private_kib;
    }
    assert_eq!(entropies.len(), N, "every sandbox has its own entropy");
    let n = N as u64;
    println!(
        "{N} sandboxes in {create_s:.1} s; guest memory per sandbox: rss {} KiB, pss {} KiB, private {} KiB",
        rss / n,
        pss / n,
        private / n
    );
    // Template pages are shared: each sandbox maps the 16 MiB it read, but its proportional
    // share is a small fraction, and what it owns alone is the few pages the guest wrote.
    assert!(rss / n >= 16 * 1024, "rss {} KiB", rss / n);
    assert!(
        pss / n * 4 < rss / n,
        "pss {} vs rss {} KiB",
        pss / n,
        rss / n
    );
    assert!(
        private / n < 1024,
        "private {} KiB per sandbox",
        private / n
    );
    let mut c = c;
    for i in 0..N {
        c.kill_sandbox(pb::SandboxRef {
            sandbox_id: format!("many{i}"),
        })
        .await
        .unwrap();
    }
    node.stop();
    let left = node.leftovers();
    assert!(left.is_empty(), "leftovers: {left:?}");
}

/// A template snapshot that cannot be built is retried with exponential back-off (100 ms
/// doubling), not at the refiller's 50 ms interval; the node keeps serving meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_template_snapshot_is_retried_with_backoff() {
    cube_testkit::require_kvm!("microvm_refill_backoff");
    cube_testkit::require_priv!("microvm_refill_backoff");
    // A "cube-shim" that always fails: every snapshot build (and shim spawn) errors out.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("cube-shim");
    std::fs::write(&bad, b"#!/bin/sh\necho refusing >&2\nexit 3\n").unwrap();
    std::fs::set_permissions(&bad, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut node = Node::with_shim("boff", 1, &bad);
    let mut c = node.start().await;
    let watch = Duration::from_millis(2500);
    let t0 = Instant::now();
    while t0.elapsed() < watch {
        // Still answering while its refills fail.
        let st = c
            .node_status(pb::NodeStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(st.runtime, "microvm");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = strip_ansi(&node.log());
    let waits: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("shim pool: template snapshot"))
        .map(|l| {
            let v = l
                .split("retry_in_ms=")
                .nth(1)
                .unwrap_or_else(|| panic!("{l}"));
            v.split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    // Tries at ~0, 0.1, 0.3, 0.7, 1.5 s (then 3.1 s): 5, give or take start-up and
    // scheduling; at the 50 ms refill interval it would be ~50.
    assert!(
        (3..=7).contains(&waits.len()),
        "{} tries in {watch:?}: {waits:?}\n{log}",
        waits.len()
    );
    assert_eq!(
        waits,
        [100, 200, 400, 800, 1600, 3200][..waits.len()],
        "{log}"
    );
    node.stop();
    let left = node.leftovers();
    assert!(left.is_empty(), "leftovers: {left:?}\n{}", node.log());
}

/// The log without terminal colour codes (`ESC [ … m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\x1b' {
            for c in it.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
